"""The Celery cookbook recipe "Ensuring a task is only executed one at a time", on Redis.

The recipe locks with Django's cache: ``cache.add(lock_id, oid, LOCK_EXPIRE)`` (atomic "set if
absent" with a timeout) before the body, and ``cache.delete(lock_id)`` in ``finally``, unless
the lock was not acquired or the timeout has (almost) passed. The lock id is the task name and
the MD5 digest of the argument. This module keeps those semantics without Django, against Redis:
``add`` is ``SET lock_id oid NX EX timeout`` (what Django's Redis cache backend sends for
``add``), ``delete`` is ``DEL lock_id``.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import redis

#: The recipe's lock timeout: ten minutes.
LOCK_EXPIRE = 60 * 10

_client: redis.Redis | None = None


def configure(url: str) -> None:
    """Point the recipe's "cache" at a Redis URL (the benchmark's lock database)."""
    global _client
    os.environ["BENCH_LOCK_URL"] = url
    _client = None


def cache() -> redis.Redis:
    global _client
    if _client is None:
        _client = redis.Redis.from_url(os.environ["BENCH_LOCK_URL"])
    return _client


def cache_add(key: str, value: str, timeout: float) -> bool:
    """Django's ``cache.add``: store ``value`` unless ``key`` exists; True if it stored it."""
    return bool(cache().set(key, value, ex=int(timeout), nx=True))


def cache_delete(key: str) -> None:
    """Django's ``cache.delete``."""
    cache().delete(key)


def lock_id(task_name: str, argument: object) -> str:
    digest = hashlib.md5(str(argument).encode()).hexdigest()
    return f"{task_name}-lock-{digest}"


@contextmanager
def cache_lock(lock_key: str, oid: str) -> Iterator[bool]:
    """The recipe's ``memcache_lock``: yields whether the lock was acquired."""
    timeout_at = time.monotonic() + LOCK_EXPIRE - 3
    status = cache_add(lock_key, oid, LOCK_EXPIRE)
    try:
        yield status
    finally:
        # Release only a lock we took, and not once its timeout has (nearly) passed: by then it
        # may belong to someone else.
        if time.monotonic() < timeout_at and status:
            cache_delete(lock_key)
