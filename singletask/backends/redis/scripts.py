"""The Lua scripts of the Redis lock store, one atomic step each.

**One key per lock.** Every script that takes, gives back, renews or inspects a lock reads and
writes the lock key alone, so it runs on one Redis Cluster slot with nothing else to wait for
(a script over two keys of a slot that is being migrated gets ``TRYAGAIN`` while only one of
them has moved). The key is in one of three states:

* *held, plain*: a string, written by :data:`ACQUIRE_SCRIPT` (the plain lock: no holder slots,
  no preemption, no named limits in the same script, no replica wait):
  ``<token> NUL <fence> NUL <since in ms or ''> NUL <field> NUL <value> ...``, the compact
  metadata fields :mod:`singletask.backends.redis.wire` writes; its expiry is the lease. One
  ``SET ... PX`` takes it, a ``GET`` and a comparison of the token with the start of the value
  release or renew it: about a third less of the server's work than a hash (``python -m bench
  cost``);
* *held, hash*: the field ``token`` (the owner token), ``f`` (the fencing token), ``a`` (the
  since, as ms before the fence's time), ``d`` (a carried completion marker) and the same
  metadata fields; its expiry is the lease. Written by every other acquiring script, and by
  :data:`ACQUIRE_SCRIPT` itself when the key is a hash already (a released record, or a lock
  of singletask 0.3.0 or earlier);
* *released*: a hash without ``token``; ``f``, the last fencing token issued, and ``d``, the
  completion marker of the last execution that recorded one; its expiry is how long they are
  kept (the transport options ``fence_retention`` and ``marker_retention``). By default a
  release leaves nothing: the key is deleted.

Every script that reads a lock key reads both held forms: the plain path's scripts tell a hash
by the ``WRONGTYPE`` error of their ``GET`` (caught with ``redis.pcall``) and then run the hash
path; the others first rewrite a string lock as the equivalent held hash, same expiry
(``hashed()`` in ``_STRING_RECORD``). A string that is not a held record (another
application's value) is never rewritten: it fails the scripts with ``WRONGTYPE`` as before (an
acquire's refusal carries it to the client, which raises the same). Scripts of singletask 0.3.0
and earlier cannot read a string lock: they fail with ``WRONGTYPE`` on it, writing nothing.

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

**Every script of the Redis stores is here**, but those of named limits, each under a comment
giving its KEYS, ARGV and reply: besides the lock's, those of holder slots (``lock_limit``:
every slot of a key read and one taken, :mod:`~singletask.backends.redis.slots`), of the rate
record that goes with them (``lock_rate``), of debounce windows (``lock_debounce``,
:mod:`~singletask.backends.redis.rates`) and of preemption records (``lock_policy =
"replace"``, :mod:`~singletask.backends.redis.replaced`). The scripts of named limits
(``take_units``, ``give_units``, :mod:`~singletask.backends.redis.units`) are in
:mod:`~singletask.backends.redis.limit_scripts`, under the same rules. Each one's keys share a
Redis Cluster slot. :mod:`~singletask.backends.redis.wire` sends them.
"""

from __future__ import annotations

from typing import Final

from ..base import MAX_LEASE

