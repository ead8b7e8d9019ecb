"""Holder slots (``lock_limit``, :mod:`singletask.protocol.slots`) on the Redis stores.

A slot is a lock key of its own, one hash as :mod:`~singletask.backends.redis.scripts` describes;
slot 0 is the key itself. :data:`ACQUIRE_SLOT_SCRIPT` reads every slot of a key and takes one,
in one script: the slots of a key hash to the key's own Redis Cluster slot (a key with a hash
tag, or without ``}``; :meth:`RedisClusterBackend.acquire_slot
<singletask.backends.redis.deploy.RedisClusterBackend>` refuses any other). The key's last
fencing token is the largest the records of its slots hold (held or released), and the server
clock's after that, as for one key; its completion marker is the base key's (field ``d``),
where a slot's release records it (:data:`~singletask.backends.redis.scripts.RELEASE_SCRIPT`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import redis
from redis.cluster import RedisCluster

from ...protocol.slots import base_key, slot_index
from ..base import AcquireResult, Holder
from .scripts import _ACQUIRE_FUNCTION, _CHECK_MS
from .wire import _conflict_holder, _glob_escape, _holder, _Script, _text

__all__ = [
    "ACQUIRE_SLOT_KEEPING_SCRIPT",
    "ACQUIRE_SLOT_SCRIPT",
    "COMPANION_ENDS",
    "listed",
    "scan_locks",
    "scan_pattern",
    "slot_result",
]

# Lua: acquire_slot(keeping, start) is ACQUIRE_SLOT_SCRIPT's body (take() is ACQUIRE_SCRIPT's:
# the chosen slot is given exactly as acquire() gives a key). With keeping, a successful reply
# gets what the slot was before as a fifth element (as ACQUIRE_KEEPING_SCRIPT's fourth). With
# start (the rated scripts of rates.py), a slot about to be taken by a new token is a start:
# start() records it and returns false, or returns the ms until one is allowed, and the reply is
# {2, those ms} (nothing written).
_ACQUIRE_SLOT_FUNCTION = """
local function acquire_slot(keeping, start)
local lease = ms(ARGV[2])
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

_ACQUIRE_SLOT = _Script(ACQUIRE_SLOT_SCRIPT)
_ACQUIRE_SLOT_KEEPING = _Script(ACQUIRE_SLOT_KEEPING_SCRIPT)


def slot_result(keys: Sequence[str], reply: Sequence[Any]) -> AcquireResult:
    """The AcquireResult of an ACQUIRE_SLOT_SCRIPT (or rated: rates.py) ``reply`` over the
    slot ``keys``."""
    if reply[0] == 2:  # a start within the interval: refused by the rate record
        return AcquireResult(False, retry_after=int(reply[1]) / 1000)
    if reply[0] == 1:
        fence, completed, index = reply[1:4]
        return AcquireResult(
            True,
            fence=int(fence),
            completed=_text(completed) if completed else None,
            key=keys[int(index)],
        )
    holders = tuple(_conflict_holder(*reply[i : i + 6]) for i in range(1, len(reply), 6))
    return AcquireResult(False, holders[0], holders=holders)


#: How the name of every companion record of a lock key ends (see :mod:`.rates`).
COMPANION_ENDS = ("}:fence", "}:rate", "}:debounce")


def scan_pattern(prefix: str) -> str:
    """The SCAN MATCH pattern of the locks under ``prefix``: every name that holds ``prefix``,
    so that one pass over the keyspace finds the keys that start with it (a key with ``}`` has
    its slots among them) and the slots ``{<key>}:slot:<i>`` of the others alike; :func:`listed`
    keeps the right ones (a foreign name that holds ``prefix`` elsewhere costs its name only).
    """
    escaped = _glob_escape(prefix)
    return f"*{escaped}*" if escaped else "*"


def listed(name: str, prefix: str) -> bool:
    """Whether ``name``, found by :func:`scan_pattern`, is to be listed: a key under ``prefix``
    or a slot of one, and no companion record (a name ending in one of
    :data:`COMPANION_ENDS`)."""
    if name.endswith(COMPANION_ENDS) or not base_key(name).startswith(prefix):
        return False
    return name.startswith(prefix) or slot_index(name) > 0


def scan_locks(client: redis.Redis, prefix: str, page_size: int) -> Iterator[tuple[str, Holder]]:
    """The locks under ``prefix`` on ``client`` (one server): one SCAN MATCH
    :func:`scan_pattern` COUNT ``page_size``, each page of listed keys read in one pipeline.
    Raises redis-py's errors."""
    page: list[bytes | str] = []
    for raw in client.scan_iter(match=scan_pattern(prefix), count=page_size):
        if listed(_text(raw), prefix):
            page.append(raw)
        if len(page) >= page_size:
            yield from _read_page(client, page)
            page = []
    if page:
        yield from _read_page(client, page)


def _read_page(client: redis.Redis, keys: list[bytes | str]) -> Iterator[tuple[str, Holder]]:
    """The locks among ``keys`` (released records, companion records and foreign keys are left
    out)."""
    # MULTI/EXEC keeps each key's fields and lease consistent; a cluster pipeline splits the page
    # by node instead.
    transaction = not isinstance(client, RedisCluster)
    with client.pipeline(transaction=transaction) as pipe:
        for key in keys:
            pipe.hgetall(key)
            pipe.pttl(key)
        replies = pipe.execute(raise_on_error=False)
    for index, key in enumerate(keys):
        fields, pttl = replies[2 * index], replies[2 * index + 1]
        if isinstance(fields, Exception) or isinstance(pttl, Exception):
            continue  # not a hash: not one of ours
        name = _text(key)
        found = _holder(name, fields, pttl)
        if found is not None:
            yield name, found
