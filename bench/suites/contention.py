"""Measurement 3: duplicates of one key.

* **Rejecting a duplicate, in process.** While one execution of a key holds its lock (an eager
  execution blocked in its body, in a thread), the benchmark sends duplicates of that key through
  ``apply_async`` (eager) and times each, with its round trips counted as in measurement 1. For
  a library that locks when a task is sent, the duplicate is turned away in ``apply_async``;
  for the others, in the execution.
* **Overlap on real workers.** Many duplicates of one key go to a ``celery worker -P prefork``
  at once, from several producer threads, each body sleeping a little; the probe database
  records the most bodies of that key that ran at the same moment. Twice per variant: sent with
  ``delay()`` (through the task's ``apply_async``), and with ``app.send_task()``, which is how
  beat, Flower's API and other producers send, bypassing ``apply_async``.
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from bench.harness import app as bench_app
from bench.harness.common import (
    LOCK_DB,
    PROBE_DB,
    RedisServer,
    ServerCounters,
    log,
    running_worker,
    summary,
)


def send_through_task(task: Any, key: str, mode: str, token: str) -> bool:
    """Send ``hold`` through the task's ``apply_async`` (what ``delay()`` does).

    Returns True if a message was published: a library that deduplicates when sending returns
    the holder's result, returns a placeholder, or raises instead.
    """
    task_id = str(uuid.uuid4())
    try:
        result = task.apply_async(
            kwargs={"key": key, "mode": mode, "token": token}, task_id=task_id
        )
    except Exception:  # celery-once's AlreadyQueued, singletask's TaskLocked
        return False
    return getattr(result, "id", None) == task_id


def _reject_one(
    counters: ServerCounters, app: Celery, variant: str, *, count: int, rounds: int, budget: float
) -> dict[str, Any]:
    """Hold one key of ``variant`` in a thread; time and count duplicates of it."""
    task = app.tasks[f"bench.{variant}.hold"]
    key = f"reject-{variant}-{uuid.uuid4().hex[:8]}"
    name = uuid.uuid4().hex
    started, release = threading.Event(), threading.Event()
    bench_app.WAITERS[name] = (started, release)
    errors: list[BaseException] = []

    def hold() -> None:
        try:
            task.apply_async(kwargs={"key": key, "mode": f"wait:{name}", "token": name})
        except BaseException as exc:  # reported below
            errors.append(exc)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    if not started.wait(15):
        release.set()
        return {"error": f"the holder did not start: {errors}"}
    outcomes: dict[str, int] = {"body ran": 0, "rejected": 0}
    raised: set[str] = set()

    def duplicate(i: int) -> None:
        bench_app._ran.value = False
        try:
            task.apply_async(kwargs={"key": key, "mode": "probe", "token": f"dup-{i}"})
        except Exception as exc:
            raised.add(type(exc).__name__)
        outcomes["body ran" if getattr(bench_app._ran, "value", False) else "rejected"] += 1

    def batch(limit: int) -> tuple[float, int]:
        done = 0
        start = time.perf_counter()
        while done < limit:
            duplicate(done)
            done += 1
            if done >= 3 and time.perf_counter() - start > budget:
                break
        return (time.perf_counter() - start) / done * 1e6, done

    slow = variant == "celery-heimdall"  # blocks ~1 s per duplicate by default
    duplicate(0)
    # The counters are the server's: anything else that reaches it during a batch (the
    # holder's lease renewal, a worker of an earlier measurement still shutting down) adds to
    # them and never takes away. So each batch is counted, and the fewest per duplicate wins.
    counted: list[tuple[float, dict[str, float]]] = []
    for _ in range(2):
        before = counters.snapshot()
        _, done = batch(5 if slow else count)
        delta = ServerCounters.delta(before, counters.snapshot())
        commands = {k: v / done for k, v in sorted(delta["commands"].items())}
        counted.append((delta["round_trips"] / done, commands))
    round_trips, commands = min(counted, key=lambda row: row[0])
    timings = [batch(3 if slow else count)[0] for _ in range(rounds)]
    release.set()
    holder.join(30)
    bench_app.WAITERS.pop(name, None)
    return {
        "us_per_duplicate": summary(timings),
        "round_trips": round_trips,
        "commands": commands,
        "outcomes": outcomes,
        "raised": sorted(raised),
    }


def reject_in_process(
    server: RedisServer,
    app: Celery,
    variants: list[str],
    *,
    count: int,
    rounds: int,
    budget: float,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    counters = ServerCounters(server.url(LOCK_DB))
    for variant in variants:
        if variant == "plain":
            continue
        out[variant] = row = _reject_one(
            counters, app, variant, count=count, rounds=rounds, budget=budget
        )
        if "error" in row:
            log(f"contention: {variant}: {row['error']}")
            continue
        log(
            f"contention: {variant}: a duplicate costs {row['us_per_duplicate']['median']:.0f}us, "
            f"{row['round_trips']:.2f} round trips, {row['outcomes']}"
        )
    counters.client.close()
    return out


def _send_all(
    pool: ThreadPoolExecutor, producer: Celery, task: Any, key: str, mode: str, via: str, n: int
) -> list[bool]:
    """Send ``n`` duplicates of ``key`` at once; which of them were published."""

    def send(token: str) -> bool:
        if via == "delay":
            return send_through_task(task, key, mode, token)
        producer.send_task(task.name, kwargs={"key": key, "mode": mode, "token": token})
        return True

    return list(pool.map(send, [f"{key}-{i}" for i in range(n)]))


def overlap_on_workers(
    server: RedisServer,
    env: dict[str, str],
    producer: Celery,
    variants: list[str],
    *,
    duplicates: int,
    body_seconds: float,
    rounds: int,
    concurrency: int,
    logdir: Path,
) -> dict[str, Any]:
    probe = redis.Redis.from_url(server.url(PROBE_DB), decode_responses=True)
    results: dict[str, Any] = {v: {"delay": [], "send_task": []} for v in variants}
    with (
        running_worker(
            env,
            logdir / "worker-contention.log",
            probe,
            concurrency=concurrency,
            queues=["bench"],
        ),
        ThreadPoolExecutor(8) as pool,
    ):
        for number in range(rounds):
            for variant in variants:
                task = producer.tasks[f"bench.{variant}.hold"]
                for via in ("delay", "send_task"):
                    key = f"hot-{variant}-{via}-{number}-{uuid.uuid4().hex[:6]}"
                    start = time.monotonic()
                    sent = _send_all(
                        pool, producer, task, key, f"sleep:{body_seconds}", via, duplicates
                    )
                    published = sum(sent)
                    deadline = time.monotonic() + 30 + 2 * duplicates
                    while int(probe.get(f"done:{key}") or 0) < published:
                        if time.monotonic() > deadline:
                            log(f"contention: {variant}/{via}: timed out waiting for the worker")
                            break
                        time.sleep(0.05)
                    row = {
                        "sent": duplicates,
                        "published": published,
                        "bodies_run": int(probe.get(f"bodies:{key}") or 0),
                        "max_overlap": int(probe.get(f"most:{key}") or 0),
                        "seconds": time.monotonic() - start,
                    }
                    results[variant][via].append(row)
                    log(f"contention: round {number + 1} {variant} via {via}: {row}")
    probe.close()
    return {
        variant: {
            via: {
                "rounds": rows,
                "max_overlap": max((r["max_overlap"] for r in rows), default=None),
                "bodies_run": summary(r["bodies_run"] for r in rows),
                "published": summary(r["published"] for r in rows),
            }
            for via, rows in by_via.items()
        }
        for variant, by_via in results.items()
    }
