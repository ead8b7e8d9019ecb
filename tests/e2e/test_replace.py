"""``lock_policy = "replace"`` on real workers: prefork (the session cluster) and threads.

A running body is preempted by a newer execution of its key: the newer one runs at once with a
larger fence, the older one learns it within one renewal interval (``lock_ttl / 3``, 0.5 s here),
its late fenced write is refused, and it ends as ``Skipped("replaced")`` naming the newer one.
The tasks are in tasks_replace.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from singletask import Skipped
from singletask.backends.redis import RedisBackend
from singletask.protocol.slots import slot_keys

from .conftest import Cluster, start_cluster
from .probe import Probe
from .tasks_policies import gate_key
from .tasks_replace import LONG_TTL, MAX_HOLD, MAX_HOLD_TTL, PREFIX, TTL, resource_key

pytestmark = pytest.mark.e2e

#: Seconds; far above what each step needs, so a slow machine does not fail the tests.
BOUND = 20.0
#: What the preempted body may take beyond one renewal interval to learn it: the renewal's and
#: the read's round trips, the body's polling step, a loaded machine's scheduling.
SLACK = 1.0


@pytest.fixture
def label(cluster: Cluster) -> Iterator[str]:
    """A probe label of this test only; its gate is opened at teardown, whatever happened."""
    name = cluster.label()
    yield name
    cluster.probe.client.rpush(gate_key(name), *["open"] * 10)


def preempt_and_check(cluster: Cluster, label: str, task: str = "rebuild") -> dict[str, Any]:
    """Given version 1 running, when version 2 of the same key is sent, then version 1 is
    preempted within the bound, its late fenced write refused, and it ends replaced."""
    rebuild = cluster.task(PREFIX + task)
    older = rebuild.delay(label, 1)
    first = cluster.probe.wait_for(label, "start", timeout=BOUND)[0]

    # When a newer execution of the key is sent
    newer = rebuild.delay(label, 2)

    # Then it runs at once, with a larger fence, while the older one is still running
    starts = cluster.probe.wait_for(label, "start", count=2, timeout=BOUND)
    second = next(s for s in starts if s["version"] == 2)
    assert second["task_id"] == newer.id
    assert second["fence"] > first["fence"]
    # And the older one learns it within one renewal interval, naming the newer one
    preempted = cluster.probe.wait_for(label, "preempted", timeout=BOUND)[0]
    assert preempted["task_id"] == older.id
    assert preempted["successor"] == newer.id
    assert preempted["t"] - second["t"] < TTL / 3 + SLACK
    # And its late write is refused by its older fencing token: the resource keeps version 2
    assert preempted["late_write"] is False
    assert cluster.probe.client.hget(resource_key(label), "value") == "2"
    # And it ends as replaced, naming the newer execution
    value = older.get(timeout=BOUND)
    assert isinstance(value, Skipped)
    assert (value.reason, value.holder) == ("replaced", newer.id)
    # And the newer one finishes normally when let go
    cluster.probe.client.rpush(gate_key(label), "open")
    assert newer.get(timeout=BOUND) == 2
    return {"older": older, "newer": newer, "first": first, "second": second}


def test_a_newer_execution_preempts_the_running_one_on_prefork(
    cluster: Cluster, label: str
) -> None:
    """Two pool processes: the running body is preempted by the newer one (see above), and
    the key is free once the newer one has ended."""
    preempt_and_check(cluster, label)
    cluster.wait_free(f"singletask:{PREFIX}rebuild:{label}")


def successor_ends_first(rebuild: Any, probe: Probe, label: str) -> None:
    """Given version 1 of ``rebuild`` (``rebuild_long``) running, when version 2 preempts it and
    ends (releasing the key) before version 1's next renewal, then version 1 finds the key free,
    yet learns that it was preempted, and by whom, and ends as replaced, not as a lost lock."""
    older = rebuild.delay(label, 1)
    first = probe.wait_for(label, "start", timeout=BOUND)[0]
    # Sent just after the older one's first renewal (a third of its lease after it acquired,
    # which is just before it started), so the newer one has most of an interval to run
    time.sleep(max(0.0, first["t"] + LONG_TTL / 3 + 0.3 - time.time()))

    # When a newer execution preempts it and ends at once
    newer = rebuild.delay(label, 2, hold=False)
    assert newer.get(timeout=BOUND) == 2
    ended = next(e for e in probe.events(label, "end") if e["task_id"] == newer.id)

    # Then the older one ends as replaced, naming the newer one
    value = older.get(timeout=BOUND, propagate=False)
    assert isinstance(value, Skipped), value
    assert (value.reason, value.holder) == ("replaced", newer.id)
    # And its body learned it (LockPreempted naming the newer one) after the newer one ended
    preempted = probe.wait_for(label, "preempted", timeout=BOUND)[0]
    assert preempted["successor"] == newer.id
    assert preempted["t"] > ended["t"], "the newer one had not ended: the case is not exercised"
    assert preempted["late_write"] is False


def test_a_run_whose_successor_has_already_ended_still_ends_replaced(
    cluster: Cluster, label: str
) -> None:
    """The newer execution ends before the older one's next renewal (see above)."""
    successor_ends_first(cluster.task(PREFIX + "rebuild_long"), cluster.probe, label)
    cluster.wait_free(f"singletask:{PREFIX}rebuild_long:{label}")


