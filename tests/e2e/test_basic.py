"""The heart of it: duplicates of a global singleton on a real prefork worker never overlap."""

from __future__ import annotations

import time

import pytest

from singletask import Skipped

from .conftest import Cluster

pytestmark = pytest.mark.e2e


def test_a_duplicate_of_a_running_singleton_is_skipped(cluster: Cluster) -> None:
    # Given a global singleton running on one pool process
    label = cluster.label()
    sleep = cluster.task("e2e.basic.sleep")
    holder = sleep.delay(label, 1.5)
    cluster.probe.wait_for(label, "start")

    # When a duplicate reaches the other pool process
    duplicate = sleep.delay(label, 0)

    # Then the duplicate returns at once with a Skipped naming the holder, and the holder finishes
    skipped = duplicate.get(timeout=10)
    assert isinstance(skipped, Skipped)
    assert skipped.holder == holder.id
    assert skipped.key == "singletask:e2e.basic.sleep"
    assert holder.get(timeout=10) == "done"
    assert cluster.probe.max_overlap(label) == 1
    # And the lock is free once the holder has returned
    assert cluster.lock_keys("singletask:e2e.basic.sleep") == []
    # So the next run goes ahead
    time.sleep(0.05)
    assert sleep.delay(label, 0).get(timeout=10) == "done"
