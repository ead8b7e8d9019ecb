"""Lock scopes "queue" and "coalesce" on a real prefork worker, once per broker.

With ``lock_scope="queue"`` the producer reserves the key before it publishes, and a duplicate
gets the holder's ``AsyncResult`` (or ``TaskLocked`` with the "raise" policy); with "coalesce" a
run in progress collects later submissions into one follow-up. What the producer decided is
seen through the ``lock_conflict`` signal in this process, what the worker did through the
probe, the worker log and the lock store.

The test-side helpers at the top are shared with test_beat.py and test_canvas.py.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery.result import AsyncResult
from kombu.exceptions import OperationalError

from singletask import Skipped, TaskLocked
from singletask.signals import lock_conflict

from ..backends.redis_lock import lock_token
from ..servers import free_port
from .app import LOCK_OPTIONS_ENV, make_app
from .conftest import ON_REDIS_BROKER, Cluster
from .tasks_scopes import QUEUE_TTL, gate_key

pytestmark = pytest.mark.e2e

NAME = "e2e.scopes."

# -- helpers (also used by test_beat.py and test_canvas.py) ---------------------------------


@pytest.fixture
def label(cluster: Cluster) -> Iterator[str]:
    """A probe label of this test only; its gate is opened at teardown, whatever happened."""
    name = cluster.label()
    yield name
    cluster.probe.client.rpush(gate_key(name), *["open"] * 10)


def open_gate(cluster: Cluster, label: str, times: int = 1) -> None:
    """Let ``times`` bodies held on the gate of ``label`` finish."""
    cluster.probe.client.rpush(gate_key(label), *["open"] * times)


def wait_until(condition: Callable[[], Any], what: str, timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def key_of(cluster: Cluster, name: str, label: str, *args: Any) -> str:
    """The lock key of task ``name`` (without the prefix) called with ``label, *args``."""
    return str(cluster.task(NAME + name).lock_key_for((label, *args)))


def worker_conflicts(cluster: Cluster, label: str) -> list[dict[str, Any]]:
    """The lock conflicts the worker decided for ``label``."""
    return cluster.probe.events(label, "conflict")


def runs(cluster: Cluster, label: str) -> list[tuple[str, str]]:
    """``(event, task id)`` of every body start and end under ``label``, in order."""
    return [
        (event["event"], event["task_id"])
        for event in cluster.probe.events(label)
        if event["event"] in ("start", "end")
    ]


@dataclass
class ProducerConflicts:
    """The conflicts decided in this process (by ``apply_async``) for one lock key."""

    key: str
    seen: list[dict[str, Any]] = field(default_factory=list)
    _mutex: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, sender: Any = None, **kwargs: Any) -> None:
        if kwargs.get("key") == self.key:
            with self._mutex:
                self.seen.append(kwargs)

    def actions(self) -> list[str]:
        with self._mutex:
            return [event["action"] for event in self.seen]


@contextlib.contextmanager
def producer_conflicts(key: str) -> Iterator[ProducerConflicts]:
    listener = ProducerConflicts(key)
    lock_conflict.connect(listener, weak=False)
    try:
        yield listener
    finally:
        lock_conflict.disconnect(listener)


@contextlib.contextmanager
def without_broker(cluster: Cluster, name: str) -> Iterator[Any]:
    """Task ``name`` of a producer whose broker is down (a closed port, no retries: a publish
    raises OperationalError at once, well within a debounce wait), sharing the cluster's real
    lock store."""
    env = cluster.worker.env
    dead = make_app(
        broker=f"redis://127.0.0.1:{free_port()}/0",
        results=env["SINGLETASK_E2E_RESULTS"],
        locks=env["SINGLETASK_E2E_LOCKS"],
        queue=env["SINGLETASK_E2E_QUEUE"],
        lock_options=json.loads(env.get(LOCK_OPTIONS_ENV) or "{}"),
    )
    dead.conf.update(
        broker_connection_timeout=0.5,
        broker_connection_retry=False,
        broker_connection_max_retries=1,
        task_publish_retry=False,
        # Without it the transport waits 2 s before it gives up on the closed port.
        broker_transport_options={**dead.conf.broker_transport_options, "max_retries": 0},
    )
    task = dead.tasks[name]
    try:
        yield task
    finally:
        task.lock_backend.close()
        dead.close()


def log_offset(cluster: Cluster) -> int:
    return cluster.worker.log.stat().st_size


def log_since(cluster: Cluster, offset: int) -> list[str]:
    with cluster.worker.log.open("rb") as log:
        log.seek(offset)
        return log.read().decode(errors="replace").splitlines()


def received(cluster: Cluster, offset: int, name: str) -> list[str]:
    """The task ids of the worker's "received" log lines for task ``name`` since ``offset``."""
    pattern = re.compile(re.escape(name) + r"\[([0-9a-f-]+)\] received")
    return [m.group(1) for line in log_since(cluster, offset) if (m := pattern.search(line))]


