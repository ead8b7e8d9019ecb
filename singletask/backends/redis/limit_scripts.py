"""The Lua scripts of named limits on the Redis stores (``take_units``, ``give_units``), one
atomic step each, under the rules of :mod:`singletask.backends.redis.scripts`: each under a
comment giving its KEYS, ARGV and reply; every argument checked before the first write; every
key written gets its expiry in the same script; no key is ever left without one.

A limit is four keys, all in the limit key's Redis Cluster slot
(:mod:`singletask.backends.redis.units` names them and describes them):

* the *record*, at the limit's key: a hash ``{s: size, p: period in ms (a rate only), n: units
  counted}``, ``n`` being the sum of the units of every hold or start in the log;
* the *log*, ``{<key>}:holds``: a sorted set of tokens, scored by a concurrency hold's deadline
  or a rate start's time, in microseconds of the server's clock (``TIME``);
* the *units*, ``{<key>}:units``: a hash with, per token, ``u<token>`` (its units) and, when the
  take's metadata gave them, ``i<token>`` (task id) and ``t<token>`` (task name);
* the *line*, ``{<key>}:turns``: the limit's waiting line (fair turns,
  :mod:`singletask.backends.turns`), a string holding the JSON of ``Line.to_json``, its times
  in microseconds of the server's clock; it exists only while the line has a ticket.

A hold or start counts while its score plus the *span* (0 for a concurrency limit, the period
for a rate) is after now; the scripts drop those that stopped counting as they meet them. The
first three keys expire together when the last hold or start stops counting (its score plus the
span): each script that writes a limit sets that expiry on all three, or deletes them when
nothing counts any more. The line expires with its last ticket's lease (``Line.last``); a
script that writes it sets that expiry (``SET … PX``), or deletes it once it has no ticket.

A take reads the line with one ``GET`` per limit, and when the key does not exist (nobody
waits) and the take carries no turn, does nothing more than it did without fair turns.
"""

from __future__ import annotations

from typing import Final

from ..holders import MAX_PRIORITY, MAX_UNITS, MAX_WEIGHT
from ..turns import MAX_TICKETS
from .lock_scripts import ACQUIRE_HASH_SCRIPT, RELEASE_SCRIPT
from .scripts import MAX_LEASE_MS

__all__ = [
    "ACQUIRE_UNITS_SCRIPT", "GIVE_UNITS_SCRIPT", "LIMIT_STATE_SCRIPT", "RELEASE_UNITS_SCRIPT",
    "TAKE_UNITS_SCRIPT",
]  # fmt: skip

