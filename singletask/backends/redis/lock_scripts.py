"""The Lua scripts of the lock key on the Redis stores, each under a comment giving its KEYS, ARGV
and reply: take it (:data:`ACQUIRE_SCRIPT`, the plain lock, and :data:`ACQUIRE_HASH_SCRIPT`),
give it back (:data:`RELEASE_SCRIPT`, :data:`RELEASE_STRING_SCRIPT`), renew it
(:data:`EXTEND_SCRIPT`, :data:`EXTEND_MANY_SCRIPT`), take it keeping what it was and put that
back (the opt-in replica wait: :data:`ACQUIRE_KEEPING_SCRIPT`, :data:`RESTORE_SCRIPT`), release
it for an operator (:data:`OPERATOR_RELEASE_SCRIPT`), read its holder (:data:`HOLDER_SCRIPT`),
and a coalescing task's follow-up claim in the companion hash (:data:`CLAIM_NEXT_SCRIPT`,
:data:`CLEAR_NEXT_SCRIPT`).

The key's states and the rules every script keeps are in
:mod:`singletask.backends.redis.scripts`, with the Lua pieces these scripts share with the others;
:mod:`~singletask.backends.redis.wire` sends them.
"""

from __future__ import annotations

from .scripts import (
    ACQUIRE_FUNCTION,
    ACQUIRE_HASH_PATH,
    CHECK_MS,
    KEPT_READ,
    KEPT_REPLY,
    MAX_LEASE_MS,
    STRING_RECORD,
    checked,
)

__all__ = [
    "ACQUIRE_FIRST_BODY",
    "ACQUIRE_FUNCTION_BODY",
    "ACQUIRE_HASH_SCRIPT",
    "ACQUIRE_KEEPING_SCRIPT",
    "ACQUIRE_SCRIPT",
    "CLAIM_NEXT_SCRIPT",
    "CLEAR_NEXT_SCRIPT",
    "EXTEND_MANY_SCRIPT",
    "EXTEND_SCRIPT",
    "HOLDER_SCRIPT",
    "OPERATOR_RELEASE_SCRIPT",
    "RELEASE_SCRIPT",
    "RELEASE_STRING_SCRIPT",
    "RESTORE_SCRIPT",
]

# KEYS, ARGV and reply: acquire()'s (scripts.py, ACQUIRE_FUNCTION).
ACQUIRE_HASH_SCRIPT = (
    CHECK_MS + ACQUIRE_FUNCTION + "ms(ARGV[2])\nhashed(KEYS[1])\nreturn acquire()\n"
)

