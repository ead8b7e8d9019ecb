"""Flower tells singletask's outcomes apart from runs that did their work.

A real worker started with ``-E`` and a real ``celery flower`` process (with singletask's
formatter in its configuration file) on the session's private Redis broker. For a skipped, a
refused (raise), a lock-retried, a superseded (debounce) and a preempted (``lock_policy
"replace"``) execution:

* the caller's ``AsyncResult`` is what it always was;
* the worker sends ``task-singletask-<outcome>`` with the key and the holder;
* Flower's API shows the outcome's key and holder in ``result`` / ``exception``; its task list
  and task page show the outcome in the state and the key and holder in rows of their own;
* Flower's ``/metrics`` counts the events by type.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from singletask import Skipped, TaskLocked
from tests.visibility.events_world import Visibility, start

pytestmark = pytest.mark.visibility

TIMEOUT = 60


def hold(vis: Visibility, name: str, label: str) -> Any:
    """Start a run of ``name`` on ``label`` that holds its lock until the gate opens."""
    holder = vis.app.tasks[name].delay(label, hold=True)
    vis.recorder.wait(holder.id, "acquired", TIMEOUT)
    return holder


def key_of(vis: Visibility, name: str, label: str) -> str:
    return str(vis.app.tasks[name].lock_key_for((label,)))


def shown_by_flower(vis: Visibility, task_id: str, state: str, key: str, holder: str) -> None:
    """Flower's API, task list and task page tell the outcome, the key and the holder."""
    info = vis.flower_task(task_id, lambda i: i.get("state") == state.split(":")[0])
    told = info["result"] if state.startswith("SUCCESS") else info["exception"]
    assert key in told, info
    assert holder in told, info
    row = vis.listed(task_id)
    assert row["state"] == state, row
    assert (row["lock_key"], row["lock_holder"]) == (key, holder), row
    status, page = vis.get(f"/task/{task_id}")
    assert status == 200
    for text in (state, "Lock outcome", "Lock key", key, "Lock holder", holder):
        assert text in page, f"{text!r} not on Flower's page of {task_id}"


def counted_by_flower(vis: Visibility, outcome: str, task: str, *, worker: bool = True) -> float:
    """``flower_events_total`` for ``task-singletask-<outcome>`` of ``task`` (sent by the worker,
    or with ``worker`` False by any node)."""
    status, text = vis.get("/metrics")
    assert status == 200
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if (
                sample.name == "flower_events_total"
                and labels.get("type") == f"task-singletask-{outcome}"
                and labels.get("task") == task
                and (labels.get("worker") == vis.hostname or not worker)
            ):
                return float(sample.value)
    return 0.0


def test_a_skipped_duplicate_is_told_apart_from_the_run_that_did_the_work(
    vis: Visibility,
) -> None:
    # Given a run of a "skip" task holding its lock
    label = vis.label()
    holder = hold(vis, "events.skip", label)
    key = key_of(vis, "events.skip", label)

    # When a duplicate is sent
    duplicate = vis.app.tasks["events.skip"].delay(label)

    # Then its caller gets the Skipped value as always
    value = duplicate.get(timeout=TIMEOUT)
    assert isinstance(value, Skipped)
    assert value.holder == holder.id
    # And the worker sent the skipped event with the key and the holder
    event = vis.recorder.wait(duplicate.id, "skipped")
    assert event["singletask_key"] == key
    assert event["singletask_holder"] == holder.id
    assert event["name"] == "events.skip"
    assert event["hostname"] == vis.hostname
    # And Flower shows the holder as running, its Terminate button there
    vis.flower_task(holder.id, lambda i: i.get("state") == "SINGLETASK-ACQUIRED")
    assert vis.listed(holder.id)["state"] == "STARTED"
    assert 'id="task-terminate"' in vis.get(f"/task/{holder.id}")[1]
    # And Flower shows it as skipped, the holder as a run that did its work
    shown_by_flower(vis, duplicate.id, "SUCCESS: skipped", key, holder.id)
    vis.open_gate(label)
    assert holder.get(timeout=TIMEOUT) == f"did the work of {label}"
    released = vis.recorder.wait(holder.id, "released")
    assert released["singletask_held"] > 0
    assert released["singletask_key"] == key
    acquired = vis.recorder.of(holder.id, "acquired")[0]
    assert isinstance(acquired["singletask_fence"], int)
    # A "skip" task sent by a producer that cannot tell the worker reports its wait (-E on the
    # command line alone) carries no send time: its wait is null
    assert acquired["singletask_wait"] is None
    vis.flower_task(holder.id, lambda i: i.get("state") == "SUCCESS")
    assert vis.listed(holder.id)["state"] == "SUCCESS"
    # And Flower's /metrics counts the event
    assert counted_by_flower(vis, "skipped", "events.skip") >= 1
    assert counted_by_flower(vis, "acquired", "events.skip") >= 1


