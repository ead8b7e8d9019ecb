"""The "only_one" recipe: a decorator that runs a task body under a non-blocking redis-py Lock.

A minimal re-implementation of the widely copied blog recipe ("Enforced Single Celery Task"):
take ``redis_client.lock(key, timeout=timeout)`` with ``acquire(blocking=False)``; run the
body only if that worked (a duplicate returns None); release the lock in ``finally``. The
recipe's lock is a redis-py :class:`redis.lock.Lock`: ``SET key <random token> NX PX timeout``
to acquire, a Lua compare-and-delete (``EVALSHA``) to release.

One addition for the benchmark: ``key`` may be a callable taking the task's arguments, so that
the recipe can lock per argument value (the original takes a fixed string, one lock per task).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import redis

#: The recipe's module-level client, created on first use from ``BENCH_LOCK_URL``.
REDIS_CLIENT: redis.Redis | None = None


def configure(url: str) -> None:
    """Point the recipe at a Redis URL (the benchmark's lock database)."""
    global REDIS_CLIENT
    os.environ["BENCH_LOCK_URL"] = url
    REDIS_CLIENT = None


def client() -> redis.Redis:
    global REDIS_CLIENT
    if REDIS_CLIENT is None:
        REDIS_CLIENT = redis.Redis.from_url(os.environ["BENCH_LOCK_URL"])
    return REDIS_CLIENT


def only_one(
    function: Callable[..., Any] | None = None,
    key: str | Callable[..., str] = "",
    timeout: float | None = None,
) -> Any:
    """Run the decorated body only while holding ``key``; otherwise return None."""

    def decorate(run: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(run)
        def caller(*args: Any, **kwargs: Any) -> Any:
            value = None
            have_lock = False
            name = key(*args, **kwargs) if callable(key) else key
            lock = client().lock(name, timeout=timeout)
            try:
                have_lock = lock.acquire(blocking=False)
                if have_lock:
                    value = run(*args, **kwargs)
            finally:
                if have_lock:
                    lock.release()
            return value

        return caller

    return decorate(function) if function is not None else decorate
