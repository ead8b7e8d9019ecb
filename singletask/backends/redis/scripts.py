"""The Lua scripts of the Redis lock store, one atomic step each.

**One key per lock.** Every script that takes, gives back, renews or inspects a lock reads and
writes the lock key alone, so it runs on one Redis Cluster slot with nothing else to wait for
(a script over two keys of a slot that is being migrated gets ``TRYAGAIN`` while only one of
them has moved). The key is a hash in one of two states:

* *held*: the field ``token`` (the owner token), ``f`` (the fencing token) and the holder's
  metadata in the compact fields :mod:`singletask.backends.redis.wire` writes; its expiry is
  the lease;
* *released*: no ``token``; ``f``, the last fencing token issued, and ``d``, the completion
  marker of the last execution that recorded one; its expiry is how long they are kept (the
  transport options ``fence_retention`` and ``marker_retention``). By default a release leaves
  nothing: the key is deleted.

A lock written by singletask 0.1.0 is a hash with ``token``, ``fence`` and long metadata
fields, and its fence hash ``<tag>:fence`` holds its last token and marker: these scripts read
such a lock (``token`` for exclusion, ``fence`` before ``f``, ``task_id``) and never write
``fence``. The companion hash ``<tag>:fence`` now holds only a coalescing task's follow-up
claim (:data:`CLAIM_NEXT_SCRIPT`).

Every key a script writes gets its expiry in the same script, and no script leaves a key without
one, whatever it is given: each script first checks every duration argument (a whole number of
milliseconds from 1, or 0 where it says so, to :data:`MAX_LEASE_MS`) and fails *before its
first write* when one is out of range, so ``PEXPIRE`` cannot fail after a write. (Redis runs a
script that has started writing to its end even when it is out of memory, and a script cannot
be killed once it has written, so nothing else can stop one between a write and its expiry.)
"""

from __future__ import annotations

from ..base import MAX_LEASE

__all__ = [
    "ACQUIRE_KEEPING_SCRIPT",
    "ACQUIRE_SCRIPT",
    "CLAIM_NEXT_SCRIPT",
    "CLEAR_NEXT_SCRIPT",
    "EXTEND_MANY_SCRIPT",
    "EXTEND_SCRIPT",
    "MAX_LEASE_MS",
    "OPERATOR_RELEASE_SCRIPT",
    "RELEASE_SCRIPT",
    "RESTORE_SCRIPT",
]

#: The longest duration a script accepts, in milliseconds (the backends' MAX_LEASE).
MAX_LEASE_MS = int(MAX_LEASE * 1000)

# Lua functions every writing script starts with: ms(value) returns value as a number if it is a
# whole number of milliseconds from 1 to MAX_LEASE_MS, else raises a script error; keep(value)
# the same from 0 (0: nothing is kept).
_CHECK_MS = f"""
local function whole(value, low)
  local n = tonumber(value)
  if n == nil or n < low or n > {MAX_LEASE_MS} or n ~= math.floor(n) then
    error('singletask: duration out of range (' .. low .. ' to {MAX_LEASE_MS} ms): '
      .. tostring(value))
  end
  return n
end
local function ms(value) return whole(value, 1) end
local function keep(value) return whole(value, 0) end
"""

# Lua: the released record a key keeps after its holder is gone (lock key hash, fields of the
# held record rec = {f, d}), or nothing: d is kept for marker_keep ms, f for fence_keep ms, and
# both as long as the longer of the two that applies. The key must have been deleted already.
_LEAVE_RECORD = """
local function leave(key, fence, marker, fence_keep, marker_keep)
  local ttl = fence_keep
  if marker and marker_keep > ttl then ttl = marker_keep end
  if ttl == 0 or not fence then return end
  if marker and marker_keep > 0 then
    redis.call('HSET', key, 'f', fence, 'd', marker)
  else
    redis.call('HSET', key, 'f', fence)
  end
  redis.call('PEXPIRE', key, ttl)
end
"""

