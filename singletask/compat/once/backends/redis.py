"""celery-once's Redis backend (``celery_once.backends.Redis``): settings ``url``,
``default_timeout``, ``blocking`` and ``blocking_timeout``.

The key holds a random token (the task id with ``owner_checked_release``, which makes a release
delete the key only while that task holds it). As in celery-once, the process keeps one client,
made from the first URL it is given (the module global ``redis``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, urlparse

import redis as redis_py

from ..tasks import AlreadyQueued

__all__ = ["Redis", "get_redis", "parse_url"]

#: Delete a key only while it holds the given token.
RELEASE_IF_OWNER = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""

#: Give a key its time again only while it holds the given token.
RENEW_IF_OWNER = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
return 0
"""

#: The process's client (made on first use from the first ``url``).
redis: Any = None


def parse_url(url: str) -> dict[str, Any]:
    """Connection arguments of ``redis://``, ``rediss://`` and ``redis+socket://`` URLs."""
    parsed = urlparse(url)
    details: dict[str, Any]
    if parsed.scheme in ("redis", "rediss"):
        details = {"host": parsed.hostname}
        if parsed.port:
            details["port"] = parsed.port
        if parsed.password:
            details["password"] = parsed.password
        db = parsed.path.lstrip("/")
        if db.isdigit():
            details["db"] = db
        if parsed.scheme == "rediss":
            details["ssl"] = True
    elif parsed.scheme == "redis+socket":
        details = {"unix_socket_path": parsed.path}
    else:
        raise ValueError(f"Unsupported protocol {parsed.scheme}")
    details.update(parse_qsl(parsed.query))
    if "socket_timeout" in details:
        details["socket_timeout"] = float(details["socket_timeout"])
    if "db" in details:
        details["db"] = int(details["db"])
    return details


def get_redis(settings: Mapping[str, Any]) -> Any:
    global redis
    if not redis:
        redis = redis_py.StrictRedis(**parse_url(settings["url"]))
    return redis


class Redis:
    """The lock of a key is a Redis key with an expiry (``timeout`` seconds)."""

    def __init__(self, settings: Mapping[str, Any]) -> None:
        self._redis = get_redis(settings)
        self.blocking_timeout = settings.get("blocking_timeout", 1)
        self.blocking = settings.get("blocking", False)

    @property
    def redis(self) -> Any:
        return self._redis

    def raise_or_lock(self, key: str, timeout: float, owner: str | None = None) -> None:
        """Lock ``key`` for ``timeout`` seconds, or raise :class:`AlreadyQueued` with the
        seconds left (waiting up to ``blocking_timeout`` first with ``blocking``)."""
        token = owner or uuid.uuid4().hex
        deadline = time.monotonic() + float(self.blocking_timeout or 0)
        while not self.redis.set(key, token, nx=True, px=int(float(timeout) * 1000)):
            if not self.blocking or time.monotonic() >= deadline:
                raise AlreadyQueued(max(self.redis.pttl(key), 0) / 1000.0)
            time.sleep(0.1)

    def renew(self, key: str, timeout: float, owner: str | None = None) -> None:
        """Give ``key`` ``timeout`` seconds again, if it is still set (with ``owner``: held by
        ``owner``). singletask's addition: the lock of a running task is a lease."""
        if owner is None:
            self.redis.pexpire(key, int(float(timeout) * 1000))
        else:
            self.redis.eval(RENEW_IF_OWNER, 1, key, owner, int(float(timeout) * 1000))

    def clear_lock(self, key: str, owner: str | None = None) -> Any:
        """Delete ``key`` (with ``owner``: only while ``owner`` holds it)."""
        if owner is None:
            return self.redis.delete(key)
        return self.redis.eval(RELEASE_IF_OWNER, 1, key, owner)
