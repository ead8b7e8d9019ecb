"""The Lua scripts of holder slots (``lock_limit``, :mod:`~singletask.backends.redis.slots`) on
the Redis stores, each under a comment giving its KEYS, ARGV and reply: every slot of a key read
and one taken (:data:`ACQUIRE_SLOT_SCRIPT`), with the rate record that goes with them
(``lock_rate``, :mod:`~singletask.backends.redis.rates`: :data:`ACQUIRE_SLOT_RATED_SCRIPT`), and
each of those keeping what the slot was (the opt-in replica wait). ``ACQUIRE_SLOT_FUNCTION`` is
their body, which the slot preemptions (:mod:`~singletask.backends.redis.preempt_scripts`) run
too. A slot is given as the lock's scripts give a key (``acquire()``'s ``take()``), under the
rules of :mod:`singletask.backends.redis.scripts`; a slot is released by
:data:`~singletask.backends.redis.lock_scripts.RELEASE_SCRIPT`.
"""

from __future__ import annotations

from .scripts import ACQUIRE_FUNCTION, CHECK_MS

__all__ = [
    "ACQUIRE_SLOT_FUNCTION",
    "ACQUIRE_SLOT_KEEPING_SCRIPT",
    "ACQUIRE_SLOT_RATED_KEEPING_SCRIPT",
    "ACQUIRE_SLOT_RATED_SCRIPT",
    "ACQUIRE_SLOT_SCRIPT",
]

# Lua: acquire_slot(keeping, start) is ACQUIRE_SLOT_SCRIPT's body (take() is ACQUIRE_SCRIPT's:
# the chosen slot is given exactly as acquire() gives a key). With keeping, a successful reply
# gets what the slot was before as a fifth element (as ACQUIRE_KEEPING_SCRIPT's fourth). With
# start (the rated scripts below), a slot about to be taken by a new token is a start:
# start() records it and returns false, or returns the ms until one is allowed, and the reply is
# {2, those ms} (nothing written).
ACQUIRE_SLOT_FUNCTION = """
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
    CHECK_MS + ACQUIRE_FUNCTION + ACQUIRE_SLOT_FUNCTION + "return acquire_slot()\n"
)

# KEYS, ARGV as ACQUIRE_SLOT_SCRIPT's
# Returns ACQUIRE_SLOT_SCRIPT's reply; when the caller holds a slot now, with a fifth element:
# what that slot was before (as ACQUIRE_KEEPING_SCRIPT's fourth, RESTORE_SCRIPT's ARGV[3…]).
# The slot acquisition of the opt-in replica wait. Errors as ACQUIRE_SLOT_SCRIPT.
ACQUIRE_SLOT_KEEPING_SCRIPT = (
    CHECK_MS + ACQUIRE_FUNCTION + ACQUIRE_SLOT_FUNCTION + "return acquire_slot(true)\n"
)


# Lua, after CHECK_MS and before the functions of the slot script: takes the rate record and
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
    CHECK_MS + _RATE_PRELUDE + ACQUIRE_FUNCTION + ACQUIRE_SLOT_FUNCTION
    + "return acquire_slot(false, start)\n"
)  # fmt: skip

# KEYS, ARGV as ACQUIRE_SLOT_RATED_SCRIPT's
# Returns its replies, a taken slot's with a fifth element as ACQUIRE_SLOT_KEEPING_SCRIPT's:
# the rated slot acquisition of the opt-in replica wait (which puts back the slot it cannot
# confirm, not the rate record: that start stays spent).
ACQUIRE_SLOT_RATED_KEEPING_SCRIPT = (
    CHECK_MS + _RATE_PRELUDE + ACQUIRE_FUNCTION + ACQUIRE_SLOT_FUNCTION
    + "return acquire_slot(true, start)\n"
)  # fmt: skip