__all__ = [
    "ACQUIRE_HASH_SCRIPT",
    "ACQUIRE_KEEPING_SCRIPT",
    "ACQUIRE_SCRIPT",
    "ACQUIRE_SLOT_KEEPING_SCRIPT",
    "ACQUIRE_SLOT_RATED_KEEPING_SCRIPT",
    "ACQUIRE_SLOT_RATED_SCRIPT",
    "ACQUIRE_SLOT_SCRIPT",
    "CLAIM_NEXT_SCRIPT",
    "CLEAR_NEXT_SCRIPT",
    "DEBOUNCE_PUBLISHED_SCRIPT",
    "DEBOUNCE_SCRIPT",
    "DEBOUNCE_TAKE_SCRIPT",
    "DEBOUNCE_UNDO_SCRIPT",
    "EXTEND_MANY_SCRIPT",
    "EXTEND_SCRIPT",
    "HOLDER_SCRIPT",
    "MAX_LEASE_MS",
    "OPERATOR_RELEASE_SCRIPT",
    "PREEMPT_KEEPING_SCRIPT",
    "PREEMPT_SCRIPT",
    "PREEMPT_SLOT_KEEPING_SCRIPT",
    "PREEMPT_SLOT_SCRIPT",
    "RELEASE_SCRIPT",
    "RELEASE_STRING_SCRIPT",
    "REPLACED_BY_SCRIPT",
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
  if n == nil or n < low or n > {MAX_LEASE_MS} or n % 1 ~= 0 then
    error('singletask: duration out of range (' .. low .. ' to {MAX_LEASE_MS} ms): '
      .. tostring(value))
  end
  return n
end
local function ms(value) return whole(value, 1) end
local function keep(value) return whole(value, 0) end
"""


def _checked(name: str, value: str, low: int) -> str:
    """Lua: the local ``name``, ``value`` as a number, checked as _CHECK_MS's whole() checks it
    (same error), written out inline: a script whose hot path calls no function of its own
    allocates no closure per call (the server's Lua garbage collector runs every 50 scripts)."""
    return (
        f"local {name} = tonumber({value})\n"
        f"if {name} == nil or {name} < {low} or {name} > {MAX_LEASE_MS} or {name} % 1 ~= 0 then\n"
        f"  error('singletask: duration out of range ({low} to {MAX_LEASE_MS} ms): '\n"
        f"    .. tostring({value}))\n"
        "end\n"
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

# Lua: the held record as a string (the plain lock's layout, written by ACQUIRE_SCRIPT):
# <token> NUL <fence> NUL <since in ms, or ''> NUL <field> NUL <value> NUL ... (the compact
# metadata fields, possibly none). hashed(key) rewrites such a string as the equivalent held
# hash (token, f, a: ms before the fence's time, the fields), keeping its expiry, so that the
# scripts below that read hashes read it; any other key (no key, a hash, a string that is not a
# held record: not singletask's) is left as it is. holds(key, token): whether token holds key,
# as a string record or a hash; a string that is not a held record raises WRONGTYPE there, as
# HGET does (ours(value) checks).
_STRING_RECORD = """
local function hashed(key)
  local value = redis.pcall('GET', key)
  if type(value) ~= 'string' then return end
  local token, fence, since, rest = string.match(value, '^(%Z*)%z(%d+)%z(%d*)%z(.*)$')
  if not token then return end
  local record = {'token', token, 'f', fence}
  if since ~= '' then
    record[5], record[6] = 'a', string.format('%.0f', math.floor(tonumber(fence) / 1000) - since)
  end
  if rest ~= '' then
    for part in string.gmatch(rest .. '\\0', '(%Z*)%z') do record[#record + 1] = part end
  end
  local pttl = redis.call('PTTL', key)
  redis.call('DEL', key)
  redis.call('HSET', key, unpack(record))
  if pttl > 0 then redis.call('PEXPIRE', key, pttl) end
end
local function ours(value)
  if not string.find(value, '^%Z*%z%d+%z') then
    error({err = 'WRONGTYPE Operation against a key holding the wrong kind of value'})
  end
end
local function holds(key, token)
  local value = redis.pcall('GET', key)
  if type(value) == 'table' then return redis.call('HGET', key, 'token') == token end
  if not value then return false end
  if string.sub(value, 1, #token) == token and string.byte(value, #token + 1) == 0 then
    return true
  end
  ours(value)
  return false
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
# the key with take(), which the holder-slot scripts below call for the slot they choose.)
# take(key, cur, last, marker, lease, absent): give key to ARGV[1] for lease ms, ARGV[4…] as
# above; cur is its holder's token (or false), last the last fence to grow from (or false),
# marker the completion marker to carry (or false); absent: the key does not exist (nothing to
# delete first). Returns {1, fence, marker}.
# (Cost: the new fence is the server's TIME written out by concatenation, its seconds and its
# microseconds padded to 6 digits, and compared as a number with last: a number written out by
# string.format costs the server a printf, done for it only when last + 1 is larger.)
_TAKE_FUNCTION = """
local function take(key, cur, last, marker, lease, absent)
local fence = last
if cur ~= ARGV[1] or not last then
  local now = redis.call('TIME')
  fence = now[1] .. string.rep('0', 6 - #now[2]) .. now[2]
  if last and tonumber(last) >= tonumber(fence) then
    fence = string.format('%.0f', tonumber(last) + 1)
  end
end
if not absent then redis.call('DEL', key) end
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

# acquire(): the holder's token is read alone first (a hash field costs the server a scan of
# the record): a refusal then reads only the fields its reply names, a key that does not exist
# (the common case) is taken at once, and a released record or a takeover reads its fence and
# marker.
_ACQUIRE_FUNCTION = (
    _STRING_RECORD
    + _TAKE_FUNCTION
    + """
local function acquire()
local lease = ms(ARGV[2])
local cur = redis.call('HGET', KEYS[1], 'token')
if cur and cur ~= ARGV[1] and (ARGV[3] == '' or string.sub(cur, 1, #ARGV[3]) ~= ARGV[3]) then
  local held = redis.call('HMGET', KEYS[1], 'fence', 'f', 'task_id', 'i', 'x')
  return {0, cur, held[3], held[4], held[5], redis.call('PTTL', KEYS[1]), held[1] or held[2]}
end
if not cur and redis.call('EXISTS', KEYS[1]) == 0 then
  return take(KEYS[1], false, false, false, lease, true)
end
local rec = redis.call('HMGET', KEYS[1], 'fence', 'f', 'd')
return take(KEYS[1], cur, rec[1] or rec[2], rec[3], lease)
end
"""
)

ACQUIRE_HASH_SCRIPT = (
    _CHECK_MS + _ACQUIRE_FUNCTION + "ms(ARGV[2])\nhashed(KEYS[1])\nreturn acquire()\n"
)

# KEYS[1]  lock key
# ARGV[1]  owner token
# ARGV[2]  lease in milliseconds
# ARGV[3]  the rest of the held record: when the holder started, in milliseconds since the epoch
#          (or ''), NUL, then the record's other fields (ACQUIRE_HASH_SCRIPT's ARGV[5…]) joined
#          by NUL bytes: since NUL field NUL value NUL field NUL value, or since NUL for none
# ARGV[4]  token prefix whose holder may be taken over; absent (or '') for none
# Returns the new fence alone (a string of digits) when the caller takes a free key or a string
# record; when a string refuses it, one string too: its lease left in ms (-1: no expiry), NUL,
# then its value (the record); ACQUIRE_HASH_SCRIPT's replies when the key is a hash.
# The plain lock: when the key does not exist, or is a held string record (_STRING_RECORD), the
# caller who takes it writes it as a string record, SET PX the lease, in one command: ARGV[1],
# NUL, the fence, NUL, ARGV[3]. A new fence is the server's time in microseconds (max(its fence
# + 1, that time) when taking over a string record; a retried acquire by the holder keeps its
# fence). A key that is a hash (a released record kept by fence_retention or marker_retention,
# a lock written by another script or by singletask 0.3.0) is handled as ACQUIRE_HASH_SCRIPT
# handles it, ARGV[3] split into since and fields (detected by GET's WRONGTYPE error, caught). A
# string that is not a held record (not singletask's) is refused with its value, which the
# client does not read as a lock.
# Errors (before any write) when ARGV[2] is out of range.
# (Cost: the string path calls no Lua function of the script's own and builds no table but its
# reply, the hash path's functions being defined only when it runs: closures and tables are
# garbage the server's Lua collector walks every 50 scripts; each argument costs the server
# about 1,500 instructions, hence the fields in one argument and the prefix only when there is
# one; the lease goes to SET as the string it came as, checked, since a number would be printed
# back; a refusal is one string rather than a table, cheaper to build and to read; see python -m
# bench cost.)
ACQUIRE_SCRIPT = (
    _checked("lease", "ARGV[2]", 1)
    + """
local cur = redis.pcall('GET', KEYS[1])
if type(cur) == 'table' then
local since, packed = string.match(ARGV[3], '^(%Z*)%z(.*)$')
local ARGV = {ARGV[1], ARGV[2], ARGV[4] or '', since or ''}
"""
    + _CHECK_MS
    + _ACQUIRE_FUNCTION
    + """
if packed and packed ~= '' then
  for part in string.gmatch(packed .. '\\0', '(%Z*)%z') do ARGV[#ARGV + 1] = part end
end
return acquire()
end
local fence, last = false, false
if cur then
  local prefix = ARGV[4]
  local mine = string.find(cur, ARGV[1], 1, true) == 1 and string.byte(cur, #ARGV[1] + 1) == 0
  if not mine and (not prefix or prefix == '' or string.find(cur, prefix, 1, true) ~= 1) then
    return redis.call('PTTL', KEYS[1]) .. '\\0' .. cur
  end
  last = string.match(cur, '^%Z*%z(%d+)%z')
  if not last then
    return redis.call('PTTL', KEYS[1]) .. '\\0' .. cur
  end
  if mine then fence = last end
end
if not fence then
  local now = redis.call('TIME')
  local us = now[2]
  if #us < 6 then us = string.rep('0', 6 - #us) .. us end
  fence = now[1] .. us
  if last and tonumber(last) >= tonumber(fence) then
    fence = string.format('%.0f', tonumber(last) + 1)
  end
end
redis.call('SET', KEYS[1], ARGV[1] .. '\\0' .. fence .. '\\0' .. ARGV[3], 'PX', ARGV[2])
return fence
"""
)

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
ms(ARGV[2])
hashed(KEYS[1])
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
RESTORE_SCRIPT = (
    _STRING_RECORD
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

# Lua: mark(key, marker, marker_keep) records a holder slot's completion marker on its key (the
# slot's base key, singletask.protocol.slots), a hash in one of the states above, for marker_keep
# ms: a held record gets the field d (its release carries it on, its lease is left alone); a
# released record gets d and keeps at least marker_keep ms; no key becomes a released record
# {d}. Anything else (another type, a hash without expiry: not singletask's) is left alone.
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
# A held string record (_STRING_RECORD) is released the same way (it carries no marker); a string
# that is not one fails with WRONGTYPE, as HMGET would. The functions of the released record are
# defined only when something is to be kept (as ACQUIRE_SCRIPT's hash path: no garbage).
# Errors (before any write) when ARGV[3] or ARGV[4] is out of range.
RELEASE_SCRIPT = (
    _checked("marker_keep", "ARGV[3]", 0)
    + _checked("fence_keep", "ARGV[4]", 0)
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
    if not string.find(cur, '^%Z*%z%d+%z') then
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
    + _STRING_RECORD
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

# KEYS[1]  lock key
# ARGV[1]  owner token
# Returns 1 when the lock was released (the key deleted), 0 when ARGV[1] does not hold it (no key,
# or a string record of another owner), -1 when the key is a hash: nothing is done, and the
# caller sends RELEASE_SCRIPT, which releases a hash record (keeping what it carries).
# The release of a plain lock that leaves nothing behind, RELEASE_SCRIPT's case of no completion
# marker given, fence_retention 0 and no holder slot, with one argument: a held string record
# carries nothing to keep. A string that is not a held record fails with WRONGTYPE, as
# RELEASE_SCRIPT does.
RELEASE_STRING_SCRIPT = """
local cur = redis.pcall('GET', KEYS[1])
if type(cur) ~= 'string' then
  if cur then return -1 end
  return 0
end
if string.find(cur, ARGV[1], 1, true) == 1 and string.byte(cur, #ARGV[1] + 1) == 0 then
  redis.call('DEL', KEYS[1])
  return 1
end
if not string.find(cur, '^%Z*%z%d+%z') then
  return redis.error_reply('WRONGTYPE Operation against a key holding the wrong kind of value')
end
return 0
"""

# KEYS[1]  lock key
# ARGV[1]  owner token
# ARGV[2]  new lease in milliseconds (from now)
# Returns 1 when the lease was set, 0 when ARGV[1] does not hold the lock.
# Errors when ARGV[2] is out of range.
EXTEND_SCRIPT = (
    _CHECK_MS
    + _STRING_RECORD
    + """
local lease = ms(ARGV[2])
if holds(KEYS[1], ARGV[1]) then
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
    + _STRING_RECORD
    + """
local leases = {}
for i = 1, #KEYS do
  leases[i] = ms(ARGV[2 * i])
end
local out = {}
for i = 1, #KEYS do
  if holds(KEYS[i], ARGV[2 * i - 1]) then
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
    + _STRING_RECORD
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


# Lua: acquire_slot(keeping, start) is ACQUIRE_SLOT_SCRIPT's body (take() is ACQUIRE_SCRIPT's:
# the chosen slot is given exactly as acquire() gives a key). With keeping, a successful reply
# gets what the slot was before as a fifth element (as ACQUIRE_KEEPING_SCRIPT's fourth). With
# start (the rated scripts below), a slot about to be taken by a new token is a start:
# start() records it and returns false, or returns the ms until one is allowed, and the reply is
# {2, those ms} (nothing written).
_ACQUIRE_SLOT_FUNCTION = """
local function acquire_slot(keeping, start)
local lease = ms(ARGV[2])
for i = 1, #KEYS do hashed(KEYS[i]) end
local recs, top, chosen = {}, false, nil
for i = 1, #KEYS do
  local rec = redis.call('HMGET', KEYS[i], 'token', 'fence', 'f')
  recs[i] = rec
  local last = rec[2] or rec[3]
  if last and (not top or tonumber(last) > tonumber(top)) then top = last end
  if not chosen and rec[1] == ARGV[1] then chosen = i end
end
if not chosen and ARGV[3] ~= '' then
  for i = 1, #KEYS do
    local cur = recs[i][1]
    if cur and string.sub(cur, 1, #ARGV[3]) == ARGV[3] then chosen = i break end
  end
end
if not chosen then
  for i = 1, #KEYS do
    if not recs[i][1] then chosen = i break end
  end
end
if not chosen then
  local out = {0}
  for i = 1, #KEYS do
    local held = redis.call('HMGET', KEYS[i], 'task_id', 'i', 'x')
    local rec = recs[i]
    local n = #out
    out[n + 1], out[n + 2], out[n + 3], out[n + 4] = rec[1], held[1], held[2], held[3]
    out[n + 5], out[n + 6] = redis.call('PTTL', KEYS[i]), rec[2] or rec[3]
  end
  return out
end
local key, rec = KEYS[chosen], recs[chosen]
if start and rec[1] ~= ARGV[1] then
  local wait = start()
  if wait then return {2, wait} end
end
local before
if keeping then
  local fields, pttl, now = redis.call('HGETALL', key), redis.call('PTTL', key), redis.call('TIME')
  before = {tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000), pttl}
  for i = 1, #fields do
    before[i + 2] = fields[i]
  end
end
local marker = redis.call('HGET', KEYS[1], 'd')
local reply
if rec[1] == ARGV[1] and (rec[2] or rec[3]) then
  reply = take(key, rec[1], rec[2] or rec[3], marker, lease)
else
  reply = take(key, false, top, marker, lease)
end
reply[4] = chosen - 1
if keeping then reply[5] = before end
return reply
end
"""

# KEYS[1…n]  the holder slots of a lock key (protocol.slots.slot_keys), slot 0 (the key) first
# ARGV       as ACQUIRE_SCRIPT's: owner token, lease ms, takeover prefix or '', since, fields…
# Returns {1, fence, completion marker or false, index of the slot taken (0-based)} when the
# caller holds a slot now: the slot ARGV[1] holds already (its fence is kept), else the first
# whose holder's token starts with ARGV[3], else the first free one, taken as ACQUIRE_SCRIPT
# takes a key; a new fence is max(largest fence any slot's record holds + 1, server time in
# microseconds), and the marker is KEYS[1]'s. Otherwise (every slot held) {0, then for each
# slot in order: holder token, its task_id field (0.1.0), its i field, its x field, lease left
# in ms, holder fence}.
# Errors (before any write) when ARGV[2] is out of range.
ACQUIRE_SLOT_SCRIPT = (
    _CHECK_MS + _ACQUIRE_FUNCTION + _ACQUIRE_SLOT_FUNCTION + "return acquire_slot()\n"
)

# KEYS, ARGV as ACQUIRE_SLOT_SCRIPT's
# Returns ACQUIRE_SLOT_SCRIPT's reply; when the caller holds a slot now, with a fifth element:
# what that slot was before (as ACQUIRE_KEEPING_SCRIPT's fourth, RESTORE_SCRIPT's ARGV[3…]).
# The slot acquisition of the opt-in replica wait. Errors as ACQUIRE_SLOT_SCRIPT.
ACQUIRE_SLOT_KEEPING_SCRIPT = (
    _CHECK_MS + _ACQUIRE_FUNCTION + _ACQUIRE_SLOT_FUNCTION + "return acquire_slot(true)\n"
)


# Lua, after _CHECK_MS and before the functions of the slot script: takes the rate record and
# the interval off the end of KEYS and ARGV (the locals shadow them for everything after, so the
# slot script's functions see its own KEYS and ARGV), and defines start(), acquire_slot's hook.
_RATE_PRELUDE = """
local rate, interval = KEYS[#KEYS], ms(ARGV[#ARGV])
local KEYS, ARGV = {unpack(KEYS, 1, #KEYS - 1)}, {unpack(ARGV, 1, #ARGV - 1)}
local function start()
  local now = redis.call('TIME')
  local now_us = tonumber(now[1]) * 1000000 + tonumber(now[2])
  local allowed = tonumber(redis.call('GET', rate) or '0') or 0
  if allowed > now_us then return math.ceil((allowed - now_us) / 1000) end
  redis.call('SET', rate, string.format('%.0f', now_us + interval * 1000), 'PX', interval)
  return false
end
"""

# KEYS[1…n]  the holder slots of a lock key, as ACQUIRE_SLOT_SCRIPT's
# KEYS[n+1]  the key's rate record (rates.rate_key; same cluster slot)
# ARGV       as ACQUIRE_SLOT_SCRIPT's, then the interval in ms (the last one)
# Returns ACQUIRE_SLOT_SCRIPT's replies ({1, ...} taken, {0, ...} every slot held: nothing is
# written, the rate record is not read), and {2, ms until a start is allowed} when the slot it
# would take goes to a new token (free, or taken over: a start) within the interval of the key's
# last start, by the server clock (rounded up to the ms); nothing is written then. A start
# writes KEYS[n+1] = server microseconds of the next allowed start (now + interval), PX
# interval: in microseconds, so that no start comes a rounding closer than the interval. A
# holder taking its own slot again is no start: the rate record is neither read nor written.
# Errors (before any write) when ARGV[2] or the interval is out of range.
ACQUIRE_SLOT_RATED_SCRIPT = (
    _CHECK_MS + _RATE_PRELUDE + _ACQUIRE_FUNCTION + _ACQUIRE_SLOT_FUNCTION
    + "return acquire_slot(false, start)\n"
)  # fmt: skip

# KEYS, ARGV as ACQUIRE_SLOT_RATED_SCRIPT's
# Returns its replies, a taken slot's with a fifth element as ACQUIRE_SLOT_KEEPING_SCRIPT's:
# the rated slot acquisition of the opt-in replica wait (which puts back the slot it cannot
# confirm, not the rate record: that start stays spent).
ACQUIRE_SLOT_RATED_KEEPING_SCRIPT = (
    _CHECK_MS + _RATE_PRELUDE + _ACQUIRE_FUNCTION + _ACQUIRE_SLOT_FUNCTION
    + "return acquire_slot(true, start)\n"
)  # fmt: skip


# KEYS[1]  the key's debounce window (rates.window_key)
# ARGV[1]  the task id of this send
# ARGV[2]  how long the window is kept from now, in milliseconds
# ARGV[3]  how long this send is pending (its message being published), in milliseconds; 0:
#          published at once
# Returns {previous latest task id, or false when this call opened the window; ms since the
# window opened, by the server clock (0 when this call opened it); the latest of the closed
# window this call opened a new one over, else false (for DEBOUNCE_UNDO_SCRIPT)}. ARGV[1]
# becomes the latest (field l), pending until the server ms in field p (none when ARGV[3] is
# 0), the previous latest's p kept in field b for DEBOUNCE_UNDO_SCRIPT. A window is open when
# the hash has field o; with no hash, or one without o (a window closed by
# DEBOUNCE_TAKE_SCRIPT), this call opens a new one: the hash is written again as {l: ARGV[1],
# o: the server ms now, p}. The hash is kept ARGV[2] ms from now, or longer if an earlier send
# asked for longer (its PTTL is never shortened: an earlier send with a longer countdown of
# its own must still find the window when it starts).
# Errors (before any write) when ARGV[2] is out of range.
DEBOUNCE_SCRIPT = (
    _CHECK_MS
    + """
local ttl = math.max(ms(ARGV[2]), redis.call('PTTL', KEYS[1]))
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local rec = redis.call('HMGET', KEYS[1], 'l', 'o', 'p')
local opened = tonumber(rec[2])
local closed = false
if rec[1] and opened then
  redis.call('HDEL', KEYS[1], 'p', 'b')
  redis.call('HSET', KEYS[1], 'l', ARGV[1])
else
  closed, rec[1], rec[3], opened = rec[1], false, false, now_ms
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 'l', ARGV[1], 'o', string.format('%.0f', now_ms))
end
if tonumber(ARGV[3]) > 0 then
  redis.call('HSET', KEYS[1], 'p', string.format('%.0f', now_ms + tonumber(ARGV[3])))
  if rec[3] then
    redis.call('HSET', KEYS[1], 'b', rec[3])
  end
end
redis.call('PEXPIRE', KEYS[1], ttl)
return {rec[1], math.max(0, now_ms - opened), closed}
"""
)

# KEYS[1]  the key's debounce window
# ARGV[1]  the task id of a pending send whose message was published
# Returns 1 when the window is open (field o), its latest (field l) is ARGV[1] and it was
# pending (field p): deletes fields p and b. Else writes nothing and returns 0.
DEBOUNCE_PUBLISHED_SCRIPT = """
local rec = redis.call('HMGET', KEYS[1], 'l', 'o', 'p')
if rec[1] ~= ARGV[1] or not rec[2] or not rec[3] then
  return 0
end
redis.call('HDEL', KEYS[1], 'p', 'b')
return 1
"""

# KEYS[1]  the key's debounce window
# ARGV[1]  a task id
# ARGV[2]  '1' when the caller can wait no longer (overdue), else '' or absent
# Returns {the window's latest task id (field l; false when there is no window record), open
# or closed; ms it stays pending (0 unless it is pending and not ARGV[1])}. When the window is
# open (field o), its latest is another send, pending (field p) and past its deadline (or
# ARGV[2] is '1'), that send is taken back: l becomes ARGV[1]. When l is then ARGV[1] and the
# window is open, closes it: deletes fields o, p and b, keeping the hash, its latest and its
# expiry (PTTL). A pending latest before its deadline changes nothing (without ARGV[2]).
DEBOUNCE_TAKE_SCRIPT = """
local rec = redis.call('HMGET', KEYS[1], 'l', 'o', 'p')
if rec[2] and rec[1] ~= ARGV[1] and rec[3] then
  local now = redis.call('TIME')
  local left = tonumber(rec[3]) - (tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000))
  if left > 0 and ARGV[2] ~= '1' then
    return {rec[1], left}
  end
  rec[1] = ARGV[1]
  redis.call('HSET', KEYS[1], 'l', ARGV[1])
end
if rec[1] == ARGV[1] and rec[2] then
  redis.call('HDEL', KEYS[1], 'o', 'p', 'b')
end
return {rec[1], 0}
"""

# KEYS[1]  the key's debounce window
# ARGV[1]  the task id of a send whose message was never published
# ARGV[2]  the latest send its DEBOUNCE_SCRIPT call replaced, or '' when that call opened the
#          window
# ARGV[3]  the latest of the closed window that call replaced (its third reply), or ''
# Returns 1 when it changed the window, else 0. Only when the window is open (field o) and its
# latest (field l) is ARGV[1]: with ARGV[2], l becomes ARGV[2], pending again until field b if
# there is one (o and the expiry are kept); with '' and ARGV[3], the closed window is back: l
# becomes ARGV[3] and o, p and b are deleted (the expiry kept); with '' and '', the hash is
# deleted. Otherwise (superseded, closed, or no window) it writes nothing.
DEBOUNCE_UNDO_SCRIPT = """
local rec = redis.call('HMGET', KEYS[1], 'l', 'o', 'b')
if rec[1] ~= ARGV[1] or not rec[2] then
  return 0
end
if ARGV[2] ~= '' then
  redis.call('HDEL', KEYS[1], 'p', 'b')
  redis.call('HSET', KEYS[1], 'l', ARGV[2])
  if rec[3] then
    redis.call('HSET', KEYS[1], 'p', rec[3])
  end
elseif ARGV[3] ~= '' then
  redis.call('HSET', KEYS[1], 'l', ARGV[3])
  redis.call('HDEL', KEYS[1], 'o', 'p', 'b')
else
  redis.call('DEL', KEYS[1])
end
return 1
"""


# Lua, after _CHECK_MS and before the functions of the acquire or slot script: takes the
# preemption record's key and the preemptor's task id off the end of KEYS and ARGV (the locals
# shadow them for everything after, as _RATE_PRELUDE does), and defines replaced(cur): when the
# store key just taken was held by cur, a token starting with ARGV[3] (the victim's), it writes
# the record, expiring with the preemptor's lease (ARGV[2], checked by acquire() before any
# write). A key taken free (its victim gone meanwhile) leaves no record.
_PREEMPT_PRELUDE = """
local record, successor = KEYS[#KEYS], ARGV[#ARGV]
local KEYS, ARGV = {unpack(KEYS, 1, #KEYS - 1)}, {unpack(ARGV, 1, #ARGV - 1)}
local function replaced(cur)
  if cur and cur ~= ARGV[1] and string.sub(cur, 1, #ARGV[3]) == ARGV[3] then
    redis.call('SET', record, successor, 'PX', ms(ARGV[2]))
  end
end
"""

# KEYS[1]  lock key
# KEYS[2]  the victim's preemption record (replaced.record_key: same cluster slot as KEYS[1])
# ARGV     as ACQUIRE_SCRIPT's (ARGV[3], the takeover prefix, is the victim's owner token),
#          then the preemptor's task id ('' for none) (the last one)
# Returns ACQUIRE_SCRIPT's reply. A takeover of lock_policy "replace" in one atomic step: when
# the caller takes the key from a holder whose token starts with ARGV[3], the record KEYS[2]
# is written in the same script (SET PX the lease: the preemptor's task id), so the victim can
# read who preempted it the moment its lock is gone. Errors (before any write) as
# ACQUIRE_SCRIPT.
PREEMPT_SCRIPT: Final = (
    _CHECK_MS + _PREEMPT_PRELUDE + _ACQUIRE_FUNCTION
    + """
ms(ARGV[2])
hashed(KEYS[1])
local cur = redis.call('HGET', KEYS[1], 'token')
local reply = acquire()
if reply[1] == 1 then replaced(cur) end
return reply
"""
)  # fmt: skip

# KEYS, ARGV as PREEMPT_SCRIPT's
# Returns ACQUIRE_KEEPING_SCRIPT's reply, with PREEMPT_SCRIPT's record: the preemption of the
# opt-in replica wait (RESTORE_SCRIPT puts the key back; the record stays until it expires,
# read only by a holder whose renewal failed).
PREEMPT_KEEPING_SCRIPT: Final = (
    _CHECK_MS + _PREEMPT_PRELUDE + _ACQUIRE_FUNCTION
    + """
ms(ARGV[2])
hashed(KEYS[1])
local cur = redis.call('HGET', KEYS[1], 'token')
local fields = redis.call('HGETALL', KEYS[1])
local pttl = redis.call('PTTL', KEYS[1])
local now = redis.call('TIME')
local reply = acquire()
if reply[1] == 1 then
  replaced(cur)
  local before = {tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000), pttl}
  for i = 1, #fields do
    before[i + 2] = fields[i]
  end
  reply[4] = before
end
return reply
"""
)  # fmt: skip

# Lua: the slot preemption's body, for acquire_slot(keeping): every slot's holder read first,
# then the record written for the slot taken if its holder was the victim.
_PREEMPT_SLOT_BODY = """
ms(ARGV[2])
for i = 1, #KEYS do hashed(KEYS[i]) end
local held = {}
for i = 1, #KEYS do held[i] = redis.call('HGET', KEYS[i], 'token') end
local reply = acquire_slot(%s)
if reply[1] == 1 then replaced(held[reply[4] + 1]) end
return reply
"""

# KEYS[1…n]  the holder slots of a lock key, as ACQUIRE_SLOT_SCRIPT's
# KEYS[n+1]  the victim's preemption record (replaced.record_key: the key's cluster slot)
# ARGV       as ACQUIRE_SLOT_SCRIPT's (ARGV[3] the victim's owner token), then the preemptor's
#            task id ('' for none) (the last one)
# Returns ACQUIRE_SLOT_SCRIPT's reply; the slot the victim held is taken first, else a free one
# (no record then), in one atomic step with the record as PREEMPT_SCRIPT's. Errors as
# ACQUIRE_SLOT_SCRIPT.
PREEMPT_SLOT_SCRIPT: Final = (
    _CHECK_MS + _PREEMPT_PRELUDE + _ACQUIRE_FUNCTION + _ACQUIRE_SLOT_FUNCTION
    + _PREEMPT_SLOT_BODY % "false"
)  # fmt: skip

# KEYS, ARGV as PREEMPT_SLOT_SCRIPT's
# Returns ACQUIRE_SLOT_KEEPING_SCRIPT's reply, with the record: the slot preemption of the
# opt-in replica wait.
PREEMPT_SLOT_KEEPING_SCRIPT: Final = (
    _CHECK_MS + _PREEMPT_PRELUDE + _ACQUIRE_FUNCTION + _ACQUIRE_SLOT_FUNCTION
    + _PREEMPT_SLOT_BODY % "true"
)  # fmt: skip

# KEYS[1]  the preemption record (replaced.record_key)
# Returns the preemptor's task id ('' for none), or false when there is no such record.
REPLACED_BY_SCRIPT: Final = "return redis.call('GET', KEYS[1])\n"


# KEYS[1]  lock key
# Returns {holder fields as field, value, ..., lease left in ms} (an empty hash: free), or
# {the held string record (_STRING_RECORD), lease left in ms}.
HOLDER_SCRIPT = """
local value = redis.pcall('GET', KEYS[1])
if type(value) == 'string' then
  return {value, redis.call('PTTL', KEYS[1])}
end
return {redis.call('HGETALL', KEYS[1]), redis.call('PTTL', KEYS[1])}
"""
