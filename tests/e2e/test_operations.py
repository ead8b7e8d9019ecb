"""The operator commands against a live worker: list, inspect and release locks held by running
tasks, driven as subprocesses the way an operator types them.

Each command runs both ways: the standalone script (``python -m singletask ... --url URL``) and
the Celery plugin (``celery -A tests.e2e.app singletask ...``, URL and prefix from the app).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from .conftest import ROOT, Cluster
from .tasks_ops import LEASE, LOST_LABEL, stop_flag

pytestmark = pytest.mark.e2e

WAYS = ["script", "celery"]

#: Generous bound for anything the worker should do "at once" on a loaded machine.
BOUND = 20.0


def command(cluster: Cluster, way: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run an operator command as a subprocess; ``way`` is "script" or "celery"."""
    if way == "script":
        argv = [sys.executable, "-m", "singletask", *args, "--url", locks_url(cluster)]
    else:
        argv = [sys.executable, "-m", "celery", "-A", "tests.e2e.app", "singletask", *args]
    return subprocess.run(
        argv, cwd=ROOT, env=cluster.worker.env, capture_output=True, text=True, timeout=120,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


def locks_url(cluster: Cluster) -> str:
    return cluster.worker.env["SINGLETASK_E2E_LOCKS"]


def worker_hostname(cluster: Cluster) -> str:
    return cluster.worker.nodename.replace("%h", os.uname().nodename)


@pytest.fixture
def holders(cluster: Cluster) -> Iterator[tuple[str, dict[str, Any]]]:
    """A fresh label, and the AsyncResults of the holders a test starts, stopped at the end."""
    label = cluster.label()
    started: dict[str, Any] = {}
    yield label, started
    cluster.probe.client.set(stop_flag(label), 1, ex=300)
    for result in started.values():
        result.get(timeout=BOUND)


def start_holder(cluster: Cluster, label: str, name: str, started: dict[str, Any]) -> Any:
    """Send ``e2e.ops.hold(label, name)`` and wait until its body runs."""
    result = cluster.task("e2e.ops.hold").delay(label, name)
    started[name] = result
    deadline = time.monotonic() + BOUND
    while not [e for e in cluster.probe.starts(label) if e["task_id"] == result.id]:
        assert time.monotonic() < deadline, f"holder {name} did not start\n{cluster.worker.tail()}"
        time.sleep(0.05)
    return result


def key_of(cluster: Cluster, label: str, name: str) -> str:
    return str(cluster.task("e2e.ops.hold").lock_key_for((label, name)))


def check_record(
    cluster: Cluster, record: dict[str, Any], key: str, task_id: str, sent_at: datetime
) -> None:
    """A lock record of a running e2e.ops.hold, checked field by field against the truth."""
    assert record["key"] == key
    assert record["task"] == "e2e.ops.hold"
    assert record["scope"] == "execution"
    assert record["state"] == "running"
    assert record["holder"] == task_id
    assert record["hostname"] == worker_hostname(cluster)
    assert isinstance(record["pid"], int)
    assert record["pid"] in cluster.worker.children()
    acquired = datetime.fromisoformat(record["acquired_at"])
    assert acquired.utcoffset() == timedelta(0)
    assert sent_at - timedelta(seconds=5) <= acquired <= datetime.now(timezone.utc)
    assert isinstance(record["lease_left"], float | int)
    assert 0 < record["lease_left"] <= LEASE
    assert isinstance(record["fence"], int)
    assert record["fence"] > 0
    assert record["token"].startswith(f"{task_id}:0:")
    assert record["slot"] == 0


@pytest.mark.parametrize("way", WAYS)
def test_locks_lists_the_running_holders_field_by_field(
    cluster: Cluster, holders: tuple[str, dict[str, Any]], way: str
) -> None:
    """`locks --json --task NAME` shows each running holder: its key, task, scope, task id,
    worker hostname and pool pid, when it acquired, the lease left and its fence."""
    # Given two holders of one task running on the worker's two pool processes
    label, started = holders
    sent_at = datetime.now(timezone.utc)
    first = start_holder(cluster, label, "a", started)
    second = start_holder(cluster, label, "b", started)
    expected = {key_of(cluster, label, "a"): first.id, key_of(cluster, label, "b"): second.id}

    # When the operator lists the locks of that task as JSON
    done = command(cluster, way, "locks", "--task", "e2e.ops.hold", "--json")

    # Then both holders are listed, each field right
    assert done.returncode == 0, done.stderr
    records = json.loads(done.stdout)
    assert isinstance(records, list)
    assert {r["task"] for r in records} == {"e2e.ops.hold"}
    mine = {r["key"]: r for r in records if r["key"] in expected}
    assert set(mine) == set(expected), records
    for key, task_id in expected.items():
        check_record(cluster, mine[key], key, task_id, sent_at)
    assert mine[next(iter(expected))]["pid"] != mine[list(expected)[1]]["pid"]

    # And another task name filters them out; --limit bounds the listing
    other = command(cluster, way, "locks", "--task", "e2e.ops.other", "--json")
    assert other.returncode == 0, other.stderr  # an empty listing is an answer
    assert json.loads(other.stdout) == []
    limited = command(cluster, way, "locks", "--task", "e2e.ops.hold", "--limit", "1", "--json")
    assert limited.returncode == 0, limited.stderr
    assert len(json.loads(limited.stdout)) == 1

    # And the table shows the same locks, one row each
    table = command(cluster, way, "locks", "--task", "e2e.ops.hold")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == [
        "KEY", "SLOT", "TASK", "SCOPE", "STATE", "HOLDER", "HOST", "PID", "ACQUIRED", "LEASE",
        "FENCE",
    ]  # fmt: skip
    for key, task_id in expected.items():
        (row,) = [line for line in lines if line.startswith(key + " ")]
        assert task_id in row.split()
        assert worker_hostname(cluster) in row.split()


@pytest.mark.parametrize("way", WAYS)
def test_inspect_shows_one_lock_and_a_release_by_the_wrong_holder_is_refused(
    cluster: Cluster, holders: tuple[str, dict[str, Any]], way: str
) -> None:
    """`inspect KEY` shows the holder (exit 1 for a free key); `release KEY --holder OTHER`
    changes nothing and exits 1."""
    # Given a running holder
    label, started = holders
    sent_at = datetime.now(timezone.utc)
    holder = start_holder(cluster, label, "a", started)
    key = key_of(cluster, label, "a")

    # When the operator inspects its key
    shown = command(cluster, way, "inspect", key, "--json")

    # Then it is the holder, field by field
    assert shown.returncode == 0, shown.stderr
    record = json.loads(shown.stdout)
    check_record(cluster, record, key, holder.id, sent_at)
    text = command(cluster, way, "inspect", key)
    assert text.returncode == 0, text.stderr
    assert [line.split() for line in text.stdout.splitlines() if line.startswith("holder:")] == [
        ["holder:", holder.id]
    ]

    # And a key nobody holds is reported as such, with exit status 1
    free = command(cluster, way, "inspect", key_of(cluster, label, "nobody"))
    assert free.returncode == 1
    assert "is not held" in free.stderr

    # When the operator releases it naming another task id
    refused = command(cluster, way, "release", key, "--holder", "not-the-holder")

    # Then it is refused, with exit status 1, and nothing changed
    assert refused.returncode == 1, refused.stderr
    assert holder.id in refused.stderr
    assert "not released" in refused.stderr
    again = json.loads(command(cluster, way, "inspect", key, "--json").stdout)
    assert again["holder"] == holder.id
    assert again["fence"] == record["fence"]
    assert not cluster.probe.events(label, "outcome")


@pytest.mark.parametrize(("way", "how"), [("script", "--force"), ("celery", "--holder")])
def test_a_release_lets_a_new_execution_start_at_once_and_the_old_holder_reports_the_loss(
    cluster: Cluster, holders: tuple[str, dict[str, Any]], way: str, how: str
) -> None:
    """After `release KEY --force --yes` (or `--holder ITS_ID`), a new execution of the key runs
    at once, with a larger fence, and the old holder learns at its next renewal that its lock is
    lost: LockLost from check(), an ERROR log line naming its task id, the lock_lost signal."""
    # Given a running holder of a key
    label, started = holders
    old = start_holder(cluster, label, "a", started)
    key = key_of(cluster, label, "a")
    before = json.loads(command(cluster, way, "inspect", key, "--json").stdout)

    # When the operator releases it
    args = ["--force", "--yes"] if how == "--force" else ["--holder", old.id]
    released = command(cluster, way, "release", key, *args)

    # Then the command says whose lock it released
    assert released.returncode == 0, released.stderr
    assert f"released lock {key!r}" in released.stdout
    assert old.id in released.stdout
    # And a new execution of the same key runs at once (the old holder, still renewing for its
    # 60 s run, would otherwise make it a Skipped)
    new = cluster.task("e2e.ops.hold").delay(label, "a", 0.5)
    started["new"] = new
    assert new.get(timeout=BOUND) == {"lost": False, "raised": None}
    assert new.id in {e["task_id"] for e in cluster.probe.starts(label)}
    # And the old holder saw the loss at its next renewal: it returned long before its 60 s
    outcome = old.get(timeout=BOUND)
    assert outcome == {"lost": True, "raised": "LockLost"}, cluster.worker.tail()
    # And its worker logged an ERROR naming its task id and the key, and sent lock_lost
    deadline = time.monotonic() + BOUND
    wanted = f"e2e.ops.hold[{old.id}]: lock {key!r} lost while the task runs"
    while wanted not in cluster.worker.log.read_text(errors="replace"):
        assert time.monotonic() < deadline, cluster.worker.tail()
        time.sleep(0.1)

    # (the renewer marks the lock lost before it logs and signals, so the task may have returned,
    # and the line been written, before the signal's receiver recorded it: wait for it too)
    def signals() -> list[str]:
        return [
            e["key"]
            for e in cluster.probe.events(LOST_LABEL, "lock_lost")
            if e["task_id"] == old.id
        ]

    while not signals():
        assert time.monotonic() < deadline, cluster.worker.tail()
        time.sleep(0.1)
    assert signals() == [key]
    # And the fence moved on: the next holder's fence is larger
    # (it holds until the test ends: a loaded machine's slow CLI calls could miss a short hold)
    again = cluster.task("e2e.ops.hold").delay(label, "a")
    started["again"] = again
    deadline = time.monotonic() + BOUND
    while not [e for e in cluster.probe.starts(label) if e["task_id"] == again.id]:
        assert time.monotonic() < deadline, cluster.worker.tail()
        time.sleep(0.05)
    shown = command(cluster, way, "inspect", key, "--json")
    assert shown.returncode == 0, shown.stderr
    after = json.loads(shown.stdout)
    assert after["holder"] == again.id
    assert after["fence"] > before["fence"]
