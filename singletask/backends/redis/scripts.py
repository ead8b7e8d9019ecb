"""The Lua scripts of the Redis lock store, one atomic step each: the rules they all keep, and the
Lua pieces they share. The scripts themselves are in a module per concept (listed at the end).

**One key per lock.** Every script that takes, gives back, renews or inspects a lock reads and
writes the lock key alone, so it runs on one Redis Cluster slot with nothing else to wait for
(a script over two keys of a slot that is being migrated gets ``TRYAGAIN`` while only one of
them has moved). The key is in one of three states:

* *held, plain*: a string, written by
  :data:`~singletask.backends.redis.lock_scripts.ACQUIRE_SCRIPT` (the plain lock: no holder
  slots, no preemption, no named limits in the same script, no replica wait):
  ``<token> NUL <fence>[@<written>] NUL <lease in ms> NUL <since in ms, = or ''> NUL <field>
  NUL <value> ...``, the compact metadata fields :mod:`singletask.backends.redis.wire` writes; its
  expiry is the lease, which the record states too (from ``<written>``, the server's time in
  microseconds, or else the fence's: ``STRING_RECORD`` below), so that a refusal needs no
  ``PTTL``. One ``SET ... PX`` takes it, a ``GET`` and a comparison of the token with the start
  of the value release it (a renewal writes it again): about a third less of the server's work
  than a hash (``python -m bench cost``);
* *held, hash*: the field ``token`` (the owner token), ``f`` (the fencing token), ``a`` (the
  since, as ms before the fence's time), ``d`` (a carried completion marker) and the same
  metadata fields; its expiry is the lease. Written by every other acquiring script, and by
  :data:`~singletask.backends.redis.lock_scripts.ACQUIRE_SCRIPT` itself when the key is a hash
  already (a released record, or a lock of singletask 0.3.0 or earlier);
* *released*: a hash without ``token``; ``f``, the last fencing token issued, and ``d``, the
  completion marker of the last execution that recorded one; its expiry is how long they are
  kept (the transport options ``fence_retention`` and ``marker_retention``). By default a
  release leaves nothing: the key is deleted.

Every script that reads a lock key reads both held forms: the plain path's scripts tell a hash
by the ``WRONGTYPE`` error of their ``GET`` (caught with ``redis.pcall``) and then run the hash
path; the others first rewrite a string lock as the equivalent held hash, same expiry
(``hashed()`` in ``STRING_RECORD``). A string that is not a held record (another
application's value) is never rewritten: it fails the scripts with ``WRONGTYPE`` as before (an
acquire's refusal carries it to the client, which raises the same). Scripts of singletask 0.3.0
and earlier cannot read a string lock: they fail with ``WRONGTYPE`` on it, writing nothing.

A lock written by singletask 0.1.0 is a hash with ``token``, ``fence`` and long metadata
fields, and its fence hash ``<tag>:fence`` holds its last token and marker: these scripts read
such a lock (``token`` for exclusion, ``fence`` before ``f``, ``task_id``) and never write
``fence``. The companion hash ``<tag>:fence`` now holds only a coalescing task's follow-up
claim (:data:`~singletask.backends.redis.lock_scripts.CLAIM_NEXT_SCRIPT`).

Every key a script writes gets its expiry in the same script, and no script leaves a key without
one, whatever it is given: each script checks every duration argument it would use (a whole
number of milliseconds from 1, or 0 where it says so, to :data:`MAX_LEASE_MS`) and fails
*before its first write* when one is out of range, so ``PEXPIRE`` cannot fail after a write (a
path that writes nothing, such as a refusal, may return without reading it). (Redis runs a
script that has started writing to its end even when it is out of memory, and a script cannot
be killed once it has written, so nothing else can stop one between a write and its expiry.)

**The scripts**, each under a comment giving its KEYS, ARGV and reply, all under these rules, are
in a module per concept; each one's keys share a Redis Cluster slot, and
:mod:`~singletask.backends.redis.wire` sends them:

* :mod:`~singletask.backends.redis.lock_scripts`: the lock key's (acquire, release, renew, read
  its holder, put it back after a replica wait, an operator's release) and a coalescing task's
  follow-up claim;
* :mod:`~singletask.backends.redis.slot_scripts`: holder slots (``lock_limit``: every slot of a
  key read and one taken, :mod:`~singletask.backends.redis.slots`), with or without the rate
  record that goes with them (``lock_rate``, :mod:`~singletask.backends.redis.rates`);
* :mod:`~singletask.backends.redis.debounce_scripts`: debounce windows (``lock_debounce``,
  :mod:`~singletask.backends.redis.rates`);
* :mod:`~singletask.backends.redis.preempt_scripts`: preemptions and their records
  (``lock_policy = "replace"``, :mod:`~singletask.backends.redis.replaced`);
* :mod:`~singletask.backends.redis.limit_scripts`: named limits (``take_units``,
  ``give_units``, :mod:`~singletask.backends.redis.units`).

Here: :data:`MAX_LEASE_MS`, and the Lua pieces the scripts start with: ``CHECK_MS`` (the
duration checks), ``checked()`` (one check written out inline), ``STRING_RECORD`` (reading a
string lock) and ``ACQUIRE_FUNCTION`` (``acquire()`` and ``take()``: taking a key; without
``STRING_RECORD``, ``ACQUIRE_HASH_PATH``).
"""

from __future__ import annotations

from ..base import MAX_LEASE

__all__ = [
    "ACQUIRE_FUNCTION",
    "ACQUIRE_HASH_PATH",
    "CHECK_MS",
    "KEPT_READ",
    "KEPT_REPLY",
    "MAX_LEASE_MS",
    "STRING_RECORD",
    "checked",
]