def submit_at_once(count: int, submit: Callable[[], Any]) -> list[Any]:
    """Call ``submit`` from ``count`` threads released together; return each outcome in order
    (the return value, or the exception raised)."""
    barrier = threading.Barrier(count)
    outcomes: list[Any] = [None] * count

    def run(index: int) -> None:
        barrier.wait(timeout=30)
        try:
            outcomes[index] = submit()
        except Exception as exc:
            outcomes[index] = exc

    threads = [threading.Thread(target=run, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return outcomes


# -- lock_scope "queue": the producer race ---------------------------------------------------

PRODUCERS = 40


def test_forty_producers_at_once_publish_one_message_and_share_its_result(
    cluster: Cluster, label: str
) -> None:
    # Given a queue-scope task, and a log position to count the worker's received messages from
    task = cluster.task(NAME + "queued")
    key = key_of(cluster, "queued", label)
    offset = log_offset(cluster)

    # When 40 threads send the same call at the same instant
    with producer_conflicts(key) as decided:
        results = submit_at_once(PRODUCERS, lambda: task.delay(label, hold=True))

    # Then every caller got an AsyncResult, all for one task id
    assert all(isinstance(result, AsyncResult) for result in results), results
    ids = {result.id for result in results}
    assert len(ids) == 1
    (the_id,) = ids
    # And 39 of them were told at the producer that it was already queued or running
    assert decided.actions() == ["dedupe"] * (PRODUCERS - 1)
    assert {event["holder"] for event in decided.seen} == {the_id}
    # And the worker received exactly one message and ran it once
    cluster.probe.wait_for(label, "start")
    open_gate(cluster, label)
    values = [result.get(timeout=15) for result in results]
    assert values == [{"task_id": the_id, "note": ""}] * PRODUCERS
    assert received(cluster, offset, NAME + "queued") == [the_id]
    assert runs(cluster, label) == [("start", the_id), ("end", the_id)]
    assert worker_conflicts(cluster, label) == []
    cluster.wait_free(key)


def test_forty_producers_at_once_with_raise_get_one_result_and_39_task_locked(
    cluster: Cluster, label: str
) -> None:
    # Given a queue-scope task with the "raise" policy
    task = cluster.task(NAME + "queued_raise")
    key = key_of(cluster, "queued_raise", label)
    offset = log_offset(cluster)

    # When 40 threads send the same call at the same instant
    with producer_conflicts(key) as decided:
        outcomes = submit_at_once(PRODUCERS, lambda: task.delay(label, hold=True))

    # Then one caller got an AsyncResult and 39 got TaskLocked naming it as the holder
    sent = [outcome for outcome in outcomes if isinstance(outcome, AsyncResult)]
    locked = [outcome for outcome in outcomes if isinstance(outcome, TaskLocked)]
    assert len(sent) == 1, outcomes
    assert len(locked) == PRODUCERS - 1, outcomes
    (holder,) = sent
    assert {(error.key, error.holder) for error in locked} == {(key, holder.id)}
    assert decided.actions() == ["raise"] * (PRODUCERS - 1)
    # And only that one message reached the worker and ran
    cluster.probe.wait_for(label, "start")
    open_gate(cluster, label)
    assert holder.get(timeout=15) == holder.id
    assert received(cluster, offset, NAME + "queued_raise") == [holder.id]
    assert runs(cluster, label) == [("start", holder.id), ("end", holder.id)]
    cluster.wait_free(key)


# -- lock_scope "queue": retries, countdown, ETA ---------------------------------------------


def test_the_tasks_own_retry_keeps_its_reservation_and_is_not_deduplicated(
    cluster: Cluster, label: str
) -> None:
    # Given a queue-scope task whose first attempt retries itself with countdown=1
    task = cluster.task(NAME + "queued_retrying")
    key = key_of(cluster, "queued_retrying", label)
    first = task.delay(label)

    # When the first attempt has retried, and the key is reserved for the retry (attempt 1)
    cluster.probe.wait_for(label, "retrying")
    reserved = f"{first.id}:1:-:0:reserved"
    wait_until(lambda: lock_token(cluster.locks, key) == reserved, "the retry's reservation")
    # And a duplicate is sent during the countdown
    with producer_conflicts(key) as decided:
        duplicate = task.delay(label)

    # Then the duplicate is the same task, and nothing new was published
    assert duplicate.id == first.id
    assert decided.actions() == ["dedupe"]
    # And the retry itself was not deduplicated away: it ran, and its result is the final one
    assert first.get(timeout=15) == {"task_id": first.id, "retries": 1}
    assert duplicate.get(timeout=5) == {"task_id": first.id, "retries": 1}
    starts = cluster.probe.starts(label)
    assert [(start["task_id"], start["retries"]) for start in starts] == [
        (first.id, 0),
        (first.id, 1),
    ]
    cluster.wait_free(key)


def test_a_reservation_covers_a_countdown_or_an_eta_and_the_message_runs_once(
    cluster: Cluster, label: str
) -> None:
    # Given two keys of a queue-scope task: one sent with countdown=2, one with an ETA 2 s ahead
    task = cluster.task(NAME + "queued")
    by_eta = f"{label}-eta"
    keys = [key_of(cluster, "queued", label), key_of(cluster, "queued", by_eta)]
    eta = datetime.now(timezone.utc) + timedelta(seconds=2)
    firsts = [
        task.apply_async((label,), {"note": "first"}, countdown=2),
        task.apply_async((by_eta,), {"note": "first"}, eta=eta),
    ]

    # When a duplicate of each is sent while the first still waits for its time
    duplicates = [task.delay(label, note="second"), task.delay(by_eta, note="second")]

    # Then each duplicate is the waiting message, and nothing has run yet
    assert [d.id for d in duplicates] == [f.id for f in firsts]
    assert cluster.probe.starts(label) == []
    assert cluster.probe.starts(by_eta) == []
    # And each reservation lasts the delay plus lock_queue_ttl
    for key in keys:
        assert cluster.locks.pttl(key) > QUEUE_TTL * 1000
    # And when the time comes the message runs once, with the first call's arguments
    for first, duplicate, name in zip(firsts, duplicates, [label, by_eta], strict=True):
        assert first.get(timeout=15) == {"task_id": first.id, "note": "first"}
        assert duplicate.get(timeout=5) == {"task_id": first.id, "note": "first"}
        assert runs(cluster, name) == [("start", first.id), ("end", first.id)]
    for key in keys:
        cluster.wait_free(key)


# -- lock_scope "queue": messages that never run ---------------------------------------------


def test_a_message_that_expires_before_it_starts_frees_its_key(
    cluster: Cluster, label: str
) -> None:
    # Given a queue-scope message that expires (1 s) before its countdown (2 s) is over
    task = cluster.task(NAME + "queued")
    key = key_of(cluster, "queued", label)
    doomed = task.apply_async((label,), countdown=2, expires=1)

    # Then its reservation lasts no longer than the message can run: until it expires
    assert 0 < cluster.locks.pttl(key) <= 1000
    cluster.wait_free(key, timeout=5)

    # When a new submission is sent once the key is free
    fresh = task.delay(label, hold=True, note="fresh")

    # Then it is a new message, and it runs
    assert fresh.id != doomed.id
    cluster.probe.wait_for(label, "start")
    # And when the expired message is discarded, it leaves the new holder's lock alone
    wait_until(lambda: doomed.state == "REVOKED", "the expired message to be discarded")
    assert cluster.held_by(key) == fresh.id
    open_gate(cluster, label)
    assert fresh.get(timeout=15) == {"task_id": fresh.id, "note": "fresh"}
    assert runs(cluster, label) == [("start", fresh.id), ("end", fresh.id)]
    cluster.wait_free(key)


def test_a_message_revoked_before_it_starts_frees_its_key(cluster: Cluster, label: str) -> None:
    # Given a queue-scope message waiting for its countdown, its key reserved for 2 + 30 s
    task = cluster.task(NAME + "queued")
    key = key_of(cluster, "queued", label)
    doomed = task.apply_async((label,), countdown=2)
    assert task.delay(label).id == doomed.id

    # When it is revoked before it starts
    cluster.app.control.revoke(doomed.id)

    # Then the worker releases the reservation when it discards the message, long before the
    # lease would end
    cluster.wait_free(key, timeout=10)
    assert doomed.state == "REVOKED"
    # And a new submission is a new message, and runs
    fresh = task.delay(label, note="fresh")
    assert fresh.id != doomed.id
    assert fresh.get(timeout=15) == {"task_id": fresh.id, "note": "fresh"}
    assert runs(cluster, label) == [("start", fresh.id), ("end", fresh.id)]
    cluster.wait_free(key)


def test_a_message_that_cannot_be_published_frees_its_key_at_once(
    cluster: Cluster, label: str
) -> None:
    # Given a producer whose broker is down, sharing the real lock store
    key = key_of(cluster, "queued", label)
    with without_broker(cluster, NAME + "queued") as task:
        # When it sends a queue-scope task (ignore_result: no result subscription to close)
        with pytest.raises(OperationalError):
            task.apply_async((label,), ignore_result=True)

        # Then the publish error reaches the caller, and the key is not left reserved
        assert not cluster.locks.exists(key)

    # And a submission through the live broker runs
    fresh = cluster.task(NAME + "queued").delay(label, note="fresh")
    assert fresh.get(timeout=15) == {"task_id": fresh.id, "note": "fresh"}
    assert runs(cluster, label) == [("start", fresh.id), ("end", fresh.id)]
    cluster.wait_free(key)


# -- lock_scope "queue": paths that bypass apply_async ---------------------------------------


def test_send_task_bypasses_the_reservation_and_meets_the_execution_lock(
    cluster: Cluster, label: str
) -> None:
    # Given a queue-scope task running
    name = NAME + "queued"
    key = key_of(cluster, "queued", label)
    holder = cluster.task(name).delay(label, hold=True)
    cluster.probe.wait_for(label, "start")

    # When a duplicate is published by name, without the task's apply_async
    duplicate = cluster.app.send_task(name, args=[label])

    # Then it is a message of its own, skipped by the worker at execution time
    assert duplicate.id != holder.id
    skipped = duplicate.get(timeout=10)
    assert isinstance(skipped, Skipped)
    assert (skipped.key, skipped.holder) == (key, holder.id)
    assert [(e["action"], e["task_id"]) for e in worker_conflicts(cluster, label)] == [
        ("skip", duplicate.id)
    ]
    open_gate(cluster, label)
    assert holder.get(timeout=10) == {"task_id": holder.id, "note": ""}
    assert runs(cluster, label) == [("start", holder.id), ("end", holder.id)]
    cluster.wait_free(key)


# -- lock_scope "coalesce" -------------------------------------------------------------------

BURST = 20


def test_a_burst_during_a_run_coalesces_into_one_follow_up_with_the_first_arguments(
    cluster: Cluster, label: str
) -> None:
    # Given a coalescing task running
    task = cluster.task(NAME + "coalesced")
    key = key_of(cluster, "coalesced", label)
    offset = log_offset(cluster)
    first = task.delay(label, "first", hold=True)
    cluster.probe.wait_for(label, "start")

    # When a burst of 20 submissions, each with its own tag, arrives during the run
    with producer_conflicts(key) as decided:
        burst = [task.delay(label, f"burst-{index}") for index in range(BURST)]

    # Then the first of them became the one follow-up, and the others joined it
    follow_up = burst[0]
    assert {result.id for result in burst} == {follow_up.id}
    assert follow_up.id != first.id
    assert decided.actions() == ["follow"] + ["join"] * (BURST - 1)
    # And the follow-up waits while the run goes on
    wait_until(
        lambda: any(e["action"] == "follow" for e in worker_conflicts(cluster, label)),
        "the follow-up to wait for the run",
    )
    assert len(cluster.probe.starts(label)) == 1

    # When the run ends
    open_gate(cluster, label)

    # Then exactly one more run follows it, never overlapping, with the first burst arguments
    assert first.get(timeout=10) == "first"
    assert [result.get(timeout=15) for result in burst] == ["burst-0"] * BURST
    assert runs(cluster, label) == [
        ("start", first.id),
        ("end", first.id),
        ("start", follow_up.id),
        ("end", follow_up.id),
    ]
    assert [start["tag"] for start in cluster.probe.starts(label)] == ["first", "burst-0"]
    assert cluster.probe.max_overlap(label) == 1
    # And only two messages were sent by the 21 callers (the waiting follow-up republishes
    # itself quietly, under its own id)
    assert set(received(cluster, offset, NAME + "coalesced")) == {first.id, follow_up.id}
    cluster.wait_free(key)

    # And a later submission, with the key free and no follow-up pending, runs on its own
    later = task.delay(label, "later")
    assert later.id not in (first.id, follow_up.id)
    assert later.get(timeout=10) == "later"
    assert len(cluster.probe.starts(label)) == 3
    cluster.wait_free(key)


@ON_REDIS_BROKER
def test_a_follow_up_that_cannot_be_published_leaves_the_follow_up_slot_free(
    cluster: Cluster, label: str
) -> None:
    """Issue 29: a coalescing follow-up whose publish fails gives its claim back, so later calls
    during the run do not join a follow-up that was never sent (their results would stay
    PENDING, and nothing would follow the run)."""
    # Given a coalescing task running
    task = cluster.task(NAME + "coalesced")
    key = key_of(cluster, "coalesced", label)
    first = task.delay(label, "first", hold=True)
    cluster.probe.wait_for(label, "start")

    # When a call during the run, the would-be follow-up, comes from a producer whose broker
    # is down
    with without_broker(cluster, NAME + "coalesced") as dead:
        with producer_conflicts(key) as decided, pytest.raises(OperationalError):
            dead.apply_async((label, "lost"), task_id=f"lost-{label}", ignore_result=True)
        assert decided.actions() == ["follow"]

    # Then a later call through the live broker becomes the follow-up itself
    with producer_conflicts(key) as decided:
        later = task.delay(label, "later")
    assert decided.actions() == ["follow"]
    assert later.id != f"lost-{label}"

    # And once the run ends, the follow-up runs with its own arguments
    open_gate(cluster, label)
    assert first.get(timeout=10) == "first"
    assert later.get(timeout=15) == "later"
    assert [start["tag"] for start in cluster.probe.starts(label)] == ["first", "later"]
    assert cluster.probe.max_overlap(label) == 1
    cluster.wait_free(key)


def test_a_revoked_follow_up_frees_the_follow_up_slot(cluster: Cluster, label: str) -> None:
    # Given a coalescing task running, and its follow-up waiting in the worker
    task = cluster.task(NAME + "coalesced")
    key = key_of(cluster, "coalesced", label)
    first = task.delay(label, "first", hold=True)
    cluster.probe.wait_for(label, "start")
    doomed = task.delay(label, "doomed")
    wait_until(
        lambda: any(e["action"] == "follow" for e in worker_conflicts(cluster, label)),
        "the follow-up to wait for the run",
    )

    # When the follow-up is revoked, and the worker has discarded it and freed its slot
    # (Celery logs the discard before it sends task_revoked, which frees the slot)
    offset = log_offset(cluster)
    cluster.app.control.revoke(doomed.id)
    wait_until(
        lambda: any(
            "follow-up slot" in line and "freed" in line and doomed.id in line
            for line in log_since(cluster, offset)
        ),
        "the worker to free the revoked follow-up's slot",
    )
    assert any(
        "Discarding revoked task" in line and doomed.id in line
        for line in log_since(cluster, offset)
    )
    assert doomed.state == "REVOKED"

    # Then a new call during the run becomes the new follow-up, and runs after the run
    with producer_conflicts(key) as decided:
        fresh = task.delay(label, "fresh")
    assert fresh.id != doomed.id
    assert decided.actions() == ["follow"]
    open_gate(cluster, label)
    assert first.get(timeout=10) == "first"
    assert fresh.get(timeout=15) == "fresh"
    assert [start["tag"] for start in cluster.probe.starts(label)] == ["first", "fresh"]
    cluster.wait_free(key)


def test_a_coalescing_duplicate_of_a_queued_message_joins_it(cluster: Cluster, label: str) -> None:
    # Given a coalescing task sent with a countdown (queued, not running)
    task = cluster.task(NAME + "coalesced")
    key = key_of(cluster, "coalesced", label)
    queued = task.apply_async((label, "queued"), countdown=1)

    # When a duplicate is sent before it starts
    with producer_conflicts(key) as decided:
        duplicate = task.delay(label, "duplicate")

    # Then it joins the queued message: same id, nothing new published, one run
    assert duplicate.id == queued.id
    assert decided.actions() == ["dedupe"]
    assert duplicate.get(timeout=15) == "queued"
    assert runs(cluster, label) == [("start", queued.id), ("end", queued.id)]
    cluster.wait_free(key)
