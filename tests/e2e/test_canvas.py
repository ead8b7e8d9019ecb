"""A locked singleton as a chain link, a group member or a chord header member, once per broker.

For each policy a holder of the key runs (held on its gate) while a canvas containing the same
key is sent. Canvas parts are never deduplicated when sent, whatever the lock scope: the
execution-time lock decides, and the policy applies to the part like to any duplicate:

* skip: the part returns a ``Skipped`` (SUCCESS); a chain goes on and its next ``.s()`` link
  receives the ``Skipped``; a group / chord header has the ``Skipped`` among its results, and the
  chord callback runs;
* raise: the part fails with ``TaskLocked``; a chain stops there and its errback runs; a chord's
  callback fails with ``ChordError`` instead of hanging;
* retry: the part waits (RETRY) and runs after the holder; the chain goes on, the chord completes.

``record`` is a plain task (no lock) that records what it received; ``on_error`` an errback.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import chain, chord, group
from celery.exceptions import ChordError
from celery.result import AsyncResult

from singletask import Skipped, TaskLocked

from .conftest import Cluster
from .test_scopes import NAME, key_of, label, open_gate, runs, wait_until, worker_conflicts

__all__ = ["label"]  # the fixture, shared with test_scopes.py

pytestmark = pytest.mark.e2e


def hold(cluster: Cluster, name: str, label: str) -> AsyncResult[Any]:
    """Start a holder of ``name``'s key for ``label``, held on its gate until the test opens it."""
    holder = cluster.task(NAME + name).delay(label, hold=True)
    cluster.probe.wait_for(label, "start")
    return holder


def release(cluster: Cluster, name: str, label: str, holder: AsyncResult[Any]) -> None:
    """Let the holder finish, and check that it leaves no lock behind."""
    open_gate(cluster, label)
    holder.get(timeout=15)
    cluster.wait_free(key_of(cluster, name, label))


def recorded(cluster: Cluster, label: str) -> list[str]:
    """The steps ``record`` ran for ``label``, in order."""
    return [event["step"] for event in cluster.probe.events(label, "record")]


def sigs(cluster: Cluster) -> tuple[Any, Any, Any, Any, Any]:
    """The task objects: canvas_skip, canvas_raise, canvas_retry, record, on_error."""
    names = ["canvas_skip", "canvas_raise", "canvas_retry", "record", "on_error"]
    skip, raise_, retry, record, on_error = (cluster.task(NAME + name) for name in names)
    return skip, raise_, retry, record, on_error


# -- skip ----------------------------------------------------------------------------------


def test_skip_a_chain_goes_on_past_a_skipped_link_which_passes_on_the_skipped(
    cluster: Cluster, label: str
) -> None:
    skip, _, _, record, _ = sigs(cluster)
    # Given a holder of the key
    holder = hold(cluster, "canvas_skip", label)

    # When chains with the locked task as head, as middle link, and before a .si() link run
    head = chain(skip.s(label), record.s(label, "after-head")).apply_async()
    middle = chain(
        record.si("start", label, "before-middle"), skip.si(label), record.s(label, "after-middle")
    ).apply_async()
    immutable = chain(skip.s(label), record.si("own", label, "si")).apply_async()

    # Then the locked link is skipped (SUCCESS) and the next .s() link receives the Skipped
    skipped_by_holder = {"skipped_by": holder.id}
    assert head.get(timeout=15) == {"step": "after-head", "got": skipped_by_holder}
    assert middle.get(timeout=15) == {"step": "after-middle", "got": skipped_by_holder}
    assert isinstance(head.parent.result, Skipped)
    assert head.parent.state == "SUCCESS"
    # And a .si() link runs with its own arguments
    assert immutable.get(timeout=15) == {"step": "si", "got": "own"}
    # And only the holder ran a body of the key
    assert runs(cluster, label) == [("start", holder.id)]
    release(cluster, "canvas_skip", label, holder)


def test_skip_a_group_has_the_skipped_members_among_its_results(
    cluster: Cluster, label: str
) -> None:
    skip, _, _, record, _ = sigs(cluster)
    # Given a holder of the key
    holder = hold(cluster, "canvas_skip", label)

    # When a group with two members of the key and another task runs
    values = group(skip.s(label), skip.s(label), record.si(1, label, "member")).apply_async()

    # Then both locked members are skipped, and the other one ran
    first, second, other = values.get(timeout=15)
    assert isinstance(first, Skipped)
    assert isinstance(second, Skipped)
    assert first.holder == second.holder == holder.id
    assert other == {"step": "member", "got": 1}
    release(cluster, "canvas_skip", label, holder)


