"""Redis memory per record of candidate lock record layouts, the current one among them.

The aim is a held lock of at most about 350 bytes and a released key of at most about 64 bytes.
On a private ``redis-server``, this measures what each candidate way of storing the same
information costs, so that a layout is chosen with numbers:

* every candidate stores what a real execution of ``bench.singletask.noop`` (locked per
  argument) writes: its key (``<prefix><task name>:<64 hex digits>``), an owner token made by
  :func:`singletask.protocol.tokens.execution_token`, the holder metadata the lifecycle writes (task
  id, task name, scope, host name, pid, start time) and a fencing token of today's size;
* memory per key is the growth of ``used_memory`` over ``--keys`` keys divided by their number
  (so it includes the key name, the main and expiry dictionaries and their tables, as a Redis
  operator sees it), and ``MEMORY USAGE`` and ``OBJECT ENCODING`` of one of them are shown too.

The candidates are storage shapes, written with plain commands, except those marked ``now``,
which :class:`singletask.backends.redis.RedisBackend` itself writes (acquire, and release with
and without a completion marker). ``0.1.0`` is what it wrote in 0.1.0 (a 66-byte owner token),
``60-byte token`` the first step from it (the token shortened, two keys per lock); the
others are alternatives that were considered.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from bench import RESULTS
from bench.harness.common import RedisServer, log
from singletask.backends.redis.store import RedisBackend, fence_key
from singletask.protocol.tokens import execution_token

TASK = "bench.singletask.noop"
PREFIX = "singletask:"
LEASE_MS = 3_600_000
RETENTION_MS = 7 * 24 * 3_600_000
FENCE = 1_763_900_000_123_456  # a fencing token of today's size (server time in microseconds)
SINCE = "1763900000.123"

#: Hash buckets of the "shared marker hash" candidate: one per Redis Cluster slot.
BUCKETS = 16384

#: A candidate: writes record ``i`` through a pipeline (flushed every 1,000 records) or, for the
#: ``now`` candidates, through the store itself.
Writer = Callable[[Any, RedisBackend, int], None]


def lock_key(i: int) -> str:
    """Key number ``i``, shaped like a ``lock_args`` key (a SHA-256 hex digest)."""
    return f"{PREFIX}{TASK}:{hashlib.sha256(str(i).encode()).hexdigest()}"


def record(i: int) -> tuple[str, dict[str, str]]:
    """The owner token and metadata an execution writes (see
    singletask.execution.lifecycle.execute)."""
    task_id = str(uuid.UUID(int=i + 1, version=4))
    meta = {
        "task": TASK,
        "scope": "execution",
        "hostname": f"celery@{socket.gethostname()}",
        "pid": str(os.getpid()),  # the pid the token names, as in an execution
        "since": f"{time.time():.3f}",
        "task_id": task_id,
    }
    return execution_token(task_id, 0), meta


def legacy_token(token: str) -> str:
    """The same token as 0.1.0 wrote it: host id and random part in hex (66 bytes)."""
    task_id, retries, _, pid, _ = token.rsplit(":", 4)
    return f"{task_id}:{retries}:{'f805907e2752'}:{pid}:{'9df9d448'}"


def held_legacy(pipe: Any, store: RedisBackend, i: int) -> None:
    """0.1.0: the lock hash (token, fence, metadata) plus the fence hash, both with expiries."""
    key = lock_key(i)
    token, meta = record(i)
    pipe.hset(key, mapping={"token": legacy_token(token), "fence": FENCE, **meta})
    pipe.pexpire(key, LEASE_MS)
    pipe.hset(fence_key(key), "fence", FENCE)
    pipe.pexpire(fence_key(key), RETENTION_MS)


def held_legacy_hash_only(pipe: Any, store: RedisBackend, i: int) -> None:
    """0.1.0's lock hash alone (no fence hash while held)."""
    key = lock_key(i)
    token, meta = record(i)
    pipe.hset(key, mapping={"token": legacy_token(token), "fence": FENCE, **meta})
    pipe.pexpire(key, LEASE_MS)


