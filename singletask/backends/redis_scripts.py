"""The Lua scripts of the Redis lock store, one atomic step each.

Every key a script writes gets its expiry in the same script, and no script leaves a key without
one, whatever it is given: each script first checks every duration argument (a whole number of
milliseconds from 1 to :data:`MAX_LEASE_MS`) and fails *before its first write* when one is
out of range, so ``PEXPIRE`` cannot fail after a write. (Redis runs a script that has started
writing to its end even when it is out of memory, and a script cannot be killed once it has
written, so nothing else can stop one between a write and its expiry.)
"""

from __future__ import annotations

from .base import MAX_LEASE

__all__ = [
    "ACQUIRE_SCRIPT",
    "CLAIM_NEXT_SCRIPT",
    "CLEAR_NEXT_SCRIPT",
    "EXTEND_MANY_SCRIPT",
    "EXTEND_SCRIPT",
    "MAX_LEASE_MS",
    "OPERATOR_RELEASE_SCRIPT",
    "RELEASE_SCRIPT",
]

#: The longest duration a script accepts, in milliseconds (the backends' MAX_LEASE).
MAX_LEASE_MS = int(MAX_LEASE * 1000)

# A Lua function every writing script starts with: ms(value) returns value as a number if it is a
# whole number of milliseconds from 1 to MAX_LEASE_MS, else raises a script error.
_CHECK_MS = f"""
local function ms(value)
  local n = tonumber(value)
  if n == nil or n < 1 or n > {MAX_LEASE_MS} or n ~= math.floor(n) then
    error('singletask: duration out of range (1 to {MAX_LEASE_MS} ms): ' .. tostring(value))
  end
  return n
end
"""

# KEYS[1]  lock key (a hash)
# KEYS[2]  the lock's fence hash (same cluster slot): fields fence (last token issued), done
# ARGV[1]  owner token
# ARGV[2]  lease in milliseconds
# ARGV[3]  token prefix whose holder may be taken over, or '' for none
# ARGV[4]  how long the fence hash is kept after this acquisition, in milliseconds
# ARGV[5…] holder metadata: field, value, field, value, …
# Returns {1, fence, completion marker or false} when the caller holds the lock now (it was free,
# already the caller's, or held by a token starting with ARGV[3]); otherwise
# {0, holder token, holder task id, lease left in ms, holder fence}.
# A new fence is max(last fence + 1, server time in microseconds): it grows while the fence hash
# is kept, and after it is gone (or lost) it still grows as long as the server clock does.
# Errors (before any write) when ARGV[2] or ARGV[4] is out of range.
ACQUIRE_SCRIPT = (
    _CHECK_MS
    + """
local lease, keep = ms(ARGV[2]), ms(ARGV[4])
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
redis.call('PEXPIRE', KEYS[2], keep)
if cur then
  redis.call('DEL', KEYS[1])
end
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'fence', fence, unpack(ARGV, 5))
redis.call('PEXPIRE', KEYS[1], lease)
return {1, fence, last[2]}
"""
)

# KEYS[1]  lock key
# KEYS[2]  the lock's fence hash
# ARGV[1]  owner token
# ARGV[2]  completion marker to record, or '' for none
# ARGV[3]  how long the fence hash is kept from a release that records a marker, in milliseconds
# Returns 1 when the lock was deleted, 0 when ARGV[1] does not hold it (free or another owner).
# The fence hash always has an expiry (every script that writes it sets one); a marker is kept
# ARGV[3] from its release, however long the lock was held.
# Errors (before any write) when ARGV[3] is out of range.
RELEASE_SCRIPT = (
    _CHECK_MS
    + """
local keep = ms(ARGV[3])
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
if ARGV[2] ~= '' then
  redis.call('HSET', KEYS[2], 'done', ARGV[2])
  redis.call('PEXPIRE', KEYS[2], keep)
end
return 1
"""
)

# KEYS[1]  lock key
# ARGV[1]  owner token
# ARGV[2]  new lease in milliseconds (from now)
# Returns 1 when the lease was set, 0 when ARGV[1] does not hold the lock.
# Errors when ARGV[2] is out of range.
EXTEND_SCRIPT = (
    _CHECK_MS
    + """
local lease = ms(ARGV[2])
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], lease)
end
return 0
"""
)

# KEYS[1…n]  lock keys
# ARGV[2i-1] owner token of KEYS[i]; ARGV[2i] its new lease in milliseconds
# Returns a list with, for each key, 1 when its lease was set and 0 when that token does not
# hold it. One round trip renews every lock a process holds.
# Errors (before any lease is set) when one of the leases is out of range.
EXTEND_MANY_SCRIPT = (
    _CHECK_MS
    + """
local leases = {}
for i = 1, #KEYS do
  leases[i] = ms(ARGV[2 * i])
end
local out = {}
for i = 1, #KEYS do
  if redis.call('HGET', KEYS[i], 'token') == ARGV[2 * i - 1] then
    out[i] = redis.call('PEXPIRE', KEYS[i], leases[i])
  else
    out[i] = 0
  end
end
return out
"""
)

# KEYS[1]  the lock's fence hash
# ARGV[1]  task id claiming the follow-up slot
# ARGV[2]  how long the claim lasts, in milliseconds
# ARGV[3]  how long the fence hash is kept, in milliseconds
# Returns the task id holding the slot now: ARGV[1] if its claim took, else the one pending.
# Errors (before any write) when ARGV[2] or ARGV[3] is out of range.
CLAIM_NEXT_SCRIPT = (
    _CHECK_MS
    + """
local claim, keep = ms(ARGV[2]), ms(ARGV[3])
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local pending = redis.call('HMGET', KEYS[1], 'next', 'next_until')
if pending[1] and tonumber(pending[2] or '0') > now_ms then
  return pending[1]
end
redis.call('HSET', KEYS[1], 'next', ARGV[1], 'next_until', string.format('%.0f', now_ms + claim))
redis.call('PEXPIRE', KEYS[1], math.max(keep, claim))
return ARGV[1]
"""
)

# KEYS[1]  the lock's fence hash
# ARGV[1]  task id whose follow-up claim ends
# Returns 1 when ARGV[1] was the pending follow-up (its claim is removed), else 0.
# Writes no key that could be left without an expiry: it only removes fields of a hash that has
# one.
CLEAR_NEXT_SCRIPT = """
if redis.call('HGET', KEYS[1], 'next') == ARGV[1] then
  redis.call('HDEL', KEYS[1], 'next', 'next_until')
  return 1
end
return 0
"""

# KEYS[1]  lock key
# ARGV[1]  task id the holder must have (its task_id field), or '' to release whoever holds it
# Returns {} when nothing changed (no lock at KEYS[1], or ARGV[1] is not its holder's task id);
# otherwise the lock it deleted: {lease left in ms, field, value, field, value, ...}.
# Only a lock hash (one with a token field) is deleted, never a fence hash or a foreign key; the
# fence hash is left alone, so the next acquisition still gets a larger fencing token.
OPERATOR_RELEASE_SCRIPT = """
if redis.call('TYPE', KEYS[1]).ok ~= 'hash' or not redis.call('HGET', KEYS[1], 'token') then
  return {}
end
if ARGV[1] ~= '' and redis.call('HGET', KEYS[1], 'task_id') ~= ARGV[1] then
  return {}
end
local pttl = redis.call('PTTL', KEYS[1])
local fields = redis.call('HGETALL', KEYS[1])
redis.call('DEL', KEYS[1])
return {pttl, unpack(fields)}
"""
