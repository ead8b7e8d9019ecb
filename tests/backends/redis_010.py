"""What a singletask 0.1.0 worker does to a Redis lock store: its acquire and release scripts,
as that release shipped them, so the tests can run an old worker beside a new one on one store
(a rolling upgrade). Only the parts the tests call; 0.1.0 passed its metadata with the long field
names (``task_id``, ``task``, ``hostname``, ``pid``, ``since``, ``scope``) and kept the fencing
token and the completion marker in the fence hash ``{<key>}:fence``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis

from singletask.backends.redis.store import fence_key

ACQUIRE_010 = """
local cur = redis.call('HGET', KEYS[1], 'token')
if cur and cur ~= ARGV[1] and (ARGV[3] == '' or string.sub(cur, 1, #ARGV[3]) ~= ARGV[3]) then
  local held = redis.call('HMGET', KEYS[1], 'task_id', 'fence')
  return {0, cur, held[1], redis.call('PTTL', KEYS[1]), held[2]}
end
local last = redis.call('HMGET', KEYS[2], 'fence', 'done')
local fence
if cur == ARGV[1] then
  fence = redis.call('HGET', KEYS[1], 'fence')
else
  local now = redis.call('TIME')
  fence = string.format('%.0f', math.max(tonumber(last[1] or '0') + 1, now[1] * 1000000 + now[2]))
  redis.call('HSET', KEYS[2], 'fence', fence)
end
redis.call('PEXPIRE', KEYS[2], ARGV[4])
if cur then
  redis.call('DEL', KEYS[1])
end
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'fence', fence, unpack(ARGV, 5))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {1, fence, last[2]}
"""

RELEASE_010 = """
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
if ARGV[2] ~= '' and redis.call('HSET', KEYS[2], 'done', ARGV[2]) == 1
    and redis.call('PTTL', KEYS[2]) < 0 then
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
return 1
"""

#: 0.1.0's fixed retention of the fence hash: 7 days, in milliseconds.
RETENTION_010 = 7 * 24 * 3600 * 1000


class OldWorker:
    """A 0.1.0 worker's view of the store: acquire and release as it ran them."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def acquire(self, key: str, token: str, lease_ms: int, meta: Mapping[str, str]) -> list[Any]:
        """``[1, fence, marker]`` when taken, ``[0, token, task_id, pttl, fence]`` when held."""
        flat = [item for pair in meta.items() for item in pair]
        args = [token, lease_ms, "", RETENTION_010, *flat]
        reply: list[Any] = self.client.eval(ACQUIRE_010, 2, key, fence_key(key), *args)
        return reply

    def release(self, key: str, token: str, completed: str = "") -> bool:
        args = [token, completed, RETENTION_010]
        return bool(self.client.eval(RELEASE_010, 2, key, fence_key(key), *args))