def held_current(pipe: Any, store: RedisBackend, i: int) -> None:
    """The first step: 0.1.0's layout, with the token as execution_token makes it (60 bytes)."""
    key = lock_key(i)
    token, meta = record(i)
    pipe.hset(key, mapping={"token": token, "fence": FENCE, **meta})
    pipe.pexpire(key, LEASE_MS)
    pipe.hset(fence_key(key), "fence", FENCE)
    pipe.pexpire(fence_key(key), RETENTION_MS)


def held_hash_only(pipe: Any, store: RedisBackend, i: int) -> None:
    """The first step's lock hash alone (no fence hash while held)."""
    key = lock_key(i)
    token, meta = record(i)
    pipe.hset(key, mapping={"token": token, "fence": FENCE, **meta})
    pipe.pexpire(key, LEASE_MS)


def held_hash_listpack(pipe: Any, store: RedisBackend, i: int) -> None:
    """The same fields, but the token stored without its task id (which is a field already),
    so that every value fits Redis' small-hash encoding (listpack: values up to 64 bytes)."""
    key = lock_key(i)
    token, meta = record(i)
    rest = token[len(meta["task_id"]) :]
    pipe.hset(key, mapping={"token": rest, "fence": FENCE, **meta})
    pipe.pexpire(key, LEASE_MS)


def held_hash_compact(pipe: Any, store: RedisBackend, i: int) -> None:
    """Listpack hash with one-letter fields, integers as integers, the scope as one letter."""
    key = lock_key(i)
    token, meta = record(i)
    pipe.hset(
        key,
        mapping={
            "o": token[len(meta["task_id"]) :],
            "f": FENCE,
            "i": meta["task_id"],
            "t": TASK,
            "s": "e",
            "h": meta["hostname"],
            "p": int(meta["pid"]),
            "a": int(float(SINCE) * 1000),
        },
    )
    pipe.pexpire(key, LEASE_MS)


def held_string(pipe: Any, store: RedisBackend, i: int) -> None:
    """One string: token, fence and metadata values joined by a separator (task id once)."""
    token, meta = record(i)
    value = "\x1f".join([token, str(FENCE), TASK, "e", meta["hostname"], SINCE])
    pipe.set(lock_key(i), value, px=LEASE_MS)


def held_string_task_id(pipe: Any, store: RedisBackend, i: int) -> None:
    """Reference: a string holding only a task id, as celery-once or celery-singleton store."""
    _, meta = record(i)
    pipe.set(lock_key(i), meta["task_id"], px=LEASE_MS)


def released_fence_hash(pipe: Any, store: RedisBackend, i: int) -> None:
    """0.1.0 after a release: the fence hash keeps the last fence and the completion marker."""
    key = fence_key(lock_key(i))
    _, meta = record(i)
    pipe.hset(key, mapping={"fence": FENCE, "done": f"{meta['task_id']}:0"})
    pipe.pexpire(key, RETENTION_MS)


def released_own_key(pipe: Any, store: RedisBackend, i: int) -> None:
    """A per-key record as small as it gets: the completion marker alone, in a string."""
    _, meta = record(i)
    pipe.set(fence_key(lock_key(i)), f"{meta['task_id']}:0", px=RETENTION_MS)


def released_shared_hash(pipe: Any, store: RedisBackend, i: int) -> None:
    """The marker and last fence as one field of a shared hash, one hash per cluster slot
    (field: 8 bytes of the key's digest; value: marker and fence); no key per released lock."""
    key = lock_key(i)
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    bucket = f"{PREFIX}done:{int.from_bytes(digest[:2], 'big') % BUCKETS}"
    _, meta = record(i)
    pipe.hset(bucket, digest, f"{meta['task_id']}:0:{FENCE}")
    pipe.pexpire(bucket, RETENTION_MS)


def held_now(pipe: Any, store: RedisBackend, i: int) -> None:
    """What the store writes now: one compact hash at the lock key (see redis_wire)."""
    token, meta = record(i)
    if not store.acquire(lock_key(i), token, LEASE_MS / 1000, meta=meta).acquired:
        raise RuntimeError("not acquired")


