"""Where the demo's output goes: a live view on a terminal, plain progress lines elsewhere.

On a terminal (:class:`LiveDisplay`) the current scenario's timeline is redrawn in place with
ANSI escape sequences, about ten times a second. Otherwise (:class:`PlainDisplay`: a pipe, a
file, CI) every event is printed as one line when it happens, and each scenario's timeline is
printed once, when the scenario ends.
"""

from __future__ import annotations

import re
import textwrap
import time
from collections.abc import Sequence
from typing import TextIO

from .events import Event
from .local import DemoError
from .scenarios import Call, Scenario
from .timeline import MARKS, Board, Style, legend, render

__all__ = ["LiveDisplay", "PlainDisplay", "clock", "short"]

#: Why a conflict that names no holder happened: its key started too recently.
RATED = "started too recently for its lock_rate"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def short(task_id: str | None) -> str:
    """The first 8 characters of a task id (enough to tell the runs of a demo apart)."""
    return task_id[:8] if task_id else "?"


def clock(seconds: float) -> str:
    """A time on a scenario's clock, e.g. `` +1.52s`` (right-aligned, 7 characters)."""
    return f"{f'+{seconds:.2f}s':>7}"


def visible(text: str) -> int:
    return len(ANSI.sub("", text))


class PlainDisplay:
    """Progress as plain lines, one per event; each timeline printed once, at the end."""

    live = False

    def __init__(self, out: TextIO, style: Style, width: int) -> None:
        self.out = out
        self.style = style
        self.width = width
        self.closed_pipe = False

    def text(self, line: str = "") -> None:
        self._write(line + "\n")

    def _write(self, text: str) -> None:
        if self.closed_pipe:
            return
        try:
            self.out.write(text)
            self.out.flush()
        except BrokenPipeError as exc:  # e.g. `singletask demo | head`: stop, and clean up
            self.closed_pipe = True
            raise DemoError("the output was closed") from exc

    def para(self, text: str, indent: int = 0, hanging: int = 0) -> None:
        """Print ``text`` wrapped to the width, indented (and the lines after the first by
        ``hanging`` more)."""
        self.text(
            textwrap.fill(
                text,
                self.width - 1,
                initial_indent=" " * indent,
                subsequent_indent=" " * (indent + hanging),
                break_long_words=False,
                break_on_hyphens=False,
            )
        )

    def begin(self, number: int, scenario: Scenario) -> None:
        self.text(self.style.paint(f"{number}. {scenario.title}", "1"))
        self.para(f"{scenario.setup}.", 3)
        self.para(f"Expect: {scenario.expect}.", 3, 8)

    def sent(self, board: Board, now: float, calls: Sequence[Call]) -> None:
        counts: dict[str, int] = {}
        for call in calls:
            counts[call.text] = counts.get(call.text, 0) + 1
        what = ", ".join(f"{n} x {text}" if n > 1 else text for text, n in counts.items())
        self.text(f"  {clock(now)}  sent {what}")

    def event(self, board: Board, event: Event) -> None:
        if event.key is None:
            return
        t = event.t - board.t0
        label, task = board.label(event.key), (event.task or "").rsplit(".", 1)[-1]
        if event.kind == "start":
            what = f"{short(event.task_id)} started, holding the lock"
        elif event.kind == "end":
            run = next((r for r in board.runs if r.task_id == event.task_id), None)
            took = f" after {run.end - run.start:.2f}s" if run and run.end is not None else ""
            what = f"{short(event.task_id)} finished{took}, lock released"
        else:
            why = f"held by {short(event.holder)}" if event.holder else RATED
            what = f"{short(event.task_id)} {_conflict(event.kind)} {why}"
            label = MARKS[event.kind]
        self.text(f"  {clock(t)}  pid {event.pid:<7} {label} {task:<17} {what}")

    def refresh(self, board: Board, now: float, span: float, status: str) -> None:
        """Nothing to do between events."""

    def end(self, board: Board, now: float, span: float, labels: dict[str, str], policy: str,
            lines: Sequence[str]) -> None:  # fmt: skip
        self.text()
        for line in render(board, now, span, self.width, self.style):
            self.text(line)
        self.text(legend(self.style, labels.items(), policy))
        self.text()
        for line in lines:
            self.para(line.lstrip(), len(line) - len(line.lstrip()), 2)
        self.text()

    def close(self) -> None:
        self._write("")


def _conflict(kind: str) -> str:
    return {
        "skip": "skipped: lock",
        "retry": "will retry: lock",
        "raise": "raised TaskLocked: lock",
        "replaced": "was replaced: lock now",
    }[kind]


class LiveDisplay(PlainDisplay):
    """The current scenario's timeline, redrawn in place; finished ones stay on the screen."""

    live = True
    HIDE_CURSOR, SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"

    def __init__(self, out: TextIO, style: Style, width: int) -> None:
        super().__init__(out, style, width)
        self._drawn = 0
        self._last = 0.0
        self._write(self.HIDE_CURSOR)

    def sent(self, board: Board, now: float, calls: Sequence[Call]) -> None:
        """The timeline shows it."""

    def event(self, board: Board, event: Event) -> None:
        """The timeline shows it."""

    def _draw(self, lines: Sequence[str]) -> None:
        # Back to the first line drawn last time, rewrite, then clear what is left below.
        up = f"\x1b[{self._drawn}F" if self._drawn else ""
        body = "".join(f"\x1b[2K{self._fit(line)}\n" for line in lines)
        self._write(f"{up}{body}\x1b[J")
        self._drawn = len(lines)

    def _fit(self, line: str) -> str:
        """Cut a line to the terminal's width, so that no line wraps (that would break the
        count of lines to go back up)."""
        if visible(line) < self.width:
            return line
        plain = ANSI.sub("", line)
        return plain[: self.width - 1]

    def refresh(self, board: Board, now: float, span: float, status: str) -> None:
        if time.monotonic() - self._last < 0.1:
            return
        self._last = time.monotonic()
        self._draw([*render(board, now, span, self.width, self.style), "", status])

    def end(self, board: Board, now: float, span: float, labels: dict[str, str], policy: str,
            lines: Sequence[str]) -> None:  # fmt: skip
        chart = render(board, now, span, self.width, self.style)
        self._draw([*chart, legend(self.style, labels.items(), policy), ""])
        self._drawn = 0  # it stays: the next drawing starts below it
        for line in lines:
            self.para(line.lstrip(), len(line) - len(line.lstrip()), 2)
        self.text()

    def text(self, line: str = "") -> None:
        self._drawn = 0
        super().text(line)

    def close(self) -> None:
        self._write(self.SHOW_CURSOR)