# Lua functions the limit scripts start with:
# ms(value), keep(value): value as a number if it is a whole number of milliseconds from 1 (ms)
#   or 0 (keep) to MAX_LEASE_MS, else a script error (as in scripts.py);
# count(value, low): the same for a whole number of units from low to MAX_UNITS;
# clock(): the server's time in microseconds; num(x): x as the text of a whole number;
# sum(h, tokens): the units hash h holds for the tokens (a list), read CHUNK at a time;
# drop(z, h, tokens): removes the tokens from the log z and their fields from h;
# counted(k, z, h): the record's n (the sum of the log's units, when the record has none);
# prune(k, z, h, cutoff): drops the log's entries scored at most cutoff (stopped counting);
#   returns the units still counted and whether anything was dropped;
# settle(k, z, h, n, span, now): writes n into the record and gives the three keys the expiry
#   of the last entry of the log (its score plus span, rounded up to the ms), or deletes them
#   when it stopped counting (or the log is empty).
_UNITS_FUNCTIONS = f"""
local function whole(value, low, high, what)
  local n = tonumber(value)
  if n == nil or n < low or n > high or n ~= math.floor(n) then
    error('singletask: ' .. what .. ' out of range (' .. low .. ' to ' .. high .. '): '
      .. tostring(value))
  end
  return n
end
local function ms(value) return whole(value, 1, {MAX_LEASE_MS}, 'duration (ms)') end
local function keep(value) return whole(value, 0, {MAX_LEASE_MS}, 'duration (ms)') end
local function count(value, low) return whole(value, low, {MAX_UNITS}, 'units') end
local function clock()
  local now = redis.call('TIME')
  return tonumber(now[1]) * 1000000 + tonumber(now[2])
end
local function num(x) return string.format('%.0f', x) end
local CHUNK = 500
local function sum(h, tokens)
  local total = 0
  for first = 1, #tokens, CHUNK do
    local fields = {{}}
    for j = first, math.min(first + CHUNK - 1, #tokens) do
      fields[#fields + 1] = 'u' .. tokens[j]
    end
    local units = redis.call('HMGET', h, unpack(fields))
    for j = 1, #units do
      total = total + (tonumber(units[j]) or 0)
    end
  end
  return total
end
local function drop(z, h, tokens)
  for first = 1, #tokens, CHUNK do
    local last = math.min(first + CHUNK - 1, #tokens)
    local fields = {{}}
    for j = first, last do
      local n, t = #fields, tokens[j]
      fields[n + 1], fields[n + 2], fields[n + 3] = 'u' .. t, 'i' .. t, 't' .. t
    end
    redis.call('ZREM', z, unpack(tokens, first, last))
    redis.call('HDEL', h, unpack(fields))
  end
end
local function counted(k, z, h)
  local n = tonumber(redis.call('HGET', k, 'n'))
  if n then return n end
  return sum(h, redis.call('ZRANGE', z, 0, -1))
end
local function prune(k, z, h, cutoff)
  local n = counted(k, z, h)
  local dead = redis.call('ZRANGEBYSCORE', z, '-inf', num(cutoff))
  if #dead == 0 then return n, false end
  n = n - sum(h, dead)
  drop(z, h, dead)
  return n, true
end
local function settle(k, z, h, n, span, now)
  local top = redis.call('ZRANGE', z, -1, -1, 'WITHSCORES')
  local left = 0
  if top[2] then left = math.ceil((tonumber(top[2]) + span - now) / 1000) end
  if left <= 0 then
    redis.call('DEL', k, z, h)
    return
  end
  redis.call('HSET', k, 'n', num(n))
  redis.call('PEXPIRE', k, left)
  redis.call('PEXPIRE', z, left)
  redis.call('PEXPIRE', h, left)
end
"""

