"""The named limits of the in-process store (:mod:`~singletask.backends.memory.store`):
their records, and what a take, a giving back and a listing do to them. The store calls them
with its mutex held and its clock's time, so each is one atomic step of the store.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..base import StoreState, Units, UnitsResult
from ..holders import MAX_SHOWN
from ..turns import Line, fits, settle

__all__ = ["Limits"]


@dataclass
class _Hold:
    """Units a token holds of a limit (until ``at``), or started in its window (at ``at``)."""

    units: int
    at: float  # time.monotonic(): a hold's deadline, a start's time
    meta: dict[str, str]


@dataclass
class _Limit:
    """A named limit's record: its size as last given, its rate's period (None: concurrency),
    and its holds or starts by token."""

    size: int
    period: float | None
    holds: dict[str, _Hold]

    def live(self, now: float) -> dict[str, _Hold]:
        """Drop the holds and starts that stopped counting; return the rest."""
        period = self.period
        self.holds = {
            t: h for t, h in self.holds.items()
            if (h.at > now if period is None else h.at + period > now)
        }  # fmt: skip
        return self.holds

    def until(self, hold: _Hold) -> float:
        """When ``hold`` stops counting."""
        return hold.at if self.period is None else hold.at + self.period


class Limits:
    """Every named limit's record, by the limit's key."""

    def __init__(self) -> None:
        self.records: dict[str, _Limit] = {}
        self.lines: dict[str, Line] = {}  # the limits' waiting lines (fair turns)

    def take(
        self,
        token: str,
        ttl: float,
        units: Sequence[Units],
        meta: Mapping[str, str] | None,
        now: float,
    ) -> UnitsResult:
        """:meth:`~singletask.backends.base.LockBackend.take_units` at ``now``."""
        refusal: UnitsResult | None = None
        seen: list[tuple[Units, int, bool]] = []
        for item in units:
            record = self.records.get(item.key)
            holds = record.live(now) if record is not None else {}
            used = sum(h.units for t, h in holds.items() if t != token)
            if item.period is not None and token in holds:
                seen.append((item, used, True))  # a retried take: this start is counted already
                continue
            line = self.lines.get(item.key)
            line = line.live(now) if line is not None else None
            fitted = fits(line, item, used, now, holding=token in holds)
            seen.append((item, used, fitted))
            if fitted or refusal is not None:
                continue
            retry_after = None
            if item.period is not None and used + item.units > item.size:
                # The oldest starts leave the window first: wait for enough of them.
                free, need = 0, used + item.units - item.size
                for hold in sorted(holds.values(), key=lambda h: h.at):
                    free += hold.units
                    if free >= need:
                        retry_after = max(hold.at + item.period - now, 0.001)
                        break
            refusal = UnitsResult(False, item.key, used, retry_after)
        taken = refusal is None
        for item, used, fitted in seen:
            if taken:
                self._record(token, ttl, item, meta, now)
            self._settle(item, used, fitted, taken, meta, now)
        return refusal or UnitsResult(True)

    def _record(
        self, token: str, ttl: float, item: Units, meta: Mapping[str, str] | None, now: float
    ) -> None:
        record = self.records.get(item.key)
        if record is None:
            record = self.records[item.key] = _Limit(item.size, item.period, {})
        record.size, record.period = item.size, item.period
        if item.period is None:
            record.holds[token] = _Hold(item.units, now + ttl, dict(meta or {}))
        elif token not in record.holds:
            record.holds[token] = _Hold(item.units, now, dict(meta or {}))

    def _settle(
        self,
        item: Units,
        used: int,
        fitted: bool,
        taken: bool,
        meta: Mapping[str, str] | None,
        now: float,
    ) -> None:
        """The limit's waiting line after the take (kept only while it has tickets)."""
        line = self.lines.get(item.key)
        if line is None and item.turn is None:
            return
        line = line if line is not None else Line()
        settle(line, item, used, fitted, taken, now, meta)
        if line:
            self.lines[item.key] = line
        else:
            self.lines.pop(item.key, None)

    def give(self, token: str, units: Sequence[Units], now: float) -> list[bool]:
        """:meth:`~singletask.backends.base.LockBackend.give_units` at ``now``."""
        found = []
        for item in units:
            line = self.lines.get(item.key)
            if item.turn is not None and line is not None:
                line.drop(item.turn.ticket)
                if not line.live(now):
                    del self.lines[item.key]
            record = self.records.get(item.key)
            hold = record.live(now).get(token) if record is not None else None
            found.append(hold is not None)
            if record is None or hold is None:
                continue
            if item.period is None or item.units == 0:
                del record.holds[token]
            else:
                hold.units = item.units
            if not record.holds:
                del self.records[item.key]
        return found

    def prune(self, now: float) -> None:
        """Forget the limits nothing counts in any more."""
        self.records = {k: r for k, r in self.records.items() if r.live(now)}
        self.lines = {k: line for k, line in self.lines.items() if line.live(now)}

    def state(self, key: str, now: float) -> StoreState | None:
        """The listing of limit ``key`` (a StoreState of kind "limit"), or None."""
        limit = self.records.get(key)
        holds = limit.live(now) if limit is not None else {}
        if limit is None or not holds:
            return None
        ordered = sorted(holds.items(), key=lambda item: item[1].at)
        shown = [
            {"token": t, "units": h.units, "task_id": h.meta.get("task_id"),
             "task": h.meta.get("task"), "ttl": limit.until(h) - now}
            for t, h in ordered[:MAX_SHOWN]
        ]  # fmt: skip
        shape: dict[str, Any] = {
            "size": limit.size, "period": limit.period,
            "used": sum(h.units for h in holds.values()), "holds": shown,
            "waiting": len(self.lines[key].live(now).tickets) if key in self.lines else 0,
        }  # fmt: skip
        last = max(limit.until(h) for h in holds.values())
        return StoreState("limit", key, None, last - now, shape)
