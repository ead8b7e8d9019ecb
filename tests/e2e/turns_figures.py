"""What a flood of one tenant's sends says about fair turns: where the other tenants' last
starts came among the flood's, and how evenly the tenants started while all of them waited.
Shared by tests/e2e/test_fair_turns.py and the benchmark (bench/suites/turns.py).

A *start* is a body's ``start`` event (tests/e2e/probe.py, or the benchmark's probe): a dict
with at least ``tenant`` and ``t`` (the worker's clock, seconds since the epoch), in the order
they were recorded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Figures", "figures", "jain"]


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index of ``values``: ``(sum x)^2 / (n * sum x^2)``, 1 when all are
    equal, ``1/n`` when one has everything (1 for no values or all zero)."""
    squares = sum(x * x for x in values)
    if not values or squares == 0:
        return 1.0
    return sum(values) ** 2 / (len(values) * squares)


@dataclass
class Figures:
    """The figures of one flood (see :func:`figures`)."""

    #: The tenant that floods.
    flood: str
    #: Each other tenant: how many of the flood's starts came before its last start.
    flood_before_last: dict[str, int]
    #: The window in which every tenant had a send waiting (worker clock), None if never.
    window: tuple[float, float] | None
    #: Each tenant's starts within the window.
    starts_in_window: dict[str, int] = field(default_factory=dict)
    #: Jain's index of the starts within the window, each divided by its tenant's weight.
    jain: float | None = None
    #: The tenants in the order their starts were recorded (``"aabcabc..."``, tenants'
    #: first letters).
    order: str = ""
    #: Jain's index over the window from when every tenant waited in the limit's line (the
    #: latest of the tenants' first refusals) to the same end, when those were recorded.
    jain_in_line: float | None = None
    #: Each tenant's starts within that window.
    starts_in_line: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "flood": self.flood,
            "flood_before_last": self.flood_before_last,
            "window_s": None if self.window is None else self.window[1] - self.window[0],
            "starts_in_window": self.starts_in_window,
            "jain": self.jain,
            "order": self.order,
            "jain_in_line": self.jain_in_line,
            "starts_in_line": self.starts_in_line,
        }

    def __str__(self) -> str:
        before = ", ".join(f"{t}: {n}" for t, n in sorted(self.flood_before_last.items()))
        window = ", ".join(f"{t} {n}" for t, n in sorted(self.starts_in_window.items()))
        jain = "—" if self.jain is None else f"{self.jain:.3f}"
        in_line = ""
        if self.jain_in_line is not None:
            counts = ", ".join(f"{t} {n}" for t, n in sorted(self.starts_in_line.items()))
            in_line = f"; from all in line: {counts}, Jain's index {self.jain_in_line:.3f}"
        return (f"{self.flood}'s starts before each other tenant's last: {before}; "
                f"starts while all waited: {window}; Jain's index {jain}{in_line}; "
                f"order {self.order}")  # fmt: skip


def figures(
    starts: Sequence[Mapping[str, Any]],
    sent: Mapping[str, float],
    flood: str,
    weights: Mapping[str, float] | None = None,
    refused: Mapping[str, float] | None = None,
) -> Figures:
    """The figures of a flood: ``starts`` in the order recorded, ``sent`` each tenant's first
    send (same clock as the starts), ``flood`` the tenant that floods; ``refused``, when
    known, each tenant's first refusal (when the limit's line first had it waiting).

    * **Position**: for each other tenant, the number of ``flood``'s starts recorded before
      that tenant's last start.
    * **Window**: from when every tenant has a send waiting (the latest of the tenants' first
      sends) to when the first of them has none left (the earliest of the tenants' last
      starts), both included.
    * **Jain's index** over the window: ``x_t`` = tenant ``t``'s starts within the window
      divided by its weight (``weights``, 1 when not given); ``J = (sum x)^2 / (n * sum x^2)``
      over the ``n`` tenants.
    * **In line**: the same index from the latest of the tenants' first refusals instead of
      their first sends (a tenant's first message may wait in the broker behind the flood's,
      where no lock store sees it), to the same end.
    """
    weights = weights or {}
    order = "".join(str(s["tenant"])[:1] for s in starts)
    last: dict[str, int] = {}
    for i, start in enumerate(starts):
        last[str(start["tenant"])] = i
    before = {
        tenant: sum(1 for s in starts[:i] if s["tenant"] == flood)
        for tenant, i in last.items()
        if tenant != flood
    }
    tenants = sorted(sent)
    if any(t not in last for t in tenants):
        return Figures(flood, before, None, order=order)
    begin = max(sent.values())
    end = min(starts[last[t]]["t"] for t in tenants)
    if end < begin:
        return Figures(flood, before, None, order=order)
    within = _counts(starts, tenants, begin, end)
    index = jain([within[t] / weights.get(t, 1.0) for t in tenants])
    found = Figures(flood, before, (begin, end), within, index, order)
    if refused and all(t in refused for t in tenants):
        found.starts_in_line = _counts(starts, tenants, max(refused[t] for t in tenants), end)
        found.jain_in_line = jain([found.starts_in_line[t] / weights.get(t, 1.0) for t in tenants])
    return found


def _counts(
    starts: Sequence[Mapping[str, Any]], tenants: Sequence[str], begin: float, end: float
) -> dict[str, int]:
    return {t: sum(1 for s in starts if s["tenant"] == t and begin <= s["t"] <= end)
            for t in tenants}  # fmt: skip