# Lua functions of fair turns (singletask.backends.turns, the same rules, the same order; times
# in microseconds of the server's clock), after _UNITS_FUNCTIONS. A line is the table of
# Line.to_json: {v: virtual time, q: next seq, k: {ticket name: {g: group, f: finish, t: tag,
# q: seq, u: units, e: expiry, h: hold, r: when marked ready or nil, m: {task_id, task}}}}.
# turn_arg(args, a): the turn at args[a…a+5] (ticket, group, weight, priority, lease ms, hold
#   ms), checked, or nil when args[a] is '' or absent (no turn);
# line_load(key, now): the line kept at key with its live tickets (Line.live), or nil;
# line_store(key, line, now, existed): keeps line at key until its last ticket's expiry
#   (Line.last), or deletes the key (when it existed) once the line has no ticket; the JSON
#   is written here (ticket_json), numbers with 17 significant digits, so that a line read
#   back holds the very same numbers (cjson.encode keeps 14), and empty objects stay {};
# line_ahead, line_wait, line_served, line_mark, line_fits, line_settle: Line.ahead, .wait,
#   .served, .mark, turns.fits and turns.settle (l: a limit of TAKE_UNITS_SCRIPT, with its
#   size, want and turn).
_TURNS_FUNCTIONS = f"""
local function turn_arg(args, a)
  local ticket = args[a]
  if ticket == nil or ticket == '' then return nil end
  local weight = tonumber(args[a + 2])
  if weight == nil or not (weight > 0 and weight <= {MAX_WEIGHT!r}) then
    error('singletask: turn weight out of range (above 0 to {MAX_WEIGHT:g}): '
      .. tostring(args[a + 2]))
  end
  return {{ticket = ticket, group = args[a + 1], weight = weight,
    priority = whole(args[a + 3], -{MAX_PRIORITY}, {MAX_PRIORITY}, 'turn priority'),
    lease = ms(args[a + 4]) * 1000, hold = ms(args[a + 5]) * 1000}}
end
local function line_load(key, now)
  local raw = redis.call('GET', key)
  if not raw then return nil end
  local line, live = cjson.decode(raw), {{}}
  for name, t in pairs(line.k) do
    if t.r == cjson.null then t.r = nil end
    if t.e > now then live[name] = t end
  end
  line.k = live
  return line
end
local function jnum(x) return string.format('%.17g', x) end
local function ticket_json(name, t)
  local m, r = {{}}, 'null'
  for field, value in pairs(t.m) do
    m[#m + 1] = cjson.encode(field) .. ':' .. cjson.encode(value)
  end
  if t.r ~= nil then r = jnum(t.r) end
  return cjson.encode(name) .. ':{{"g":' .. cjson.encode(t.g) .. ',"f":' .. jnum(t.f)
    .. ',"t":' .. jnum(t.t) .. ',"q":' .. jnum(t.q) .. ',"u":' .. jnum(t.u) .. ',"e":'
    .. jnum(t.e) .. ',"h":' .. jnum(t.h) .. ',"r":' .. r .. ',"m":{{' .. table.concat(m, ',')
    .. '}}}}'
end
local function line_store(key, line, now, existed)
  local last, parts = nil, {{}}
  for name, t in pairs(line.k) do
    if last == nil or t.e > last then last = t.e end
    parts[#parts + 1] = ticket_json(name, t)
  end
  if last == nil then
    if existed then redis.call('DEL', key) end
    return
  end
  local text = '{{"v":' .. jnum(line.v) .. ',"q":' .. jnum(line.q) .. ',"k":{{'
    .. table.concat(parts, ',') .. '}}}}'
  redis.call('SET', key, text, 'PX', math.ceil((last - now) / 1000))
end
local function lapsed(t, now) return t.r ~= nil and now - t.r > t.h end
local function line_finish(line, turn, units)
  local start = line.v
  for _, t in pairs(line.k) do
    if t.g == turn.group and t.f > start then start = t.f end
  end
  return start + units / turn.weight
end
local function line_ahead(line, turn, units, now)
  local total, tag, seq = 0, nil, nil
  if turn ~= nil then
    local mine = line.k[turn.ticket]
    if mine ~= nil then tag, seq = mine.t, mine.q
    else tag, seq = line_finish(line, turn, units) - turn.priority, line.q end
  end
  for name, t in pairs(line.k) do
    if not lapsed(t, now) and (turn == nil or (name ~= turn.ticket
        and (t.t < tag or (t.t == tag and t.q < seq)))) then
      total = total + t.u
    end
  end
  return total
end
local function line_wait(line, turn, units, now, meta)
  local mine = line.k[turn.ticket]
  if mine == nil then
    local size = 0
    for _ in pairs(line.k) do size = size + 1 end
    if size >= {MAX_TICKETS} then return false end
    local finish = line_finish(line, turn, units)
    mine = {{g = turn.group, f = finish, t = finish - turn.priority, q = line.q, u = units,
      e = 0, h = turn.hold, m = meta}}
    line.q = line.q + 1
    line.k[turn.ticket] = mine
  elseif lapsed(mine, now) then
    mine.r = nil
  end
  mine.e, mine.h = now + turn.lease, turn.hold
  return true
end
local function line_served(line, turn, units)
  local mine = line.k[turn.ticket]
  if mine ~= nil then
    line.k[turn.ticket] = nil
    if mine.f > line.v then line.v = mine.f end
  elseif next(line.k) ~= nil then
    local finish = line_finish(line, turn, units)
    if finish > line.v then line.v = finish end
  end
end
local function line_mark(line, room, now)
  local order = {{}}
  for _, t in pairs(line.k) do order[#order + 1] = t end
  table.sort(order, function(a, b) return a.t < b.t or (a.t == b.t and a.q < b.q) end)
  local left = room
  for _, t in ipairs(order) do
    if not lapsed(t, now) then
      if t.u <= left then
        left = left - t.u
        if t.r == nil then t.r = now end
      else
        left = -1
        t.r = nil
      end
    end
  end
end
local function line_fits(line, l, used, now, holding)
  local ahead = 0
  if line ~= nil and not holding then ahead = line_ahead(line, l.turn, l.want, now) end
  return used + ahead + l.want <= l.size
end
local function line_settle(line, l, used, fitted, taken, now, meta)
  local turn, room = l.turn, l.size - used
  if taken then
    if turn ~= nil then line_served(line, turn, l.want) end
    room = room - l.want
  elseif turn ~= nil and (not fitted or line.k[turn.ticket] ~= nil) then
    line_wait(line, turn, l.want, now, meta)
    local mine = line.k[turn.ticket]
    if fitted and mine ~= nil then mine.r = now - mine.h - 1 end
  end
  line_mark(line, room, now)
end
"""

