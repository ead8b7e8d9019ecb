"""What a lock store answers about a lock, and the bounds of a lease it accepts.

:class:`Holder` and :class:`AcquireResult` are the values of the store contract,
:class:`singletask.backends.base.LockBackend`, which exports them as well (every store and its
caller import them from there); :data:`MAX_LEASE` and :func:`check_lease` bound every lease a
store writes. They live here, at the bottom of the package, so that the contract's module holds
the contract alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from ..exceptions import ConfigurationError

__all__ = [
    "MAX_LEASE", "MAX_PRIORITY", "MAX_SHOWN", "MAX_UNITS", "MAX_WEIGHT", "STATE_KINDS",
    "AcquireResult", "Holder", "StoreState", "Turn", "Units", "UnitsResult", "check_lease",
    "check_taken", "check_turn", "check_units", "is_priority", "is_weight",
]  # fmt: skip

#: The longest lease, in seconds, any backend accepts (366 days). It is far above every lease
#: the task options allow (each at most 30 days; a queue reservation adds the message's
#: countdown, and is capped here), and far below what the stores can represent.
MAX_LEASE = 366 * 24 * 3600.0


def check_lease(ttl: object, operation: str = "lease") -> float:
    """Return ``ttl`` as float seconds if it is a finite number in (0, MAX_LEASE].

    Backends call it before they write anything, so no record is ever written without an
    expiry the store can represent.

    Raises:
        ConfigurationError: ``ttl`` is not such a number; the message names the operation.
    """
    if (
        isinstance(ttl, bool)
        or not isinstance(ttl, (int, float))  # a tuple: no union built per call
        or not math.isfinite(ttl)
        or not 0 < ttl <= MAX_LEASE
    ):
        raise ConfigurationError(
            f"{operation}: a lease must be a finite number of seconds above 0 and at most "
            f"{MAX_LEASE:.0f} (366 days), got {ttl!r}"
        )
    return float(ttl)


@dataclass(frozen=True)
class Holder:
    """Who holds a lock, as the backend saw it.

    Attributes:
        token: The holder's owner token.
        task_id: The holder's task id, when it stored one.
        ttl: Seconds left on the lease, when known.
        meta: Every metadata field stored with the lock (``task_id``, ``task``, ``hostname``,
            ``pid``, ``since``), as strings. Empty when the backend returned only the essentials.
        fence: The holder's fencing token, when known.
    """

    token: str
    task_id: str | None = None
    ttl: float | None = None
    meta: Mapping[str, str] = field(default_factory=dict)
    fence: int | None = None


@dataclass(frozen=True)
class AcquireResult:
    """The outcome of :meth:`LockBackend.acquire`.

    Attributes:
        acquired: True when the caller holds the lock now.
        holder: When not acquired, who holds it (from the same atomic step).
        fence: When acquired, the fencing token of this acquisition: strictly greater than every
            token issued earlier for the key (see :meth:`LockBackend.acquire`).
        completed: When acquired, the marker the key's last normal release recorded (see
            :meth:`LockBackend.release`), if the store still remembers one.
        key: When acquired by :meth:`LockBackend.acquire_slot`, the store key of the slot
            taken (renew and release that one).
        holders: When :meth:`LockBackend.acquire_slot` found every slot held, every holder,
            slot 0 first (``holder`` is the first of them).
        retry_after: When :meth:`LockBackend.acquire_slot` was refused by its ``interval``
            (a slot was free, the key started too recently): seconds until a start is allowed;
            with ``limit``, a rate's seconds until it has room.
        limit: When the key was free but a limit of the acquire's ``units`` had no room: that
            limit's key (nothing was taken).
        used: With ``limit``: its units in use, the caller's own not counted.
    """

    acquired: bool
    holder: Holder | None = None
    fence: int | None = None
    completed: str | None = None
    key: str | None = None
    holders: tuple[Holder, ...] = ()
    retry_after: float | None = None
    limit: str | None = None
    used: int | None = None


#: The kinds of bookkeeping record :meth:`LockBackend.iter_state
#: <singletask.backends.base.LockBackend.iter_state>` yields: a pending follow-up claim
#: (``claim_next``), a debounce window (``debounce``), a rate record (``lock_rate``), a
#: limit's record (``take_units``: a named limit of ``singletask_limits``).
STATE_KINDS = ("follow_up", "window", "rate", "limit")

#: The most holds of one limit :class:`StoreState` lists (its ``used`` counts them all).
MAX_SHOWN = 100

#: The largest size of a limit, and the most units one take asks of it.
MAX_UNITS = 1_000_000_000


def check_units(value: object, operation: str, *, allow_zero: bool = False) -> int:
    """Return ``value`` if it is a whole number of units from 1 (0 with ``allow_zero``) to
    :data:`MAX_UNITS`.

    Raises:
        ConfigurationError: It is not; the message names the operation.
    """
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_UNITS:
        raise ConfigurationError(
            f"{operation}: expected a whole number of units from {low} to {MAX_UNITS}, "
            f"got {value!r}"
        )
    return value


#: The largest ``lock_priority`` (and the smallest is its negative).
MAX_PRIORITY = 10

#: The largest ``lock_weight`` (the smallest is above 0).
MAX_WEIGHT = 1000.0


@dataclass(frozen=True)
class Turn:
    """How an execution waits for a limit's room, when it has to.

    Attributes:
        ticket: The waiting execution's name in the line: its task id (the same on each of its
            retries).
        group: Whose turn it is: the execution's lock key (a tenant, a customer, a task).
        weight: The group's share, above 0: twice the weight, twice the turns.
        priority: From ``-MAX_PRIORITY`` to ``MAX_PRIORITY``: that many turns ahead (or behind).
        lease: Seconds a ticket stays in line without its owner coming back.
        hold: Seconds room freed for a ticket is kept for its owner.
    """

    ticket: str
    group: str
    weight: float = 1.0
    priority: int = 0
    lease: float = 30.0
    hold: float = 5.0


def is_weight(value: object) -> TypeGuard[float]:
    """Whether ``value`` is a weight of fair turns: a finite number above 0, at most
    :data:`MAX_WEIGHT`."""
    return (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and 0 < value <= MAX_WEIGHT
    )


def is_priority(value: object) -> TypeGuard[int]:
    """Whether ``value`` is a priority of fair turns: a whole number within
    :data:`MAX_PRIORITY` of 0."""
    return not isinstance(value, bool) and isinstance(value, int) and abs(value) <= MAX_PRIORITY


def check_turn(turn: Turn, operation: str) -> None:
    """Check a :class:`Turn` before anything is written.

    Raises:
        ConfigurationError: A field is out of range; the message names the operation.
    """
    where = f"{operation} turn"
    if not turn.ticket or not isinstance(turn.ticket, str):
        raise ConfigurationError(f"{where}: a ticket needs a name, got {turn.ticket!r}")
    if not isinstance(turn.group, str):
        raise ConfigurationError(f"{where}: a group is a string, got {turn.group!r}")
    weight, priority = turn.weight, turn.priority
    if not is_weight(weight):
        raise ConfigurationError(
            f"{where}: weight must be a number above 0 and at most {MAX_WEIGHT:g}, got {weight!r}"
        )
    if not is_priority(priority):
        raise ConfigurationError(
            f"{where}: priority must be a whole number from {-MAX_PRIORITY} to {MAX_PRIORITY}, "
            f"got {priority!r}"
        )
    check_lease(turn.lease, f"{where} lease")
    check_lease(turn.hold, f"{where} hold")


@dataclass(frozen=True)
class Units:
    """Units taken from one limit, or given back to it (:meth:`LockBackend.take_units
    <singletask.backends.base.LockBackend.take_units>`).

    A limit is one store record, named by ``key``
    (:func:`singletask.protocol.limits.limit_key`), of one of two kinds:

    * *concurrency* (``period`` None): at most ``size`` units held at once. A take holds its
      units for a lease; they come back when given back or when the lease runs out;
    * *rate* (``period`` in seconds): at most ``size`` units started in any window of
      ``period`` seconds of the store's clock, a sliding log of starts: a take records a start
      of its units, which count until ``period`` after it and are never given back (only
      their number can change, :meth:`~singletask.backends.base.LockBackend.give_units`).

    Attributes:
        key: The limit's store key.
        size: Units held at once (concurrency) or started per window (rate).
        units: Units taken (from 1 to ``size``); given back to a rate: the start's real cost
            (0 or more).
        period: The rate's window in seconds, or None for a concurrency limit.
        turn: How the take waits in the limit's line when it finds no room (fair turns,
            :mod:`singletask.backends.turns`), or None: it does not wait. Given back, the
            turn's ticket leaves the line.
    """

    key: str
    size: int
    units: int
    period: float | None = None
    turn: Turn | None = None


def check_taken(units: Sequence[Units], operation: str, *, give: bool = False) -> None:
    """Check every :class:`Units` a store is given before it writes anything: a size and
    units in range (units at most the size for a take; a rate's given back from 0), a rate's
    period a lease (:func:`check_lease`), no limit named twice.

    Raises:
        ConfigurationError: One is not; the message names the operation and the limit.
    """
    seen: set[str] = set()
    for item in units:
        where = f"{operation} {item.key!r}"
        check_units(item.size, f"{where} size")
        check_units(item.units, f"{where} units", allow_zero=give and item.period is not None)
        if not give and item.units > item.size:
            raise ConfigurationError(
                f"{where}: {item.units} units can never fit a limit of {item.size}"
            )
        if item.period is not None:
            check_lease(item.period, f"{where} period")
        if item.turn is not None:
            check_turn(item.turn, where)
        if item.key in seen:
            raise ConfigurationError(f"{where}: the limit is named twice")
        seen.add(item.key)


@dataclass(frozen=True)
class UnitsResult:
    """The outcome of :meth:`LockBackend.take_units
    <singletask.backends.base.LockBackend.take_units>`.

    Attributes:
        taken: True when every limit had room and the caller holds its units now.
        limit: When not taken, the key of the first limit (in the order given) without room.
        used: When not taken, the units that limit had in use (held, or started in the
            window), the caller's own not counted.
        retry_after: When a rate refused: seconds until it has room for the units asked, if
            nothing else starts (exact, by the store's clock). None for a concurrency limit,
            whose room comes back when a holder ends.
    """

    taken: bool
    limit: str | None = None
    used: int | None = None
    retry_after: float | None = None


@dataclass(frozen=True)
class StoreState:
    """One bookkeeping record of a lock key, as the store holds it (see ``STATE_KINDS``).

    Attributes:
        kind: ``"follow_up"``, ``"window"`` or ``"rate"``.
        key: The lock key the record belongs to (not the store key it is kept under).
        task_id: follow_up: the waiting task id; window: its latest send; rate: None.
        ttl: Seconds left before the record runs out (follow_up: the claim; window: its
            record, which outlives the window's last countdown; rate: until the key's next
            start is allowed), when the store says.
        detail: Kind-specific JSON values: window: ``open`` (bool: False once its latest
            send's run closed it) and ``age`` (seconds since it opened, by the store's clock;
            None when closed); rate: ``next_start_in`` (seconds until a start is allowed);
            limit (``key`` is the limit's store key, ``task_id`` None, ``ttl`` until its
            last hold or start stops counting): ``size`` (as the last take gave it),
            ``period`` (seconds, None for a concurrency limit), ``used`` (units held, or
            started in the window) and ``holds``, the holds or counted starts, oldest first,
            at most :data:`MAX_SHOWN`: each ``{"token", "units", "task_id", "task", "ttl"}``
            (``ttl``: seconds until it stops counting; ``task_id`` and ``task`` from the
            take's ``meta``, None when it gave none).
    """

    kind: str
    key: str
    task_id: str | None = None
    ttl: float | None = None
    detail: Mapping[str, Any] = field(default_factory=dict)