#: The longest duration a script accepts, in milliseconds (the backends' MAX_LEASE).
MAX_LEASE_MS = int(MAX_LEASE * 1000)

# Lua functions every writing script starts with: ms(value) returns value as a number if it is a
# whole number of milliseconds from 1 to MAX_LEASE_MS, else raises a script error; keep(value)
# the same from 0 (0: nothing is kept).
CHECK_MS = f"""
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


def checked(name: str, value: str, low: int) -> str:
    """Lua: the local ``name``, ``value`` as a number, checked as CHECK_MS's whole() checks it
    (same error), written out inline: a script whose hot path calls no function of its own
    allocates no closure per call (the server's Lua garbage collector runs every 50 scripts)."""
    return (
        f"local {name} = tonumber({value})\n"
        f"if {name} == nil or {name} < {low} or {name} > {MAX_LEASE_MS} or {name} % 1 ~= 0 then\n"
        f"  error('singletask: duration out of range ({low} to {MAX_LEASE_MS} ms): '\n"
        f"    .. tostring({value}))\n"
        "end\n"
    )


# Lua: the held record as a string (the plain lock's layout, written by ACQUIRE_SCRIPT):
# <token> NUL <fence>[@<written>] NUL <lease in ms> NUL <since in ms, '=' (the fence's time:
# the holder started as it took the lock) or ''> NUL <field> NUL <value> ... (the compact
# metadata fields, possibly none). The record's expiry is the lease
# counted from <written>, the server's time in microseconds when the record was last written, or
# from the fence's time when there is no @<written> (the fence is the server's time then): a
# refusal tells the lease left from the record alone, with no PTTL. hashed(key) rewrites such a
# string as the equivalent held hash (token, f, a: ms before the fence's time, the fields),
# keeping its expiry, so that the scripts that read hashes read it; any other key (no key, a
# hash, a string that is not a held record: not singletask's) is left as it is.
# holds(key, token): whether token holds key, as a string record or a hash; a string that is
# not a held record raises WRONGTYPE there, as HGET does (ours(value) checks). renew(key,
# token, lease): holds() and, when it does, the key's expiry set to lease ms from now (a string
# record is written again with its new @<written> and lease); returns 1, or 0 when token does
# not hold key.
STRING_RECORD = """
local function hashed(key)
  local value = redis.pcall('GET', key)
  if type(value) ~= 'string' then return end
  local token, fence, since, rest = string.match(value, '^(%Z*)%z(%d+)[@%d]*%z%d+%z([=%d]*)(.*)$')
  if not token then return end
  local record = {'token', token, 'f', fence}
  if since == '=' then
    record[5], record[6] = 'a', '0'
  elseif since ~= '' then
    record[5], record[6] = 'a', string.format('%.0f', math.floor(tonumber(fence) / 1000) - since)
  end
  for part in string.gmatch(rest, '%z(%Z*)') do record[#record + 1] = part end
  local pttl = redis.call('PTTL', key)
  redis.call('DEL', key)
  redis.call('HSET', key, unpack(record))
  if pttl > 0 then redis.call('PEXPIRE', key, pttl) end
end
local function ours(value)
  if not string.find(value, '^%Z*%z%d+[@%d]*%z') then
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
local function renew(key, token, lease)
  local value = redis.pcall('GET', key)
  if type(value) == 'table' then
    if redis.call('HGET', key, 'token') ~= token then return 0 end
    return redis.call('PEXPIRE', key, lease)
  end
  if not value then return 0 end
  if string.sub(value, 1, #token) ~= token or string.byte(value, #token + 1) ~= 0 then
    ours(value)
    return 0
  end
  local head, rest = string.match(value, '^(%Z*%z%d+)[@%d]*%z%d+(%z.*)$')
  if not head then
    error({err = 'WRONGTYPE Operation against a key holding the wrong kind of value'})
  end
  local now = redis.call('TIME')
  local us = string.rep('0', 6 - #now[2]) .. now[2]
  lease = string.format('%d', lease)
  redis.call('SET', key, head .. '@' .. now[1] .. us .. '\\0' .. lease .. rest, 'PX', lease)
  return 1
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
# the key with take(), which the holder-slot scripts (slot_scripts.py) call for the slot they
# choose.)
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

# ACQUIRE_HASH_PATH: take() and acquire() alone, for a script that knows the key is a hash
# (ACQUIRE_SCRIPT's hash path); ACQUIRE_FUNCTION: with STRING_RECORD, for the scripts that
# rewrite a string lock first.
# acquire(): the holder's token is read alone first (a hash field costs the server a scan of
# the record): a refusal then reads only the fields its reply names, a key that does not exist
# (the common case) is taken at once, and a released record or a takeover reads its fence and
# marker.
ACQUIRE_HASH_PATH = (
    _TAKE_FUNCTION
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
ACQUIRE_FUNCTION = STRING_RECORD + ACQUIRE_HASH_PATH

# Lua of the opt-in replica wait's acquisitions (ACQUIRE_KEEPING_SCRIPT, PREEMPT_KEEPING_SCRIPT),
# which may have to be undone: KEPT_READ reads what KEYS[1] is before acquire() runs (its fields,
# its PTTL, the server's time); KEPT_REPLY, run once the caller holds the lock, adds it to the
# reply as its fourth element {server time in ms, PTTL, field, value, ...}.
KEPT_READ = """\
local fields = redis.call('HGETALL', KEYS[1])
local pttl = redis.call('PTTL', KEYS[1])
local now = redis.call('TIME')
"""
KEPT_REPLY = """\
  local before = {tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000), pttl}
  for i = 1, #fields do
    before[i + 2] = fields[i]
  end
  reply[4] = before
"""
