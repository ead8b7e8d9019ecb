"""Named limits at execution: what an execution takes of its limits, and when it gives it back.

An execution of a task with ``lock_limits`` (or ``lock_cost``) takes its units of every limit
it names with its key, all or nothing:

* :func:`wanted`: the :class:`~singletask.backends.base.Units` of one call: each name of
  ``lock_limits`` (templates filled in) with its cost, looked up in ``singletask_limits``
  (a concurrency, a rate, or both), and with ``lock_cost`` its own key's ``lock_limit``;
* the take is the acquire's (:meth:`~singletask.backends.base.LockBackend.acquire` with
  ``units``: one atomic step with the key where the store can); :func:`no_room` turns its
  refusal into a :class:`~singletask.policies.Conflict` naming the limit, which the task's
  ``lock_policy`` handles as it handles a held key;
* the concurrency units come back on every ending, with the key's release
  (:func:`give_back` where they cannot go with it); a rate's units are spent; after a crash,
  the hold's lease (``lock_ttl``, renewed with the key's) gives them back.

An execution that holds no key of its own (:attr:`~singletask.conf.options.LockOptions.keyless`)
holds :func:`own_key` instead: a key of its message alone, which nothing else takes, so that its
lease is renewed, lost and released as every execution's is.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..backends.holders import Turn, Units, check_units
from ..conf.limits import cost_of
from ..conf.turns import priority_of, weight_of
from ..exceptions import ConfigurationError
from ..policies import Conflict
from ..protocol.limits import limit_key

if TYPE_CHECKING:
    from celery import Task

    from ..backends.base import AcquireResult, LockBackend
    from ..conf.options import LockOptions
    from ..conf.runtime import AppState

__all__ = [
    "KEY_LIMIT", "Wanted", "charge", "give_back", "leave_line", "no_room", "own_key", "turn",
    "wanted",
]  # fmt: skip

logger = logging.getLogger("singletask")

#: The name a refusal gives the key's own ``lock_limit`` counted in units (``lock_cost``).
KEY_LIMIT = "lock_limit"

#: What marks an execution's own key (``own_key``): a key's suffix escapes ``%``, so no key
#: built from a call has it.
OWN_MARK = "%~"


def own_key(key: str, ident: str) -> str:
    """The key an execution that holds no key of its own holds: ``key`` (the task's) marked
    with ``ident``, its task id (or, for a direct call, its token)."""
    return f"{key}{OWN_MARK}{ident}"


class Wanted:
    """The units one call takes, the name of the limit each comes from, and how it waits for
    room (``turn``: None, it does not wait in line)."""

    __slots__ = ("names", "turn", "units")

    def __init__(self, units: Sequence[Units], names: Mapping[str, str]) -> None:
        self.units = tuple(units)
        self.names = dict(names)
        self.turn: Turn | None = None

    def __bool__(self) -> bool:
        return bool(self.units)

    @property
    def taking(self) -> tuple[Units, ...]:
        """The units as a take asks for them: with its turn, when it waits in line (on a
        rate, a ticket whose lease lasts :data:`LEASE_COUNTDOWNS` periods at least: its owner
        comes back when the rate allows a start, up to a period later)."""
        turn = self.turn
        if turn is None:
            return self.units
        return tuple(
            dataclasses.replace(u, turn=turn if u.period is None else _rated_turn(turn, u.period))
            for u in self.units
        )

    @property
    def held(self) -> tuple[Units, ...]:
        """The concurrency units: held for a lease, renewed and given back."""
        return tuple(u for u in self.units if u.period is None)

    def rated(self, name: str) -> Units | None:
        """The rate of limit ``name`` this call started, if any."""
        for units in self.units:
            if units.period is not None and self.names[units.key] == name:
                return units
        return None


def wanted(
    task: Task[Any, Any],
    options: LockOptions,
    state: AppState,
    key: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> Wanted:
    """The units an execution of ``task`` with these arguments takes.

    Raises:
        ConfigurationError: A limit is unknown, a cost callable failed, or a cost is larger
            than its limit: the message names the task, the limit and the cost.
        LockKeyError: A limit's name cannot be filled in with these arguments.
    """
    units: list[Units] = []
    names: dict[str, str] = {}
    if options.limits is not None:
        for name, cost in options.limits.named(args, kwargs):
            spec = state.limit_spec(name, task.name)
            for item in spec.units(options.prefix, name, cost):
                _fits(task.name, f"lock_limits[{name!r}]", name, cost, item.size)
                units.append(item)
                names[item.key] = name
    if options.cost is not None:
        where = f"task {task.name!r} attribute lock_cost"
        cost = cost_of(options.cost, args, kwargs, where)
        _fits(task.name, "lock_cost", KEY_LIMIT, cost, options.limit)
        item_key = limit_key(options.prefix, key.removeprefix(options.prefix))
        units.append(Units(item_key, options.limit, cost))
        names[item_key] = KEY_LIMIT
    return Wanted(units, names)


#: Room freed for a ticket is kept for its owner's next retry: ``lock_retry_countdown``, its
#: jitter (up to a quarter more), and this many seconds for the message to come back.
HOLD_SLACK = 2.0

#: A ticket lasts this many countdowns, plus :data:`LEASE_SLACK` seconds, from its owner's last
#: take: a retry late by a busy worker keeps its place; one that never comes back gives it up.
LEASE_COUNTDOWNS = 3.0
LEASE_SLACK = 10.0


def _rated_turn(turn: Turn, period: float) -> Turn:
    lease = LEASE_COUNTDOWNS * period + LEASE_SLACK
    return turn if turn.lease >= lease else dataclasses.replace(turn, lease=lease)


def turn(
    task: Task[Any, Any],
    options: LockOptions,
    group: str,
    ticket: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> Turn:
    """How an execution that retries until its limits have room waits in their lines: as
    ``ticket`` (its task id) of ``group`` (its lock key), weighed by ``lock_weight`` and
    moved by ``lock_priority``.

    Raises:
        ConfigurationError: A weight or priority callable failed or answered out of range.
    """
    where = f"task {task.name!r} attribute"
    weight = 1.0
    if options.weight is not None:
        weight = weight_of(options.weight, args, kwargs, f"{where} lock_weight")
    priority = 0
    if options.priority is not None:
        priority = priority_of(options.priority, args, kwargs, f"{where} lock_priority")
    countdown = options.retry_countdown
    return Turn(
        ticket, group, weight, priority,
        lease=LEASE_COUNTDOWNS * countdown + LEASE_SLACK, hold=1.25 * countdown + HOLD_SLACK,
    )  # fmt: skip


def leave_line(task: Task[Any, Any], backend: LockBackend, token: str, want: Wanted) -> None:
    """An execution that stops waiting gives its tickets back (never raises: a ticket the
    store could not drop ends with its lease)."""
    if want.turn is None:
        return
    try:
        backend.give_units(token, want.taking)
    except Exception:
        logger.warning(
            "Task %s: could not leave the line of its limits; its place ends with its lease",
            task.name, exc_info=True,
        )  # fmt: skip


def _fits(task: str, attribute: str, name: str, cost: int, size: int) -> None:
    if cost > size:
        raise ConfigurationError(
            f"task {task!r} attribute {attribute}: a cost of {cost} units can never fit limit "
            f"{name!r}, whose size is {size}; nothing was taken"
        )


def no_room(
    task: Task[Any, Any],
    options: LockOptions,
    backend: LockBackend,
    key: str,
    want: Wanted,
    result: AcquireResult,
    direct: bool,
) -> Conflict:
    """The refusal of an acquire whose key was free but whose limit ``result.limit`` had no
    room for ``want``: a conflict naming the limit, for the task's policy."""
    name = want.names.get(result.limit or "", result.limit or "")
    return Conflict(
        task, options, backend, key.partition(OWN_MARK)[0], None, direct,
        retry_after=result.retry_after, limit=name, used=result.used,
    )  # fmt: skip


def give_back(task: Task[Any, Any], backend: LockBackend, token: str, want: Wanted) -> None:
    """Give the concurrency units of ``want`` back (never raises: a hold the store could not
    drop ends with its lease)."""
    held = want.held
    if not held:
        return
    try:
        backend.give_units(token, held)
    except Exception:
        logger.warning(
            "Task %s: could not give back its units of %s; they come back when its lease ends",
            task.name, ", ".join(sorted({want.names[u.key] for u in held})), exc_info=True,
        )  # fmt: skip


def charge(
    task: Task[Any, Any], backend: LockBackend, token: str, want: Wanted, name: str, units: int
) -> None:
    """``self.lock.charge(name, units)``: the start this execution made in the rate of limit
    ``name`` counts ``units`` from now on, at its start time.

    Raises:
        ConfigurationError: The execution took no rate of that limit, or ``units`` is no whole
            number from 0.
        BackendError: The store failed.
    """
    rate = want.rated(name)
    if rate is None:
        rated = sorted({want.names[u.key] for u in want.units if u.period is not None})
        raise ConfigurationError(
            f"task {task.name!r}: charge({name!r}, ...): this execution started no rate of "
            f"limit {name!r} (the rates it started: {', '.join(map(repr, rated)) or 'none'})"
        )
    check_units(units, f"task {task.name!r}: charge({name!r}, ...)", allow_zero=True)
    backend.give_units(token, [Units(rate.key, rate.size, units, rate.period)])
