"""Named limits (:meth:`~singletask.backends.base.LockBackend.take_units`) in the PostgreSQL and
MySQL stores: what both share. Their SQL is in :mod:`.postgres.units` and :mod:`.mysql.units`.

Two companion tables, named after the lock table (in its schema, when it names one):

``<table>_limits``, one row per limit::

    key          the limit's stored key (primary key): its store key
                 (:func:`singletask.protocol.limits.limit_key`), or for a key longer than the
                 store's limit its fixed-size form (:func:`.core.stored_key`)
    full_key     the limit's key when ``key`` holds the fixed-size form, else NULL
    size         the size the last take that succeeded gave
    period       the rate's window (PostgreSQL: ``period``, seconds; MySQL: ``period_us``,
                 microseconds); NULL for a concurrency limit
    expires_at   when the row may be deleted: never earlier than the end of any of its holds

``<table>_limit_holds``, one row per limit and owner token (primary key ``key, token``)::

    key, token   the limit's stored key, the owner token
    units        the units held, or started (a rate's: its real cost, once given back)
    at           a concurrency hold's deadline; a rate's start time
    expires_at   when it stops counting (the hold's deadline; the start's time + the period the
                 take gave); past it the row is ignored, then deleted
    meta         the take's metadata (``task_id``, ``task``), a JSON object

Atomicity: a take is one transaction. It first locks the rows of its limits in
``<table>_limits`` (inserting those missing, expiring as the take's holds would, so that no
sweep deletes one under it), in stored-key order, so takes of one limit are serialised and
takes of several limits never wait for each other in a circle; only then does it read the
database's clock, delete the expired holds of those limits, read the live holds, and write its
own when every limit has room. A give is one transaction too, on the caller's own holds only:
it frees room or changes a start's cost, so it needs no limit row. (MySQL: every write finds
its rows by primary key, the sweep included, so InnoDB locks no row of another limit.)

``acquire`` of a key (no holder slot) with units is one transaction too: the key's row locked
first (inserted free if missing) and judged, then, only when the key may be taken, the take
as above, then the key. ``release`` with units frees the key (its row first), then gives the
concurrency holds back, in one transaction. So every transaction locks in one order: the key's
row, limit rows in stored-key order, holds; none waits for another in a circle.
(``acquire_slot`` and a slot's release take their units in a step of their own.)

Every row has an expiry: reads ignore rows past it; a take deletes the expired holds of the
limits it locked, and a process that takes or gives units deletes a batch of expired rows of
both tables at most every :data:`.core.RECLAIM_INTERVAL` seconds (through their indexes on
``expires_at``). The tables are created by a process's first ``take_units`` or ``give_units``
(a store whose tasks name no limit has none); reads create nothing, and a missing table holds
no limit.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...protocol.slots import slot_index
from ..base import AcquireResult, StoreState, Units, UnitsResult, check_lease, check_taken
from ..holders import MAX_SHOWN, Turn
from . import core

__all__ = ["Limit", "SQLUnits", "limit_tables"]


def limit_tables(table: str) -> tuple[str, str]:
    """The tables of the named limits of the store whose lock table is ``table``: its limits'
    rows and their holds (``schema.name`` stays in ``schema``). At most 60 characters per part
    (a table name has at most 48), and their indexes' names (``_ex`` added) at most 63."""
    return f"{table}_limits", f"{table}_limit_holds"


@dataclass(frozen=True)
class Limit:
    """One limit of a ``take_units`` or ``give_units`` call, as a store's SQL takes it.

    Attributes:
        ord: Its place in the call, from 1.
        key: Its stored key; ``full_key``, its key when ``key`` is the fixed-size form.
        size, units, period, turn: As the call's :class:`~singletask.backends.base.Units`.
    """

    ord: int
    key: str
    full_key: str | None
    size: int
    units: int
    period: float | None
    turn: Turn | None = None

    @property
    def item(self) -> Units:
        """The limit as :mod:`..lines` decides it (under its stored key)."""
        return Units(self.key, self.size, self.units, self.period, self.turn)


def _seconds(value: Any) -> float | None:
    return None if value is None else float(value)


