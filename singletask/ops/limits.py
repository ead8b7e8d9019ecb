"""The named limits in the lock store, for operators: each limit's units in use and who holds
them.

A named limit (a name of ``singletask_limits``, taken by a task's ``lock_limits``) is one store
record per kind under the app's key prefix (:mod:`singletask.protocol.limits`): its
*concurrency* (units held at once, each hold under a lease) and its *rate* (units started in a
sliding window). :func:`find_limits` streams them from
:meth:`~singletask.backends.base.LockBackend.iter_state`, read-only, in bounded pages; nothing
here is on the execution path. :mod:`singletask.ops.inventory` re-exports the names.

A limit's record lives while a hold or a start counts: a limit that nothing holds (or that
started nothing in its window) has no record, and is not listed.

A :class:`LimitRecord`'s JSON form (:meth:`LimitRecord.as_json`) is a contract: the fields of
:data:`LIMIT_FIELDS` and :data:`HOLD_FIELDS` keep their names and types.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..backends.base import LockBackend, StoreState
from ..backends.holders import MAX_SHOWN
from ..protocol.limits import LIMIT_MARK, RATE_MARK, split_limit_key
from .bookkeeping import StateRecord

__all__ = ["HOLD_FIELDS", "LIMIT_FIELDS", "LimitHold", "LimitRecord", "find_limits"]

#: The fields of :meth:`LimitRecord.as_json`, in order.
LIMIT_FIELDS = (
    "name",  # str: the limit's name, as singletask_limits names it
    "kind",  # str: "concurrency" (units held at once) or "rate" (units started per window)
    "size",  # int: units held at once, or started per window (as the last take gave it)
    "period",  # float | null: the rate's window in seconds; null for a concurrency limit
    "used",  # int: units held now (concurrency) or started in the current window (rate)
    "ttl",  # float | null: seconds until its last hold or start stops counting
    "holds",  # array: the holds (concurrency) or starts (rate), oldest first (HOLD_FIELDS)
    "key",  # str: the limit's store key (<prefix>%limit:<name> or <prefix>%rate:<name>)
)

#: The fields of each object of a limit's ``holds``, in order.
HOLD_FIELDS = (
    "task_id",  # str | null: the task id that took the units (null: the take named none)
    "task",  # str | null: its task name
    "units",  # int: the units it holds, or started (a rate's: its real cost once known)
    "ttl",  # float | null: seconds until they stop counting (a hold's lease; a start: its window)
    "token",  # str: the owner token of the take
)


@dataclass(frozen=True)
class LimitHold:
    """Units one execution holds of a concurrency limit, or started in a rate's window.

    Attributes:
        task_id: The task id that took them (None when the take named none).
        task: Its task name.
        units: The units held, or started (a rate start's real cost, once given back).
        ttl: Seconds until they stop counting: a hold's lease left; a start's time left in
            the window.
        token: The owner token of the take.
    """

    task_id: str | None
    task: str | None
    units: int
    ttl: float | None
    token: str

    @classmethod
    def from_detail(cls, detail: Mapping[str, Any]) -> LimitHold:
        """The hold of one object of a store's ``holds`` (see
        :class:`~singletask.backends.holders.StoreState`)."""
        return cls(
            task_id=_text(detail.get("task_id")),
            task=_text(detail.get("task")),
            units=_whole(detail.get("units")),
            ttl=_number(detail.get("ttl")),
            token=str(detail.get("token") or ""),
        )

    def as_json(self) -> dict[str, Any]:
        """The hold as a JSON object (the fields of :data:`HOLD_FIELDS`)."""
        return {
            "task_id": self.task_id,
            "task": self.task,
            "units": self.units,
            "ttl": _seconds(self.ttl),
            "token": self.token,
        }


@dataclass(frozen=True)
class LimitRecord:
    """One named limit's record, as an operator sees it.

    Attributes:
        name: The limit's name (``singletask_limits``), read from its store key.
        kind: ``"concurrency"`` (at most ``size`` units held at once) or ``"rate"`` (at
            most ``size`` units started in any window of ``period`` seconds).
        size: The limit's size, as the last take gave it.
        period: The rate's window in seconds; None for a concurrency limit.
        used: Units in use: held now (concurrency), or started in the current window (rate).
        ttl: Seconds until its last hold or start stops counting (then the record is gone),
            when the store says.
        holds: The holds (concurrency) or the starts that still count (rate), oldest first, at
            most :data:`~singletask.backends.holders.MAX_SHOWN` of them (``used`` counts
            them all; ``units_not_shown`` says how many units the others have).
        key: The limit's store key.
    """

    name: str
    kind: str
    size: int
    period: float | None
    used: int
    ttl: float | None
    holds: tuple[LimitHold, ...]
    key: str

    @classmethod
    def from_store(cls, state: StoreState | StateRecord, prefix: str = "") -> LimitRecord:
        """The record of a limit's ``StoreState`` (``kind == "limit"``), as a store's
        ``iter_state`` yields it (or :func:`~singletask.ops.inventory.find_state` lists it),
        the name read after ``prefix`` (the app's key prefix)."""
        detail = state.detail
        name, rate = _name_of(state.key, prefix)
        period = _number(detail.get("period"))
        holds = detail.get("holds")
        return cls(
            name=name,
            kind="rate" if rate or (rate is None and period is not None) else "concurrency",
            size=_whole(detail.get("size")),
            period=period,
            used=_whole(detail.get("used")),
            ttl=state.ttl,
            holds=tuple(
                LimitHold.from_detail(hold)
                for hold in (holds if isinstance(holds, list | tuple) else ())[:MAX_SHOWN]
                if isinstance(hold, Mapping)
            ),
            key=state.key,
        )

    @property
    def units_not_shown(self) -> int:
        """The units of the holds not in :attr:`holds` (a limit with more than ``MAX_SHOWN``
        holds)."""
        return max(0, self.used - sum(hold.units for hold in self.holds))

    def as_json(self) -> dict[str, Any]:
        """The record as a JSON object (the fields of :data:`LIMIT_FIELDS`; seconds rounded to
        the millisecond)."""
        return {
            "name": self.name,
            "kind": self.kind,
            "size": self.size,
            "period": self.period,
            "used": self.used,
            "ttl": _seconds(self.ttl),
            "holds": [hold.as_json() for hold in self.holds],
            "key": self.key,
        }


def find_limits(
    backend: LockBackend,
    prefix: str,
    *,
    task: str | None = None,
    limit: int | None = None,
    page_size: int = 500,
) -> Iterator[LimitRecord]:
    """Stream the named limits in use under the key prefix ``prefix``: the concurrency limits,
    then the rates, each in the store's order; with ``task``, only the limits that task holds
    units of (or started units of in the window); at most ``limit`` of them.

    Reads the limits' records only (under ``<prefix>%limit:`` and ``<prefix>%rate:``), in pages
    (:meth:`~singletask.backends.base.LockBackend.iter_state`), so memory stays bounded.
    Read-only. A store that keeps no named limits lists none.

    Raises:
        UnsupportedOperation: The store cannot list its keys (memcached, the Django cache).
        BackendError: The store failed.
    """
    if limit is not None and limit <= 0:
        return
    count = 0
    for mark in (LIMIT_MARK, RATE_MARK):
        for state in backend.iter_state(prefix + mark, page_size=page_size):
            if state.kind != "limit":
                continue
            record = LimitRecord.from_store(state, prefix)
            if task is not None and all(hold.task != task for hold in record.holds):
                continue
            yield record
            count += 1
            if limit is not None and count >= limit:
                return


def _name_of(key: str, prefix: str) -> tuple[str, bool | None]:
    """The limit's name in its store key ``key`` under ``prefix``, and whether it is a rate's
    (None: ``key`` is not a limit's key; its name is then the key)."""
    for mark, rate in ((LIMIT_MARK, False), (RATE_MARK, True)):
        if key.startswith(prefix + mark) and len(key) > len(prefix + mark):
            return key[len(prefix + mark) :], rate
    split = split_limit_key(key)
    return (key, None) if split is None else (split[1], split[2])


def _text(value: object) -> str | None:
    return None if value is None else str(value)


def _whole(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