def test_a_refused_duplicate_is_told_apart(vis: Visibility) -> None:
    # Given a run of a "raise" task holding its lock
    label = vis.label()
    holder = hold(vis, "events.refuse", label)
    key = key_of(vis, "events.refuse", label)
    try:
        # When a duplicate is sent, its caller gets TaskLocked as always
        duplicate = vis.app.tasks["events.refuse"].delay(label)
        with pytest.raises(TaskLocked):
            duplicate.get(timeout=TIMEOUT)
        # And the raised event names key and holder; Flower shows it as raised
        event = vis.recorder.wait(duplicate.id, "raised")
        assert event["singletask_holder"] == holder.id
        shown_by_flower(vis, duplicate.id, "FAILURE: raised", key, holder.id)
        assert counted_by_flower(vis, "raised", "events.refuse") >= 1
    finally:
        vis.open_gate(label)
    holder.get(timeout=TIMEOUT)


def test_a_lock_retried_duplicate_is_told_apart_while_it_waits_then_runs(
    vis: Visibility,
) -> None:
    # Given a run of a "retry" task holding its lock, and a duplicate sent meanwhile
    label = vis.label()
    holder = hold(vis, "events.retry", label)
    key = key_of(vis, "events.retry", label)
    try:
        sent = time.time()
        duplicate = vis.app.tasks["events.retry"].delay(label)
        # Then while the holder holds, the duplicate is retried, and Flower says so
        vis.recorder.wait(duplicate.id, "retried")
        shown_by_flower(vis, duplicate.id, "RETRY: retried", key, holder.id)
        deadline = time.monotonic() + TIMEOUT
        while len(vis.recorder.of(duplicate.id, "retried")) < 2:  # one lock retry more
            assert time.monotonic() < deadline, "the duplicate was not retried again"
            time.sleep(0.1)
    finally:
        vis.open_gate(label)
    opened = time.time()
    # And once the holder is done, the duplicate runs, waited for since its first send
    assert duplicate.get(timeout=TIMEOUT) == f"did the work of {label}"
    acquired = vis.recorder.wait(duplicate.id, "acquired")
    assert len(vis.recorder.of(duplicate.id, "retried")) >= 2
    assert acquired["singletask_wait"] >= opened - sent - 0.5, acquired
    assert acquired["singletask_wait"] <= time.time() - sent + 0.5, acquired
    vis.flower_task(duplicate.id, lambda i: i.get("state") == "SUCCESS")
    assert vis.listed(duplicate.id)["state"] == "SUCCESS"
    assert counted_by_flower(vis, "retried", "events.retry") >= 2


def test_a_superseded_send_is_told_apart(vis: Visibility) -> None:
    # Given two sends of a debounced task within its window
    label = vis.label()
    key = key_of(vis, "events.debounce", label)
    first = vis.app.tasks["events.debounce"].delay(label)
    latest = vis.app.tasks["events.debounce"].delay(label)

    # Then the first ends superseded, naming the latest, which runs
    value = first.get(timeout=TIMEOUT)
    assert isinstance(value, Skipped)
    assert value.holder == latest.id
    assert latest.get(timeout=TIMEOUT) == f"did the work of {label}"
    event = vis.recorder.wait(first.id, "superseded")
    assert (event["singletask_holder"], event["singletask_reason"]) == (latest.id, "debounced")
    shown_by_flower(vis, first.id, "SUCCESS: superseded", key, latest.id)
    assert counted_by_flower(vis, "superseded", "events.debounce") >= 1