def test_a_body_past_lock_max_hold_still_learns_its_preemption_in_time(
    cluster: Cluster, label: str
) -> None:
    """lock_max_hold stops the renewal, not the watch for a preemption: a body preempted after
    its renewal stopped learns it within a third of its lease, as ``LockPreempted`` naming the
    newer execution, not as a plain ``LockLost`` when its last lease runs out."""
    task = cluster.task(PREFIX + "rebuild_max_hold")
    older = task.delay(label, 1)
    first = cluster.probe.wait_for(label, "start", timeout=BOUND)[0]
    # Sent just after the renewal stopped: renewed at a third and two thirds of its lease, the
    # older one's round at one lease found it held past MAX_HOLD; its last lease runs on until
    # one lease after its renewal at two thirds (10 s after it acquired)
    assert MAX_HOLD_TTL * 2 / 3 < MAX_HOLD < MAX_HOLD_TTL
    time.sleep(max(0.0, first["t"] + MAX_HOLD_TTL + 0.4 - time.time()))

    # When a newer execution of the key is sent
    newer = task.delay(label, 2)

    # Then it runs at once
    starts = cluster.probe.wait_for(label, "start", count=2, timeout=BOUND)
    second = next(s for s in starts if s["task_id"] == newer.id)
    # And the older one learns that it was preempted, and by whom, within one renewal interval
    # (and a generous margin for a loaded machine: the kind is what tells the old behaviour)
    learned = cluster.probe.wait_for(label, "learned", timeout=BOUND)[0]
    assert (learned["task_id"], learned["kind"]) == (older.id, "LockPreempted"), learned
    assert learned["successor"] == newer.id
    assert learned["t"] - second["t"] < MAX_HOLD_TTL / 3 + 1.5 * SLACK
    # And it ends as replaced, naming the newer one
    value = older.get(timeout=BOUND)
    assert isinstance(value, Skipped), value
    assert (value.reason, value.holder) == ("replaced", newer.id)
    cluster.probe.client.rpush(gate_key(label), "open")
    assert newer.get(timeout=BOUND) == 2


def test_with_every_slot_full_the_oldest_holder_is_preempted(cluster: Cluster, label: str) -> None:
    """lock_limit = 2: the test process holds one slot first (the oldest, as another host
    would), a worker execution the other; a newer execution takes the oldest's slot, and the
    worker's execution keeps running."""
    key = str(cluster.task(PREFIX + "rebuild_slots").lock_key_for((label, 0)))
    locks = RedisBackend(client=cluster.locks)
    elsewhere = locks.acquire_slot(key, 2, "elsewhere-token", 30.0, meta={"task_id": "elsewhere"})
    assert elsewhere.acquired
    rebuild = cluster.task(PREFIX + "rebuild_slots")
    running = rebuild.delay(label, 1)
    cluster.probe.wait_for(label, "start", timeout=BOUND)

    # When a newer execution of the key is sent
    newer = rebuild.delay(label, 2)

    # Then it takes the oldest holder's slot (the one held elsewhere), and the running one stays
    starts = cluster.probe.wait_for(label, "start", count=2, timeout=BOUND)
    assert {s["task_id"] for s in starts} == {running.id, newer.id}
    assert locks.extend(key, "elsewhere-token", 30.0) is False
    holders = {locks.holder(slot).task_id for slot in slot_keys(key, 2)}  # type: ignore[union-attr]
    assert holders == {running.id, newer.id}
    time.sleep(TTL)  # more than a renewal interval: nobody preempted the running one
    assert cluster.probe.events(label, "preempted") == []
    cluster.probe.client.rpush(gate_key(label), "open", "open")
    assert {running.get(timeout=BOUND), newer.get(timeout=BOUND)} == {1, 2}


