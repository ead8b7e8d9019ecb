"""Measurement 1: lock overhead per execution of an empty task, in one process.

Each execution is ``task.apply_async((i,))`` with ``task_always_eager``: Celery runs it through
``build_tracer``, the tracer a worker runs (``task_prerun``, ``__call__``, ``on_success``,
``after_return``, ``task_postrun``), without a broker. Because it goes through ``apply_async``,
the libraries that lock when a task is *sent* (celery-singleton, celery-once, celery-heimdall)
pay for their lock here too, so every contender's whole lock cycle is in the number.

Three passes per variant, all against the one private Redis:

* **count**: a batch between two ``INFO stats commandstats`` snapshots. Round trips are the
  server's read events (``total_reads_processed``), commands are ``commandstats`` calls
  (including those a Lua script runs).
* **monitor**: a short batch under ``MONITOR``, to list the commands the *client* sent (MONITOR
  marks the ones a script ran as ``lua``).
* **time**: ``rounds`` rounds; in each, every variant (in a shuffled order) runs one batch, and
  so do two references: bare ``PING`` commands in a loop, and a plain task whose body sends two
  ``PING`` commands (what two round trips cost between Celery's own work). With singletask, two
  more rows break its cost down: its acquire and release scripts called alone
  (``RedisBackend``), and its task with the in-memory backend (its Python bookkeeping, no
  Redis). Differences and ratios are computed within a round.
"""

from __future__ import annotations

import gc
import os
import random
import secrets
import socket
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery

from bench.harness.app import noop as bench_noop
from bench.harness.common import LOCK_DB, RedisServer, ServerCounters, log, summary


def _batch(run: Callable[[int], Any], count: int, budget: float) -> tuple[float, int]:
    """Run ``run(i)`` ``count`` times, or fewer once ``budget`` seconds are spent (at least 3).

    Returns (seconds per run, runs done).
    """
    gc.collect()
    done = 0
    start = time.perf_counter()
    deadline = start + budget
    while done < count:
        run(done)
        done += 1
        if done >= 3 and time.perf_counter() > deadline:
            break
    return (time.perf_counter() - start) / done, done


def _executor(app: Celery, variant: str) -> Callable[[int], Any]:
    task = app.tasks[f"bench.{variant}.noop"]

    def run(i: int) -> Any:
        return task.apply_async((i,))

    return run


def monitor_commands(server: RedisServer, run: Callable[[int], Any], count: int) -> dict[str, Any]:
    """Commands the clients sent (not those run inside scripts) during ``count`` runs."""
    watcher = redis.Redis.from_url(server.url(0))
    other = redis.Redis.from_url(server.url(0))
    sentinel = "bench-monitor-end"
    other.ping()  # connect now: its handshake must not show up below
    with watcher.monitor() as monitor:
        for i in range(count):
            run(i)
        other.echo(sentinel)
        sent: Counter[str] = Counter()
        in_scripts: Counter[str] = Counter()
        while True:
            entry = monitor.next_command()
            words = entry["command"].split(" ")
            name = words[0].upper()
            if name == "ECHO" and sentinel in entry["command"]:
                break
            (in_scripts if entry["client_type"] == "lua" else sent)[name] += 1
    watcher.close()
    other.close()
    return {
        "sent": {name: n / count for name, n in sorted(sent.items())},
        "in_scripts": {name: n / count for name, n in sorted(in_scripts.items())},
    }


def count_round_trips(
    server: RedisServer, run: Callable[[int], Any], count: int, budget: float
) -> dict[str, Any]:
    counters = ServerCounters(server.url(LOCK_DB))
    # Whatever else reaches the server during a batch only adds to its counters: of two
    # batches, the one with fewer requests per execution is the measurement.
    rows: list[tuple[float, int, dict[str, Any]]] = []
    for _ in range(2):
        before = counters.snapshot()
        _, done = _batch(run, count, budget)
        delta = ServerCounters.delta(before, counters.snapshot())
        rows.append((delta["round_trips"] / done, done, delta))
    counters.client.close()
    _, done, delta = min(rows, key=lambda row: row[0])
    return {
        "executions": done,
        "round_trips": delta["round_trips"] / done,
        "commands": {name: calls / done for name, calls in sorted(delta["commands"].items())},
        "commands_total": sum(delta["commands"].values()) / done,
    }


