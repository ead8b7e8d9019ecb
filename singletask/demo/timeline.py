"""What the demo draws: a timeline per scenario (one row per worker process) and a summary table.

:class:`Board` collects a scenario's events; :func:`render` draws it at any moment, so the same
code serves the live view (redrawn in place on a terminal) and the final picture (printed once
when the output is a file or a pipe).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..protocol.slots import base_key
from .events import Event

__all__ = ["Board", "Mark", "Run", "Style", "max_overlap", "render", "summary_table"]

#: Mark characters of the actions a locked-out execution takes, in order of precedence.
MARKS = {"raise": "x", "retry": "r", "skip": "s", "replaced": "p"}
WHAT = {
    "skip": "skipped",
    "retry": "sent again to retry",
    "raise": "failed with TaskLocked",
    "replaced": "preempted: a newer run took its lock over",
}
#: The mark of each lock policy's legend (the replace policy's marks the replaced runs).
POLICY_MARKS = {"skip": "skip", "retry": "retry", "raise": "raise", "replace": "replaced"}


@dataclass(frozen=True)
class Style:
    """How to draw: box-drawing characters or ASCII, ANSI colours or none."""

    unicode: bool = False
    color: bool = False

    def paint(self, text: str, code: str | None) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.color and code else text

    @property
    def fill(self) -> str:
        return "█" if self.unicode else "="

    @property
    def bar(self) -> str:
        return "│" if self.unicode else "|"


#: ANSI colours of the lock keys of a scenario (by first appearance), and of the marks.
KEY_COLORS = ("32", "36", "35", "34")
MARK_COLORS = {"skip": "33", "retry": "1;33", "raise": "1;31", "replaced": "35"}


@dataclass
class Run:
    """A task body run: it held its lock from ``start`` to ``end`` (seconds after t0)."""

    task_id: str
    pid: int
    key: str
    start: float
    end: float | None = None
    #: The fencing token of its lock: the store's clock at the acquire, in microseconds.
    fence: int | None = None


@dataclass(frozen=True)
class Mark:
    """A locked-out execution: what it did, when, in which process, and who held the lock."""

    kind: str
    pid: int
    t: float
    task_id: str
    key: str
    holder: str | None


@dataclass
class Board:
    """The events of one scenario, relative to its start ``t0`` (a ``time.time()``)."""

    t0: float
    rows: list[int]
    labels: dict[str, str]
    tasks: set[str]
    runs: list[Run] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)

    def add(self, event: Event) -> bool:
        """Take an event in; False if it is not about this scenario's tasks."""
        if event.task not in self.tasks or event.task_id is None or event.key is None:
            return False
        t = event.t - self.t0
        if event.pid not in self.rows:
            self.rows.append(event.pid)
        if event.kind == "start":
            self.runs.append(Run(event.task_id, event.pid, event.key, t, fence=event.fence))
        elif event.kind == "end":
            for run in reversed(self.runs):
                if run.task_id == event.task_id and run.end is None:
                    run.end = t
                    break
        elif event.kind in MARKS:
            self.marks.append(
                Mark(event.kind, event.pid, t, event.task_id, event.key, event.holder)
            )
        else:
            return False
        return True

    def label(self, key: str) -> str:
        """The character of a lock key, or of the key whose holder slot ``key`` is."""
        return self.labels.get(key) or self.labels.get(base_key(key), "?")

    def color(self, key: str) -> str:
        keys = list(dict.fromkeys(self.labels.values()))
        label = self.label(key)
        return KEY_COLORS[keys.index(label) % len(KEY_COLORS)] if label in keys else "37"

    def last(self) -> float:
        """The time of the latest event seen."""
        times = [m.t for m in self.marks] + [r.end or r.start for r in self.runs]
        return max(times, default=0.0)


def _step(span: float, columns: int) -> float:
    """A round tick interval that puts a label every 10 or more columns."""
    for step in (0.1, 0.2, 0.25, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300):
        if step / span * columns >= 10:
            return step
    return 600.0


def _seconds(value: float) -> str:
    return f"{value:g}s"