def test_a_preempted_run_is_told_apart(vis: Visibility) -> None:
    # Given a run of a "replace" task holding its lock
    label = vis.label()
    holder = hold(vis, "events.replace", label)
    key = key_of(vis, "events.replace", label)

    # When a newer execution is sent, it takes the lock over at once, with a larger fence
    # (it holds until the preempted run has learned it: a successor that ended already leaves
    # nothing that names the run it replaced)
    newer = hold(vis, "events.replace", label)
    try:
        # Then the preempted run ends replaced, naming the newer one
        value = holder.get(timeout=TIMEOUT)
        assert isinstance(value, Skipped)
        assert value.reason == "replaced"
        assert value.holder == newer.id
    finally:
        vis.open_gate(label)
    assert newer.get(timeout=TIMEOUT) == f"did the work of {label}"
    event = vis.recorder.wait(holder.id, "preempted")
    assert event["singletask_holder"] == newer.id
    assert event["singletask_reason"]
    fences = [vis.recorder.of(t, "acquired")[0]["singletask_fence"] for t in (holder.id, newer.id)]
    assert fences[1] > fences[0]
    shown_by_flower(vis, holder.id, "SUCCESS: preempted", key, newer.id)
    vis.flower_task(newer.id, lambda i: i.get("state") == "SUCCESS")
    assert vis.listed(newer.id)["state"] == "SUCCESS"
    assert counted_by_flower(vis, "preempted", "events.replace") >= 1
    # And the takeover is no lost lease (an alert on lost leases does not fire for it)
    assert counted_by_flower(vis, "lease_lost", "events.replace") == 0


@pytest.fixture(scope="module")
def vis(redis_base_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Visibility]:
    yield from start(redis_base_url, tmp_path_factory)


def test_a_start_refused_by_the_rate_is_told_apart(vis: Visibility) -> None:
    # Given a task with lock_rate "1/m" that has just started for a key
    label = vis.label()
    key = key_of(vis, "events.rated", label)
    first = vis.app.tasks["events.rated"].delay(label)
    assert first.get(timeout=TIMEOUT) == f"did the work of {label}"

    # When it is sent again within the minute, the start is refused
    second = vis.app.tasks["events.rated"].delay(label)
    value = second.get(timeout=TIMEOUT)
    assert isinstance(value, Skipped)
    assert value.reason == "rate"

    # Then the event says rate_limited (with the policy's action), and Flower shows it
    event = vis.recorder.wait(second.id, "rate_limited")
    assert (event["singletask_key"], event["singletask_reason"]) == (key, "skip")
    info = vis.flower_task(second.id, lambda i: i.get("state") == "SUCCESS")
    assert key in info["result"]
    assert vis.listed(second.id)["state"] == "SUCCESS: rate_limited"
    assert counted_by_flower(vis, "rate_limited", "events.rated") >= 1


def test_a_send_that_joins_a_queued_one_is_told_by_the_producer(vis: Visibility) -> None:
    # Given a producer that sends Celery's task-sent events, and a "queue" scope task held
    vis.app.conf.task_send_sent_event = True
    try:
        label = vis.label()
        holder = hold(vis, "events.dedupe", label)
        try:
            # When the same call is made again, it joins the holder: nothing is published
            joined = vis.app.tasks["events.dedupe"].delay(label)
            assert joined.id == holder.id
        finally:
            vis.open_gate(label)
        assert holder.get(timeout=TIMEOUT) == f"did the work of {label}"
    finally:
        vis.app.conf.task_send_sent_event = False

    # Then the producer sent "joined" under the holder's task id
    event = vis.recorder.wait(holder.id, "joined")
    assert event["singletask_holder"] == holder.id
    assert event["singletask_key"] == key_of(vis, "events.dedupe", label)
    assert event["hostname"] != vis.hostname
    deadline = time.monotonic() + TIMEOUT
    while not counted_by_flower(vis, "joined", "events.dedupe", worker=False):
        assert time.monotonic() < deadline, "Flower did not count the joined event"
        time.sleep(0.2)
