"""Measurement 5: many keys held at once.

Each variant's own storage primitive is called directly (singletask: its ``RedisBackend``;
the libraries: the functions their tasks call), with that variant's own key format:

1. ``holds`` keys are acquired, with a long lease, and stay held. Redis memory per held lock is
   the growth of ``used_memory`` (``INFO memory``) divided by ``holds``; keys per lock likewise
   from ``DBSIZE``.
2. While they are held, ``cycles`` acquire+release cycles of other keys run, ``rounds`` times:
   the rate while 100,000 locks are held; each round is followed by the same cycles on another
   database of the same server, kept empty: the baseline rate, so that each round's ratio
   compares two measurements a few seconds apart.
3. The held keys are released; whatever the store still keeps then is reported per released
   lock (singletask keeps nothing by default; "singletask-acks-late" releases with a completion
   marker, as an acks_late task's execution does, which is kept for a day).
"""

from __future__ import annotations

import gc
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery

from bench.harness.common import LOCK_DB, RedisServer, log, summary

#: A database of the same server that holds nothing: the rate to compare with.
EMPTY_DB = 5

#: The lease of the held locks, in seconds (where a variant takes one).
LONG_LEASE = 3600


class Primitive:
    """acquire(i) / release(i) of lock number ``i`` with one variant's own code."""

    def __init__(
        self,
        acquire: Callable[[int], Any],
        release: Callable[[int], Any],
        note: str,
    ) -> None:
        self.acquire = acquire
        self.release = release
        self.note = note


def primitive(app: Celery, variant: str, lock_url: str) -> Primitive | None:
    # "singletask-acks-late": singletask's task, released as an acks_late task's execution is,
    # with a completion marker (kept for a day by default).
    marked = variant == "singletask-acks-late"
    task = app.tasks.get(f"bench.{'singletask' if marked else variant}.noop")
    tokens: dict[int, Any] = {}
    if variant in ("singletask", "singletask-acks-late"):
        from singletask.backends.redis import RedisBackend
        from singletask.protocol.tokens import execution_token

        backend = RedisBackend.from_url(lock_url)
        pid = str(os.getpid())
        hostname = f"celery@{socket.gethostname()}"  # a worker's node name, as tasks store it

        def acquire(i: int) -> None:
            task_id = str(uuid.uuid4())
            token = execution_token(task_id, 0)  # the token an execution of the task takes
            meta = {
                "task": task.name,
                "scope": "execution",
                "hostname": hostname,
                "pid": pid,
                "since": f"{time.time():.3f}",
                "task_id": task_id,
            }
            if not backend.acquire(task.lock_key_for((i,)), token, LONG_LEASE, meta=meta).acquired:
                raise RuntimeError("not acquired")
            tokens[i] = token

        def release(i: int) -> None:
            token = tokens.pop(i)
            marker = token.split(":", 1)[0] + ":0" if marked else None
            backend.release(task.lock_key_for((i,)), token, completed=marker)

        note = "RedisBackend.acquire / release, task metadata"
        return Primitive(acquire, release, note + (", completion marker" if marked else ""))
    if variant == "celery-singleton":
        from celery_singleton.backends.redis import RedisBackend as SingletonBackend

        singleton = SingletonBackend(lock_url)

        def acquire(i: int) -> None:
            singleton.lock(task.generate_lock(task.name, [i], {}), str(uuid.uuid4()))

        def release(i: int) -> None:
            singleton.unlock(task.generate_lock(task.name, [i], {}))

        return Primitive(acquire, release, "backend.lock (no expiry, its default) / unlock")
    if variant == "celery-once":
        from celery_once.backends.redis import Redis as OnceBackend

        once = OnceBackend({"url": lock_url})

        def acquire(i: int) -> None:
            once.raise_or_lock(task.get_key([i], {}), timeout=LONG_LEASE)

        def release(i: int) -> None:
            once.clear_lock(task.get_key([i], {}))

        return Primitive(acquire, release, "backend.raise_or_lock / clear_lock")
    if variant == "celery-heimdall":
        from celery_heimdall.task import acquire_lock, release_lock, unique_key_for_task

        prefix = task.heimdall_config.lock_prefix

        def acquire(i: int) -> None:
            key = unique_key_for_task(task, [i], {}, prefix=prefix)
            acquire_lock(task, key, LONG_LEASE, task_id=str(uuid.uuid4()))

        def release(i: int) -> None:
            release_lock(task, unique_key_for_task(task, [i], {}, prefix=prefix))

        return Primitive(acquire, release, "acquire_lock / release_lock")
    if variant == "only-one":
        from bench.alternatives.only_one import client

        def acquire(i: int) -> None:
            lock = client().lock(f"only-one:noop:{i}", timeout=LONG_LEASE)
            if not lock.acquire(blocking=False):
                raise RuntimeError("not acquired")
            tokens[i] = lock

        def release(i: int) -> None:
            tokens.pop(i).release()

        return Primitive(acquire, release, "redis-py Lock.acquire(blocking=False) / release")
    if variant == "cookbook":
        from bench.alternatives.cookbook import LOCK_EXPIRE, cache_add, cache_delete, lock_id

        def acquire(i: int) -> None:
            cache_add(lock_id(task.name, i), app.oid, LOCK_EXPIRE)

        def release(i: int) -> None:
            cache_delete(lock_id(task.name, i))

        return Primitive(acquire, release, "cache add (SET NX EX) / delete (DEL)")
    return None  # plain has no lock; the other variants share a storage format listed above


