"""Fair turns: the waiting line a limit keeps for the executions that wait for its room.

A take of :class:`~singletask.backends.holders.Units` that carries a
:class:`~singletask.backends.base.Turn` (an execution with ``lock_policy = "retry"``) waits in
line when it finds no room: the limit keeps a *ticket* for it, in the same atomic step as the
refused take. Room that frees up goes to the tickets in their order, and a take with room is
refused while the room is promised to tickets ahead of it. This module is that line, as plain
data and pure functions of the store's clock, so that every store that keeps it in Python
(memory, SQLite, PostgreSQL, MySQL: ``singletask.backends.sql.lines``) keeps it the same
way; the Redis scripts keep the same rules in Lua.

The order (start-time fair queuing over the groups, the lock keys):

* a new ticket of group ``g`` *starts* at the line's virtual time ``vt``, or after the last
  ticket ``g`` has in line if that finishes later; it *finishes* ``units / weight`` later;
* tickets are served by ``finish - priority`` (their *tag*), then in the order they came
  (``seq``). Three tenants waiting take turns; one with twice the weight takes two turns to
  their one; within a group, the first to wait is the first served;
* serving a ticket moves ``vt`` up to its finish, so that a group that comes later starts
  where the line is, neither ahead of those waiting nor behind a backlog it never had; a take
  with a turn that finds room without a ticket moves ``vt`` up to where its ticket would
  have finished, as if it had waited;
* ``priority`` (``-MAX_PRIORITY`` to ``MAX_PRIORITY``) moves a ticket ahead by that many
  turns of weight 1 at most: a ticket of lower priority is passed over only by tickets whose
  finish is within ``2 * MAX_PRIORITY`` of its own, and ``vt`` passes that bound as the line
  is served.

Room is promised in that order: a take (with or without a ticket) fits when the units held,
the units of the tickets ahead of it, and its own are at most the size. Each take marks the
tickets the room left over can serve as *ready*; a ready ticket whose owner has not come back
within its ``hold`` seconds *lapses*: it keeps its place, but holds no room back any more; so
does, at once, a ticket whose owner found its room here but was refused by another limit of
its take (else two takes, each first in one line and behind the other in the next, would keep
each other out until a hold ran out). A lapsed ticket whose owner comes back and still finds
no room is armed again: room that frees up next is kept for it, in its place. A ticket not
taken again within its ``lease`` seconds ends (as a lock whose holder vanished).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .holders import Turn, Units

__all__ = ["MAX_TICKETS", "Line", "Ticket", "fits", "settle"]

#: The most tickets one limit keeps. A take that would add one more is refused without one
#: (its owner retries as before fair turns), so a line's cost stays bounded.
MAX_TICKETS = 10_000


@dataclass
class Ticket:
    """A waiting execution's place in a limit's line (times are the store's clock)."""

    group: str
    finish: float
    tag: float
    seq: int
    units: int
    expires: float
    hold: float
    ready: float | None = None
    meta: dict[str, str] = field(default_factory=dict)

    def lapsed(self, now: float) -> bool:
        """Ready for longer than its hold: it keeps its place but holds no room back."""
        return self.ready is not None and now - self.ready > self.hold

    def to_json(self) -> dict[str, Any]:
        return {
            "g": self.group, "f": self.finish, "t": self.tag, "q": self.seq, "u": self.units,
            "e": self.expires, "h": self.hold, "r": self.ready, "m": self.meta,
        }  # fmt: skip

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> Ticket:
        return cls(
            str(value["g"]), float(value["f"]), float(value["t"]), int(value["q"]),
            int(value["u"]), float(value["e"]), float(value["h"]),
            None if value.get("r") is None else float(value["r"]), dict(value.get("m") or {}),
        )  # fmt: skip


@dataclass
class Line:
    """One limit's waiting line: its virtual time, its ticket counter, its tickets by name."""

    vt: float = 0.0
    seq: int = 0
    tickets: dict[str, Ticket] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.tickets)

    def live(self, now: float) -> Line:
        """Drop the tickets whose lease ran out; return the line."""
        self.tickets = {n: t for n, t in self.tickets.items() if t.expires > now}
        return self

    def ordered(self) -> list[tuple[str, Ticket]]:
        return sorted(self.tickets.items(), key=lambda item: (item[1].tag, item[1].seq))

    def ahead(self, turn: Turn | None, units: int, now: float) -> int:
        """The units of the tickets ahead of a take (lapsed ones hold nothing back): of those
        before its own ticket (or where a new one would go), or, without a turn, of all."""
        if not self.tickets:
            return 0
        if turn is None:
            return sum(t.units for t in self.tickets.values() if not t.lapsed(now))
        mine = self.tickets.get(turn.ticket)
        place = (mine.tag, mine.seq) if mine is not None else (self._tag(turn, units), self.seq)
        return sum(
            t.units
            for name, t in self.tickets.items()
            if name != turn.ticket and (t.tag, t.seq) < place and not t.lapsed(now)
        )

    def _finish(self, turn: Turn, units: int) -> float:
        last = max((t.finish for t in self.tickets.values() if t.group == turn.group), default=None)
        start = self.vt if last is None else max(self.vt, last)
        return start + units / turn.weight

    def _tag(self, turn: Turn, units: int) -> float:
        return self._finish(turn, units) - turn.priority

    def wait(self, turn: Turn, units: int, now: float, meta: Mapping[str, str] | None) -> bool:
        """Keep ``turn``'s ticket (a new one at the end of its group's turns, or its own
        renewed); False when the line is full and a new ticket cannot be added."""
        mine = self.tickets.get(turn.ticket)
        if mine is None:
            if len(self.tickets) >= MAX_TICKETS:
                return False
            finish = self._finish(turn, units)
            mine = Ticket(
                turn.group, finish, finish - turn.priority, self.seq, units, 0.0, turn.hold,
                meta=dict(meta or {}),
            )  # fmt: skip
            self.seq += 1
            self.tickets[turn.ticket] = mine
        elif mine.lapsed(now):
            mine.ready = None  # its owner is back: it holds room back again when room frees
        mine.expires = now + turn.lease
        mine.hold = turn.hold
        return True

    def served(self, turn: Turn, units: int) -> None:
        """``turn`` took its units: its ticket is used, and the line moves on to it. A take
        that had no ticket here moves the line on to where its ticket would have finished
        (while others wait: else each new take of a heavier key would start again where the
        line stands, ahead of them, and pass them without end)."""
        mine = self.tickets.pop(turn.ticket, None)
        if mine is not None:
            self.vt = max(self.vt, mine.finish)
        elif self.tickets:
            self.vt = max(self.vt, self._finish(turn, units))

    def drop(self, ticket: str) -> bool:
        """Give a ticket back (its owner stopped waiting); whether it was in line."""
        return self.tickets.pop(ticket, None) is not None

    def mark(self, room: int, now: float) -> None:
        """Mark ready the tickets that ``room`` free units can serve, in order (a ticket the
        room no longer reaches is not ready any more)."""
        left = room
        for _name, ticket in self.ordered():
            if ticket.lapsed(now):
                continue
            if ticket.units <= left:
                left -= ticket.units
                if ticket.ready is None:
                    ticket.ready = now
            else:
                left = -1  # in order: none after it is served before it
                ticket.ready = None

    def last(self) -> float | None:
        """When the last ticket's lease runs out (the line's record may expire then)."""
        return max((t.expires for t in self.tickets.values()), default=None)

    def to_json(self) -> dict[str, Any]:
        return {
            "v": self.vt, "q": self.seq,
            "k": {name: t.to_json() for name, t in self.tickets.items()},
        }  # fmt: skip

    @classmethod
    def from_json(cls, value: Mapping[str, Any] | None) -> Line:
        if not value:
            return cls()
        tickets = {str(n): Ticket.from_json(t) for n, t in dict(value.get("k") or {}).items()}
        return cls(float(value.get("v") or 0.0), int(value.get("q") or 0), tickets)

    def shown(self, now: float, limit: int) -> list[dict[str, Any]]:
        """The first ``limit`` tickets in order, for operators."""
        return [
            {"ticket": name, "group": t.group, "units": t.units, "ready": t.ready is not None,
             "task": t.meta.get("task"), "ttl": t.expires - now}
            for name, t in self.ordered()[:limit]
        ]  # fmt: skip


