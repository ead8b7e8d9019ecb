"""celery-singleton's Redis backend: the key holds the holder's task id."""

from __future__ import annotations

from typing import Any

from redis import Redis

from .base import BaseBackend

__all__ = ["RedisBackend"]

#: Delete a key only while it holds the given task id.
UNLOCK_IF_OWNER = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""

#: Give a key its time again only while it holds the given task id.
RENEW_IF_OWNER = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
return 0
"""


class RedisBackend(BaseBackend):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """``args`` and ``kwargs`` go to ``Redis.from_url`` (with ``decode_responses=True``)."""
        self.redis = Redis.from_url(*args, decode_responses=True, **kwargs)

    def lock(self, lock: str, task_id: str, expiry: float | None = None) -> bool:
        return bool(
            self.redis.set(lock, task_id, nx=True, ex=None if expiry is None else int(expiry))
        )

    def unlock(self, lock: str) -> None:
        self.redis.delete(lock)

    def unlock_if_owner(self, lock: str, task_id: str) -> bool:
        """Delete ``lock`` only while ``task_id`` holds it (one atomic step)."""
        return bool(self.redis.eval(UNLOCK_IF_OWNER, 1, lock, task_id))

    def renew(self, lock: str, task_id: str, expiry: float) -> bool:
        """Give ``lock`` ``expiry`` seconds again while ``task_id`` holds it (singletask's
        addition: the lock of a running task is a lease)."""
        return bool(self.redis.eval(RENEW_IF_OWNER, 1, lock, task_id, int(expiry * 1000)))

    def get(self, lock: str) -> str | None:
        value = self.redis.get(lock)
        return None if value is None else str(value)

    def clear(self, key_prefix: str) -> None:
        for key in self.redis.scan_iter(match=key_prefix + "*"):
            self.redis.delete(key)
