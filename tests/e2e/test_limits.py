"""``lock_limit = 2`` on a real prefork worker: two holders per key at most, across processes.

The test process holds one slot of a key itself (as another host would), so that the worker's
two pool processes meet a key that is full with one execution of theirs running.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
from celery.exceptions import WorkerLostError

from singletask import Skipped
from singletask.backends.redis import RedisBackend
from singletask.protocol.slots import slot_key

from .conftest import Cluster
from .tasks_limits import TTL
from .tasks_policies import gate_key
from .test_endings import wait_pool_restored

pytestmark = pytest.mark.e2e

NAME = "e2e.limits.export"
#: Generous bound for what the worker does by itself (release after a lost process).
BOUND = 15.0


@pytest.fixture
def stopped(cluster: Cluster) -> Iterator[list[int]]:
    """Pool processes a test kills: afterwards, wait until the worker has replaced them."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        wait_pool_restored(cluster, pid)


@pytest.fixture
def label(cluster: Cluster) -> Iterator[str]:
    """A probe label of this test only; its gate is opened at teardown, whatever happened."""
    name = cluster.label()
    yield name
    cluster.probe.client.rpush(gate_key(name), *["open"] * 10)


def hold_one_slot(cluster: Cluster, key: str) -> int:
    """Take a slot of ``key`` from this process, as an execution on another host would."""
    taken = RedisBackend(client=cluster.locks).acquire_slot(
        key, 2, "elsewhere-token", TTL, meta={"task_id": "elsewhere"}
    )
    assert taken.acquired
    assert taken.key == key
    assert taken.fence is not None
    return taken.fence


def test_a_full_key_skips_naming_both_holders_and_a_freed_slot_runs_the_next(
    cluster: Cluster, label: str
) -> None:
    # Given one slot held elsewhere and an execution holding the other, on the gate
    task = cluster.task(NAME)
    key = task.lock_key_for((label,))
    elsewhere = hold_one_slot(cluster, key)
    running = task.apply_async((label,), {"hold": True})
    (start,) = cluster.probe.wait_for(label, "start")
    assert start["slot_key"] == slot_key(key, 1)
    assert start["fence"] > elsewhere

    # When a third export of the label is sent
    third = task.apply_async((label,)).get(timeout=BOUND)

    # Then it is skipped, naming both holders, without running its body
    assert isinstance(third, Skipped)
    assert third.holders == ("elsewhere", running.id)
    assert len(cluster.probe.starts(label)) == 1

    # And once the running one ends, its slot is free again and the next export takes it,
    # with a larger fence, while the other slot stays held
    cluster.probe.client.rpush(gate_key(label), "open")
    assert running.get(timeout=BOUND)["key"] == slot_key(key, 1)
    cluster.wait_free(slot_key(key, 1))
    after = task.apply_async((label,)).get(timeout=BOUND)
    assert after["key"] == slot_key(key, 1)
    assert after["fence"] > start["fence"]
    assert cluster.held_by(key) == "elsewhere"
    assert cluster.probe.max_overlap(label) == 1  # one of ours at a time: the other slot is held


def test_a_killed_pool_process_has_its_slot_released_by_the_worker(
    cluster: Cluster, label: str, stopped: list[int]
) -> None:
    # Given an execution holding slot 1 of its key (slot 0 held elsewhere)
    task = cluster.task(NAME)
    key = task.lock_key_for((label,))
    hold_one_slot(cluster, key)
    running = task.apply_async((label,), {"hold": True})
    (start,) = cluster.probe.wait_for(label, "start")
    assert cluster.held_by(slot_key(key, 1)) == running.id

    # When its pool process is SIGKILLed
    stopped.append(start["pid"])
    os.kill(start["pid"], signal.SIGKILL)

    # Then the worker's main process releases that slot, long before the lease ends, and
    # leaves the other holder alone
    cluster.wait_free(slot_key(key, 1), timeout=BOUND)
    assert isinstance(running.get(timeout=BOUND, propagate=False), WorkerLostError)
    assert cluster.held_by(key) == "elsewhere"