def render(board: Board, now: float, span: float, width: int, style: Style) -> list[str]:
    """Draw the board up to ``now`` (seconds after t0) on ``width`` columns.

    The time axis covers ``span`` seconds, or more once the events go further.
    """
    digits = max((len(str(pid)) for pid in board.rows), default=5)
    head = len(f"    pid {0:<{digits}} ")
    # A line is at most width - 1 long: on a terminal, a full line may wrap.
    columns = max(20, width - head - 3)
    span = max(span, now, board.last()) * 1.04 or 1.0
    per_column = span / columns

    def column(t: float) -> int:
        return min(columns - 1, max(0, int(t / per_column)))

    grid: dict[int, list[str]] = {pid: [" "] * columns for pid in board.rows}
    for run in board.runs:
        cells = grid[run.pid]
        first = column(run.start)
        last = max(first, column(run.end if run.end is not None else now) - 1)
        color = board.color(run.key)
        cells[first] = style.paint(board.label(run.key), "1;" + color)
        for c in range(first + 1, last + 1):
            cells[c] = style.paint(style.fill, color)
    order = {kind: n for n, kind in enumerate(MARKS)}
    for mark in sorted(board.marks, key=lambda m: order[m.kind]):
        cells = grid[mark.pid]
        first = column(mark.t)
        # A mark never hides a run or another mark: it goes to one of the next free cells, so
        # that three skips in a row read "sss" (or, with no room, is left out).
        for c in range(first, min(first + 4, columns)):
            if cells[c] == " ":
                cells[c] = style.paint(MARKS[mark.kind], MARK_COLORS[mark.kind])
                break

    lines = []
    for pid in board.rows:
        lines.append(f"    pid {pid:<{digits}} {style.bar}{''.join(grid[pid])}{style.bar}")
    step = _step(span, columns)
    axis, labels = [], [" "] * (columns + 1)
    ticks = [n * step for n in range(math.floor(span / step) + 1)]
    tick_columns = {column(t) for t in ticks}
    for c in range(columns):
        if c in tick_columns:
            axis.append("┬" if style.unicode else "+")
        else:
            axis.append("─" if style.unicode else "-")
    for t in ticks:
        text, c = _seconds(round(t, 3)), column(t)
        fits = c + len(text) <= len(labels)
        if fits and all(cell == " " for cell in labels[c : c + len(text) + 1]):
            labels[c : c + len(text)] = list(text)
    corner = "└" if style.unicode else " "
    lines.append(" " * head + corner + "".join(axis))
    lines.append(" " * (head + 1) + "".join(labels).rstrip())
    return lines


def legend(style: Style, labels: Iterable[tuple[str, str]], policy: str) -> str:
    """One line: what the characters of a timeline mean (labels: ``(label, call text)``)."""
    parts = [
        f"{style.paint(label, '1;' + KEY_COLORS[n % len(KEY_COLORS)])}"
        f"{style.paint(style.fill * 2, KEY_COLORS[n % len(KEY_COLORS)])} {text}"
        for n, (label, text) in enumerate(labels)
    ]
    kind = POLICY_MARKS[policy]
    parts.append(f"{style.paint(MARKS[kind], MARK_COLORS[kind])} {WHAT[kind]}")
    return "    " + "   ".join(parts)


def max_overlap(intervals: Iterable[tuple[float, float]]) -> int:
    """The most intervals that contain one same moment (touching ends do not overlap)."""
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running = most = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


#: Columns of the summary table: (header lines, width, right-aligned).
COLUMNS: Sequence[tuple[tuple[str, str], int, bool]] = (
    (("", "scenario"), 11, False),
    (("", "task"), 17, False),
    (("", "submitted"), 9, True),
    (("", "ran"), 3, True),
    (("", "skipped"), 7, True),
    (("", "retried"), 7, True),
    (("", "raised"), 6, True),
    (("max overlap", "per key"), 11, True),
    (("", "parallel"), 8, True),
)


def summary_table(rows: Sequence[Sequence[object]], style: Style, width: int) -> list[str]:
    """The summary table: a header, one line per row, the last row (totals) set apart.

    Rows have a cell per column of :data:`COLUMNS`. The task column is left out when the
    table would not fit in ``width`` columns.
    """
    keep = list(range(len(COLUMNS)))
    if sum(COLUMNS[i][1] + 2 for i in keep) + 2 >= width:
        keep.remove(1)

    def line(cells: Sequence[object]) -> str:
        parts = []
        for i in keep:
            cell, (_, size, right) = cells[i], COLUMNS[i]
            parts.append(f"{cell!s:>{size}}" if right else f"{cell!s:<{size}}")
        return ("  " + "  ".join(parts)).rstrip()

    header = [line([column[0][n] for column in COLUMNS]) for n in (0, 1)]
    size = max(len(line(row)) for row in [*rows, [column[0][1] for column in COLUMNS]])
    rule = "  " + ("─" if style.unicode else "-") * (size - 2)
    out = [style.paint(text, "1") for text in header if text.strip()]
    out += [rule, *(line(row) for row in rows[:-1]), rule, line(rows[-1])]
    return out
