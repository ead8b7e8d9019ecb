"""Rate records (``lock_rate``) and debounce windows (``lock_debounce``) on the Redis stores,
and the names of every companion record a lock key has there.

A key's companions are named by :func:`singletask.protocol.slots.companion_key`: ``{<key>}:<name>``,
or ``<key>}:<name>`` for a key with a ``}``. They hash to the key's Redis Cluster slot when the key
has a hash tag or no ``}`` at all:

* ``}:fence`` — a hash holding a coalescing task's pending follow-up claim (:func:`fence_key`);
* ``}:rate`` — the rate record: a string, the server time (microseconds since the epoch) of
  the key's next allowed start, expiring then (``PX`` interval).
  :data:`ACQUIRE_SLOT_RATED_SCRIPT` checks and writes it in the script that takes the slot,
  so it must share the slots' cluster slot (the Cluster store refuses a key whose rate record
  would not);
* ``}:debounce`` — the debounce window: a hash ``{l: latest task id, o: server ms it opened}``,
  kept ``ttl`` from each send. A window closed by its latest send's take has no ``o``: it keeps
  naming that send until it expires, and the next send opens a new window. Its scripts touch
  it alone.

A lock key built by singletask never ends in one of :data:`COMPANION_ENDS` (a ``}`` in its text
is escaped, :mod:`singletask.protocol.keys`); a raw key that does is refused (:func:`check_key`),
since it may be another lock's companion, and the listing of locks leaves such names out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ...exceptions import LockKeyError
from ...protocol.slots import companion_key, slot_keys
from ..base import check_lease
from .scripts import _ACQUIRE_FUNCTION, _CHECK_MS
from .slots import _ACQUIRE_SLOT, _ACQUIRE_SLOT_FUNCTION, COMPANION_ENDS
from .wire import _ms, _Script, _text, encode_meta

__all__ = [
    "ACQUIRE_SLOT_RATED_KEEPING_SCRIPT",
    "ACQUIRE_SLOT_RATED_SCRIPT",
    "COMPANION_ENDS",
    "DEBOUNCE_SCRIPT",
    "DEBOUNCE_TAKE_SCRIPT",
    "DEBOUNCE_UNDO_SCRIPT",
    "check_key",
    "fence_key",
    "rate_key",
    "slot_request",
    "window_key",
]


def fence_key(key: str) -> str:
    """The key of ``key``'s companion hash, which holds a coalescing task's pending follow-up
    claim: ``{<key>}:fence``, or ``<key>}:fence`` when ``key`` has a ``}`` already.

    The name is out of reach of every lock key: it has a ``}`` after the key's prefix, which a
    lock key built by singletask never has there (the task name and the key's suffix are
    escaped, :mod:`singletask.protocol.keys`), so a ``lock_key`` whose text ends in ``:fence``
    cannot name another lock's companion. It is in the lock key's Redis Cluster slot whenever the
    key has a hash tag or no ``}`` at all (``{<key>}`` then is the tag; a tag already in the key
    stays the first one). A key with a ``}`` but no hash tag has its companion in another slot,
    which does no harm: no script uses the two keys together.

    Earlier versions named the companion of a key with a ``}`` ``<key>:fence``, which a lock key
    under a hash-tagged prefix could be as well (see docs/store-redis.rst, "Data layout");
    0.1.0 named this hash the fence hash and kept fences and completion markers in it.
    """
    return companion_key(key, "fence")


def rate_key(key: str) -> str:
    """The key of ``key``'s rate record (``lock_rate``)."""
    return companion_key(key, "rate")


def window_key(key: str) -> str:
    """The key of ``key``'s debounce window (``lock_debounce``). A key with a ``}`` but no hash
    tag has it in another cluster slot, which does no harm: its scripts touch it alone."""
    return companion_key(key, "debounce")