# KEYS[1]  lock key
# ARGV[1]  owner token
# ARGV[2]  lease in milliseconds
# ARGV[3]  token prefix whose holder may be taken over, or '' for none
# ARGV[4]  when the holder started, in milliseconds since the epoch, or '' (stored as field a:
#          how many milliseconds before the fence's time, a small number when the fence came
#          from the server's clock)
# ARGV[5…] the held record's other fields: field, value, field, value, …
# Returns {1, fence, completion marker or false} when the caller holds the lock now (it was free,
# released, already the caller's, or held by a token starting with ARGV[3]); otherwise
# {0, holder token, its task_id field (0.1.0), its i field, its x field, lease left in ms, holder
# fence}.
# A new fence is max(last fence + 1, server time in microseconds), the last fence being the one
# the key holds (held or released record); a retried acquire by the holder keeps its fence. The
# last completion marker (d) is carried into the new held record.
# Errors (before any write) when ARGV[2] is out of range.
# (The body is the Lua function acquire(), which ACQUIRE_KEEPING_SCRIPT calls as well; it gives
# the key with take(), which the holder-slot scripts of slots.py call for the slot they
# choose.)
# take(key, cur, last, marker, lease): give key to ARGV[1] for lease ms, ARGV[4…] as above; cur
# is its holder's token (or false), last the last fence to grow from (or false), marker the
# completion marker to carry (or false). Returns {1, fence, marker}.
_TAKE_FUNCTION = """
local function take(key, cur, last, marker, lease)
local fence = last
if cur ~= ARGV[1] or not last then
  local now = redis.call('TIME')
  fence = string.format('%.0f', math.max(tonumber(last or '0') + 1, now[1] * 1000000 + now[2]))
end
redis.call('DEL', key)
local record = {'token', ARGV[1], 'f', fence}
if marker then
  record[#record + 1], record[#record + 2] = 'd', marker
end
local since = tonumber(ARGV[4])
if since then
  local before = math.floor(tonumber(fence) / 1000) - since
  record[#record + 1], record[#record + 2] = 'a', string.format('%.0f', before)
end
for i = 5, #ARGV do
  record[#record + 1] = ARGV[i]
end
redis.call('HSET', key, unpack(record))
redis.call('PEXPIRE', key, lease)
return {1, fence, marker}
end
"""

_ACQUIRE_FUNCTION = (
    _TAKE_FUNCTION
    + """
local function acquire()
local lease = ms(ARGV[2])
local rec = redis.call('HMGET', KEYS[1], 'token', 'fence', 'f', 'd')
local cur, last, marker = rec[1], rec[2] or rec[3], rec[4]
if cur and cur ~= ARGV[1] and (ARGV[3] == '' or string.sub(cur, 1, #ARGV[3]) ~= ARGV[3]) then
  local held = redis.call('HMGET', KEYS[1], 'task_id', 'i', 'x')
  return {0, cur, held[1], held[2], held[3], redis.call('PTTL', KEYS[1]), last}
end
return take(KEYS[1], cur, last, marker, lease)
end
"""
)

ACQUIRE_SCRIPT = _CHECK_MS + _ACQUIRE_FUNCTION + "return acquire()\n"

# KEYS[1]  lock key
# ARGV     as ACQUIRE_SCRIPT's
# Returns ACQUIRE_SCRIPT's reply; when the caller holds the lock now, with a fourth element: what
# the key was before, {server time in ms, its PTTL then (-2: no key, -1: no expiry), field,
# value, ...} (RESTORE_SCRIPT's ARGV[3...]). The acquisition of the opt-in replica wait, which
# puts the key back as it was when too few replicas confirm the acquisition.
# Errors (before any write) as ACQUIRE_SCRIPT.
ACQUIRE_KEEPING_SCRIPT = (
    _CHECK_MS
    + _ACQUIRE_FUNCTION
    + """
local fields = redis.call('HGETALL', KEYS[1])
local pttl = redis.call('PTTL', KEYS[1])
local now = redis.call('TIME')
local reply = acquire()
if reply[1] == 1 then
  local before = {tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000), pttl}
  for i = 1, #fields do
    before[i + 2] = fields[i]
  end
  reply[4] = before
end
return reply
"""
)