def test_skip_a_chord_callback_runs_with_the_skipped_header_member(
    cluster: Cluster, label: str
) -> None:
    skip, _, _, record, _ = sigs(cluster)
    # Given a holder of the key
    holder = hold(cluster, "canvas_skip", label)

    # When a chord whose header has a member of the key runs
    result = chord([skip.s(label), record.si(1, label, "member")], record.s(label, "callback"))()

    # Then the callback runs (the chord never hangs) and receives the Skipped among the results
    assert result.get(timeout=15) == {
        "step": "callback",
        "got": [{"skipped_by": holder.id}, {"step": "member", "got": 1}],
    }
    release(cluster, "canvas_skip", label, holder)


# -- raise ---------------------------------------------------------------------------------


def test_raise_a_chain_stops_at_the_locked_link_and_its_errback_runs(
    cluster: Cluster, label: str
) -> None:
    _, raise_, _, record, on_error = sigs(cluster)
    # Given a holder of the key
    holder = hold(cluster, "canvas_raise", label)

    # When chains with the locked task as head and as middle link run, with an errback
    errback = on_error.s(label=label)
    head = chain(raise_.s(label), record.s(label, "after-head")).apply_async(link_error=errback)
    middle = chain(
        record.si("start", label, "before-middle"),
        raise_.si(label),
        record.s(label, "after-middle"),
    ).apply_async(link_error=errback)

    # Then the locked link fails with TaskLocked naming the holder
    for failed in (head.parent, middle.parent):
        error = failed.get(timeout=15, propagate=False)
        assert isinstance(error, TaskLocked), error
        assert error.holder == holder.id
        assert failed.state == "FAILURE"
    # And the errback ran for it: the failure is visible, not silent
    errbacks = cluster.probe.wait_for(label, "errback", count=2)
    assert {event["task_id"] for event in errbacks} == {head.parent.id, middle.parent.id}
    assert {event["error"] for event in errbacks} == {"TaskLocked"}
    # And the chain stopped there: the links after it never ran, and Celery failed their results
    # with the same TaskLocked, so the chain's own result raises it
    for stopped in (head, middle):
        with pytest.raises(TaskLocked):
            stopped.get(timeout=15)
        assert stopped.state == "FAILURE"
    release(cluster, "canvas_raise", label, holder)
    assert recorded(cluster, label) == ["before-middle"]


def test_raise_a_group_member_fails_with_task_locked_and_the_others_succeed(
    cluster: Cluster, label: str
) -> None:
    _, raise_, _, record, _ = sigs(cluster)
    # Given a holder of the key
    holder = hold(cluster, "canvas_raise", label)

    # When a group with a member of the key and another task runs
    values = group(raise_.s(label), record.si(1, label, "member")).apply_async()

    # Then the locked member failed with TaskLocked, the other one succeeded
    locked, other = values.get(timeout=15, propagate=False)
    assert isinstance(locked, TaskLocked)
    assert locked.holder == holder.id
    assert other == {"step": "member", "got": 1}
    assert [result.state for result in values.results] == ["FAILURE", "SUCCESS"]
    release(cluster, "canvas_raise", label, holder)


def test_raise_a_chord_with_a_locked_header_member_fails_its_callback_instead_of_hanging(
    cluster: Cluster, label: str
) -> None:
    _, raise_, _, record, _ = sigs(cluster)
    # Given a holder of the key
    holder = hold(cluster, "canvas_raise", label)

    # When a chord whose header has a member of the key runs
    result = chord([raise_.s(label), record.si(1, label, "member")], record.s(label, "callback"))()

    # Then the callback fails with a ChordError naming the locked member, and never runs; get()
    # raises the member's own TaskLocked first, as Celery re-raises a failed parent's error
    with pytest.raises(TaskLocked):
        result.get(timeout=15)
    error = result.get(timeout=15, propagate=False)
    assert result.state == "FAILURE"
    assert isinstance(error, ChordError), error
    assert "TaskLocked" in str(error)
    assert "callback" not in recorded(cluster, label)
    release(cluster, "canvas_raise", label, holder)


