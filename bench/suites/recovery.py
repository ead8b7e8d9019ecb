"""Measurement 4: how long a key stays unusable after its holder dies.

For each fault, one worker runs one holder per variant at the same time (``hold`` sleeping for
ten minutes). Once every holder's body has started, the fault is applied to each:

``sigkill``
    ``SIGKILL`` to the pool process running the body (the time is the kill).
``time-limit``
    the holder was sent with ``time_limit`` (hard): the time is when its pool process took it
    (``task_prerun``, before any lock wait in ``__call__``) plus the limit.
``revoke``
    ``app.control.revoke(task_id, terminate=True)`` (the time is the call).

Just before the fault, one new execution of each key is sent, and must be turned away (the key
is locked). Then, from the fault on, a thread per variant sends a new execution of the same key
through the task's ``apply_async`` every ``interval`` seconds, until one of them runs its body.
The result is the time that execution was sent, counted from the fault: the moment the key was
usable again (within one interval). A variant that is still locked out after ``window``
seconds is reported as "never within ``window`` s" and is not tried again for that fault in
later rounds: its lock is left for its TTL (or forever), which only manual cleanup ends. Between
faults every lock is deleted (FLUSHDB of the lock database), as an operator would. One worker
serves the three faults of a round (the pool replaces the processes killed).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from bench.harness.common import LOCK_DB, PROBE_DB, RedisServer, log, running_worker, summary
from bench.suites.contention import send_through_task

FAULTS = ("sigkill", "time-limit", "revoke")


def _wait_done(probe: redis.Redis, token: str, timeout: float = 15.0) -> str | None:
    """The ``done:`` marker of a sent execution ("1": its body ran), or None if none came."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = probe.get(f"done:{token}")
        if done is not None:
            return str(done)
        time.sleep(0.02)
    return None


def _in_threads(function: Any, items: list[str], timeout: float = 120.0) -> None:
    threads = [threading.Thread(target=function, args=(item,), daemon=True) for item in items]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)


def _until_usable(
    task: Any,
    key: str,
    since: float,
    *,
    window: float,
    interval: float,
    probe: redis.Redis,
) -> dict[str, Any]:
    """Send executions of ``key`` until one runs its body; when was it sent, after ``since``?"""
    wait = since - time.time()
    if wait > 0:
        time.sleep(wait)
    attempts = 0
    while time.time() < since + window:
        token = uuid.uuid4().hex
        sent_at = time.time()
        attempts += 1
        if send_through_task(task, key, "probe", token) and _wait_done(probe, token) == "1":
            return {"seconds": max(0.0, sent_at - since), "attempts": attempts}
        pause = interval - (time.time() - sent_at)
        if pause > 0:
            time.sleep(pause)
    return {"seconds": None, "attempts": attempts}


def _one_fault(
    producer: Celery,
    probe: redis.Redis,
    active: list[str],
    fault: str,
    number: int,
    *,
    window: float,
    time_limit: float,
    interval: float,
) -> dict[str, dict[str, Any]]:
    """Start a holder per variant, apply ``fault`` to each, measure until each key is usable."""
    holders: dict[str, tuple[Any, str, str]] = {}
    for variant in active:
        task = producer.tasks[f"bench.{variant}.hold"]
        key = f"rec-{fault}-{number}-{variant}-{uuid.uuid4().hex[:6]}"
        token = uuid.uuid4().hex
        options = {"time_limit": time_limit} if fault == "time-limit" else {}
        task.apply_async(kwargs={"key": key, "mode": "sleep:600", "token": token}, **options)
        holders[variant] = (task, key, token)
    deadline = time.monotonic() + 60
    for _, _, token in holders.values():
        while not probe.exists(f"holder:{token}") and time.monotonic() < deadline:
            time.sleep(0.05)
    # Before the fault, each key must be locked: a new execution of it must not run its body.
    held_before: dict[str, bool] = {}

    def check(variant: str) -> None:
        task, key, _ = holders[variant]
        token = uuid.uuid4().hex
        ran = send_through_task(task, key, "probe", token) and _wait_done(probe, token) == "1"
        held_before[variant] = not ran

    _in_threads(check, list(holders))
    since: dict[str, float] = {}
    for variant, (_, _, token) in holders.items():
        info = probe.hgetall(f"holder:{token}")
        if not info or not held_before.get(variant):
            log(f"recovery: {fault}: the {variant} holder did not start, or held no lock")
            continue
        if fault == "sigkill":
            since[variant] = time.time()
            os.kill(int(info["pid"]), signal.SIGKILL)
        elif fault == "revoke":
            since[variant] = time.time()
            producer.control.revoke(info["task_id"], terminate=True)
        else:
            since[variant] = float(info.get("prerun") or info["started"]) + time_limit
    found: dict[str, dict[str, Any]] = {}

    def measure(variant: str) -> None:
        task, key, _ = holders[variant]
        found[variant] = _until_usable(
            task, key, since[variant], window=window, interval=interval, probe=probe
        )

    _in_threads(measure, list(since), timeout=window + 60)
    results = {}
    for variant in active:
        if not held_before.get(variant):
            continue
        result = found.get(variant, {"seconds": None, "attempts": 0})
        results[variant] = result
        seconds = result["seconds"]
        log(
            f"recovery: {fault} round {number + 1}: {variant}: "
            + (f"usable after {seconds:.2f}s" if seconds is not None else "never")
            + f" ({result['attempts']} attempts)"
        )
    return results


def run(
    server: RedisServer,
    env: dict[str, str],
    producer: Celery,
    variants: list[str],
    *,
    window: float,
    rounds: int,
    time_limit: float,
    interval: float,
    logdir: Path,
) -> dict[str, Any]:
    probe = redis.Redis.from_url(server.url(PROBE_DB), decode_responses=True)
    locks = redis.Redis.from_url(server.url(LOCK_DB))
    contenders = [v for v in variants if v != "plain"]
    outcome: dict[str, dict[str, list[dict[str, Any]]]] = {
        v: {fault: [] for fault in FAULTS} for v in contenders
    }
    for number in range(rounds):
        with running_worker(
            env,
            logdir / f"worker-recovery-{number}.log",
            probe,
            concurrency=len(contenders) + 4,
            queues=["bench"],
        ):
            for fault in FAULTS:
                active = [
                    v
                    for v in contenders
                    if all(r["seconds"] is not None for r in outcome[v][fault])
                ]
                if active:
                    for variant, result in _one_fault(
                        producer, probe, active, fault, number,
                        window=window, time_limit=time_limit, interval=interval,
                    ).items():  # fmt: skip
                        outcome[variant][fault].append(result)
                locks.flushdb()  # manual cleanup before the next fault
    probe.close()
    locks.close()
    return {
        "window": window,
        "time_limit": time_limit,
        "interval": interval,
        "variants": {
            variant: {
                fault: {
                    "rounds": rows,
                    "never": any(r["seconds"] is None for r in rows),
                    "seconds": summary(r["seconds"] for r in rows),
                }
                for fault, rows in by_fault.items()
            }
            for variant, by_fault in outcome.items()
        },
    }