# Lua: wait(l, used, now): the microseconds until rate l (a limit of TAKE_UNITS_SCRIPT) has
# room for its units, if nothing else starts: the oldest starts leave the window first, so the
# time until enough of them have left (their start plus the period), at least 1 ms.
_WAIT_FUNCTION = """
local function wait(l, used, now)
  local need, free, index = used + l.want - l.size, 0, 0
  while true do
    local page = redis.call('ZRANGE', l.z, index, index + CHUNK - 1, 'WITHSCORES')
    if #page == 0 then return l.span end
    for j = 1, #page, 2 do
      free = free + (tonumber(redis.call('HGET', l.h, 'u' .. page[j])) or 0)
      if free >= need then return math.max(tonumber(page[j + 1]) + l.span - now, 1000) end
    end
    index = index + CHUNK
  end
end
"""

# KEYS[4i-3]  limit i's record (its limit key: protocol.limits.limit_key)
# KEYS[4i-2]  limit i's log (units.log_key); KEYS[4i-1] its units hash (units.units_key);
#             KEYS[4i] its line (units.line_key); every key of every limit in one cluster slot
# ARGV[1]     owner token
# ARGV[2]     lease of a concurrency hold, in milliseconds
# ARGV[3]     the metadata given: 'i' when ARGV[4] is a task id, 't' when ARGV[5] is a task
#             name, both, or ''
# ARGV[4]     task id (or ''); ARGV[5] task name (or '')
# ARGV[3i+3]  limit i's size; ARGV[3i+4] the units taken (at most the size); ARGV[3i+5] its
#             period in milliseconds, 0 for a concurrency limit
# ARGV[5+3n+6i-5…5+3n+6i]  (n limits; all absent when no limit has a turn) limit i's turn:
#             its ticket ('' for none, and the five others are not read), group, weight (above
#             0, at most MAX_WEIGHT), priority (-MAX_PRIORITY to MAX_PRIORITY), lease and hold
#             in milliseconds
# Every limit is evaluated (a limit after the first without room only when it has a turn or a
# line): it has room (turns.fits) when the units held by other tokens (concurrency) or started
# in the last period (rate), those promised to the live tickets ahead of the take in its line
# (of a take with a turn: those before its ticket, or where a new one would go; without: all;
# none for a token holding units of the limit: a renewal), and those asked are at most the
# size; a rate's retried take (ARGV[1] has a start counted) always has.
# Returns {1} when every limit had room: each recorded the take (a concurrency limit holds the
# units for ARGV[1] until now + ARGV[2], replacing a hold ARGV[1] had: its renewal; a rate logs
# a start of the units now, unless ARGV[1] has a start counted already: a retried take), and
# its record keeps the size and period given. Otherwise {0, i, units in use of limit i (the
# first in order without room; the caller's own not counted), microseconds until it has room
# (a rate short of room, whatever waits in line), or -1 (a concurrency limit, or a rate with
# room promised to the line)}, and nothing changes but the entries that stopped counting,
# dropped (each limit's keys keep an expiry). Then each evaluated limit with a line or a turn
# settles its line as turns.settle does (the turn's ticket served when taken, kept or renewed
# when refused, the tickets the room left can serve marked ready), and keeps it until its last
# ticket's lease ends, or deletes it when no ticket is left.
# Errors (before any write) when ARGV[2], a size, units, period or turn is out of range, or the
# units are more than the size.
TAKE_UNITS_SCRIPT: Final = (
    _UNITS_FUNCTIONS
    + _TURNS_FUNCTIONS
    + _WAIT_FUNCTION
    + """
local token, lease = ARGV[1], ms(ARGV[2])
local turns = 5 + 3 * (#KEYS / 4)
local limits = {}
for i = 1, #KEYS / 4 do
  local a = 3 * i + 3
  local l = {k = KEYS[4 * i - 3], z = KEYS[4 * i - 2], h = KEYS[4 * i - 1], q = KEYS[4 * i]}
  l.size, l.want, l.span = count(ARGV[a], 1), count(ARGV[a + 1], 1), keep(ARGV[a + 2]) * 1000
  if l.want > l.size then error('singletask: more units than the size: ' .. ARGV[a + 1]) end
  l.turn = turn_arg(ARGV, turns + 6 * i - 5)
  limits[i] = l
end
local meta, given = {}, {}
for j, letter in ipairs({'i', 't'}) do
  if string.find(ARGV[3], letter, 1, true) then
    local n = #meta
    meta[n + 1], meta[n + 2] = letter .. token, ARGV[3 + j]
    given[({'task_id', 'task'})[j]] = ARGV[3 + j]
  end
end
local now = clock()
local refusal = nil
for i, l in ipairs(limits) do
  l.line = line_load(l.q, now)
  if refusal == nil or l.turn or l.line then
    l.n, l.changed = prune(l.k, l.z, l.h, now - l.span)
    l.mine = tonumber(redis.call('HGET', l.h, 'u' .. token))
    l.used = l.n - (l.mine or 0)
    l.fitted = (l.span > 0 and l.mine ~= nil) or line_fits(l.line, l, l.used, now, l.mine ~= nil)
    if not l.fitted and refusal == nil then
      local after = -1
      if l.span > 0 and l.used + l.want > l.size then after = wait(l, l.used, now) end
      refusal = {0, i, l.used, after}
    end
  end
end
for _, l in ipairs(limits) do
  if refusal ~= nil then
    if l.changed then settle(l.k, l.z, l.h, l.n, l.span, now) end
  elseif l.span == 0 then
    l.n = l.n - (l.mine or 0) + l.want
    redis.call('ZADD', l.z, num(now + lease * 1000), token)
    redis.call('HDEL', l.h, 'i' .. token, 't' .. token)
    redis.call('HSET', l.h, 'u' .. token, num(l.want), unpack(meta))
    redis.call('HSET', l.k, 's', num(l.size))
    redis.call('HDEL', l.k, 'p')
    settle(l.k, l.z, l.h, l.n, l.span, now)
  else
    if not l.mine then
      l.n = l.n + l.want
      redis.call('ZADD', l.z, num(now), token)
      redis.call('HSET', l.h, 'u' .. token, num(l.want), unpack(meta))
    end
    redis.call('HSET', l.k, 's', num(l.size), 'p', num(l.span / 1000))
    settle(l.k, l.z, l.h, l.n, l.span, now)
  end
  if l.line or l.turn then
    local line = l.line or {v = 0, q = 0, k = {}}
    line_settle(line, l, l.used, l.fitted, refusal == nil, now, given)
    line_store(l.q, line, now, l.line ~= nil)
  end
end
return refusal or {1}
"""
)

