"""What the demo checks on a scenario's timeline: runs at once per lock key, spacing of starts.

A run's key is the store key it held: with ``lock_limit`` above 1 that is one of the key's
holder slots (:mod:`singletask.protocol.slots`), so runs are grouped by the lock key their slot
belongs to. Each check returns its problems in words; an empty list means the timeline kept the
limits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise

from ..protocol.slots import base_key
from .timeline import Run, max_overlap

__all__ = [
    "REPLACE_SLACK", "Limits", "closest_starts", "late_replaced", "most_at_once", "most_in_all",
    "problems", "slack", "spacing_line",
]  # fmt: skip


@dataclass(frozen=True)
class Limits:
    """What a scenario's task allows per lock key.

    Attributes:
        limit: Runs of one key at once (``lock_limit``).
        interval: Seconds between two starts of one key (``lock_rate``), or None.
        replace_within: With ``lock_policy = "replace"``, the seconds within which a run that
            a newer one replaced stops (a third of its ``lock_ttl``), or None.
    """

    limit: int = 1
    interval: float | None = None
    replace_within: float | None = None

    @property
    def at_once(self) -> int:
        """Runs of one key the timeline may show at once: the limit, and with "replace" one
        more, for the moment a replaced run takes to stop."""
        return self.limit + (self.replace_within is not None)


def slack(interval: float) -> float:
    """How much closer than ``interval`` two starts may look on the timeline: the start events
    are written by the task bodies just after their lock was taken, not by the store, so they
    can be a little late (5% of the interval, at least 20 ms)."""
    return max(interval * 0.05, 0.02)


def _by_key(runs: Iterable[Run]) -> dict[str, list[Run]]:
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(base_key(run.key), []).append(run)
    return groups


def _intervals(runs: Iterable[Run]) -> list[tuple[float, float]]:
    return [(r.start, r.end if r.end is not None else float("inf")) for r in runs]


def most_at_once(runs: Iterable[Run]) -> int:
    """The most runs of one lock key (all its holder slots together) at the same moment."""
    return max((max_overlap(_intervals(group)) for group in _by_key(runs).values()), default=0)


def most_in_all(runs: Iterable[Run]) -> int:
    """The most runs at the same moment, all lock keys together."""
    return max_overlap(_intervals(runs))


def _starts(group: Sequence[Run], interval: float) -> tuple[list[float], float]:
    """The starts of one key's runs in seconds, sorted, and how close two may be: by the
    store's clock (the runs' fencing tokens, in microseconds on the built-in stores), to the
    millisecond the rate record keeps, when every run has one; else by the timeline, less
    :func:`slack`."""
    fences = [r.fence for r in group]
    if group and all(fence is not None for fence in fences):
        return sorted(int(fence or 0) / 1e6 for fence in fences), interval - 0.001
    return sorted(r.start for r in group), interval - slack(interval)


def closest_starts(runs: Iterable[Run], interval: float | None = None) -> float | None:
    """The shortest time between two starts of one lock key (by the store's clock where the
    runs carry fences, with ``interval``), or None with no two starts."""
    gaps = []
    for group in _by_key(runs).values():
        starts = _starts(group, interval or 0.0)[0] if interval else sorted(r.start for r in group)
        gaps += [b - a for a, b in pairwise(starts)]
    return min(gaps, default=None)


#: How much later than ``Limits.replace_within`` a replaced run may be seen ending: its renewal
#: and the read that names its successor, its next check, and the end event it writes.
REPLACE_SLACK = 0.3


def late_replaced(name: str, key: str, group: Sequence[Run], within: float) -> list[str]:
    """A run of ``key`` that kept running longer than ``within`` (plus :data:`REPLACE_SLACK`)
    after a newer run of the key started."""
    found = []
    ordered = sorted(group, key=lambda r: r.start)
    for index, older in enumerate(ordered):
        end = older.end if older.end is not None else float("inf")
        for newer in ordered[index + 1 :]:
            if newer.start < end and end - newer.start > within + REPLACE_SLACK:
                found.append(
                    f"{name}: a run of lock key {key!r} kept running {end - newer.start:.2f}s "
                    f"after a newer run took its lock over (it should stop within {within:.2f}s)"
                )
                break
    return found


def problems(name: str, runs: Sequence[Run], limits: Limits) -> list[str]:
    """Where the runs of a scenario broke its task's limits: more runs of one key at once than
    ``limits.at_once``, a replaced run that did not stop within ``limits.replace_within``, or
    two starts of one key closer than ``limits.interval`` (less :func:`slack`)."""
    found = []
    for key, group in _by_key(runs).items():
        most = max_overlap(_intervals(group))
        if most > limits.at_once:
            found.append(
                f"{name}: {most} runs of lock key {key!r} overlapped (at most {limits.at_once} "
                "allowed)"
            )
        if limits.replace_within is not None:
            found += late_replaced(name, key, group, limits.replace_within)
        if limits.interval is None:
            continue
        starts, allowed = _starts(group, limits.interval)
        clock = "by the store's clock" if group[0].fence is not None else "on the timeline"
        for a, b in pairwise(starts):
            if b - a < allowed:
                found.append(
                    f"{name}: two runs of lock key {key!r} started {b - a:.3f}s apart "
                    f"({clock}), closer than its lock_rate interval of "
                    f"{limits.interval:.3f}s"
                )
    return found


def spacing_line(runs: Sequence[Run], limits: Limits) -> str:
    """How close the starts of one key came, for a scenario with a rate ("" without)."""
    closest = closest_starts(runs, limits.interval)
    if limits.interval is None or closest is None:
        return ""
    groups = _by_key(runs).values()
    close = any(b - a < _starts(g, limits.interval)[1]
                for g in groups for a, b in pairwise(_starts(g, limits.interval)[0]))  # fmt: skip
    ok = "TOO CLOSE" if close else "ok"
    return (
        f"Starts of one lock key: at least {closest:.3f}s apart (the lock_rate's interval is "
        f"{limits.interval:.3f}s) [{ok}]."
    )