def test_terminate_stops_a_body_that_never_checks_on_prefork(cluster: Cluster, label: str) -> None:
    """lock_replace_terminate: the preempted body does not call check(); the newer execution
    revokes it with terminate=True, prefork's SIGTERM ends it at once, its state is REVOKED."""
    rebuild = cluster.task(PREFIX + "rebuild_terminate")
    older = rebuild.delay(label, 1, check=False)
    cluster.probe.wait_for(label, "start", timeout=BOUND)

    newer = rebuild.delay(label, 2, check=False)

    ends = cluster.probe.wait_for(label, "end", timeout=BOUND)
    assert ends[0]["task_id"] == older.id
    deadline = time.monotonic() + BOUND
    while older.state != "REVOKED" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert older.state == "REVOKED"
    assert cluster.probe.client.hget(resource_key(label), "value") == "2"
    cluster.probe.client.rpush(gate_key(label), "open")
    assert newer.get(timeout=BOUND) == 2


@pytest.fixture(scope="module")
def threads(
    redis_base_url: str, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Cluster]:
    """A ``celery worker -P threads -c 4`` on the Redis broker, locks in Redis."""
    with start_cluster(
        "redis", redis_base_url, tmp_path_factory, request, pool="threads", concurrency=4
    ) as cluster:
        yield cluster


@pytest.mark.pools
def test_a_newer_execution_preempts_the_running_one_on_threads(threads: Cluster) -> None:
    """Both executions are threads of one process, renewed by one renewer: the preempted one
    learns it all the same, and ends replaced."""
    label = threads.label()
    try:
        preempt_and_check(threads, label)
    finally:
        threads.probe.client.rpush(gate_key(label), *["open"] * 10)


@pytest.mark.pools
def test_terminate_sends_no_revoke_to_a_body_on_threads(threads: Cluster) -> None:
    """lock_replace_terminate where the pool cannot terminate a task (threads): the preempted
    send is not revoked, so its caller never sees REVOKED while its body still runs; the body
    stops at its next check of its lock, and the caller gets the Skipped "replaced" naming the
    newer send, which runs."""
    label, probe = threads.label(), threads.probe
    rebuild = threads.task(PREFIX + "rebuild_terminate_long")
    try:
        older = rebuild.delay(label, 1)
        first = probe.wait_for(label, "start", timeout=BOUND)[0]
        # Sent just after the older one's first renewal: its body runs on for most of an
        # interval (2 s) before it learns, the time a revoke would have shown as REVOKED
        time.sleep(max(0.0, first["t"] + LONG_TTL / 3 + 0.3 - time.time()))

        # When a newer execution of the key is sent
        newer = rebuild.delay(label, 2)

        # Then the older one's caller gets a Skipped "replaced" naming it (not TaskRevokedError)
        value = older.get(timeout=BOUND)
        assert isinstance(value, Skipped), value
        assert (value.reason, value.holder) == ("replaced", newer.id)
        assert older.state == "SUCCESS"
        # And its body stopped itself, at a check of its lock that named the newer one
        preempted = probe.wait_for(label, "preempted", timeout=BOUND)[0]
        assert (preempted["task_id"], preempted["successor"]) == (older.id, newer.id)
        # And the newer one ran, and ends with its value when let go
        starts = probe.wait_for(label, "start", count=2, timeout=BOUND)
        assert newer.id in {s["task_id"] for s in starts}
        probe.client.rpush(gate_key(label), "open")
        assert newer.get(timeout=BOUND) == 2
    finally:
        probe.client.rpush(gate_key(label), *["open"] * 10)