# KEYS[4i-3…4i]  limit i's record, log, units hash and line, as TAKE_UNITS_SCRIPT's
# ARGV[1]     owner token
# ARGV[2i]    limit i's units: a rate start's real cost (0 removes the start); not read for a
#             concurrency limit
# ARGV[2i+1]  limit i's period in milliseconds, 0 for a concurrency limit
# ARGV[2n+1+i]  (n limits; all absent when no limit has a turn) the ticket of limit i's turn,
#             or '' for none
# Returns a list with, per limit in order, 1 when ARGV[1] had a hold or a counted start there,
# else 0. A concurrency limit drops ARGV[1]'s hold; a rate sets its start's units to ARGV[2i]
# (keeping its time), or removes it for 0. Entries that stopped counting are left alone (the
# next take drops them). A limit left with nothing counting is deleted. A turn's ticket leaves
# the limit's line (Line.drop), which keeps its live tickets until the last one's lease ends,
# or is deleted when none is left.
# Errors (before any write) when a units or period is out of range.
GIVE_UNITS_SCRIPT: Final = (
    _UNITS_FUNCTIONS
    + _TURNS_FUNCTIONS
    + """
local token = ARGV[1]
local tickets = 1 + 2 * (#KEYS / 4)
local limits = {}
for i = 1, #KEYS / 4 do
  limits[i] = {k = KEYS[4 * i - 3], z = KEYS[4 * i - 2], h = KEYS[4 * i - 1], q = KEYS[4 * i],
    units = count(ARGV[2 * i], 0), span = keep(ARGV[2 * i + 1]) * 1000,
    ticket = ARGV[tickets + i] or ''}
end
local now = clock()
local out = {}
for i, l in ipairs(limits) do
  if l.ticket ~= '' then
    local line = line_load(l.q, now)
    if line ~= nil then
      line.k[l.ticket] = nil
      line_store(l.q, line, now, true)
    end
  end
  local score = tonumber(redis.call('ZSCORE', l.z, token))
  if score == nil or score + l.span <= now then
    out[i] = 0
  else
    out[i] = 1
    local old = tonumber(redis.call('HGET', l.h, 'u' .. token)) or 0
    local n = counted(l.k, l.z, l.h) - old
    if l.span == 0 or l.units == 0 then
      drop(l.z, l.h, {token})
    else
      redis.call('HSET', l.h, 'u' .. token, num(l.units))
      n = n + l.units
    end
    settle(l.k, l.z, l.h, n, l.span, now)
  end
end
return out
"""
)

