"""Hand-offs of a coalescing follow-up, in one process: a call made while a follow-up starts
(issue 29, finding 10), and a follow-up interrupted before it is sent again.

A follow-up takes the lock, then clears its follow-up claim: two requests to the lock store. A
call made between them finds the key held, and the claim still naming that follow-up. Here the
window is opened for certain: the store's ``clear_next`` makes the call first. The end-to-end
test of the same property is in tests/e2e/test_handoffs.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import celery
import pytest

from singletask import SingletonTask
from singletask.backends.memory import MemoryBackend
from singletask.conf.runtime import lock_options
from singletask.execution.outcomes import refused
from singletask.policies import Conflict
from singletask.signals import lock_conflict
from singletask.task import override_lock_backend


class CallsWhileClearing(MemoryBackend):
    """The memory store, where ``call`` runs at the start of the first ``clear_next``."""

    def __init__(self) -> None:
        super().__init__()
        self.call: Any = None
        self.outcome: Any = None

    def clear_next(self, key: str, task_id: str) -> bool:
        call, self.call = self.call, None
        if call is not None:
            self.outcome = call()
        return super().clear_next(key, task_id)


@pytest.fixture
def store() -> CallsWhileClearing:
    return CallsWhileClearing()


@pytest.fixture
def app(store: CallsWhileClearing) -> Iterator[celery.Celery]:
    """A producer app (not eager: its sends are published, to an in-memory broker that no
    worker reads) whose locks live in ``store``."""
    app = celery.Celery("handoffs", set_as_current=False, broker="memory://")
    override_lock_backend(app, store)
    yield app
    app.close()


def test_a_call_between_a_follow_ups_take_and_its_claims_clearing_is_the_next_follow_up(
    app: celery.Celery, store: CallsWhileClearing
) -> None:
    """The call comes after the follow-up's run has started: it must not join that run (its
    caller would get a result computed without it), it becomes the next follow-up."""
    ran: list[str] = []

    @app.task(
        base=SingletonTask, shared=False, lazy=False, lock_scope="coalesce", lock_args=("key",)
    )
    def sync(key: str, tag: str) -> str:
        ran.append(tag)
        return tag

    key = sync.lock_key_for(("k", "any"))
    # Given a follow-up whose claim is pending (a call made during a run that has ended since)
    assert store.claim_next(key, "follow-up", 60) == "follow-up"
    # And a call that will be made between its take and the clearing of its claim
    store.call = lambda: sync.delay("k", "later")

    # When the follow-up starts (here in this process)
    assert sync.apply(("k", "follow-up"), task_id="follow-up").get() == "follow-up"

    # Then the call was not joined to the follow-up, which had started: it is a message of its
    # own, and the key's next follow-up
    later = store.outcome
    assert later is not None
    assert later.id != "follow-up"
    assert store.claim_next(key, "probe", 60) == later.id
    assert ran == ["follow-up"]


class Interrupted(BaseException):
    """Stands for what can reach an execution at any point (a soft time limit, a signal)."""


def test_a_follow_up_interrupted_before_it_is_sent_again_gives_its_claim_back(
    app: celery.Celery, store: CallsWhileClearing
) -> None:
    """A coalescing execution that finds a run in progress claims the follow-up slot, then sends
    itself again to wait. If anything ends it between the two (the interaction campaign saw a
    soft time limit there), nothing will run it: its claim must not stay for lock_queue_ttl,
    where every later call would join it."""

    @app.task(
        base=SingletonTask, shared=False, lazy=False, lock_scope="coalesce", lock_args=("key",)
    )
    def sync(key: str) -> str:
        return key

    key = sync.lock_key_for(("k",))
    # Given a run in progress on the key
    assert store.acquire(key, "holder-token", 60, meta={"task_id": "holder"}).acquired

    def interrupt(action: str | None = None, **_: Any) -> None:
        if action == "follow":
            raise Interrupted

    # When an execution of a worker's message becomes its follow-up and is interrupted before
    # its message is sent again
    lock_conflict.connect(interrupt, weak=False)
    sync.push_request(id="follow-up", is_eager=False, called_directly=False, retries=0)
    try:
        conflict = Conflict(sync, lock_options(sync), store, key, store.holder(key), False)
        with pytest.raises(Interrupted):
            refused(conflict)
    finally:
        sync.pop_request()
        lock_conflict.disconnect(interrupt)

    # Then its claim is given back: the next call becomes the follow-up
    assert store.claim_next(key, "later", 60) == "later"
