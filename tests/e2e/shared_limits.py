"""What the end-to-end tests of named limits share, on Redis (test_named_limits.py) and on the
other stores that keep limits (test_stores_units.py): the names and sizes of a test's limits,
units held from the test process as executions on another host would hold them, and what the
probe's events say the worker's bodies held.

The events are read in the order the probe's Redis recorded them: a body (tasks_shared.py)
records its start after its units were taken and its end before they are given back, so the
events never show more than was held.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from singletask.backends.base import LockBackend, Units
from singletask.protocol.limits import limit_key

from .app import e2e_limits

#: The apps' key prefix (the default ``singletask_key_prefix``).
KEY_PREFIX = "singletask:"

#: The size of each test's database limit, and the tokens' rate: units per period (seconds),
#: as tests/e2e/app.py's ``e2e_limits`` defines them.
SIZE: int = (e2e_limits("{e2e}-db:") or {})["concurrency"]
RATE_SIZE, RATE_PERIOD = 10, 2.0
assert (e2e_limits("{e2e}-tokens:") or {})["rate"] == f"{RATE_SIZE}/{RATE_PERIOD:g}s"

#: The token and task id of the units :func:`hold_elsewhere` holds.
ELSEWHERE = "elsewhere-token"


def database(label: str) -> str:
    """The name of the label's database limit (a concurrency of :data:`SIZE`)."""
    return f"{{e2e}}-db:{label}"


def database_key(label: str) -> str:
    """The store key of the label's database limit."""
    return limit_key(KEY_PREFIX, database(label))


def hold_elsewhere(store: LockBackend, label: str, units: int) -> Units:
    """Hold ``units`` of the label's database limit in ``store`` from this process, for a
    minute, as another host's executions would."""
    held = Units(database_key(label), SIZE, units)
    taken = store.take_units(ELSEWHERE, 60, [held], meta={"task_id": "elsewhere"})
    assert taken.taken, taken
    return held


def most_held(events: Sequence[dict[str, Any]]) -> int:
    """The most units the worker's bodies held at once."""
    held = most = 0
    for event in events:
        if event["event"] == "start":
            held += event["units"]
            most = max(most, held)
        elif event["event"] == "end":
            held -= event["units"]
    return most


def most_running_of(events: Sequence[dict[str, Any]], units: int) -> int:
    """The most bodies of ``units`` units each that ran at once."""
    running: dict[str, int] = {}
    most = 0
    for event in events:
        if event["event"] == "start":
            running[event["task_id"]] = event["units"]
            most = max(most, sum(u == units for u in running.values()))
        elif event["event"] == "end":
            running.pop(event["task_id"], None)
    return most


def crowded_windows(starts: Sequence[dict[str, Any]], margin: float = 0.1) -> list[list[float]]:
    """The windows of the tokens' rate period (less ``margin`` seconds, for the time between
    a take and the body's record of it) whose starts add up to more units than the rate
    allows: the start times of each, none when the rate was kept."""
    timed = sorted((s["t"], s["units"]) for s in starts)
    crowded = []
    for i, (first, _) in enumerate(timed):
        within = [(t, u) for t, u in timed[i:] if t < first + RATE_PERIOD - margin]
        if sum(u for _, u in within) > RATE_SIZE:
            crowded.append([t for t, _ in within])
    return crowded