def _singletask_breakdown(server: RedisServer, app: Celery) -> dict[str, Callable[[int], Any]]:
    """Where singletask's time goes: its two scripts alone, and its task without Redis."""
    from celery import Celery as _Celery

    from singletask import SingletonTask
    from singletask.backends.redis import RedisBackend

    task = app.tasks["bench.singletask.noop"]
    backend = RedisBackend.from_url(server.url(LOCK_DB))
    task_id = str(uuid.uuid4())
    token = f"{task_id}:0:{secrets.token_hex(6)}:{os.getpid()}:{secrets.token_hex(4)}"
    meta = {
        "task": task.name,
        "scope": "execution",
        "hostname": socket.gethostname(),
        "pid": str(os.getpid()),
        "since": f"{time.time():.3f}",
        "task_id": task_id,
    }

    def scripts(i: int) -> None:
        key = f"bench:scripts:{i}"
        backend.acquire(key, token, 30.0, meta=meta)
        backend.release(key, token, completed=f"{task_id}:0")  # as an execution does

    memory_app = _Celery("bench-memory", broker="memory://", set_as_current=False)
    memory_app.conf.update(
        task_always_eager=True,
        task_eager_propagates=True,
        task_ignore_result=True,
        singletask_backend_url="memory://",
    )
    in_memory = memory_app.task(
        name="bench.singletask.noop", base=SingletonTask, lock_args="*", shared=False
    )(bench_noop)
    return {
        "singletask-scripts": scripts,
        "singletask-memory": lambda i: in_memory.apply_async((i,)),
    }


def run(
    server: RedisServer,
    app: Celery,
    variants: list[str],
    *,
    executions: int,
    rounds: int,
    warmup: int,
    budget: float,
) -> dict[str, Any]:
    runners = {variant: _executor(app, variant) for variant in variants}
    ping_client = redis.Redis.from_url(server.url(LOCK_DB))
    references: dict[str, Callable[[int], Any]] = {"PING": lambda _i: ping_client.ping()}
    if "plain" in runners:
        two_pings = app.tasks["bench.plain.two_pings"]
        references["plain+2PING"] = lambda i: two_pings.apply_async((i,))
        references["SET+DEL"] = lambda i: (
            ping_client.set(f"bench:setdel:{i}", "x", nx=True, ex=600),
            ping_client.delete(f"bench:setdel:{i}"),
        )
    if "singletask" in runners:
        references.update(_singletask_breakdown(server, app))
    runners_with_ping = {**runners, **references}

    log(f"overhead: warm-up ({warmup} executions each; loads scripts, opens connections)")
    for runner in runners_with_ping.values():
        _batch(runner, warmup, budget)

    counts: dict[str, Any] = {}
    for variant, runner in runners_with_ping.items():
        counts[variant] = count_round_trips(server, runner, executions, budget)
        counts[variant]["client_commands"] = monitor_commands(
            server, runner, 3 if "heimdall" in variant and "-nb" not in variant else 20
        )
        log(
            f"overhead: {variant}: {counts[variant]['round_trips']:.2f} round trips/execution, "
            f"sent {counts[variant]['client_commands']['sent']}"
        )

    per_round: dict[str, list[float]] = {name: [] for name in runners_with_ping}
    added: dict[str, list[float]] = {name: [] for name in runners}
    vs_ping: dict[str, list[float]] = {name: [] for name in runners}
    vs_body_pings: dict[str, list[float]] = {name: [] for name in runners}
    done_counts: dict[str, list[int]] = {name: [] for name in runners_with_ping}
    for number in range(rounds):
        order = list(runners_with_ping)
        random.shuffle(order)
        seconds: dict[str, float] = {}
        for name in order:
            seconds[name], done = _batch(runners_with_ping[name], executions, budget)
            per_round[name].append(seconds[name] * 1e6)
            done_counts[name].append(done)
        if "plain" in seconds:
            # Everything that runs a task: its time over the plain task's, in this round.
            for name in [*runners, "plain+2PING", "singletask-memory"]:
                if name in seconds:
                    extra = (seconds[name] - seconds["plain"]) * 1e6
                    added.setdefault(name, []).append(extra)
            pings_in_body = added["plain+2PING"][-1]
            two_bare = 2 * seconds["PING"] * 1e6
            for name in [*runners, "plain+2PING", "singletask-memory"]:
                if name in added:
                    vs_ping.setdefault(name, []).append(added[name][-1] / two_bare)
            for name in runners:
                vs_body_pings[name].append(added[name][-1] / pings_in_body)
            if "singletask-scripts" in seconds:
                # Not a task: the scripts' own time against two bare PINGs.
                vs_ping.setdefault("singletask-scripts", []).append(
                    seconds["singletask-scripts"] * 1e6 / two_bare
                )
        log(
            f"overhead: round {number + 1}/{rounds}: "
            + ", ".join(f"{n} {seconds[n] * 1e6:.0f}us" for n in runners_with_ping)
        )
    ping_client.close()
    return {
        "method": (
            "task.apply_async((i,)) with task_always_eager and a worker's stack protection, "
            "no result backend"
        ),
        "executions_per_batch": executions,
        "rounds": rounds,
        "variants": {
            name: {
                "us_per_execution": summary(per_round[name]),
                "added_us": summary(added.get(name, [])),
                "added_vs_two_pings": summary(vs_ping.get(name, [])),
                "added_vs_two_pings_in_a_body": summary(vs_body_pings.get(name, [])),
                "executions_per_round": done_counts[name],
                **counts[name],
            }
            for name in runners_with_ping
        },
    }