# KEYS[1]  a limit's record; KEYS[2] its log; KEYS[3] its units hash (as TAKE_UNITS_SCRIPT's)
# ARGV[1]  the most holds to list
# Returns {} when nothing of the limit counts; otherwise {size, period in ms (0: concurrency),
# units in use (held, or started in the window), microseconds until the last hold or start
# stops counting, then for each hold or counted start, oldest first, at most ARGV[1]: token,
# units, task id or false, task name or false, microseconds until it stops counting}.
# Read-only (operators' listing): it writes nothing, and skips entries that stopped counting.
LIMIT_STATE_SCRIPT: Final = (
    _UNITS_FUNCTIONS
    + """
local rec = redis.call('HMGET', KEYS[1], 's', 'p', 'n')
local now = clock()
local span = (tonumber(rec[2]) or 0) * 1000
local cutoff = now - span
local top = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
if not top[2] or tonumber(top[2]) <= cutoff then return {} end
local n = tonumber(rec[3]) or sum(KEYS[3], redis.call('ZRANGE', KEYS[2], 0, -1))
local used = n - sum(KEYS[3], redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', num(cutoff)))
local out = {tonumber(rec[1]) or 0, tonumber(rec[2]) or 0, used, tonumber(top[2]) + span - now}
local live = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. num(cutoff), '+inf', 'WITHSCORES',
  'LIMIT', 0, tonumber(ARGV[1]))
for j = 1, #live, 2 do
  local t = live[j]
  local f = redis.call('HMGET', KEYS[3], 'u' .. t, 'i' .. t, 't' .. t)
  local n = #out
  out[n + 1], out[n + 2], out[n + 3], out[n + 4] = t, tonumber(f[1]) or 0, f[2], f[3]
  out[n + 5] = tonumber(live[j + 1]) + span - now
end
return out
"""
)


def _as_function(name: str, script: str) -> str:
    """Lua: the whole ``script`` as the local function ``name(KEYS, ARGV)``, which returns its
    reply (its parameters shadow the globals, for it and the functions it defines)."""
    return f"local function {name}(KEYS, ARGV)\n{script}\nend\n"