# -- retry ---------------------------------------------------------------------------------


def wait_for_lock_retries(cluster: Cluster, label: str, *task_ids: str) -> None:
    """Wait until each of ``task_ids`` has lock-retried at least twice."""

    def retried() -> bool:
        events = worker_conflicts(cluster, label)
        return all(
            sum(1 for e in events if e["task_id"] == task_id and e["action"] == "retry") >= 2
            for task_id in task_ids
        )

    wait_until(retried, f"two lock retries of each of {task_ids}")


def test_retry_a_chain_waits_at_the_locked_link_and_goes_on_after_the_holder(
    cluster: Cluster, label: str
) -> None:
    _, _, retry, record, _ = sigs(cluster)
    # Given a holder of the key
    holder = hold(cluster, "canvas_retry", label)

    # When chains with the locked task as head and as middle link run
    head = chain(retry.s(label, tag="head"), record.s(label, "after-head")).apply_async()
    middle = chain(
        record.si("start", label, "before-middle"),
        retry.si(label, tag="middle"),
        record.s(label, "after-middle"),
    ).apply_async()

    # Then the locked links wait (lock retries), and the chains do not go on meanwhile
    wait_until(lambda: middle.parent.state == "RETRY", "the middle link to wait")
    wait_for_lock_retries(cluster, label, head.parent.id, middle.parent.id)
    assert recorded(cluster, label) == ["before-middle"]

    # When the holder ends
    release(cluster, "canvas_retry", label, holder)

    # Then each locked link runs, and its chain goes on with its value
    assert head.get(timeout=15) == {"step": "after-head", "got": "head"}
    assert middle.get(timeout=15) == {"step": "after-middle", "got": "middle"}
    assert cluster.probe.max_overlap(label) == 1
    assert cluster.probe.starts(label)[0]["task_id"] == holder.id
    cluster.wait_free(key_of(cluster, "canvas_retry", label))


def test_retry_a_group_member_runs_after_the_holder(cluster: Cluster, label: str) -> None:
    _, _, retry, record, _ = sigs(cluster)
    # Given a holder of the key
    holder = hold(cluster, "canvas_retry", label)

    # When a group with two members of the key and another task runs
    values = group(
        retry.s(label, tag="one"), retry.s(label, tag="two"), record.si(1, label, "member")
    ).apply_async()
    wait_for_lock_retries(cluster, label, values.results[0].id, values.results[1].id)
    release(cluster, "canvas_retry", label, holder)

    # Then the group completes with every member's own value, one run of the key at a time
    assert values.get(timeout=15) == ["one", "two", {"step": "member", "got": 1}]
    assert cluster.probe.max_overlap(label) == 1
    cluster.wait_free(key_of(cluster, "canvas_retry", label))


def test_retry_a_chord_completes_once_the_locked_member_has_run(
    cluster: Cluster, label: str
) -> None:
    _, _, retry, record, _ = sigs(cluster)
    # Given a holder of the key
    holder = hold(cluster, "canvas_retry", label)

    # When a chord whose header has a member of the key runs
    header = [retry.s(label, tag="member"), record.si(1, label, "other")]
    result = chord(header, record.s(label, "callback"))()
    wait_until(
        lambda: any(e["action"] == "retry" for e in worker_conflicts(cluster, label)),
        "the locked member to wait",
    )
    # Then the callback waits for it
    assert "callback" not in recorded(cluster, label)
    release(cluster, "canvas_retry", label, holder)

    # And once the holder ended, the member runs and the callback gets its value
    assert result.get(timeout=15) == {
        "step": "callback",
        "got": ["member", {"step": "other", "got": 1}],
    }
    cluster.wait_free(key_of(cluster, "canvas_retry", label))


# -- lock scopes "queue" and "coalesce" in a canvas ------------------------------------------