def _cycles(prim: Primitive, first: int, count: int) -> float:
    """Acquire+release cycles per second on keys first .. first + count - 1."""
    gc.collect()
    start = time.perf_counter()
    for i in range(first, first + count):
        prim.acquire(i)
        prim.release(i)
    return count / (time.perf_counter() - start)


def run(
    server: RedisServer,
    app: Celery,
    variants: list[str],
    *,
    holds: int,
    cycles: int,
    rounds: int,
) -> dict[str, Any]:
    lock_url = server.url(LOCK_DB)
    client = redis.Redis.from_url(lock_url)
    empty_url = server.url(EMPTY_DB)  # the same server's database that stays empty
    empty_client = redis.Redis.from_url(empty_url)
    out: dict[str, Any] = {"holds": holds, "cycles": cycles, "rounds": rounds, "variants": {}}
    for variant in variants:
        prim = primitive(app, variant, lock_url)
        empty_prim = primitive(app, variant, empty_url)
        if prim is None or empty_prim is None:
            continue
        empty_client.flushdb()
        empty_prim.acquire(10**9)  # connect, load scripts
        empty_prim.release(10**9)
        empty_client.flushdb()
        client.flushdb()
        prim.acquire(10**9)  # connect, load scripts
        prim.release(10**9)
        client.flushdb()
        memory_before = int(client.info("memory")["used_memory"])
        start = time.perf_counter()
        for i in range(holds):
            prim.acquire(i)
        acquire_rate = holds / (time.perf_counter() - start)
        memory_held = int(client.info("memory")["used_memory"])
        keys_held = int(client.dbsize())
        sample = client.randomkey()  # how Redis encodes a held lock's record
        encoding = client.object("encoding", sample).decode() if sample else None
        # Rounds while the locks are held and rounds on an empty database of the same server
        # alternate, so that each ratio compares two rounds a few seconds apart (the machine's
        # speed drifts by more than the difference looked for).
        loaded: list[float] = []
        baseline: list[float] = []
        for r in range(rounds):
            loaded.append(_cycles(prim, holds + r * cycles, cycles))
            baseline.append(_cycles(empty_prim, holds + r * cycles, cycles))
            empty_client.flushdb()
        start = time.perf_counter()
        for i in range(holds):
            prim.release(i)
        release_rate = holds / (time.perf_counter() - start)
        # Every lock released so far (the held ones and the cycled ones) left the same residue.
        released = holds + rounds * cycles
        memory_left = int(client.info("memory")["used_memory"]) - memory_before
        keys_left = int(client.dbsize())
        client.flushdb()
        row = {
            "note": prim.note,
            "bytes_per_held_lock": (memory_held - memory_before) / holds,
            "keys_per_held_lock": keys_held / holds,
            "record_encoding": encoding,
            "bytes_left_per_released_lock": memory_left / released,
            "keys_left_per_released_lock": keys_left / released,
            "acquire_per_second": acquire_rate,
            "release_per_second": release_rate,
            "cycles_per_second_while_held": summary(loaded),
            "cycles_per_second_empty": summary(baseline),
            "while_held_vs_empty": summary(a / b for a, b in zip(loaded, baseline, strict=True)),
        }
        out["variants"][variant] = row
        log(
            f"scale: {variant}: {row['bytes_per_held_lock']:.0f} B/lock, "
            f"{row['keys_per_held_lock']:.1f} keys/lock ({encoding}), "
            f"{row['cycles_per_second_while_held']['median']:.0f} cycles/s while "
            f"{holds} held vs {row['cycles_per_second_empty']['median']:.0f} empty; "
            f"{row['keys_left_per_released_lock']:.1f} keys left per released lock"
        )
    client.close()
    empty_client.close()
    return out