class SQLUnits(core.SQLBackend):
    """``take_units``, ``give_units`` and the limits of ``iter_state`` above a dialect's SQL:
    it runs :meth:`_take` and :meth:`_give` (one transaction each) and the read-only query
    ``limit_state`` (through :meth:`_select`)."""

    supports_units = True
    supports_turns = True

    def take_units(
        self,
        token: str,
        ttl: float,
        units: Sequence[Units],
        *,
        meta: Mapping[str, str] | None = None,
    ) -> UnitsResult:
        ttl = check_lease(ttl, "take_units")
        check_taken(units, "take_units")
        if not units:
            return UnitsResult(True)
        refused = self._take(token, ttl, self._limits(units), meta, self._what(units))
        if refused is None:
            return UnitsResult(True)
        return UnitsResult(False, *self._refusal(units, refused))

    def acquire(
        self, key: str, token: str, ttl: float, *,
        meta: Mapping[str, str] | None = None, takeover_prefix: str | None = None,
        units: Sequence[Units] = (),
    ) -> AcquireResult:  # fmt: skip
        """A key that is no holder slot and its units: one transaction (:meth:`_acquire_units`);
        otherwise as :class:`~.core.SQLBackend` does."""
        if not units or slot_index(key):
            return super().acquire(
                key, token, ttl, meta=meta, takeover_prefix=takeover_prefix, units=units
            )
        ttl = check_lease(ttl, "acquire")
        check_taken(units, "acquire")
        outcome = self._acquire_units(
            key, token, ttl, meta, takeover_prefix, self._limits(units), self._what(units)
        )
        if isinstance(outcome, AcquireResult):
            return outcome
        limit, used, retry_after = self._refusal(units, outcome)
        return AcquireResult(False, retry_after=retry_after, limit=limit, used=used)

    @staticmethod
    def _refusal(
        units: Sequence[Units], refused: tuple[int, int, float | None]
    ) -> tuple[str, int, float | None]:
        """The limit, units used and (a rate's) seconds until it has room, of a refusal
        ``(ord, used, seconds)`` of ``units``."""
        ord_, used, wait = refused
        item = units[ord_ - 1]
        retry_after = None
        if item.period is not None and wait is not None:
            retry_after = max(float(wait), 0.001)
        return item.key, int(used), retry_after

    def give_units(self, token: str, units: Sequence[Units]) -> list[bool]:
        check_taken(units, "give_units", give=True)
        if not units:
            return []
        had = self._give(token, self._limits(units), self._what(units))
        return [n in had for n in range(1, len(units) + 1)]

    def iter_state(self, prefix: str, *, page_size: int = 500) -> Iterator[StoreState]:
        """The records of the lock table, then the limits under ``prefix`` in pages of
        ``page_size`` limits in stored-key order (each with at most MAX_SHOWN holds)."""
        yield from super().iter_state(prefix, page_size=page_size)
        yield from self._limit_states(prefix, max(1, page_size))

    def _limit_states(self, prefix: str, page_size: int) -> Iterator[StoreState]:
        """Each live limit under ``prefix`` (one with a hold that counts): one page a query."""
        head = prefix.encode(errors="surrogatepass")[: self._key_bytes - 4]
        scan = core.like_prefix(head.decode("utf-8", "ignore"))
        after: str | bytes = ""
        while True:
            args = {"scan": scan, "pattern": core.like_prefix(prefix), "after": after,
                    "limit": page_size}  # fmt: skip
            rows = self._select("list state", prefix, "limit_state", args)
            groups: list[list[Sequence[Any]]] = []
            for row in rows:
                if groups and groups[-1][0][0] == row[0]:
                    groups[-1].append(row)
                else:
                    groups.append([row])
            for group in groups:
                state = self._limit_state(group)
                if state.key.startswith(prefix):
                    yield state
            if len(groups) < page_size:
                return
            after = self._page_key(groups[-1][0])

    def _limit_state(self, rows: Sequence[Sequence[Any]]) -> StoreState:
        """The record of one limit from its rows of ``limit_state``: (stored key, key, size,
        period, units used, seconds left, then of one hold: token, units, meta, seconds left),
        its holds oldest first."""
        _, key, size, period, used, left = rows[0][:6]
        holds = []
        for row in rows[:MAX_SHOWN]:
            token, held, meta, hold_left = row[6:10]
            fields: dict[str, Any] = json.loads(meta) if meta else {}
            holds.append({
                "token": self._decode(token), "units": int(held),
                "task_id": fields.get("task_id"), "task": fields.get("task"),
                "ttl": _seconds(hold_left),
            })  # fmt: skip
        detail = {"size": int(size), "period": _seconds(period), "used": int(used),
                  "holds": holds}  # fmt: skip
        return StoreState("limit", self._decode(key) or "", None, _seconds(left), detail)

    def _limits(self, units: Sequence[Units]) -> list[Limit]:
        limits = []
        for n, item in enumerate(units, 1):
            stored, full = self._limit_key(item.key)
            period = None if item.period is None else float(item.period)
            limits.append(Limit(n, stored, full, item.size, item.units, period, item.turn))
        return limits

    def _limit_key(self, key: str) -> tuple[str, str | None]:
        """The ``key`` and ``full_key`` column values of a limit's key."""
        return core.stored_key(key, self._key_bytes)

    @staticmethod
    def _what(units: Sequence[Units]) -> str:
        """The key an error message names: the limit, or how many."""
        return units[0].key if len(units) == 1 else f"{len(units)} limits"

    @abc.abstractmethod
    def _take(
        self, token: str, ttl: float, limits: list[Limit], meta: Mapping[str, str] | None,
        what: str,
    ) -> tuple[int, int, float | None] | None:  # fmt: skip
        """Take ``limits`` for ``token`` in one transaction (creating the tables first if this
        process has not checked them). Returns None when taken, else ``(ord, used, seconds)``
        of the first limit without room: its units in use and, for a rate, the seconds until
        enough of its oldest starts leave the window."""

    @abc.abstractmethod
    def _acquire_units(
        self, key: str, token: str, ttl: float, meta: Mapping[str, str] | None,
        takeover_prefix: str | None, limits: list[Limit], what: str,
    ) -> AcquireResult | tuple[int, int, float | None]:  # fmt: skip
        """:meth:`acquire` of ``key`` (no holder slot; ``ttl`` checked) with ``limits``, in one
        transaction: the key's row locked first and judged (held by another token: refused by
        its holder, no limit read nor locked), then the limits taken as :meth:`_take` takes
        them (their rows locked in stored-key order after the key's), then the key. Returns the
        result, or ``(ord, used, seconds)`` as :meth:`_take` when a limit had no room (the key
        not taken)."""

    @abc.abstractmethod
    def _give(self, token: str, limits: list[Limit], what: str) -> set[int]:
        """Give ``limits`` back for ``token`` in one transaction; returns the ``ord`` of those
        where ``token`` had a hold or a counted start."""
