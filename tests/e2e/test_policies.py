"""Lock policies and lock keys on a real prefork worker, once per broker.

A holder blocks on a gate (see tasks_policies.py) until the test opens it, so every duplicate
below meets a lock that is certainly held; nothing depends on guessed sleep times.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import group

from singletask import Skipped, TaskLocked

from .conftest import Cluster
from .tasks_policies import TTL, gate_key

pytestmark = pytest.mark.e2e

PREFIX = "singletask:e2e.policies."


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
        time.sleep(0.05)


def conflicts(cluster: Cluster, label: str, task_id: str | None = None) -> list[dict[str, Any]]:
    """The lock conflicts recorded by the worker for ``label`` (optionally of one task id)."""
    return [
        event
        for event in cluster.probe.events(label, "conflict")
        if task_id is None or event["task_id"] == task_id
    ]


def log_lines(cluster: Cluster, *needles: str, timeout: float = 10.0) -> list[str]:
    """Worker log lines containing every one of ``needles`` (waits for at least one)."""

    def matching() -> list[str]:
        text = cluster.worker.log.read_text(errors="replace")
        return [line for line in text.splitlines() if all(n in line for n in needles)]

    try:
        return wait_until(matching, f"a worker log line with {needles}", timeout)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nworker log:\n{cluster.worker.tail()}") from None


# -- skip ----------------------------------------------------------------------------------


def test_skip_returns_a_skipped_value_at_once_unlike_a_body_returning_none(
    cluster: Cluster, label: str
) -> None:
    # Given a global singleton (skip policy, body returns None) held by one execution
    task = cluster.task("e2e.policies.skip_none")
    key = PREFIX + "skip_none"
    holder = task.delay(label, hold=True)
    cluster.probe.wait_for(label, "start")

    # When a duplicate runs on the other pool process
    duplicate = task.delay(label)
    skipped = duplicate.get(timeout=10)

    # Then it returned while the holder still runs, with a Skipped naming key, holder and lease
    assert not holder.ready()
    assert isinstance(skipped, Skipped)
    assert skipped.key == key
    assert skipped.holder == holder.id
    assert skipped.ttl is not None
    assert 0 < skipped.ttl <= TTL
    assert duplicate.state == "SUCCESS"
    # And the worker logged it at INFO, naming the key and the holder
    log_lines(cluster, "INFO/", f"[{duplicate.id}] skipped", repr(key), holder.id)

    # When the holder finishes
    open_gate(cluster, label)

    # Then its own value, None, is told apart from the skip
    assert holder.get(timeout=10) is None
    assert holder.state == "SUCCESS"
    assert [start["task_id"] for start in cluster.probe.starts(label)] == [holder.id]
    cluster.wait_free(key)


def test_a_duplicate_sent_with_send_task_is_skipped_at_execution_time(
    cluster: Cluster, label: str
) -> None:
    # Given a global singleton held by one execution
    task = cluster.task("e2e.policies.skip_none")
    holder = task.delay(label, hold=True)
    cluster.probe.wait_for(label, "start")

    # When a duplicate is published by name, without the task class (no apply_async of ours)
    duplicate = cluster.app.send_task("e2e.policies.skip_none", args=[label])

    # Then the worker still finds the lock held and skips it
    skipped = duplicate.get(timeout=10)
    assert isinstance(skipped, Skipped)
    assert skipped.holder == holder.id
    assert skipped.key == PREFIX + "skip_none"
    open_gate(cluster, label)
    assert holder.get(timeout=10) is None
    assert cluster.probe.max_overlap(label) == 1
    cluster.wait_free(PREFIX + "skip_none")


# -- retry ---------------------------------------------------------------------------------


def test_retry_waits_for_the_holder_then_runs_without_spending_max_retries(
    cluster: Cluster, label: str
) -> None:
    # Given a retry-policy task that Celery itself may never retry (max_retries=0), held
    task = cluster.task("e2e.policies.retry_patient")
    key = PREFIX + "retry_patient"
    holder = task.delay(label, hold=True)
    cluster.probe.wait_for(label, "start")

    # When a duplicate arrives and has lock-retried several times
    duplicate = task.delay(label)
    wait_until(lambda: len(conflicts(cluster, label, duplicate.id)) >= 3, "three lock retries")

    # And the holder then finishes
    open_gate(cluster, label)

    # Then the duplicate runs after it, once, with request.retries still 0
    assert holder.get(timeout=10) == {"retries": 0}
    assert duplicate.get(timeout=15) == {"retries": 0}
    events = cluster.probe.events(label)
    runs = [(e["event"], e["task_id"]) for e in events if e["event"] in ("start", "end")]
    assert runs == [
        ("start", holder.id),
        ("end", holder.id),
        ("start", duplicate.id),
        ("end", duplicate.id),
    ]
    assert cluster.probe.max_overlap(label) == 1
    # And every conflict was a lock retry against the holder
    seen = conflicts(cluster, label, duplicate.id)
    assert {(e["action"], e["holder"], e["key"]) for e in seen} == {("retry", holder.id, key)}
    log_lines(cluster, f"[{duplicate.id}] retries in", "(lock retry 3 of 30)", repr(key))
    cluster.wait_free(key)


def test_a_spent_lock_retry_budget_fails_with_task_locked(cluster: Cluster, label: str) -> None:
    # Given a retry-policy task with lock_retry_max=2, held for longer than two lock retries
    task = cluster.task("e2e.policies.retry_short")
    key = PREFIX + "retry_short"
    holder = task.delay(label, hold=True)
    cluster.probe.wait_for(label, "start")

    # When a duplicate arrives
    duplicate = task.delay(label)

    # Then it lock-retries twice, then fails with TaskLocked naming key, holder and lease
    with pytest.raises(TaskLocked) as raised:
        duplicate.get(timeout=15)
    assert raised.value.key == key
    assert raised.value.holder == holder.id
    assert raised.value.ttl is not None
    assert 0 < raised.value.ttl <= TTL
    assert duplicate.state == "FAILURE"
    actions = [e["action"] for e in conflicts(cluster, label, duplicate.id)]
    assert actions == ["retry", "retry", "raise"]
    log_lines(
        cluster,
        "WARNING",
        f"[{duplicate.id}] raises TaskLocked",
        repr(key),
        holder.id,
        "lock retries spent: 2 of 2",
    )
    # And the holder, untouched, finishes and frees the lock
    assert not holder.ready()
    open_gate(cluster, label)
    assert holder.get(timeout=10) == "done"
    assert [start["task_id"] for start in cluster.probe.starts(label)] == [holder.id]
    cluster.wait_free(key)


def test_lock_retries_leave_the_body_its_own_retry_budget(cluster: Cluster, label: str) -> None:
    # Given a retry-policy task with max_retries=1 whose body retries once, and a holder
    task = cluster.task("e2e.policies.retry_body")
    key = PREFIX + "retry_body"
    holder = task.delay(label, hold=True)
    cluster.probe.wait_for(label, "start")

    # When a duplicate lock-retries more often than max_retries allows, then gets the lock
    duplicate = task.delay(label, body_retry=True)
    wait_until(lambda: len(conflicts(cluster, label, duplicate.id)) >= 2, "two lock retries")
    open_gate(cluster, label)

    # Then its body's own self.retry() still works: it ran twice, the second time as retry 1
    assert holder.get(timeout=10) == {"retries": 0}
    assert duplicate.get(timeout=15) == {"retries": 1}
    starts = [s for s in cluster.probe.starts(label) if s["task_id"] == duplicate.id]
    assert [s["retries"] for s in starts] == [0, 1]
    assert cluster.probe.max_overlap(label) == 1
    cluster.wait_free(key)


# -- raise ---------------------------------------------------------------------------------


def test_raise_reraises_task_locked_in_the_caller_and_stores_a_failure(
    cluster: Cluster, label: str
) -> None:
    # Given a raise-policy task held by one execution
    task = cluster.task("e2e.policies.raise_locked")
    key = PREFIX + "raise_locked"
    holder = task.delay(label, hold=True)
    cluster.probe.wait_for(label, "start")

    # When a duplicate runs, Then .get() re-raises TaskLocked with its fields (JSON results)
    assert cluster.app.conf.result_serializer == "json"
    with pytest.raises(TaskLocked) as raised:
        task.delay(label).get(timeout=10)
    assert raised.value.key == key
    assert raised.value.holder == holder.id
    assert raised.value.ttl is not None
    assert 0 < raised.value.ttl <= TTL

    # When another duplicate is read without propagation, Then its state is FAILURE
    second = task.delay(label)
    error = second.get(timeout=10, propagate=False)
    assert second.state == "FAILURE"
    assert isinstance(error, TaskLocked)
    assert error.holder == holder.id

    # And the failed duplicates left the holder's lock alone
    assert cluster.held_by(key) == holder.id
    open_gate(cluster, label)
    assert holder.get(timeout=10) == "done"
    assert [start["task_id"] for start in cluster.probe.starts(label)] == [holder.id]
    cluster.wait_free(key)


# -- per-argument keys ---------------------------------------------------------------------


def test_different_customers_run_in_parallel(cluster: Cluster, label: str) -> None:
    # Given sync_customer, locked per customer_id
    task = cluster.task("e2e.policies.sync_customer")

    # When customers 7 and 8 are synced at the same time
    first = task.delay(7, label=label, hold=True)
    second = task.delay(8, label=label, hold=True)

    # Then both bodies run at once, each under its own lock
    cluster.probe.wait_for(label, "start", count=2)
    assert cluster.probe.max_overlap(label) == 2
    keys = {task.lock_key_for((7,)), task.lock_key_for((8,))}
    assert len(keys) == 2
    assert set(cluster.lock_keys(PREFIX + "sync_customer:*")) == keys
    open_gate(cluster, label, times=2)
    assert first.get(timeout=10) == "synced 7"
    assert second.get(timeout=10) == "synced 8"
    assert cluster.probe.max_overlap(f"{label}:7") == 1
    assert cluster.probe.max_overlap(f"{label}:8") == 1
    for key in keys:
        cluster.wait_free(key)


def test_the_same_customer_is_locked_however_the_call_is_spelled(
    cluster: Cluster, label: str
) -> None:
    # Given sync_customer(7) running
    task = cluster.task("e2e.policies.sync_customer")
    holder = task.delay(7, label=label, hold=True)
    cluster.probe.wait_for(label, "start")
    key = task.lock_key_for((7,))
    assert re.fullmatch(re.escape(PREFIX) + r"sync_customer:[0-9a-f]{64}", key)
    assert cluster.lock_keys(PREFIX + "sync_customer:*") == [key]

    # When customer 7 is requested by keyword, with the default spelled out, and with full=True
    duplicates = [
        task.delay(customer_id=7, label=label),
        task.delay(7, False, label=label),
        task.delay(7, full=True, label=label),
        cluster.app.send_task("e2e.policies.sync_customer", args=[7], kwargs={"label": label}),
    ]

    # Then every one is skipped on the same key, held by the first
    for duplicate in duplicates:
        skipped = duplicate.get(timeout=10)
        assert isinstance(skipped, Skipped), skipped
        assert (skipped.key, skipped.holder) == (key, holder.id)
    open_gate(cluster, label)
    assert holder.get(timeout=10) == "synced 7"
    assert [start["task_id"] for start in cluster.probe.starts(f"{label}:7")] == [holder.id]
    cluster.wait_free(key)


def test_a_key_on_every_argument_ignores_sequence_type_and_dict_order(
    cluster: Cluster, label: str
) -> None:
    # Given merge (lock_args="*") running with a tuple and a dict
    task = cluster.task("e2e.policies.merge")
    holder = task.delay(label, (1, 2), {"a": 1, "b": 2})
    cluster.probe.wait_for(label, "start")
    key = task.lock_key_for((label, (1, 2), {"a": 1, "b": 2}))

    # When it is called with a list, the dict's keys in the other order, and by keyword
    duplicates = [
        task.delay(label, [1, 2], {"b": 2, "a": 1}),
        task.delay(options={"b": 2, "a": 1}, items=[1, 2], label=label),
        cluster.app.send_task("e2e.policies.merge", args=[label, [1, 2], {"b": 2, "a": 1}]),
    ]

    # Then all collide with the holder
    for duplicate in duplicates:
        skipped = duplicate.get(timeout=10)
        assert isinstance(skipped, Skipped), skipped
        assert (skipped.key, skipped.holder) == (key, holder.id)
    # And other items are another key: that call runs beside the holder
    other = task.delay(label, [2, 1], {"a": 1, "b": 2})
    cluster.probe.wait_for(label, "start", count=2)
    assert set(cluster.lock_keys(PREFIX + "merge:*")) == {
        key,
        task.lock_key_for((label, [2, 1], {"a": 1, "b": 2})),
    }
    open_gate(cluster, label, times=2)
    assert holder.get(timeout=10) == "merged"
    assert other.get(timeout=10) == "merged"
    assert cluster.lock_keys(PREFIX + "merge:*") == []


def test_a_class_based_task_with_a_lock_key_template_raises_on_its_feed(
    cluster: Cluster, label: str
) -> None:
    # Given ImportFeed (lock_key="feed:{url}", policy raise) importing one feed
    name = "e2e.policies.import_feed"
    url = f"https://example.com/{label}/rss.xml"
    holder = cluster.app.send_task(name, kwargs={"url": url, "label": label, "hold": True})
    cluster.probe.wait_for(label, "start")
    key = f"{PREFIX}import_feed:feed:{url}"
    assert cluster.lock_keys(f"{PREFIX}import_feed:*") == [key]

    # When the same feed is imported again, Then TaskLocked names the templated key
    with pytest.raises(TaskLocked) as raised:
        cluster.app.send_task(name, args=[url, label]).get(timeout=10)
    assert (raised.value.key, raised.value.holder) == (key, holder.id)

    # And another feed is not locked by it
    other_url = f"https://example.org/{label}/atom.xml"
    assert cluster.app.send_task(name, args=[other_url, label]).get(timeout=10) == (
        f"imported {other_url}"
    )
    assert not holder.ready()
    open_gate(cluster, label)
    assert holder.get(timeout=10) == f"imported {url}"
    cluster.wait_free(key)


# -- races ---------------------------------------------------------------------------------

DUPLICATES = 60
BY_NAME = 10  # of which published with send_task


def pool_pids(cluster: Cluster, label: str) -> set[int]:
    """The worker processes that started a body or decided a conflict under ``label``."""
    return {e["pid"] for e in cluster.probe.events(label) if e["event"] in ("start", "conflict")}


def test_sixty_simultaneous_duplicates_with_skip_never_overlap(
    cluster: Cluster, label: str
) -> None:
    # Given a skip-policy singleton with a short body, and both pool processes up
    name = "e2e.policies.race_skip"
    task = cluster.task(name)
    wait_until(lambda: len(cluster.worker.children()) == 2, "two pool processes")

    # When 60 duplicates are published at once, some as a group, some by name
    batch = group(task.s(label, 0.3) for _ in range(DUPLICATES - BY_NAME)).apply_async()
    by_name = [cluster.app.send_task(name, args=[label, 0.3]) for _ in range(BY_NAME)]
    values = batch.get(timeout=30) + [result.get(timeout=30) for result in by_name]

    # Then no two bodies ever ran at once, on either pool process
    assert cluster.probe.max_overlap(label) == 1
    assert pool_pids(cluster, label) <= set(cluster.worker.children())
    assert len(pool_pids(cluster, label)) == 2
    # And every duplicate resolved: it ran (returning its id) or was skipped by one that ran
    assert len(values) == DUPLICATES
    ran = [value for value in values if not isinstance(value, Skipped)]
    skipped = [value for value in values if isinstance(value, Skipped)]
    assert ran
    assert skipped
    assert {start["task_id"] for start in cluster.probe.starts(label)} == set(ran)
    assert {s.holder for s in skipped} <= set(ran)
    assert {s.key for s in skipped} == {PREFIX + "race_skip"}
    assert len(conflicts(cluster, label)) == len(skipped)
    # And no lock is left behind
    cluster.wait_free(PREFIX + "race_skip")


def test_sixty_simultaneous_duplicates_with_retry_all_run_one_at_a_time(
    cluster: Cluster, label: str
) -> None:
    # Given a retry-policy singleton with a short body and a short lock retry countdown
    name = "e2e.policies.race_retry"
    task = cluster.task(name)
    wait_until(lambda: len(cluster.worker.children()) == 2, "two pool processes")

    # When 60 duplicates are published at once, some as a group, some by name
    split = DUPLICATES - BY_NAME
    batch = group(task.s(label, index, 0.05) for index in range(split)).apply_async()
    by_name = [
        cluster.app.send_task(name, args=[label, index, 0.05]) for index in range(split, DUPLICATES)
    ]
    values = batch.get(timeout=45) + [result.get(timeout=45) for result in by_name]

    # Then every one of them ran, once, and never two at the same time
    assert sorted(values) == list(range(DUPLICATES))
    starts = cluster.probe.starts(label)
    assert len(starts) == DUPLICATES
    assert len({start["task_id"] for start in starts}) == DUPLICATES
    assert cluster.probe.max_overlap(label) == 1
    assert len(pool_pids(cluster, label)) == 2
    # And every conflict was a lock retry (no budget ran out)
    assert {event["action"] for event in conflicts(cluster, label)} <= {"retry"}
    cluster.wait_free(PREFIX + "race_retry")
