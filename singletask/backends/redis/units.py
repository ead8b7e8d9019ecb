"""Named limits (``singletask_limits``, a task's ``lock_limits``) on the Redis stores:
:meth:`~singletask.backends.base.LockBackend.take_units` and ``give_units``, one script each
(:mod:`singletask.backends.redis.limit_scripts`), and the limits' records for operators.

A limit (:func:`singletask.protocol.limits.limit_key`: ``<prefix>%limit:<name>`` or
``<prefix>%rate:<name>``) is four keys, named with
:func:`singletask.protocol.slots.companion_key` so that they hash to the limit key's Redis
Cluster slot (when the key has a hash tag, or no ``}`` at all):

* ``<limit key>``: the record, a small hash ``{s: size as the last take gave it, p: period in
  ms (a rate only), n: units counted}``; a hash without ``token``, which the listing of locks
  reads as no lock;
* ``{<limit key>}:holds`` (:func:`log_key`): the log, a sorted set of owner tokens, scored by a
  concurrency hold's deadline or a rate start's time, in microseconds of the server's clock;
* ``{<limit key>}:units`` (:func:`units_key`): per token, ``u<token>`` its units, and
  ``i<token>`` / ``t<token>`` the task id and task name of the take's metadata;
* ``{<limit key>}:turns`` (:func:`line_key`): the limit's waiting line (fair turns,
  :mod:`singletask.backends.turns`), a string, the JSON of ``Line.to_json`` (virtual time
  ``v``, next seq ``q``, tickets ``k`` by name, each ``{g, f, t, q, u, e, h, r, m}``), its
  times (``e`` expiry, ``r`` ready, ``h`` hold) in microseconds of the server's clock. It
  exists only while a ticket waits.

The first three expire together, when the last hold or start stops counting; the line expires
with its last ticket's lease. A take costs a few commands on the log whatever its length
(entries that stopped counting are dropped as the scripts meet them), and one ``GET`` of the
line (which, when nobody waits, finds nothing); a refused rate reads the oldest starts it has
to wait for. A take that carries a turn sends six arguments more per limit (the turn's ticket,
group, weight, priority, lease and hold), one without sends none.

Every key of one take is in one script, so on Redis Cluster every limit of one take must be in
one slot: names with one hash tag (``"{openai}-requests"``, ``"{openai}-tokens"``), when the
prefix has none. :func:`check_limit_keys` refuses others before anything is sent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from redis.crc import key_slot

from ...exceptions import ConfigurationError
from ...protocol.slots import companion_key
from ..base import StoreState, Turn, Units, UnitsResult, check_taken
from ..holders import MAX_SHOWN
from .limit_scripts import (
    ACQUIRE_UNITS_SCRIPT,
    GIVE_UNITS_SCRIPT,
    LIMIT_STATE_SCRIPT,
    RELEASE_UNITS_SCRIPT,
    TAKE_UNITS_SCRIPT,
)
from .wire import Script, as_text, lease_ms

__all__ = [
    "ACQUIRE_UNITS", "GIVE_UNITS", "LIMIT_ENDS", "LIMIT_STATE_SCRIPT", "RELEASE_UNITS",
    "TAKE_UNITS", "check_limit_keys", "give_request", "limit_keys", "limit_state", "line_key",
    "log_key", "script_keys", "take_request", "take_result", "units_key", "with_lock",
]  # fmt: skip

TAKE_UNITS = Script(TAKE_UNITS_SCRIPT)
GIVE_UNITS = Script(GIVE_UNITS_SCRIPT)
ACQUIRE_UNITS = Script(ACQUIRE_UNITS_SCRIPT)
RELEASE_UNITS = Script(RELEASE_UNITS_SCRIPT)


def with_lock(
    lock_keys: Sequence[str],
    lock_args: Sequence[str | int],
    unit_keys: Sequence[str],
    unit_args: Sequence[str | int],
) -> tuple[list[str], list[str | int]]:
    """The keys and arguments of ACQUIRE_UNITS or RELEASE_UNITS: a lock script's, then the
    limits' script's, with the counts that split them."""
    args: list[str | int] = [len(lock_keys), len(lock_args), *lock_args, *unit_args]
    return [*lock_keys, *unit_keys], args


#: How the names of a limit's log, units hash and line end (companion records: never listed as
#: locks, refused as raw lock keys and as limit keys).
LIMIT_ENDS = ("}:holds", "}:units", "}:turns")


def log_key(key: str) -> str:
    """The key of limit ``key``'s log (its holds or starts, by time)."""
    return companion_key(key, "holds")


def units_key(key: str) -> str:
    """The key of limit ``key``'s units hash (each hold's or start's units and metadata)."""
    return companion_key(key, "units")


def line_key(key: str) -> str:
    """The key of limit ``key``'s waiting line (fair turns: its tickets, as JSON)."""
    return companion_key(key, "turns")


def limit_keys(key: str) -> tuple[str, str, str]:
    """The three keys of limit ``key`` that count its units: its record, log and units hash
    (they expire together; LIMIT_STATE_SCRIPT's keys)."""
    return key, log_key(key), units_key(key)


def script_keys(key: str) -> tuple[str, str, str, str]:
    """The four keys of limit ``key`` its take and give scripts are given: its record, log,
    units hash and line."""
    return key, log_key(key), units_key(key), line_key(key)


