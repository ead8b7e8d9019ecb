"""Measurement 2: throughput of a real ``celery worker -P prefork`` on the Redis broker.

For each round and variant (in a shuffled order): publish ``messages`` empty tasks with distinct
lock keys (``noop(i)``) to a fresh queue, then start a worker on that queue. Every pool process
writes the start and end time of each execution to its own file (``task_prerun`` /
``task_postrun``); the rate is taken between the 10th and the 90th percentile of the end times,
which leaves out the pool's start and the last stragglers. A variant that has not finished
after ``cap`` seconds is measured on what it completed. Ratios to the plain task are computed
within a round.

Publishing time per message is reported too: the libraries that lock when a task is sent pay for
that lock there, not in the worker.
"""

from __future__ import annotations

import random
import time
import uuid
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from bench.harness.common import (
    BROKER_DB,
    LOCK_DB,
    PROBE_DB,
    RedisServer,
    log,
    quantile,
    running_worker,
    summary,
)


def _read_times(directory: Path) -> list[tuple[float, float, int]]:
    rows = []
    for path in directory.glob("*.tsv"):
        for line in path.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) == 4:
                rows.append((float(parts[1]), float(parts[2]), int(parts[3])))
    return rows


def _count_lines(directory: Path) -> int:
    return sum(path.read_bytes().count(b"\n") for path in directory.glob("*.tsv"))


def _rate(rows: list[tuple[float, float, int]], complete: bool) -> float | None:
    ends = sorted(end for _, end, _ in rows)
    if len(ends) < 3:
        return None
    if complete:
        low, high = int(len(ends) * 0.1), int(len(ends) * 0.9)
    else:
        low, high = 0, len(ends) - 1
    span = ends[high] - ends[low]
    return (high - low) / span if span > 0 else None


def run(
    server: RedisServer,
    env: dict[str, str],
    producer: Celery,
    variants: list[str],
    *,
    messages: int,
    rounds: int,
    concurrency: int,
    cap: float,
    workdir: Path,
) -> dict[str, Any]:
    probe = redis.Redis.from_url(server.url(PROBE_DB))
    broker = redis.Redis.from_url(server.url(BROKER_DB))
    locks = redis.Redis.from_url(server.url(LOCK_DB))
    rows: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for number in range(rounds):
        order = list(variants)
        random.shuffle(order)
        rates: dict[str, float | None] = {}
        for variant in order:
            queue = f"tp-{variant}-{number}-{uuid.uuid4().hex[:6]}"
            times = workdir / f"times-{queue}"
            times.mkdir(parents=True)
            task = producer.tasks[f"bench.{variant}.noop"]
            start = time.perf_counter()
            for i in range(messages):
                task.apply_async((i,), queue=queue)
            publish_us = (time.perf_counter() - start) / messages * 1e6
            worker_env = {**env, "BENCH_TIMES_DIR": str(times)}
            with running_worker(
                worker_env,
                workdir / f"worker-{queue}.log",
                probe,
                concurrency=concurrency,
                queues=[queue],
            ):
                deadline = time.monotonic() + cap
                while _count_lines(times) < messages and time.monotonic() < deadline:
                    time.sleep(0.1)
                finished = _read_times(times)
            complete = len(finished) >= messages
            rate = _rate(finished, complete)
            rates[variant] = rate
            durations = [(end - begin) * 1e6 for begin, end, _ in finished]
            row = {
                "messages": messages,
                "completed": len(finished),
                "bodies_run": sum(ran for _, _, ran in finished),
                "complete": complete,
                "tasks_per_second": rate,
                "publish_us": publish_us,
                "task_us_median": quantile(durations, 0.5) if durations else None,
            }
            rows[variant].append(row)
            log(
                f"throughput: round {number + 1}/{rounds} {variant}: "
                f"{rate or 0:.0f} tasks/s ({len(finished)}/{messages} done), "
                f"publish {publish_us:.0f}us/message"
            )
            # Leave nothing behind for the next variant: queued messages, locks still held.
            broker.flushdb()
            locks.flushdb()
        plain = rates.get("plain")
        for variant in variants:
            rate = rates.get(variant)
            rows[variant][-1]["vs_plain"] = rate / plain if rate and plain else None
    for client in (probe, broker, locks):
        client.close()
    return {
        "messages": messages,
        "rounds": rounds,
        "concurrency": concurrency,
        "variants": {
            variant: {
                "rounds": variant_rows,
                "tasks_per_second": summary(r["tasks_per_second"] for r in variant_rows),
                "vs_plain": summary(r["vs_plain"] for r in variant_rows),
                "publish_us": summary(r["publish_us"] for r in variant_rows),
                "task_us": summary(r["task_us_median"] for r in variant_rows),
                "all_complete": all(r["complete"] for r in variant_rows),
            }
            for variant, variant_rows in rows.items()
        },
    }