# KEYS[1]  lock key
# ARGV[1]  owner token
# ARGV[2]  the rest of the held record: the lease in milliseconds, NUL, when the holder started
#          (milliseconds since the epoch, '=': at the fence's time, or ''), then the record's
#          other fields (ACQUIRE_HASH_SCRIPT's ARGV[5…]), each after a NUL byte: lease NUL since
#          NUL field NUL value …, or lease NUL since for none
# ARGV[3]  token prefix whose holder may be taken over; absent (or '') for none
# Returns the new fence alone (a string of digits) when the caller takes a free key or a string
# record; when a string refuses it, that string (the holder's record, which says its lease
# left: STRING_RECORD), after a NUL byte when it has none (then it is not a record: the reply
# is never a string of digits); ACQUIRE_HASH_SCRIPT's replies when the key is a hash.
# The plain lock: when the key does not exist, or is a held string record (STRING_RECORD), the
# caller who takes it writes it as a string record, SET PX the lease, in one command: ARGV[1],
# NUL, the fence (and @ the server's time when the fence is not that time), NUL, ARGV[2]. A new
# fence is the server's time in microseconds (max(its fence + 1, that time) when taking over a
# string record; a retried acquire by the holder keeps its fence). A key that is a hash (a
# released record kept by fence_retention or marker_retention, a lock written by another script
# or by singletask 0.3.0) is handled as ACQUIRE_HASH_SCRIPT handles it, ARGV[2] split into lease,
# since and fields (detected by GET's WRONGTYPE error, caught). A string that is not a held
# record (not singletask's) is refused with its value (a NUL byte before it when it does not
# read as a record), which the client does not read as a lock.
# Errors (before any write) when the lease is out of range (a refusal, which writes nothing,
# does not read it).
# (Cost, python -m bench cost: the string path calls no Lua function of the script's own and
# builds no table but TIME's; it converts no number (the lease is checked as the digits it came
# as and goes to SET as they are; the fence is TIME's two strings concatenated): strtod and
# printf cost the server some thousands of instructions each; closures and tables are garbage
# its Lua collector walks every 50 calls; each argument costs it about 1,200 instructions, hence
# the lease and the fields in one argument and the prefix only when there is one; a refusal is
# the record as it is, which also says the lease left, so no PTTL.)
# The digits of MAX_LEASE_MS: a lease of more digits is out of range, of as many compared as text.
_WIDTH = len(str(MAX_LEASE_MS))
# The pieces of the plain acquire (ACQUIRE_SCRIPT reads the key first, ACQUIRE_FIRST_BODY writes
# first), with cur the key's value (or the error of reading or writing it) and fence, last the
# fence kept and the last one to grow from (false: none):
# _HASH_PATH: a key that is a hash is taken as ACQUIRE_HASH_SCRIPT takes it.
_HASH_PATH = (
    """if type(cur) == 'table' then
if not string.find(cur.err or '', '^WRONGTYPE') then return cur end
local lease, since, packed = string.match(ARGV[2], '^(%Z*)%z(%Z*)(.*)$')
if since == '=' then since, packed = '', packed .. '\\0a\\0' .. '0' end
local ARGV = {ARGV[1], lease or ARGV[2], ARGV[3] or '', since or ''}
"""
    + CHECK_MS
    + ACQUIRE_HASH_PATH
    + """
if packed then
  for part in string.gmatch(packed, '%z(%Z*)') do ARGV[#ARGV + 1] = part end
end
return acquire()
end
"""
)
# _HELD: a string refuses the caller, unless it is the caller's (a retried acquire: its fence is
# kept) or its token starts with ARGV[3] (a takeover: the fence grows from its).
_HELD = """local prefix = ARGV[3]
local mine = string.find(cur, ARGV[1], 1, true) == 1 and string.byte(cur, #ARGV[1] + 1) == 0
if not mine and (not prefix or prefix == '' or string.find(cur, prefix, 1, true) ~= 1) then
  if string.find(cur, '\\0', 1, true) then return cur end
  return '\\0' .. cur
end
last = string.match(cur, '^%Z*%z(%d+)[@%d]*%z')
if not last then
  return '\\0' .. cur
end
if mine then fence = last end
"""
# _LEASE: the lease, checked as the digits it came as; _CLOCK: the server's time (us: its
# microseconds, 6 digits).
_LEASE = (
    """local lease = string.match(ARGV[2], '^([1-9]%d*)%z')
"""
    + f"""if not lease or #lease > {_WIDTH} or (#lease == {_WIDTH} and lease > '{MAX_LEASE_MS}')
then
  error('singletask: duration out of range (1 to {MAX_LEASE_MS} ms): '
    .. string.match(ARGV[2], '^%Z*'))
end
"""
)
_CLOCK = """local now = redis.call('TIME')
local us = now[2]
if #us < 6 then us = string.rep('0', 6 - #us) .. us end
"""


def _write(get: str) -> str:
    """Lua: the string record written (``get``: SET's option GET, or ''), the fence returned."""
    return f"""local at = ''
if not fence then
  fence = now[1] .. us
  if last and tonumber(last) >= tonumber(fence) then
    at = '@' .. fence
    fence = string.format('%.0f', tonumber(last) + 1)
  end
else
  at = '@' .. now[1] .. us
end
redis.call('SET', KEYS[1], ARGV[1] .. '\\0' .. fence .. at .. '\\0' .. ARGV[2], 'PX', lease{get})
return fence
"""


def _acquire_plain(get: str) -> str:
    """Lua: the plain acquire that reads the key first (``get``: its SET's option GET, or '')."""
    return (
        """
local cur = redis.pcall('GET', KEYS[1])
local fence, last = false, false
if cur then
"""
        + _HASH_PATH
        + _HELD
        + "end\n"
        + _LEASE
        + _CLOCK
        + _write(get)
    )


ACQUIRE_SCRIPT = _acquire_plain("")

# ACQUIRE_SCRIPT as the body of a Redis 7 function (functions.py; KEYS, ARGV and reply the
# same): its SET also asks for the old value (GET, Redis 6.2 and later), nil here, which costs
# the server less than the status reply a plain SET returns, a table in Lua.
ACQUIRE_FUNCTION_BODY = _acquire_plain(", 'GET'")

