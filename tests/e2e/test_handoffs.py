"""What an execution that ends without its body leaves for the sends after it, on a real
prefork worker (issue 29, "every send accounted for").

An execution can find something kept in the lock store for its message alone: the reservation
``apply_async`` made for it (``lock_scope`` "queue" or "coalesce"), the reservation its previous
attempt left when the body retried itself, or its follow-up claim. Whatever it ends as, it must
not keep them: a later send must never be deduplicated onto, joined to, or locked out by an
execution that has ended.
"""

from __future__ import annotations

import time

import pytest

from singletask import RateLimited, Skipped
from singletask.protocol.slots import slot_keys

from ..backends.redis_lock import lock_token
from .conftest import ON_REDIS_BROKER, Cluster
from .tasks_handoffs import PREFIX
from .tasks_scopes import QUEUE_TTL as SCOPES_QUEUE_TTL
from .test_scopes import NAME as SCOPES
from .test_scopes import key_of, open_gate, producer_conflicts

# On the Redis broker only: what is tested lives in the lock store, and the other e2e modules
# already cover RabbitMQ; this keeps the suite short.
pytestmark = [pytest.mark.e2e, ON_REDIS_BROKER]

#: A generous bound for what should happen "soon".
BOUND = 30.0
#: Seconds the probe's start times may lag the store's start of a lease.
SLACK = 0.1


@pytest.fixture
def label(cluster: Cluster) -> str:
    return cluster.label()


def held(cluster: Cluster, key: str, limit: int = 1) -> list[str]:
    """The slots of ``key`` that a lock or a reservation holds."""
    return [slot for slot in slot_keys(key, limit) if lock_token(cluster.locks, slot) is not None]


# -- finding 3: a queued message refused by the rate -----------------------------------------


@pytest.mark.parametrize("name", ["queued_skip", "queued_raise", "coalesced_skip"])
def test_a_queued_message_refused_by_the_rate_frees_its_reservation(
    cluster: Cluster, label: str, name: str
) -> None:
    """Issue 29, finding 3: a message deduplicated when sent (``lock_scope`` "queue" or
    "coalesce") that a worker starts too soon for the task's ``lock_rate`` ends as its policy
    says for the rate, and gives its reservation back: later sends are published and run,
    instead of being deduplicated onto (or refused by) an execution that has ended."""
    # Given a task deduplicated when sent and limited to one start a second, whose key has
    # just started (and finished) a run
    task = cluster.task(PREFIX + name)
    key = task.lock_key_for((label,))
    assert task.delay(label, note="first").get(timeout=BOUND) == "first"

    # When a second send is queued at once, so that a worker starts it within that second
    second = task.delay(label, note="second")

    # Then it ends as the policy says for the rate: a Skipped saying so, or RateLimited
    if name == "queued_raise":
        with pytest.raises(RateLimited):
            second.get(timeout=BOUND)
    else:
        skipped = second.get(timeout=BOUND)
        assert isinstance(skipped, Skipped), skipped
        assert skipped.reason == "rate"
    # And it leaves the key free at once (not reserved for lock_queue_ttl)
    cluster.wait_free(key, timeout=2)
    # And a send made once the rate allows a start is a message of its own, and runs
    time.sleep(1.0)
    third = task.delay(label, note="third")
    assert third.id != second.id
    assert third.get(timeout=BOUND) == "third"
    assert [start["note"] for start in cluster.probe.starts(label)] == ["first", "third"]
    cluster.wait_free(key)


# -- finding 5: a body retry sooner than the rate ---------------------------------------------