# KEYS[1]  lock key
# ARGV[1]  owner token of the acquisition being undone
# ARGV[2]  the fencing token that acquisition issued
# ARGV[3]  the server time in ms when it read the key (ACQUIRE_KEEPING_SCRIPT's reply)
# ARGV[4]  the key's PTTL then: -2 (no key), -1 (no expiry) or milliseconds
# ARGV[5…] the key's fields then: field, value, field, value, …
# Returns 1 when the key was put back as it was, 0 when ARGV[1] no longer holds it (nothing is
# changed: its lease ended, or another took it since).
# The key gets back its fields and what was left of its expiry (ARGV[4] less the time since
# ARGV[3]; the key is deleted when nothing is left, or when there was no key). A released
# record (no token) keeps as f the larger of its own fence and ARGV[2], so that fences never go
# back; a held record (a queue reservation taken over, the caller's own earlier acquisition) is
# put back exactly. A key that had no expiry (not written by singletask) gets none.
RESTORE_SCRIPT = """
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then
  return 0
end
local pttl = tonumber(ARGV[4])
redis.call('DEL', KEYS[1])
if pttl == -2 or #ARGV < 6 then
  return 1
end
local left = -1
if pttl >= 0 then
  local now = redis.call('TIME')
  local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
  left = pttl - (now_ms - tonumber(ARGV[3]))
  if left <= 0 then
    return 1
  end
end
local record, token, fence = {}, false, false
for i = 5, #ARGV - 1, 2 do
  if ARGV[i] == 'token' then token = true end
  if ARGV[i] == 'f' then fence = i - 3 end
  record[#record + 1], record[#record + 2] = ARGV[i], ARGV[i + 1]
end
if not token and fence and tonumber(ARGV[2]) > (tonumber(record[fence]) or 0) then
  record[fence] = ARGV[2]
end
redis.call('HSET', KEYS[1], unpack(record))
if left > 0 then
  redis.call('PEXPIRE', KEYS[1], left)
end
return 1
"""

# Lua: mark(key, marker, marker_keep) records a holder slot's completion marker on its key (the
# slot's base key, singletask.protocol.slots), a hash in one of the states above, for marker_keep
# ms: a held record gets the field d (its release carries it on, its lease is left alone); a
# released record gets d and keeps at least marker_keep ms; no key becomes a released record
# {d}. Anything else (another type, a hash without expiry: not singletask's) is left alone.
_MARK_BASE = """
local function mark(key, marker, marker_keep)
  if not marker or marker_keep == 0 then return end
  local kind = redis.call('TYPE', key).ok
  if kind == 'none' then
    redis.call('HSET', key, 'd', marker)
    redis.call('PEXPIRE', key, marker_keep)
  elseif kind == 'hash' then
    local pttl = redis.call('PTTL', key)
    if pttl < 0 then return end
    redis.call('HSET', key, 'd', marker)
    if not redis.call('HGET', key, 'token') and pttl < marker_keep then
      redis.call('PEXPIRE', key, marker_keep)
    end
  end
end
"""

