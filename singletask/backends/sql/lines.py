"""Fair turns (:mod:`singletask.backends.turns`) in the SQL stores: what PostgreSQL, MySQL and
SQLite share.

Each keeps a limit's waiting line as the JSON of :meth:`~singletask.backends.turns.Line.to_json`
(times in the store's clock, as seconds since the epoch), in one row per limit of a table of
its own (``<table>_lines``; SQLite: ``singletask_lines``)::

    key          the limit's stored key (primary key)
    line         the line's JSON
    expires_at   when its last ticket's lease runs out (SQLite: ``expires``, seconds)

A row exists only while its line has tickets: it is read, in the take's transaction after the
limit's row is locked (so the takes of one limit change it one at a time), only when the take
carries a turn or the line exists, and written back only then (deleted once empty). A take
decides with :func:`decide` exactly as the in-process store does
(:mod:`singletask.backends.memory.limits`): every limit judged by
:func:`~singletask.backends.turns.fits`, all or nothing, then every line settled.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..holders import Units
from ..turns import Line, fits, settle

__all__ = ["Decision", "Seen", "decide", "dump", "leave", "line_table", "load"]


def line_table(table: str) -> str:
    """The table of the waiting lines of the store whose lock table is ``table``."""
    return f"{table}_lines"


@dataclass(frozen=True)
class Seen:
    """One limit as a take read it in its transaction.

    Attributes:
        used: The units held (or started in the window) by other tokens.
        mine: Whether the taker holds units of it (or has a start counted in the window).
        line: Its waiting line (live tickets only), or None when it has no row.
        starts: A rate's starts of other tokens in the window, ``(units, time)`` oldest first
            (needed only when its units used and asked exceed its size).
    """

    used: int
    mine: bool
    line: Line | None
    starts: Sequence[tuple[int, float]] = ()


@dataclass(frozen=True)
class Decision:
    """A take's outcome: ``refusal`` ``(ord, used, seconds)`` of the first limit without room
    (None: taken), and the lines to write back ``(ord, line)`` (an empty line: delete its row)."""

    refusal: tuple[int, int, float | None] | None
    lines: list[tuple[int, Line]]


def load(text: str | bytes | None, now: float) -> Line | None:
    """The line stored as ``text`` (its live tickets), or None when there is no row."""
    if text is None:
        return None
    if isinstance(text, bytes):
        text = text.decode()
    return Line.from_json(json.loads(text)).live(now)


def dump(line: Line) -> tuple[str, float]:
    """The JSON of a line that has tickets, and when its row may expire."""
    return json.dumps(line.to_json(), separators=(",", ":")), line.last() or 0.0


def _wait(item: Units, seen: Seen, now: float) -> float | None:
    """A rate's seconds until enough of its oldest starts leave the window for ``item``."""
    if item.period is None or seen.used + item.units <= item.size:
        return None
    free, need = 0, seen.used + item.units - item.size
    for units, at in seen.starts:
        free += units
        if free >= need:
            return max(at + item.period - now, 0.001)
    return None


def decide(
    items: Sequence[Units], seen: Sequence[Seen], now: float, meta: Mapping[str, str] | None
) -> Decision:
    """The take of ``items`` (``seen``: each as read), as the in-process store decides it."""
    refusal: tuple[int, int, float | None] | None = None
    fitted: list[bool] = []
    for n, (item, found) in enumerate(zip(items, seen, strict=True), 1):
        if item.period is not None and found.mine:
            fitted.append(True)  # a retried take: this start is counted already
            continue
        fitted.append(fits(found.line, item, found.used, now, holding=found.mine))
        if not fitted[-1] and refusal is None:
            refusal = (n, found.used, _wait(item, found, now))
    lines = []
    for n, (item, found, fit) in enumerate(zip(items, seen, fitted, strict=True), 1):
        if found.line is None and item.turn is None:
            continue
        line = found.line if found.line is not None else Line()
        settle(line, item, found.used, fit, refusal is None, now, meta)
        if found.line is not None or line:  # no row and still no ticket: nothing to write
            lines.append((n, line))
    return Decision(refusal, lines)


def leave(items: Sequence[Units], lines: Sequence[Line | None]) -> list[tuple[int, Line]]:
    """A give of ``items``: the tickets of their turns dropped from their ``lines`` (as read);
    the lines to write back ``(ord, line)``."""
    changed = []
    for n, (item, line) in enumerate(zip(items, lines, strict=True), 1):
        if item.turn is not None and line is not None:
            line.drop(item.turn.ticket)
            changed.append((n, line))
    return changed
