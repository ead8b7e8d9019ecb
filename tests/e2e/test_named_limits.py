"""Named limits on a real prefork worker: two task types share a limit of the fleet, costs
weigh, a crash gives its units back, a refusal says which limit, ``charge`` moves a rate's
window, and a rate is never exceeded.

The test process takes units of a limit itself, as executions on another host would, so that
the worker's two pool processes meet a limit with less room than they are. What the worker's
bodies held at once is read from the probe's start and end events (shared_limits.py). The
same, on the stores besides Redis: tests/e2e/test_stores_units.py.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
from celery import group

from singletask import Skipped
from singletask.backends.base import Units
from singletask.backends.redis import RedisBackend

from .conftest import ON_REDIS_BROKER, Cluster
from .shared_limits import (
    SIZE,
    crowded_windows,
    database,
    hold_elsewhere,
    most_held,
    most_running_of,
)
from .tasks_policies import gate_key
from .tasks_shared import PREFIX
from .test_endings import wait_pool_restored

pytestmark = [pytest.mark.e2e, ON_REDIS_BROKER]

#: Generous bound for what the worker does by itself.
BOUND = 30.0


@pytest.fixture
def label(cluster: Cluster) -> Iterator[str]:
    """A probe label of this test only; its gate is opened at teardown, whatever happened."""
    name = cluster.label()
    yield name
    cluster.probe.client.rpush(gate_key(name), *["open"] * 20)


def elsewhere(cluster: Cluster, label: str, units: int) -> Units:
    """Hold ``units`` of the label's database limit from this process, as another host."""
    return hold_elsewhere(RedisBackend(client=cluster.locks), label, units)


def test_two_task_types_sharing_a_limit_never_hold_more_than_its_size(
    cluster: Cluster, label: str
) -> None:
    """With 2 of 3 units held elsewhere, the reports and exports (1 unit each) run one at a
    time on two pool processes, and every one of them runs."""
    elsewhere(cluster, label, 2)
    sends = [
        cluster.task(PREFIX + name).s(label, pause=0.1)
        for name in ("report", "export") * 4
    ]  # fmt: skip

    results = group(sends).apply_async().get(timeout=BOUND * 2)

    assert results == [1] * 8
    assert most_held(cluster.probe.events(label)) == 1
    assert {e["task"] for e in cluster.probe.starts(label)} == {
        PREFIX + "report", PREFIX + "export",
    }  # fmt: skip


def test_costs_weigh_against_the_size(cluster: Cluster, label: str) -> None:
    """Executions of 2 units each on a limit of 3: never two at once, though two processes
    are free; executions of 1 unit fill the rest."""
    sends = [cluster.task(PREFIX + "report").s(label, cost=2, pause=0.1) for _ in range(4)]
    sends += [cluster.task(PREFIX + "export").s(label, cost=1, pause=0.1) for _ in range(4)]

    results = group(sends).apply_async().get(timeout=BOUND * 2)

    assert sorted(results) == [1] * 4 + [2] * 4
    events = cluster.probe.events(label)
    assert most_held(events) <= SIZE
    assert most_running_of(events, 2) == 1


def test_a_full_limit_refuses_with_its_name_and_a_crash_gives_the_units_back(
    cluster: Cluster, label: str
) -> None:
    """A skip names the limit; an execution killed while it holds the last unit gives it back
    through the worker, and the next one runs."""
    elsewhere(cluster, label, 2)
    held = cluster.task(PREFIX + "report").apply_async((label,), {"hold": True})
    (start,) = cluster.probe.wait_for(label, "start", timeout=BOUND)

    refused = cluster.task(PREFIX + "report_skip").apply_async((label,)).get(timeout=BOUND)
    assert isinstance(refused, Skipped)
    assert (refused.reason, refused.limit) == ("limit", database(label))

    os.kill(start["pid"], signal.SIGKILL)
    try:
        with pytest.raises(Exception):  # noqa: B017, PT011 - the worker reports the lost process
            held.get(timeout=BOUND)
        after = cluster.task(PREFIX + "report_skip").apply_async((label,)).get(timeout=BOUND)
        while isinstance(after, Skipped):  # the main process gives the unit back at once
            after = cluster.task(PREFIX + "report_skip").apply_async((label,)).get(timeout=BOUND)
        assert after == 1
    finally:
        wait_pool_restored(cluster, start["pid"])


def test_charge_counts_the_real_cost_so_the_next_starts_have_room(
    cluster: Cluster, label: str
) -> None:
    """ "10 tokens per 2 s", calls estimated at 5 that used 1: six in a row all run at their
    first start (the skip policy: a refused one would return Skipped), where the estimates
    alone would let two."""
    task = cluster.task(PREFIX + "complete_skip")
    used = [task.apply_async((label,), {"estimate": 5, "used": 1}).get(timeout=BOUND)
            for _ in range(6)]  # fmt: skip
    assert used == [1] * 6
    assert len(cluster.probe.starts(label)) == 6


def test_starts_never_exceed_a_rate_in_any_window(cluster: Cluster, label: str) -> None:
    """Twelve calls of 3 tokens each on "10 per 2 s", sent at once: all run, and no window of
    2 s (less 0.1 s for the time between a take and the body's record of it) holds more than
    10 tokens of starts."""
    task = cluster.task(PREFIX + "complete")
    sends = [task.s(label, estimate=3, used=3) for _ in range(12)]

    assert group(sends).apply_async().get(timeout=BOUND * 3) == [3] * 12

    assert not crowded_windows(cluster.probe.starts(label))