@pytest.mark.parametrize(("name", "limit"), [("retrying", 1), ("retrying_limited", 2)])
def test_a_body_retry_sooner_than_the_rate_waits_for_its_start_and_runs(
    cluster: Cluster, label: str, name: str, limit: int
) -> None:
    """Issue 29, finding 5: a retry the body asked for is not lost to the task's own
    ``lock_rate`` (with the default ``skip`` policy too): it waits for the allowed start,
    keeping its reservation meanwhile, and runs; once it has ended nothing holds the key."""
    # Given a task limited to one start a second (skip policy) whose first attempt retries
    # itself after 0.2 s, well within that second
    task = cluster.task(PREFIX + name)
    key = task.lock_key_for((label,))

    # When it is sent
    result = task.delay(label)

    # Then the retry runs, once the rate allows (a second after the first start), and its
    # value is the task's result
    assert result.get(timeout=BOUND) == {"task_id": result.id, "retries": 1}
    starts = cluster.probe.starts(label)
    assert [start["retries"] for start in starts] == [0, 1]
    assert starts[1]["t"] - starts[0]["t"] >= 1.0 - SLACK
    # And nothing holds the key once it has ended
    assert held(cluster, key, limit) == []
    # And a later send, once the rate allows, runs: it is not skipped as held
    time.sleep(1.0)
    later = task.delay(label)
    assert later.get(timeout=BOUND) == {"task_id": later.id, "retries": 1}
    assert held(cluster, key, limit) == []


# -- finding 4: debounce, a body retry and a later send ---------------------------------------


@pytest.mark.parametrize("countdown", [3.0, 0.5], ids=["send-starts-first", "retry-due-first"])
def test_a_send_during_a_body_retrys_countdown_runs_and_supersedes_the_retry(
    cluster: Cluster, label: str, countdown: float
) -> None:
    """Issue 29, finding 4: with ``lock_debounce``, a send made during the countdown of a body
    retry carries the latest arguments: it runs them, and the retry of the earlier arguments
    ends superseded by it. Whichever starts first, each send has one outcome and nothing stays
    reserved."""
    # Given a task debounced by 1 s whose first run (version 1) retries itself after
    # ``countdown`` seconds
    task = cluster.task(PREFIX + "versioned")
    key = task.lock_key_for((label, 1))
    first = task.delay(label, 1, countdown=countdown)
    cluster.probe.wait_for(label, "retrying")

    # When a later send (version 2) is made during the retry's countdown; it starts 1 s later:
    # before the retry is due (3 s), or after it (0.5 s)
    second = task.delay(label, 2)

    # Then the later send runs its arguments
    assert second.get(timeout=BOUND) == 2
    # And the retry, superseded by it, ends as a Skipped naming it
    superseded = first.get(timeout=BOUND)
    assert isinstance(superseded, Skipped), superseded
    assert superseded.reason == "debounced"
    assert superseded.holder == second.id
    # And each body ran once: version 1 (which retried), then version 2
    starts = cluster.probe.starts(label)
    assert [(start["version"], start["retries"]) for start in starts] == [(1, 0), (2, 0)]
    # And nothing stays reserved
    cluster.wait_free(key, timeout=2)


# -- finding 10: a coalescing call and a follow-up that has started ---------------------------


def test_a_call_made_once_a_follow_up_has_taken_the_lock_becomes_the_next_follow_up(
    cluster: Cluster, label: str
) -> None:
    """Issue 29, finding 10: a follow-up clears its claim one request after it has taken the
    lock. A coalescing call made in between finds the key held by the very task its claim
    names: that run has started, so the call must not join it (its caller would get a result
    computed before the call); it becomes the next follow-up, and runs after it."""
    # Given a coalescing key whose run holds the lock while its follow-up claim still names it:
    # the moment between a follow-up's take and the clearing of its claim
    task = cluster.task(SCOPES + "coalesced")
    key = key_of(cluster, "coalesced", label)
    running = task.delay(label, tag="running", hold=True)
    cluster.probe.wait_for(label, "start")
    assert task.lock_backend.claim_next(key, running.id, SCOPES_QUEUE_TTL) == running.id

    # When a call is made
    with producer_conflicts(key) as decided:
        later = task.delay(label, tag="later")

    # Then it is sent as the follow-up of that run, not joined to it
    assert decided.actions() == ["follow"]
    assert later.id != running.id
    # And it runs after the run, with its own arguments
    open_gate(cluster, label)
    assert running.get(timeout=BOUND) == "running"
    assert later.get(timeout=BOUND) == "later"
    assert [start["tag"] for start in cluster.probe.starts(label)] == ["running", "later"]
    cluster.wait_free(key)