def fits(line: Line | None, item: Units, used: int, now: float, *, holding: bool = False) -> bool:
    """Whether ``item`` has room in its limit, ``used`` units being held (or started) by
    others: its units, and those promised to the tickets ahead of it in ``line``. A take by a
    token that holds units of the limit already (``holding``: a holder renewing its lease) is
    not held back by the line: it only keeps what it has."""
    ahead = line.ahead(item.turn, item.units, now) if line and not holding else 0
    return used + ahead + item.units <= item.size


def settle(
    line: Line,
    item: Units,
    used: int,
    fitted: bool,
    taken: bool,
    now: float,
    meta: Mapping[str, str] | None,
) -> None:
    """The line of ``item``'s limit after a take's decision (``fitted``: this limit had room;
    ``taken``: every limit had): a taken turn's ticket is used; a refused turn waits (a new
    ticket where this limit had no room, its own renewed where it has one); then the tickets
    the room left can serve are marked ready."""
    turn = item.turn
    if taken:
        if turn is not None:
            line.served(turn, item.units)
        room = item.size - used - item.units
    else:
        if turn is not None and (not fitted or turn.ticket in line.tickets):
            line.wait(turn, item.units, now, meta)
            if fitted:
                # Its room was here and another limit of the take refused it: it gives the
                # room up at once (two takes each first in one line and second in the other
                # would otherwise keep each other out for a hold), and keeps its place.
                mine = line.tickets[turn.ticket]
                mine.ready = now - mine.hold - 1.0
        room = item.size - used
    line.mark(room, now)