# Lua: the split of a combined script's KEYS and ARGV (ARGV[1]: how many KEYS the lock has,
# ARGV[2]: how many ARGV), into the lock's (LK, LA) and the limits' (UK, UA).
_SPLIT = """
local nk, na = tonumber(ARGV[1]), tonumber(ARGV[2])
local LK, LA, UK, UA = {}, {}, {}, {}
for i = 1, #KEYS do
  if i <= nk then LK[#LK + 1] = KEYS[i] else UK[#UK + 1] = KEYS[i] end
end
for i = 3, #ARGV do
  if i <= na + 2 then LA[#LA + 1] = ARGV[i] else UA[#UA + 1] = ARGV[i] end
end
"""

# The lock key and the units of named limits, in one step (RedisBackend.acquire with units,
# on one server or Sentinel: the keys of a lock and of its limits are in no common slot of a
# cluster).
# KEYS[1]        lock key (ACQUIRE_HASH_SCRIPT's KEYS[1]; a held string record, scripts.py's
#                STRING_RECORD, is read as one and written as a hash when taken)
# KEYS[2…]       the limits' keys, as TAKE_UNITS_SCRIPT's KEYS (four per limit)
# ARGV[1]        1 (the lock's keys); ARGV[2] n, the number of ACQUIRE_HASH_SCRIPT's arguments
# ARGV[3…n+2]    ACQUIRE_HASH_SCRIPT's ARGV; ARGV[n+3…] TAKE_UNITS_SCRIPT's ARGV (same owner
#                token and lease)
# Returns ACQUIRE_HASH_SCRIPT's refusal, unchanged, when the key is held by another token (that is
# not taken over): the limits are not read. Otherwise the units are taken first, as
# TAKE_UNITS_SCRIPT takes them; when a limit has no room, {2, i, units in use, microseconds
# until room or -1} (TAKE_UNITS_SCRIPT's refusal, marked 2) and the key is not touched (the
# limits' lines are settled as TAKE_UNITS_SCRIPT settles them: a turn waits in line); else
# ACQUIRE_HASH_SCRIPT's reply, the key taken.
# Errors (before any write) as TAKE_UNITS_SCRIPT: its checks come first, and cover the lease.
ACQUIRE_UNITS_SCRIPT: Final = (
    _as_function("acquire_key", ACQUIRE_HASH_SCRIPT)
    + _as_function("take_units", TAKE_UNITS_SCRIPT)
    + _SPLIT
    + """
local cur = redis.pcall('GET', LK[1])
if type(cur) == 'table' then
  cur = redis.call('HGET', LK[1], 'token')
elseif cur then
  cur = string.match(cur, '^(%Z*)%z') or cur
end
local prefix = LA[3]
if cur and cur ~= LA[1] and (prefix == '' or string.sub(cur, 1, #prefix) ~= prefix) then
  return acquire_key(LK, LA)
end
local taken = take_units(UK, UA)
if taken[1] ~= 1 then
  return {2, taken[2], taken[3], taken[4]}
end
return acquire_key(LK, LA)
"""
)

# The concurrency units of named limits given back, then the lock released, in one step
# (RedisBackend.release with units, where ACQUIRE_UNITS_SCRIPT is used).
# KEYS[1…m]      RELEASE_SCRIPT's KEYS (m is 1, or 2 for a holder slot)
# KEYS[m+1…]     the limits' keys, as GIVE_UNITS_SCRIPT's KEYS
# ARGV[1]        m; ARGV[2] n, the number of RELEASE_SCRIPT's arguments
# ARGV[3…n+2]    RELEASE_SCRIPT's ARGV; ARGV[n+3…] GIVE_UNITS_SCRIPT's ARGV (same owner token)
# Returns RELEASE_SCRIPT's reply; the units are given back whether the token still held the
# key or not.
# Errors (before any write) when an argument of either is out of range.
RELEASE_UNITS_SCRIPT: Final = (
    _as_function("release_key", RELEASE_SCRIPT)
    + _as_function("give_units", GIVE_UNITS_SCRIPT)
    + _SPLIT
    + f"""
for _, value in ipairs({{LA[3], LA[4]}}) do
  local n = tonumber(value)
  if n == nil or n < 0 or n > {MAX_LEASE_MS} or n ~= math.floor(n) then
    error('singletask: duration out of range (0 to {MAX_LEASE_MS} ms): ' .. tostring(value))
  end
end
give_units(UK, UA)
return release_key(LK, LA)
"""
)
