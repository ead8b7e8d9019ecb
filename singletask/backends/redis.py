"""The Redis lock store: one hash per lock, every operation one round trip.

A lock is a Redis hash at the lock key with the fields ``token`` (the owner token) and the
holder metadata (``task_id``, ``task``, ``hostname``, ``pid``, ``since``); its lease is the
key's expiry. Acquire, release and extend are Lua scripts, run with EVALSHA, so each is
atomic and costs one round trip once the script is cached on the server.

URLs: ``redis://[[user]:password@]host[:port][/db]``, ``rediss://...`` (TLS) and
``unix:///path/to/socket?db=0``, with redis-py's query options (``socket_timeout``, ...).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import redis
from kombu.utils.url import maybe_sanitize_url
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.connection import parse_url
from redis.retry import Retry

from ..exceptions import BackendError, BackendTimeout, BackendUnavailable, ConfigurationError
from .base import AcquireResult, Holder, LockBackend

__all__ = ["RedisBackend"]

# KEYS[1]  lock key (a hash)
# KEYS[2]  the lock's fence hash (same cluster slot): fields fence (last token issued), done
# ARGV[1]  owner token
# ARGV[2]  lease in milliseconds
# ARGV[3]  token prefix whose holder may be taken over, or '' for none
# ARGV[4]  how long the fence hash is kept after its last use, in milliseconds
# ARGV[5…] holder metadata: field, value, field, value, …
# Returns {1, fence, completion marker or false} when the caller holds the lock now (it was free,
# already the caller's, or held by a token starting with ARGV[3]); otherwise
# {0, holder token, holder task id, lease left in ms, holder fence}.
# A new fence is max(last fence + 1, server time in microseconds): it grows while the fence hash
# is kept, and after it is gone (or lost) it still grows as long as the server clock does.
ACQUIRE_SCRIPT = """
local cur = redis.call('HGET', KEYS[1], 'token')
if cur and cur ~= ARGV[1] and (ARGV[3] == '' or string.sub(cur, 1, #ARGV[3]) ~= ARGV[3]) then
  local held = redis.call('HMGET', KEYS[1], 'task_id', 'fence')
  return {0, cur, held[1], redis.call('PTTL', KEYS[1]), held[2]}
end
local fence
if cur == ARGV[1] then
  fence = tonumber(redis.call('HGET', KEYS[1], 'fence'))
else
  local now = redis.call('TIME')
  local last = tonumber(redis.call('HGET', KEYS[2], 'fence') or '0')
  fence = math.max(last + 1, tonumber(now[1]) * 1000000 + tonumber(now[2]))
  redis.call('HSET', KEYS[2], 'fence', string.format('%.0f', fence))
end
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('DEL', KEYS[1])
local fields = {'token', ARGV[1], 'fence', string.format('%.0f', fence)}
for i = 5, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {1, fence, redis.call('HGET', KEYS[2], 'done')}
"""

# KEYS[1]  lock key
# KEYS[2]  the lock's fence hash
# ARGV[1]  owner token
# ARGV[2]  completion marker to record, or '' for none
# ARGV[3]  how long the fence hash is kept, in milliseconds
# Returns 1 when the lock was deleted, 0 when ARGV[1] does not hold it (free or another owner).
RELEASE_SCRIPT = """
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
if ARGV[2] ~= '' then
  redis.call('HSET', KEYS[2], 'done', ARGV[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
return 1
"""

# KEYS[1]  lock key
# ARGV[1]  owner token
# ARGV[2]  new lease in milliseconds (from now)
# Returns 1 when the lease was set, 0 when ARGV[1] does not hold the lock.
EXTEND_SCRIPT = """
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

# KEYS[1…n]  lock keys
# ARGV[2i-1] owner token of KEYS[i]; ARGV[2i] its new lease in milliseconds
# Returns a list with, for each key, 1 when its lease was set and 0 when that token does not
# hold it. One round trip renews every lock a process holds.
EXTEND_MANY_SCRIPT = """
local out = {}
for i = 1, #KEYS do
  if redis.call('HGET', KEYS[i], 'token') == ARGV[2 * i - 1] then
    out[i] = redis.call('PEXPIRE', KEYS[i], ARGV[2 * i])
  else
    out[i] = 0
  end
end
return out
"""

# KEYS[1]  the lock's fence hash
# ARGV[1]  task id claiming the follow-up slot
# ARGV[2]  how long the claim lasts, in milliseconds
# ARGV[3]  how long the fence hash is kept, in milliseconds
# Returns the task id holding the slot now: ARGV[1] if its claim took, else the one pending.
CLAIM_NEXT_SCRIPT = """
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local pending = redis.call('HMGET', KEYS[1], 'next', 'next_until')
if pending[1] and tonumber(pending[2] or '0') > now_ms then
  return pending[1]
end
redis.call('HSET', KEYS[1], 'next', ARGV[1], 'next_until', string.format('%.0f', now_ms + ARGV[2]))
redis.call('PEXPIRE', KEYS[1], math.max(tonumber(ARGV[3]), tonumber(ARGV[2])))
return ARGV[1]
"""

# KEYS[1]  the lock's fence hash
# ARGV[1]  task id whose follow-up claim ends
# Returns 1 when ARGV[1] was the pending follow-up (its claim is removed), else 0.
CLEAR_NEXT_SCRIPT = """
if redis.call('HGET', KEYS[1], 'next') == ARGV[1] then
  redis.call('HDEL', KEYS[1], 'next', 'next_until')
  return 1
end
return 0
"""

#: How long a lock's fence hash (last fencing token, last completion) outlives its last use.
FENCE_RETENTION = 7 * 24 * 3600.0

#: Client defaults; options given in the URL's query string or to ``from_url`` win.
CLIENT_DEFAULTS: dict[str, Any] = {
    "socket_timeout": 5.0,
    "socket_connect_timeout": 5.0,
    "health_check_interval": 30,
}


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def fence_key(key: str) -> str:
    """The key of ``key``'s fence hash, in the same Redis Cluster slot as ``key``.

    A key that has a hash tag keeps it with any suffix; any other key becomes the tag. (A key
    with a ``}`` but no hash tag cannot be a tag: its fence hash lands in another slot, which only
    matters under Redis Cluster.)
    """
    start = key.find("{")
    if start != -1 and key.find("}", start + 2) != -1 and key[start + 1] != "}":
        return f"{key}:fence"
    if "}" in key:
        return f"{key}:fence"
    return f"{{{key}}}:fence"


class RedisBackend(LockBackend):
    """Locks in Redis (or Valkey, or anything speaking its protocol with Lua scripting).

    Args:
        client: A ready client (``redis.Redis``, ``valkey.Valkey``, a cluster client, ...).
        url: A URL to build a client from, lazily, in the process that first uses it.
        **options: Extra client options for ``redis.Redis.from_url``.

    Exactly one of ``client`` and ``url`` is required.
    """

    def __init__(
        self, *, client: redis.Redis | None = None, url: str | None = None, **options: Any
    ) -> None:
        if (client is None) == (url is None):
            raise ConfigurationError("RedisBackend takes exactly one of client= and url=")
        if url is not None:
            try:
                parse_url(url)  # type: ignore[no-untyped-call]  # fail early on a bad URL
            except ValueError as exc:
                raise ConfigurationError(f"{maybe_sanitize_url(url)!r}: {exc}") from exc
        self._url = url
        self._options = {**CLIENT_DEFAULTS, **options}
        self._client = client
        self._pid = os.getpid() if client is None else None
        self._acquire: Any = None
        self._release: Any = None
        self._extend: Any = None
        self._extend_many: Any = None
        self._claim_next: Any = None
        self._clear_next: Any = None
        if client is not None:
            self._register(client)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisBackend:
        return cls(url=url, **options)

    def __repr__(self) -> str:
        where = maybe_sanitize_url(self._url) if self._url else repr(self._client)
        return f"<RedisBackend {where}>"

    @property
    def client(self) -> redis.Redis:
        """The client, created on first use in each process (a forked child makes its own)."""
        if self._url is not None and (self._client is None or self._pid != os.getpid()):
            options = dict(self._options)
            # Retry a dropped connection, never a timeout: redis-py would also retry it inside
            # each reconnect, multiplying the wait on a server that does not answer.
            options.setdefault(
                "retry",
                Retry(
                    ExponentialBackoff(cap=1.0, base=0.05),
                    2,
                    supported_errors=(redis.exceptions.ConnectionError,),
                ),
            )
            client = redis.Redis.from_url(self._url, **options)
            self._client, self._pid = client, os.getpid()
            self._register(client)
        assert self._client is not None
        return self._client

    def _register(self, client: redis.Redis) -> None:
        self._acquire = client.register_script(ACQUIRE_SCRIPT)
        self._release = client.register_script(RELEASE_SCRIPT)
        self._extend = client.register_script(EXTEND_SCRIPT)
        self._extend_many = client.register_script(EXTEND_MANY_SCRIPT)
        self._claim_next = client.register_script(CLAIM_NEXT_SCRIPT)
        self._clear_next = client.register_script(CLEAR_NEXT_SCRIPT)

    @contextlib.contextmanager
    def _translate(self, operation: str, key: str) -> Iterator[None]:
        """Map redis-py errors to singletask's, naming the server but never its password."""
        try:
            yield
        except redis.exceptions.TimeoutError as exc:
            raise BackendTimeout(f"{self!r}: {operation} {key!r} timed out: {exc}") from exc
        except redis.exceptions.ConnectionError as exc:
            raise BackendUnavailable(f"{self!r}: {operation} {key!r} failed: {exc}") from exc
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
            raise BackendError(f"{self!r}: {operation} {key!r} failed: {exc}") from exc

    def acquire(
        self,
        key: str,
        token: str,
        ttl: float,
        *,
        meta: Mapping[str, str] | None = None,
        takeover_prefix: str | None = None,
    ) -> AcquireResult:
        args: list[str | int] = [token, _ms(ttl), takeover_prefix or "", _ms(FENCE_RETENTION)]
        for name, value in (meta or {}).items():
            args += [name, value]
        client = self.client
        with self._translate("acquire", key):
            reply = self._acquire(keys=[key, fence_key(key)], args=args, client=client)
        if reply[0] == 1:
            _, fence, completed = reply
            return AcquireResult(
                True, fence=int(fence), completed=_text(completed) if completed else None
            )
        _, holder_token, task_id, pttl, holder_fence = reply
        return AcquireResult(
            False,
            Holder(
                _text(holder_token),
                _text(task_id) if task_id is not None else None,
                pttl / 1000 if pttl >= 0 else None,
                {},
                int(holder_fence) if holder_fence is not None else None,
            ),
        )

    def release(self, key: str, token: str, *, completed: str | None = None) -> bool:
        client = self.client
        args = [token, completed or "", _ms(FENCE_RETENTION)]
        with self._translate("release", key):
            return bool(self._release(keys=[key, fence_key(key)], args=args, client=client))

    def extend(self, key: str, token: str, ttl: float) -> bool:
        client = self.client
        with self._translate("extend", key):
            return bool(self._extend(keys=[key], args=[token, _ms(ttl)], client=client))

    def extend_many(self, leases: Sequence[tuple[str, str, float]]) -> list[bool]:
        if not leases:
            return []
        client = self.client
        if isinstance(client, RedisCluster):
            # Keys of several slots cannot share a script: one pipeline, split by node.
            with self._translate("extend", leases[0][0]), client.pipeline() as pipe:
                for key, token, ttl in leases:
                    pipe.eval(EXTEND_SCRIPT, 1, key, token, _ms(ttl))
                return [bool(done) for done in pipe.execute()]
        keys = [key for key, _, _ in leases]
        args: list[str | int] = []
        for _, token, ttl in leases:
            args += [token, _ms(ttl)]
        with self._translate("extend", keys[0]):
            return [bool(done) for done in self._extend_many(keys=keys, args=args, client=client)]

    def claim_next(self, key: str, task_id: str, ttl: float) -> str:
        client = self.client
        args = [task_id, _ms(ttl), _ms(FENCE_RETENTION)]
        with self._translate("claim_next", key):
            return _text(self._claim_next(keys=[fence_key(key)], args=args, client=client))

    def clear_next(self, key: str, task_id: str) -> bool:
        client = self.client
        with self._translate("clear_next", key):
            return bool(self._clear_next(keys=[fence_key(key)], args=[task_id], client=client))

    def holder(self, key: str) -> Holder | None:
        client = self.client
        with self._translate("inspect", key), client.pipeline(transaction=True) as pipe:
            pipe.hgetall(key)
            pipe.pttl(key)
            fields, pttl = pipe.execute()
        if not fields:
            return None
        meta = {_text(k): _text(v) for k, v in fields.items()}
        token = meta.pop("token", "")
        fence = meta.pop("fence", None)
        return Holder(
            token,
            meta.get("task_id"),
            pttl / 1000 if pttl >= 0 else None,
            meta,
            int(fence) if fence is not None else None,
        )

    def close(self) -> None:
        if self._url is not None and self._client is not None and self._pid == os.getpid():
            self._client.close()
            self._client = None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
