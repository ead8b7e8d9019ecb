"""The Lua scripts of debounce windows (``lock_debounce``, the ``}:debounce`` hash that
:mod:`~singletask.backends.redis.rates` describes) on the Redis stores, each under a comment
giving its KEYS, ARGV and reply: a send opens or joins the window (:data:`DEBOUNCE_SCRIPT`), its
message published (:data:`DEBOUNCE_PUBLISHED_SCRIPT`) or never sent (:data:`DEBOUNCE_UNDO_SCRIPT`),
and the latest send's take, which closes it (:data:`DEBOUNCE_TAKE_SCRIPT`). Each touches the
window alone, under the rules of :mod:`singletask.backends.redis.scripts`.
"""

from __future__ import annotations

from .scripts import CHECK_MS

__all__ = [
    "DEBOUNCE_PUBLISHED_SCRIPT",
    "DEBOUNCE_SCRIPT",
    "DEBOUNCE_TAKE_SCRIPT",
    "DEBOUNCE_UNDO_SCRIPT",
]

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
    CHECK_MS
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