def check_key(where: str, key: str, operation: str) -> None:
    """Refuse a raw lock key that may be another lock's companion record."""
    if key.endswith(COMPANION_ENDS):
        raise LockKeyError(
            f"{where}: {operation} {key!r}: a lock key ending in one of {COMPANION_ENDS} may "
            "name another lock's companion record; singletask never builds one (it escapes '}')"
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
# KEYS[n+1]  the key's rate record (rate_key; same cluster slot)
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

_ACQUIRE_SLOT_RATED = _Script(ACQUIRE_SLOT_RATED_SCRIPT)
_ACQUIRE_SLOT_RATED_KEEPING = _Script(ACQUIRE_SLOT_RATED_KEEPING_SCRIPT)

# KEYS[1]  the key's debounce window (window_key)
# ARGV[1]  the task id of this send
# ARGV[2]  how long the window is kept from now, in milliseconds
# Returns {previous latest task id, or false when this call opened the window; ms since the
# window opened, by the server clock (0 when this call opened it); the latest of the closed
# window this call opened a new one over, else false (for DEBOUNCE_UNDO_SCRIPT)}. ARGV[1]
# becomes the latest (field l). A window is open when the hash has field o; with no hash, or
# one without o (a window closed by DEBOUNCE_TAKE_SCRIPT), this call opens a new one: the hash
# is written again as {l: ARGV[1], o: the server ms now}. The hash is kept ARGV[2] ms from
# now, or longer if an earlier send asked for longer (its PTTL is never shortened: an earlier
# send with a longer countdown of its own must still find the window when it starts).
# Errors (before any write) when ARGV[2] is out of range.
DEBOUNCE_SCRIPT = (
    _CHECK_MS
    + """
local ttl = math.max(ms(ARGV[2]), redis.call('PTTL', KEYS[1]))
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local rec = redis.call('HMGET', KEYS[1], 'l', 'o')
local opened = tonumber(rec[2])
local closed = false
if rec[1] and opened then
  redis.call('HSET', KEYS[1], 'l', ARGV[1])
else
  closed, rec[1], opened = rec[1], false, now_ms
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 'l', ARGV[1], 'o', string.format('%.0f', now_ms))
end
redis.call('PEXPIRE', KEYS[1], ttl)
return {rec[1], math.max(0, now_ms - opened), closed}
"""
)

# KEYS[1]  the key's debounce window
# ARGV[1]  a task id
# Returns the window's latest task id (field l; false when there is no window record), open
# or closed. When that is ARGV[1] and the window is open (field o), closes it: deletes field o,
# keeping the hash, its latest and its expiry (PTTL). Writes nothing else.
DEBOUNCE_TAKE_SCRIPT = """
local rec = redis.call('HMGET', KEYS[1], 'l', 'o')
if rec[1] == ARGV[1] and rec[2] then
  redis.call('HDEL', KEYS[1], 'o')
end
return rec[1]
"""

# KEYS[1]  the key's debounce window
# ARGV[1]  the task id of a send whose message was never published
# ARGV[2]  the latest send its DEBOUNCE_SCRIPT call replaced, or '' when that call opened the
#          window
# ARGV[3]  the latest of the closed window that call replaced (its third reply), or ''
# Returns 1 when it changed the window, else 0. Only when the window is open (field o) and its
# latest (field l) is ARGV[1]: with ARGV[2], l becomes ARGV[2] (o and the expiry are kept);
# with '' and ARGV[3], the closed window is back: l becomes ARGV[3] and o is deleted (the
# expiry kept); with '' and '', the hash is deleted. Otherwise (superseded, closed, or no
# window) it writes nothing.
DEBOUNCE_UNDO_SCRIPT = """
local rec = redis.call('HMGET', KEYS[1], 'l', 'o')
if rec[1] ~= ARGV[1] or not rec[2] then
  return 0
end
if ARGV[2] ~= '' then
  redis.call('HSET', KEYS[1], 'l', ARGV[2])
elseif ARGV[3] ~= '' then
  redis.call('HSET', KEYS[1], 'l', ARGV[3])
  redis.call('HDEL', KEYS[1], 'o')
else
  redis.call('DEL', KEYS[1])
end
return 1
"""

_DEBOUNCE = _Script(DEBOUNCE_SCRIPT)
_DEBOUNCE_TAKE = _Script(DEBOUNCE_TAKE_SCRIPT)
_DEBOUNCE_UNDO = _Script(DEBOUNCE_UNDO_SCRIPT)


def slot_request(
    key: str,
    limit: int,
    token: str,
    ttl: float,
    meta: Mapping[str, str] | None,
    takeover_prefix: str | None,
    interval: float | None,
) -> tuple[_Script, list[str], list[str | int]]:
    """The script, keys and arguments of an acquire_slot: the slot script, or with
    ``interval`` the rated one (its rate record the last key, the interval the last argument).

    Raises:
        ConfigurationError: ``limit``, ``ttl`` or ``interval`` is out of range.
    """
    keys = slot_keys(key, limit)
    since, fields = encode_meta(key, token, meta or {})
    args: list[str | int] = [token, _ms(ttl, "acquire"), takeover_prefix or "", since, *fields]
    if interval is None:
        return _ACQUIRE_SLOT, keys, args
    # Rounded up to the millisecond (the script's unit): a shorter interval would let a start
    # through early (a third of a second truncated to 333 ms: 4 starts in a second for "3/s").
    micros = round(check_lease(interval, "acquire_slot interval") * 1_000_000)
    args.append(max(1, -(-micros // 1000)))
    return _ACQUIRE_SLOT_RATED, [*keys, rate_key(key)], args


def debounce_args(task_id: str, ttl: float) -> tuple[str, int]:
    """DEBOUNCE_SCRIPT's arguments (the lease checked)."""
    return task_id, _ms(ttl, "debounce")


def debounce_result(reply: Sequence[Any]) -> tuple[str | None, float, str | None]:
    """What :meth:`~singletask.backends.base.LockBackend.debounce` returns for DEBOUNCE_SCRIPT's
    reply."""
    previous, age, closed = reply
    return (
        _text(previous) if previous else None,
        int(age) / 1000,
        _text(closed) if closed else None,
    )