# KEYS, ARGV, reply and effect: ACQUIRE_SCRIPT's. The Redis 7 function of an acquire that writes
# first: it reads the clock, checks the lease and tries SET NX GET (Redis 7.0 and later) of the
# new record before it knows whether the key is free, then, when the key was not, does what
# ACQUIRE_SCRIPT does with what SET returned (a retried acquire or a takeover writes the record
# once more). One command fewer than ACQUIRE_SCRIPT for a free key (no GET), one more for a held
# one (TIME): the client sends it unless the key was held at its last acquire
# (RedisBackend.acquire). An error other than WRONGTYPE (a hash) that SET meets, such as OOM,
# is the reply.
ACQUIRE_FIRST_BODY = (
    _LEASE
    + _CLOCK
    + """local fence = now[1] .. us
local cur = redis.pcall('SET', KEYS[1], ARGV[1] .. '\\0' .. fence .. '\\0' .. ARGV[2], 'NX', 'PX',
  lease, 'GET')
if not cur then return fence end
local last = false
fence = false
"""
    + _HASH_PATH
    + _HELD
    + _write(", 'GET'")
)

# KEYS[1]  lock key
# ARGV     as ACQUIRE_SCRIPT's
# Returns ACQUIRE_SCRIPT's reply; when the caller holds the lock now, with a fourth element: what
# the key was before, {server time in ms, its PTTL then (-2: no key, -1: no expiry), field,
# value, ...} (RESTORE_SCRIPT's ARGV[3...]). The acquisition of the opt-in replica wait, which
# puts the key back as it was when too few replicas confirm the acquisition.
# Errors (before any write) as ACQUIRE_SCRIPT.
ACQUIRE_KEEPING_SCRIPT = (
    CHECK_MS
    + ACQUIRE_FUNCTION
    + """
ms(ARGV[2])
hashed(KEYS[1])
"""
    + KEPT_READ
    + """local reply = acquire()
if reply[1] == 1 then
"""
    + KEPT_REPLY
    + """end
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
RESTORE_SCRIPT = (
    STRING_RECORD
    + """
if not holds(KEYS[1], ARGV[1]) then
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
)

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

# Lua: mark(key, marker, marker_keep) records a holder slot's completion marker on its key (the
# slot's base key, singletask.protocol.slots), a hash in one of the states scripts.py describes,
# for marker_keep ms: a held record gets the field d (its release carries it on, its lease is
# left alone); a released record gets d and keeps at least marker_keep ms; no key becomes a
# released record {d}. Anything else (another type, a hash without expiry: not singletask's)
# is left alone.
_MARK_BASE = """
local function mark(key, marker, marker_keep)
  if not marker or marker_keep == 0 then return end
  local kind = redis.call('TYPE', key).ok
  if kind == 'string' then
    hashed(key)
    kind = redis.call('TYPE', key).ok
  end
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
# A held string record (STRING_RECORD) is released the same way (it carries no marker); a string
# that is not one fails with WRONGTYPE, as HMGET would. The functions of the released record are
# defined only when something is to be kept (as ACQUIRE_SCRIPT's hash path: no garbage).
# Errors (before any write) when ARGV[3] or ARGV[4] is out of range.
RELEASE_SCRIPT = (
    checked("marker_keep", "ARGV[3]", 0)
    + checked("fence_keep", "ARGV[4]", 0)
    + """
local cur = redis.pcall('GET', KEYS[1])
local rec
if type(cur) == 'table' then
  rec = redis.call('HMGET', KEYS[1], 'token', 'f', 'd')
  if rec[1] ~= ARGV[1] then
    return 0
  end
  redis.call('DEL', KEYS[1])