def test_queue_scope_parts_sent_by_the_canvas_meet_the_execution_lock(
    cluster: Cluster, label: str
) -> None:
    queued, record = cluster.task(NAME + "queued"), cluster.task(NAME + "record")
    # Given a queue-scope task running, its key held
    holder = hold(cluster, "queued", label)

    # When it is a chain head, a middle link, group members, a chord header member and a
    # chord callback
    head = chain(queued.s(label), record.s(label, "after-head")).apply_async()
    middle = chain(
        record.si(0, label, "before-middle"), queued.si(label), record.s(label, "after-middle")
    ).apply_async()
    members = group(queued.s(label), queued.s(label)).apply_async()
    in_header = chord([queued.s(label), record.si(1, label, "member")], record.s(label, "cb"))()
    as_callback = chord([record.si(2, label, "header")], queued.si(label))()

    # Then each part was published as its own message (not handed the holder's result) and
    # skipped by the worker
    parts = [head.parent, middle.parent, *members.results, as_callback]
    for part in parts:
        skipped = part.get(timeout=15)
        assert isinstance(skipped, Skipped), (part, skipped)
        assert skipped.holder == holder.id
    assert holder.id not in {part.id for part in parts}
    assert head.get(timeout=15)["got"] == {"skipped_by": holder.id}
    assert middle.get(timeout=15)["got"] == {"skipped_by": holder.id}
    assert in_header.get(timeout=15)["got"][0] == {"skipped_by": holder.id}
    assert runs(cluster, label) == [("start", holder.id)]
    release(cluster, "queued", label, holder)


def test_a_frozen_signature_is_published_under_its_own_id_and_meets_the_execution_lock(
    cluster: Cluster, label: str
) -> None:
    queued = cluster.task(NAME + "queued")
    # Given a queue-scope task running, its key held
    holder = hold(cluster, "queued", label)

    # When a signature of the same call is frozen (its AsyncResult handed out, as a chord does
    # with its callback) and then sent
    signature = queued.s(label)
    frozen = signature.freeze()
    sent = signature.delay()

    # Then it was published under the frozen id (not handed the holder's result, which would
    # leave the frozen AsyncResult pending forever) and skipped by the worker
    assert sent.id == frozen.id != holder.id
    skipped = frozen.get(timeout=15)
    assert isinstance(skipped, Skipped), skipped
    assert skipped.holder == holder.id
    assert runs(cluster, label) == [("start", holder.id)]
    release(cluster, "queued", label, holder)


def test_queue_scope_chain_tail_and_link_callback_meet_the_execution_lock(
    cluster: Cluster, label: str
) -> None:
    queued, record = cluster.task(NAME + "queued"), cluster.task(NAME + "record")
    # Given a queue-scope task running, its key held
    holder = hold(cluster, "queued", label)

    # When it is the last link of a chain, and a link callback, both sent by the worker
    tail = chain(record.si(0, label, "before-tail"), queued.si(label)).apply_async()
    callback = queued.si(label)
    callback.freeze()
    linked = record.apply_async((0, label, "linked"), link=callback)

    # Then each is published under its own id and skipped by the worker, so the chain's result
    # and the callback's result resolve (they are not handed the holder's result instead)
    assert linked.get(timeout=15) == {"step": "linked", "got": 0}
    for part in (tail, callback.AsyncResult(callback.id)):
        wait_until(part.ready, f"{part!r} to resolve", timeout=10)
        skipped = part.result
        assert isinstance(skipped, Skipped), (part, skipped)
        assert skipped.holder == holder.id
    release(cluster, "queued", label, holder)


def test_a_coalescing_chain_link_waits_as_the_follow_up_and_the_chain_goes_on(
    cluster: Cluster, label: str
) -> None:
    coalesced, record = cluster.task(NAME + "coalesced"), cluster.task(NAME + "record")
    # Given a coalescing task running
    holder = coalesced.delay(label, "holder", hold=True)
    cluster.probe.wait_for(label, "start")

    # When it is a chain head
    head = chain(coalesced.s(label, "chained"), record.s(label, "after")).apply_async()

    # Then the link waits as the key's follow-up (it is not skipped), and runs after the holder
    wait_until(
        lambda: any(e["action"] == "follow" for e in worker_conflicts(cluster, label)),
        "the chain link to wait as the follow-up",
    )
    open_gate(cluster, label)
    assert holder.get(timeout=15) == "holder"
    assert head.get(timeout=15) == {"step": "after", "got": "chained"}
    assert runs(cluster, label) == [
        ("start", holder.id),
        ("end", holder.id),
        ("start", head.parent.id),
        ("end", head.parent.id),
    ]
    cluster.wait_free(key_of(cluster, "coalesced", label))