def released_now(pipe: Any, store: RedisBackend, i: int) -> None:
    """What a release leaves now without a completion marker (the default: nothing)."""
    token, meta = record(i)
    store.acquire(lock_key(i), token, LEASE_MS / 1000, meta=meta)
    store.release(lock_key(i), token)


def released_now_marker(pipe: Any, store: RedisBackend, i: int) -> None:
    """What a release with a completion marker (an acks_late task) leaves now: f and d, kept
    for marker_retention (a day by default)."""
    token, meta = record(i)
    store.acquire(lock_key(i), token, LEASE_MS / 1000, meta=meta)
    store.release(lock_key(i), token, completed=f"{meta['task_id']}:0")


CANDIDATES: dict[str, tuple[str, Writer]] = {
    "held: 0.1.0 (lock hash + fence hash, 66-byte token)": ("held", held_legacy),
    "held: 0.1.0 lock hash alone": ("held", held_legacy_hash_only),
    "held: 60-byte token (lock hash + fence hash)": ("held", held_current),
    "held: 60-byte token, lock hash alone": ("held", held_hash_only),
    "held: same fields, token without its task id": ("held", held_hash_listpack),
    "held: compact hash (1-letter fields, integers)": ("held", held_hash_compact),
    "held: one string, separated values": ("held", held_string),
    "held: string holding a task id (the alternatives)": ("held", held_string_task_id),
    "held: now (one compact hash)": ("held", held_now),
    "released: 0.1.0 fence hash (fence + marker)": ("released", released_fence_hash),
    "released: the marker alone, in a key of its own": ("released", released_own_key),
    "released: one field of a shared hash per slot": ("released", released_shared_hash),
    "released: now, no marker (the default)": ("released", released_now),
    "released: now, with a marker (acks_late)": ("released", released_now_marker),
}


def measure(client: redis.Redis, store: RedisBackend, write: Writer, keys: int) -> dict[str, Any]:
    """Write ``keys`` records with ``write``; memory per record and a sample's encoding."""
    client.flushdb()
    time.sleep(0.05)
    before = int(client.info("memory")["used_memory"])
    pipe = client.pipeline(transaction=False)
    for i in range(keys):
        write(pipe, store, i)
        if i % 1000 == 999:
            pipe.execute()
    pipe.execute()
    after = int(client.info("memory")["used_memory"])
    sample = client.randomkey()
    out = {
        "bytes_per_record": (after - before) / keys,
        "keys_per_record": int(client.dbsize()) / keys,
        "sample_memory_usage": client.memory_usage(sample) if sample else None,
        "sample_encoding": client.object("encoding", sample).decode() if sample else None,
    }
    client.flushdb()
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench layouts", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--keys", type=int, default=100_000, help="records per candidate")
    parser.add_argument("--quick", action="store_true", help="2,000 records per candidate")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    keys = 2000 if args.quick else args.keys
    results: dict[str, Any] = {"keys": keys, "candidates": {}}
    with tempfile.TemporaryDirectory(prefix="singletask-layouts-") as tmp:
        server = RedisServer(Path(tmp))
        server.start()
        try:
            client = server.client(1)
            store = RedisBackend.from_url(server.url(1))
            results["redis"] = server.version()
            for name, (kind, write) in CANDIDATES.items():
                row = {"kind": kind, **measure(client, store, write, keys)}
                results["candidates"][name] = row
                log(f"layouts: {name}: {row['bytes_per_record']:.0f} B, {row['sample_encoding']}")
            client.close()
            store.close()
        finally:
            server.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "layouts.json").write_text(json.dumps(results, indent=2) + "\n")
    width = max(len(name) for name in CANDIDATES)
    print(f"Redis {results['redis']}, {keys:,} records per candidate")
    print(f"{'candidate':{width}}  bytes/record  keys/record  MEMORY USAGE  encoding")
    for name, row in results["candidates"].items():
        print(
            f"{name:{width}}  {row['bytes_per_record']:12.0f}  {row['keys_per_record']:11.2f}"
            f"  {row['sample_memory_usage'] or 0:12d}  {row['sample_encoding']}"
        )
    return 0