else
  if not cur then
    return 0
  end
  if string.find(cur, ARGV[1], 1, true) ~= 1 or string.byte(cur, #ARGV[1] + 1) ~= 0 then
    if not string.find(cur, '^%Z*%z%d+[@%d]*%z') then
      return redis.error_reply('WRONGTYPE Operation against a key holding the wrong kind of value')
    end
    return 0
  end
  redis.call('DEL', KEYS[1])
  if not KEYS[2] and fence_keep == 0 and (marker_keep == 0 or ARGV[2] == '') then
    return 1
  end
  rec = {ARGV[1], string.match(cur, '^%Z*%z(%d+)'), false}
end
"""
    + _LEAVE_RECORD
    + STRING_RECORD
    + _MARK_BASE
    + """
local marker = rec[3]
if ARGV[2] ~= '' then marker = ARGV[2] end
if KEYS[2] then
  leave(KEYS[1], rec[2], false, fence_keep, 0)
  mark(KEYS[2], ARGV[2] ~= '' and ARGV[2], marker_keep)
else
  leave(KEYS[1], rec[2], marker, fence_keep, marker_keep)
end
return 1
"""
)

#: The marker retention, in milliseconds, a release that keeps nothing applies to a hash when
#: its call leaves it out: the default ``marker_retention`` (store.MARKER_RETENTION, one day).
DEFAULT_MARKER_KEEP_MS = 86_400_000

# KEYS[1]  lock key
# ARGV[1]  owner token
# ARGV[2]  how long a completion marker the held record carries is kept, in milliseconds (0: not
#          at all); read only when the key is a hash; left out, DEFAULT_MARKER_KEEP_MS (a plain
#          lock's key is a string, and each argument costs the server some 1,200 instructions:
#          the client sends it only when its marker_retention is not the default)
# Returns 1 when the lock was released, 0 when ARGV[1] does not hold it (no key, or another
# owner's record).
# RELEASE_SCRIPT's case of no completion marker given, fence_retention 0 and no holder slot key
# beside it, in two arguments: a held string record carries nothing to keep, so it is deleted; a
# held hash (a slot's, the replica wait's, one taken over a released record) is deleted and keeps
# the marker it carries, if any, for ARGV[2] ms, as RELEASE_SCRIPT would. A string that is not a
# held record fails with WRONGTYPE, as RELEASE_SCRIPT does.
# Errors (before any write) when the key is a hash and ARGV[2] is out of range.
RELEASE_STRING_SCRIPT = (
    """
local cur = redis.pcall('GET', KEYS[1])
if type(cur) == 'table' then
"""
    + checked("marker_keep", f"(ARGV[2] or '{DEFAULT_MARKER_KEEP_MS}')", 0)
    + """local rec = redis.call('HMGET', KEYS[1], 'token', 'f', 'd')
  if rec[1] ~= ARGV[1] then return 0 end
  redis.call('DEL', KEYS[1])
  if rec[2] and rec[3] and marker_keep > 0 then
    redis.call('HSET', KEYS[1], 'f', rec[2], 'd', rec[3])
    redis.call('PEXPIRE', KEYS[1], marker_keep)
  end
  return 1
end
if not cur then return 0 end
if string.find(cur, ARGV[1], 1, true) == 1 and string.byte(cur, #ARGV[1] + 1) == 0 then
  redis.call('DEL', KEYS[1])
  return 1
end
if not string.find(cur, '^%Z*%z%d+[@%d]*%z') then
  return redis.error_reply('WRONGTYPE Operation against a key holding the wrong kind of value')
end
return 0
"""
)

# KEYS[1]  lock key
# ARGV[1]  owner token
# ARGV[2]  new lease in milliseconds (from now)
# Returns 1 when the lease was set, 0 when ARGV[1] does not hold the lock. A string record is
# written again with its new lease and the time it runs from (renew(), STRING_RECORD).
# Errors when ARGV[2] is out of range.
EXTEND_SCRIPT = (
    CHECK_MS
    + STRING_RECORD
    + """
return renew(KEYS[1], ARGV[1], ms(ARGV[2]))
"""
)

# KEYS[1…n]  lock keys
# ARGV[2i-1] owner token of KEYS[i]; ARGV[2i] its new lease in milliseconds
# Returns a list with, for each key, 1 when its lease was set and 0 when that token does not
# hold it. One round trip renews every lock a process holds.
# Errors (before any lease is set) when one of the leases is out of range.
EXTEND_MANY_SCRIPT = (
    CHECK_MS
    + STRING_RECORD
    + """
local leases = {}
for i = 1, #KEYS do
  leases[i] = ms(ARGV[2 * i])
end
local out = {}
for i = 1, #KEYS do
  out[i] = renew(KEYS[i], ARGV[2 * i - 1], leases[i])
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
    CHECK_MS
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
    CHECK_MS
    + _LEAVE_RECORD
    + STRING_RECORD
    + """
local marker_keep, fence_keep = keep(ARGV[2]), keep(ARGV[3])
hashed(KEYS[1])
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

# KEYS[1]  lock key
# Returns {holder fields as field, value, ..., lease left in ms} (an empty hash: free), or
# {the held string record (STRING_RECORD), lease left in ms}.
HOLDER_SCRIPT = """
local value = redis.pcall('GET', KEYS[1])
if type(value) == 'string' then
  return {value, redis.call('PTTL', KEYS[1])}
end
return {redis.call('HGETALL', KEYS[1]), redis.call('PTTL', KEYS[1])}
"""
