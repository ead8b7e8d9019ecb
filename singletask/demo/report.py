"""What the demo keeps of each scenario it plays, and how it reports them: the lines under a
scenario's timeline, and the summary table with the verdict at the end.

Used by :mod:`~singletask.demo.runner` (the demo itself).
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from celery.result import AsyncResult

from .checks import Limits, most_at_once, most_in_all, spacing_line
from .display import PlainDisplay, short
from .scenarios import Call, Scenario
from .timeline import Board, summary_table

__all__ = ["Played", "Sent", "report_lines", "summary"]


@dataclass
class Sent:
    """A call the demo sent, and how it ended."""

    call: Call
    task_id: str
    key: str
    result: AsyncResult[Any]
    value: Any = None
    outcome: str = "failed"


@dataclass
class Played:
    """A scenario once played: its calls, its timeline, its numbers, and what went wrong."""

    scenario: Scenario
    board: Board
    sent: list[Sent]
    limits: Limits = field(default_factory=Limits)
    problems: list[str] = field(default_factory=list)

    def count(self, outcome: str) -> int:
        return sum(1 for s in self.sent if s.outcome == outcome)

    @property
    def replaced(self) -> int:
        """Calls whose run a newer one replaced (``lock_policy = "replace"``)."""
        return sum(1 for s in self.sent if s.outcome == "skipped" and s.value.reason == "replaced")

    @property
    def retried(self) -> int:
        return sum(1 for m in self.board.marks if m.kind == "retry")

    @property
    def overlap_per_key(self) -> int:
        return most_at_once(self.board.runs)

    @property
    def parallel(self) -> int:
        return most_in_all(self.board.runs)

    def row(self, number: int) -> list[object]:
        return [
            f"{number} {self.scenario.name}",
            self.scenario.task.rsplit(".", 1)[-1],
            len(self.sent),
            self.count("ran"),
            self.count("skipped"),
            self.retried,
            self.count("raised"),
            self.overlap_per_key,
            self.parallel,
        ]


def report_lines(played: Played) -> list[str]:
    """What happened, in words, under a scenario's timeline."""
    per_key, parallel, limits = played.overlap_per_key, played.parallel, played.limits
    ok = "ok" if per_key <= limits.at_once else "OVER THE LIMIT"
    limit = f" (lock_limit {limits.limit})" if limits.limit > 1 else ""
    lines = [
        f"    {played.count('ran')} ran, {played.count('skipped')} skipped, "
        f"{played.retried} retried, {played.count('raised')} raised. Runs at once: at most "
        f"{per_key} per lock key{limit} [{ok}], {parallel} in all."
    ]
    spacing = spacing_line(played.board.runs, limits)
    if spacing:
        lines.append(f"    {spacing}")
    skipped = [s.value for s in played.sent if s.outcome == "skipped"]
    if played.replaced:
        lines.append(
            f"    {played.replaced} runs were replaced by a newer one: each stopped at its next "
            f"check, within {limits.replace_within:.1f}s, and returned a Skipped naming it"
        )
        skipped = [v for v in skipped if v.reason != "replaced"]
    if skipped:
        holders = sorted({short(v.holder) for v in skipped})
        who = (
            f"naming {holders[0]}, the run that held the lock"
            if len(holders) == 1
            else "naming the run that held its lock"
        )
        lines.append(f"    {len(skipped)} callers got a Skipped at once, each {who}")
    if played.retried:
        lines.append(
            f"    the duplicates were sent again {played.retried} times in all, then ran; on the "
            "lock's own retry budget (their request.retries stayed 0)"
        )
    for sent in played.sent:
        if sent.outcome == "raised":
            lines.append(f"    the caller of {sent.call.text} [{short(sent.task_id)}] got:")
            lines.append(f"      TaskLocked: {sent.value}")
    lines += [f"    PROBLEM: {problem}" for problem in played.problems]
    return lines


def summary(played: Sequence[Played], display: PlainDisplay) -> int:
    rows = [p.row(n) for n, p in enumerate(played, 1)]
    totals: list[object] = ["total", ""]
    for column in range(2, 7):
        totals.append(sum(int(str(row[column])) for row in rows))
    totals += [max(p.overlap_per_key for p in played), max(p.parallel for p in played)]
    style = display.style
    display.text(style.paint("Summary", "1"))
    for line in summary_table([*rows, totals], style, display.width):
        display.text(line)
    display.para(
        "max overlap per key: the most runs holding one lock key at the same moment (at most "
        "the task's lock_limit: 2 for the limit scenario, 3 for the rate one, else 1; one more "
        "for the replace one, while a replaced run stops); "
        "parallel: the most runs of the task at the same moment, all keys together.",
        2,
    )
    display.text()
    problems = [problem for p in played for problem in p.problems]
    submitted = sum(len(p.sent) for p in played)
    ended = sum(p.count("ran") + p.count("skipped") + p.count("raised") for p in played)
    if ended != submitted:
        problems.append(f"{submitted} calls submitted, but {ended} ran, were skipped or raised")
    if problems:
        display.text(style.paint("FAILED: singletask did not behave as documented:", "1;31"))
        for problem in problems:
            display.para(f"- {problem}", 2, 2)
        return 1
    verdict = textwrap.wrap(
        "OK: no lock key ever had more runs at once than its lock_limit (but for the moment a "
        "replaced run takes to stop), no two starts of a "
        "rated key came closer than its lock_rate allows, every replaced run stopped within a "
        "third of its lock_ttl, and every duplicate was skipped, retried, refused or let "
        "replace the run as its lock policy says.",
        display.width - 1,
    )
    verdict[0] = style.paint("OK", "1;32") + verdict[0][2:]
    for line in verdict:
        display.text(line)
    return 0
