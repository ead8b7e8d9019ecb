"""Counters and histograms from the workers' ``task-singletask-<outcome>`` events.

A worker started with ``-E`` sends one Celery event per lock outcome of an execution (type
``task-singletask-<outcome>``; fields ``name``, ``singletask_outcome``, ``singletask_wait`` on
``acquired``, ``singletask_held`` on ``released``, and the key, holder and fence). This module
turns one such event into metric updates; it keeps no state of its own beyond the metrics, which
live in the :class:`~prometheus_client.CollectorRegistry` it is given.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from ...observe import report
from ...protocol.keys import escape_name

__all__ = ["BUCKETS", "OTHER", "OUTCOMES", "UNKNOWN", "EventMetrics", "task_of_key"]

#: The documented outcomes (:data:`singletask.observe.report.OUTCOMES`, what the workers
#: send), each a value of the ``outcome`` label.
OUTCOMES = tuple(sorted(report.OUTCOMES))
#: The ``outcome`` of an event whose outcome is not documented (a newer worker's): counted, in
#: one bounded series per task, so that an upgrade shows up instead of vanishing.
OTHER = "other"
#: The ``task`` of an event that names no task and no key the name can be read from.
UNKNOWN = "unknown"

#: Histogram buckets (seconds) for lock waits and holds: from a few milliseconds (an uncontended
#: acquire) to hours (a long hold, a message waiting behind one).
BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
    600.0, 1800.0, 3600.0, 7200.0, 14400.0, math.inf,
)  # fmt: skip

#: How the percent-escapes of a task name in a key read back (see :mod:`singletask.protocol.keys`).
_UNESCAPES = (("%3A", ":"), ("%7B", "{"), ("%7D", "}"), ("%25", "%"))


def task_of_key(key: str, prefix: str) -> str | None:
    """The task name a lock key ``<prefix><escaped name>[:suffix]`` belongs to, or None when
    ``key`` does not start with ``prefix`` or its name part does not read back."""
    if not key.startswith(prefix):
        return None
    escaped = key[len(prefix) :].partition(":")[0]
    name = escaped
    for code, char in _UNESCAPES:
        name = name.replace(code, char)
    # "%253A" reads back as "%3A" only if escaping that gives the key's part again.
    return name if name and escape_name(name) == escaped else None


def _seconds(value: Any) -> float | None:
    """A duration field of an event: a finite, non-negative number of seconds, else None."""
    if isinstance(value, bool):
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


class EventMetrics:
    """The counters and histograms fed by events, registered in ``registry``.

    ``prefix`` is the lock key prefix, to read a task name from the key of an event that names
    none.
    """

    def __init__(self, registry: CollectorRegistry, *, prefix: str = "singletask:") -> None:
        self.prefix = prefix
        self.outcomes = Counter(
            "singletask_outcomes",
            "Lock outcomes of executions, per task and outcome (from the workers' events)",
            ["task", "outcome"],
            registry=registry,
        )
        self.wait = Histogram(
            "singletask_lock_wait_seconds",
            "From the first send of a message to its execution holding the lock",
            ["task"],
            buckets=BUCKETS,
            registry=registry,
        )
        self.hold = Histogram(
            "singletask_lock_hold_seconds",
            "How long an execution held its lock, from acquired to released",
            ["task"],
            buckets=BUCKETS,
            registry=registry,
        )
        self.tasks: set[str] = set()

    def handle(self, event: Mapping[str, Any]) -> bool:
        """Count one Celery event; return whether it was a singletask event."""
        kind = event.get("type")
        prefix = report.EVENT_PREFIX
        if not isinstance(kind, str) or not kind.startswith(prefix):
            return False
        outcome = event.get("singletask_outcome") or kind[len(prefix) :]
        if outcome not in OUTCOMES:
            outcome = OTHER
        task = self.task_of(event)
        self._known(task)
        self.outcomes.labels(task=task, outcome=outcome).inc()
        if outcome == "acquired":
            wait = _seconds(event.get("singletask_wait"))
            if wait is not None:
                self.wait.labels(task=task).observe(wait)
        elif outcome == "released":
            held = _seconds(event.get("singletask_held"))
            if held is not None:
                self.hold.labels(task=task).observe(held)
        return True

    def task_of(self, event: Mapping[str, Any]) -> str:
        """The ``task`` label of an event: its ``name``, else the one its key names."""
        name = event.get("name")
        if isinstance(name, str) and name:
            return name
        key = event.get("singletask_key")
        found = task_of_key(key, self.prefix) if isinstance(key, str) else None
        return found or UNKNOWN

    def _known(self, task: str) -> None:
        """Start every outcome of a task newly seen at 0, so that ``increase()`` sees its first
        lost lease or store error (a series that appears at 1 has no increase)."""
        if task in self.tasks:
            return
        self.tasks.add(task)
        for outcome in OUTCOMES:
            self.outcomes.labels(task=task, outcome=outcome)