def coalesce_latest(cluster: Cluster, label: str) -> None:
    """Given a coalescing run in progress, when a burst of calls arrives, then every call is
    sent, only the latest one runs after the run (with its arguments), and every earlier one
    resolves as a Skipped "superseded" naming a later call."""
    task = cluster.task(PREFIX + "coalesced_latest")
    first = task.delay(label, "first", hold=True)
    cluster.probe.wait_for(label, "start", timeout=BOUND)

    # When a burst of calls, each with its own tag, arrives during the run
    burst = [task.delay(label, f"burst-{index}") for index in range(8)]

    # Then each is a message of its own
    ids = [result.id for result in burst]
    assert len(set(ids)) == len(ids)
    assert first.id not in ids

    # When the run ends
    cluster.probe.client.rpush(gate_key(label), "open")

    # Then the latest call runs after it, with its own arguments, and never alongside it
    assert first.get(timeout=BOUND) == "first"
    assert burst[-1].get(timeout=BOUND) == "burst-7"
    assert [s["tag"] for s in cluster.probe.starts(label)] == ["first", "burst-7"]
    assert cluster.probe.max_overlap(label) == 1
    # And every earlier call resolves, naming a later call that replaced its arguments
    for index, result in enumerate(burst[:-1]):
        value = result.get(timeout=BOUND)
        assert isinstance(value, Skipped), value
        assert value.reason == "superseded"
        assert value.holder in ids[index + 1 :]
    cluster.wait_free(f"singletask:{PREFIX}coalesced_latest:{label}")


def test_coalesce_latest_runs_the_latest_arguments_on_prefork(cluster: Cluster, label: str) -> None:
    coalesce_latest(cluster, label)


@pytest.mark.pools
def test_coalesce_latest_runs_the_latest_arguments_on_threads(threads: Cluster) -> None:
    label = threads.label()
    try:
        coalesce_latest(threads, label)
    finally:
        threads.probe.client.rpush(gate_key(label), *["open"] * 10)


def test_a_storm_of_replace_sends_never_fails(cluster: Cluster, label: str) -> None:
    """Issue 37: 40 replace sends of one key at once, seven bursts. Every send runs, or ends as
    a ``Skipped`` "replaced" naming another send of the burst (preempted by a newer one, or
    superseded: a later send held the key): none ends FAILURE with TaskLocked."""
    storm = cluster.task(PREFIX + "storm")
    for burst in range(7):
        # When 40 sends of one key are sent at once
        results = [storm.delay(f"{label}-{burst}", n) for n in range(40)]
        ids = {r.id for r in results}

        # Then each one ran or ended replaced, naming another send of the burst
        for n, result in enumerate(results):
            value = result.get(timeout=BOUND, propagate=False)
            assert result.state == "SUCCESS", (burst, n, result.state, value)
            if isinstance(value, Skipped):
                assert value.reason == "replaced", (burst, n, value)
                assert value.holder in ids - {result.id}, (burst, n, value)
            else:
                assert value == n


def test_an_earlier_send_that_starts_later_is_superseded_not_preempting(
    cluster: Cluster, label: str
) -> None:
    """The latest is the send made last, not the execution started last: a send made before the
    running one (its countdown held it back) ends replaced by it without running, and the
    running body is left alone."""
    rebuild = cluster.task(PREFIX + "rebuild")
    # Given a first send held back by its countdown, and a second send made after it, running
    earlier = rebuild.apply_async((label, 1), countdown=2)
    later = rebuild.delay(label, 2)
    cluster.probe.wait_for(label, "start", timeout=BOUND)

    # When the earlier send's countdown ends while the later one still runs
    value = earlier.get(timeout=BOUND)

    # Then the earlier send ends replaced, naming the later one, without running its body
    assert isinstance(value, Skipped)
    assert (value.reason, value.holder) == ("replaced", later.id)
    assert [s["version"] for s in cluster.probe.events(label, "start")] == [2]
    # And the later one was never preempted: it finishes with its own value
    cluster.probe.client.rpush(gate_key(label), "open")
    assert later.get(timeout=BOUND) == 2
    assert cluster.probe.events(label, "preempted") == []