# KEYS[1]  lock key
# KEYS[2]  only when KEYS[1] is a holder slot (singletask.protocol.slots): its base key, which the
#          completion marker goes to (same cluster slot)
# ARGV[1]  owner token
# ARGV[2]  completion marker to record, or '' for none
# ARGV[3]  how long a completion marker is kept, in milliseconds (0: not at all)
# ARGV[4]  how long the last fencing token is kept, in milliseconds (0: not at all)
# Returns 1 when the lock was released, 0 when ARGV[1] does not hold it (free or another owner).
# The key is deleted; it is written again as a released record {f, d} when something is to be
# kept: the marker (ARGV[2], or the one the held record carried) for ARGV[3], the fence for
# ARGV[4]. With both 0, or neither a marker nor a fence retention, nothing is left. With KEYS[2],
# the slot keeps at most its fence, and ARGV[2] is recorded on KEYS[2] (mark(), above).
# Errors (before any write) when ARGV[3] or ARGV[4] is out of range.
RELEASE_SCRIPT = (
    _CHECK_MS
    + _LEAVE_RECORD
    + _MARK_BASE
    + """
local marker_keep, fence_keep = keep(ARGV[3]), keep(ARGV[4])
local rec = redis.call('HMGET', KEYS[1], 'token', 'f', 'd')
if rec[1] ~= ARGV[1] then
  return 0
end
local marker = rec[3]
if ARGV[2] ~= '' then marker = ARGV[2] end
redis.call('DEL', KEYS[1])
if KEYS[2] then
  leave(KEYS[1], rec[2], false, fence_keep, 0)
  mark(KEYS[2], ARGV[2] ~= '' and ARGV[2], marker_keep)
else
  leave(KEYS[1], rec[2], marker, fence_keep, marker_keep)
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

# KEYS[1]  the lock's companion hash (same cluster slot as the lock key)
# ARGV[1]  task id claiming the follow-up slot
# ARGV[2]  how long the claim lasts, in milliseconds
# Returns the task id holding the slot now: ARGV[1] if its claim took, else the one pending.
# The companion hash is kept as long as its claim (at least; a 0.1.0 worker keeps it longer).
# Errors (before any write) when ARGV[2] is out of range.
CLAIM_NEXT_SCRIPT = (
    _CHECK_MS
    + """
local claim = ms(ARGV[2])
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local pending = redis.call('HMGET', KEYS[1], 'next', 'next_until')
if pending[1] and tonumber(pending[2] or '0') > now_ms then
  return pending[1]
end
redis.call('HSET', KEYS[1], 'next', ARGV[1], 'next_until', string.format('%.0f', now_ms + claim))
if redis.call('PTTL', KEYS[1]) < claim then
  redis.call('PEXPIRE', KEYS[1], claim)
end
return ARGV[1]
"""
)

# KEYS[1]  the lock's companion hash
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
# ARGV[1]  task id the holder must have, or '' to release whoever holds it
# ARGV[2]  how long a carried completion marker is kept, in milliseconds (0: not at all)
# ARGV[3]  how long the last fencing token is kept, in milliseconds (0: not at all)
# Returns {} when nothing changed (no held lock at KEYS[1], or ARGV[1] is not its holder's task
# id); otherwise the lock it removed: {lease left in ms, field, value, field, value, ...}.
# The holder's task id is its task_id field (0.1.0), its i field, or else, unless its x field
# has an i, the task id its token starts with (<task id>:<retries>:<host>:<pid>:<nonce>).
# Only a held lock (a hash with a token field) is removed, never a released record or a foreign
# key; it leaves a released record as a release does, so the next acquisition still gets a
# larger fencing token when fence_retention keeps one.
# Errors (before any write) when ARGV[2] or ARGV[3] is out of range.
OPERATOR_RELEASE_SCRIPT = (
    _CHECK_MS
    + _LEAVE_RECORD
    + """
local marker_keep, fence_keep = keep(ARGV[2]), keep(ARGV[3])
if redis.call('TYPE', KEYS[1]).ok ~= 'hash' then
  return {}
end
local held = redis.call('HMGET', KEYS[1], 'token', 'task_id', 'i', 'x', 'fence', 'f', 'd')
local token = held[1]
if not token then
  return {}
end
local task_id = held[2] or held[3]
if not task_id and not string.find(held[4] or '', 'i', 1, true) then
  task_id = string.match(token, '^(.*):[^:]*:[^:]*:[^:]*:[^:]*$')
end
if ARGV[1] ~= '' and task_id ~= ARGV[1] then
  return {}
end
local pttl = redis.call('PTTL', KEYS[1])
local fields = redis.call('HGETALL', KEYS[1])
redis.call('DEL', KEYS[1])
leave(KEYS[1], held[5] or held[6], held[7], fence_keep, marker_keep)
return {pttl, unpack(fields)}
"""
)