def check_limit_keys(keys: Sequence[str], where: str, *, cluster: bool) -> None:
    """Refuse limit keys that one script of this store cannot take together: a key that ends
    as a limit's companion record does (it may be another limit's log or units hash), and, on a
    Redis Cluster (``cluster``), limits whose keys are not all in one hash slot.

    Raises:
        ConfigurationError: They cannot; the message names ``where`` and says what to change.
    """
    for key in keys:
        if key.endswith(LIMIT_ENDS):
            raise ConfigurationError(
                f"{where}: a limit whose key ends in one of {LIMIT_ENDS} ({key!r}) may be "
                "another limit's record on Redis; rename it"
            )
    if not cluster:
        return
    slots: dict[int, list[str]] = {}
    for key in keys:
        own = {key_slot(name.encode()) for name in script_keys(key)}
        if len(own) > 1:
            raise ConfigurationError(
                f"{where}: the records of limit {key!r} (a name with a '}}' but no hash tag) "
                "cannot share one Redis Cluster hash slot; give its name a hash tag, e.g. "
                '"{openai}-requests"'
            )
        slots.setdefault(own.pop(), []).append(key)
    if len(slots) > 1:
        raise ConfigurationError(
            f"{where}: the limits {list(keys)!r} are in {len(slots)} different Redis Cluster "
            "hash slots, and limits taken together must share one: give their names one hash "
            'tag, e.g. "{openai}-requests" and "{openai}-tokens" (with a key prefix that has '
            "no hash tag of its own)"
        )


def _period_ms(period: float) -> int:
    """A period in whole milliseconds, rounded up (at least 1): a shorter window would let a
    start through early."""
    micros = round(period * 1_000_000)
    return max(1, -(-micros // 1000))


def take_request(
    token: str, ttl: float, units: Sequence[Units], meta: Mapping[str, str] | None
) -> tuple[list[str], list[str | int]]:
    """TAKE_UNITS_SCRIPT's keys and arguments, everything checked first.

    Raises:
        ConfigurationError: ``ttl`` or one of ``units`` is out of range.
    """
    lease = lease_ms(ttl, "take_units")
    check_taken(units, "take_units")
    meta = meta or {}
    task_id, task = meta.get("task_id"), meta.get("task")
    given = ("i" if task_id is not None else "") + ("t" if task is not None else "")
    keys: list[str] = []
    args: list[str | int] = [token, lease, given, task_id or "", task or ""]
    for item in units:
        keys += script_keys(item.key)
        period = 0 if item.period is None else _period_ms(item.period)
        args += [item.size, item.units, period]
    if any(item.turn is not None for item in units):
        for item in units:
            args += _turn_args(item.turn)
    return keys, args


def _turn_args(turn: Turn | None) -> list[str | int]:
    """TAKE_UNITS_SCRIPT's six arguments of a limit's turn (checked already), or of none."""
    if turn is None:
        return ["", "", "", "", "", ""]
    lease, hold = lease_ms(turn.lease, "turn lease"), lease_ms(turn.hold, "turn hold")
    return [turn.ticket, turn.group, repr(float(turn.weight)), turn.priority, lease, hold]


def take_result(units: Sequence[Units], reply: Sequence[Any]) -> UnitsResult:
    """The UnitsResult of TAKE_UNITS_SCRIPT's ``reply`` to a take of ``units``."""
    if int(reply[0]) == 1:
        return UnitsResult(True)
    _, index, used, after = (int(value) for value in reply)
    retry_after = after / 1_000_000 if after >= 0 else None
    return UnitsResult(False, units[index - 1].key, used, retry_after)


def give_request(token: str, units: Sequence[Units]) -> tuple[list[str], list[str | int]]:
    """GIVE_UNITS_SCRIPT's keys and arguments, everything checked first.

    Raises:
        ConfigurationError: One of ``units`` is out of range.
    """
    check_taken(units, "give_units", give=True)
    keys: list[str] = []
    args: list[str | int] = [token]
    for item in units:
        keys += script_keys(item.key)
        args += [item.units, 0 if item.period is None else _period_ms(item.period)]
    if any(item.turn is not None for item in units):
        args += [item.turn.ticket if item.turn is not None else "" for item in units]
    return keys, args


def limit_state(key: str, reply: Any) -> StoreState | None:
    """The StoreState of limit ``key`` from LIMIT_STATE_SCRIPT's ``reply`` (with MAX_SHOWN as
    its argument), or None when nothing of it counts (or the reply is not one of ours)."""
    if not isinstance(reply, list) or len(reply) < 4:
        return None
    try:
        size, period, used, left = (int(value) for value in reply[:4])
        holds = [
            {
                "token": as_text(token),
                "units": int(units),
                "task_id": as_text(task_id) if task_id is not None else None,
                "task": as_text(task) if task is not None else None,
                "ttl": int(until) / 1_000_000,
            }
            for token, units, task_id, task, until in zip(*[iter(reply[4:])] * 5, strict=True)
        ][:MAX_SHOWN]
    except (TypeError, ValueError):
        return None  # a foreign value under a limit's name
    detail = {
        "size": size,
        "period": period / 1000 if period else None,
        "used": used,
        "holds": holds,
    }
    return StoreState("limit", key, None, left / 1_000_000, detail)
