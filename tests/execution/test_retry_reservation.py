"""A body's retry on a worker: published as the body ends, once the lock is the retry's
reservation (issue 37, interaction campaign seed 697186904), so nothing of singletask's comes
between that publish and Celery's storing of RETRY.

Each test runs one execution as a worker runs it (Celery's tracer, not eager mode) in this
process, on the memory lock store; the retry is published to an in-memory broker, or to a
broker that refuses connections. tests/e2e/test_store_errors.py states the user-visible
outcome on a real worker with a slow lock store.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import celery
import pytest
from celery import states
from celery.app.trace import build_tracer
from celery.signals import before_task_publish

from singletask import SingletonTask, Skipped
from singletask.backends.base import Holder, LockBackend
from singletask.protocol.tokens import execution_token, reservation_token
from singletask.task import LOCK_RETRIES_HEADER


@pytest.fixture
def app(key_prefix: str) -> Iterator[celery.Celery]:
    app = celery.Celery("retrying", set_as_current=False, broker="memory://")
    app.conf.update(
        singletask_backend_url="memory://",
        singletask_key_prefix=key_prefix,
        task_publish_retry=False,
        broker_connection_retry=False,
        broker_connection_max_retries=0,
    )
    yield app
    app.close()


@pytest.fixture
def published() -> Iterator[list[dict[str, Any]]]:
    """The headers of every message published during the test."""
    seen: list[dict[str, Any]] = []

    def receiver(sender: Any = None, headers: Any = None, **kwargs: Any) -> None:
        seen.append(dict(headers or {}))

    before_task_publish.connect(receiver, weak=False)
    yield seen
    before_task_publish.disconnect(receiver)


def run_on_worker(task: Any, task_id: str, retries: int = 0) -> Any:
    """Run one execution of ``task`` as a worker's pool process does (not eagerly): its
    attempt ``retries`` (0: the first)."""
    tracer = build_tracer(task.name, task, eager=False, propagate=False, app=task.app)
    request = {"id": task_id, "retries": retries, "hostname": "worker@test"}
    return tracer(task_id, (), {}, request)


def holder_of(backend: LockBackend, key: str) -> Holder | None:
    return backend.holder(key)


def test_the_retry_is_published_once_the_body_has_unwound_and_the_lock_is_its_reservation(
    app: celery.Celery, published: list[dict[str, Any]]
) -> None:
    # Given a body that retries itself and then runs a finally block
    unwound: list[str] = []

    @app.task(base=SingletonTask, bind=True, shared=False, lazy=False, name="retrying.body")
    def body(self: Any) -> None:
        try:
            raise self.retry(countdown=5)
        finally:
            unwound.append("finally")

    key = body.lock_key_for()
    at_publish: list[tuple[str | None, list[str]]] = []

    def look(sender: Any = None, **kwargs: Any) -> None:
        holder = holder_of(body.lock_backend, key)
        at_publish.append((None if holder is None else holder.token, list(unwound)))

    task_id = str(uuid.uuid4())
    before_task_publish.connect(look, weak=False)
    try:
        # When it runs on a worker
        result = run_on_worker(body, task_id)
    finally:
        before_task_publish.disconnect(look)

    # Then it ends as Celery's retry ends it
    assert result.info.state == states.RETRY
    # And the retry was published once, after the body's finally, when the lock was already
    # its reservation
    assert [h["id"] for h in published] == [task_id]
    assert at_publish == [(reservation_token(task_id, 1), ["finally"])]
    # And the lock stays reserved, for the retried attempt to take over
    holder = holder_of(body.lock_backend, key)
    assert holder is not None
    assert holder.token == reservation_token(task_id, 1)


def test_a_retry_whose_publish_fails_leaves_nothing_reserved(app: celery.Celery) -> None:
    # Given a broker that refuses connections, and a body that retries itself
    app.conf.broker_url = "redis://127.0.0.1:1/0"

    @app.task(base=SingletonTask, bind=True, shared=False, lazy=False, name="retrying.lost")
    def lost(self: Any) -> None:
        raise self.retry(countdown=5)

    # When it runs on a worker: Celery cannot publish the retry, and rejects the message
    result = run_on_worker(lost, str(uuid.uuid4()))

    # Then the execution ends as Celery ends it (Reject), and the lock is free: no reservation
    # waits for a retry that was never sent
    assert result.info.state == states.REJECTED
    assert holder_of(lost.lock_backend, lost.lock_key_for()) is None


def test_a_body_that_goes_on_after_its_retry_holds_its_lock_until_it_ends(
    app: celery.Celery, published: list[dict[str, Any]]
) -> None:
    # Given a body that asks for a retry with throw=False, then goes on
    during: list[str | None] = []

    @app.task(base=SingletonTask, bind=True, shared=False, lazy=False, name="retrying.goes_on")
    def goes_on(self: Any) -> str:
        self.retry(countdown=5, throw=False)
        holder = holder_of(self.lock_backend, self.lock.key)
        during.append(None if holder is None else holder.token)
        return "went on"

    task_id = str(uuid.uuid4())

    # When it runs on a worker
    run_on_worker(goes_on, task_id)

    # Then the retry was published, while the body still held its own lock
    assert [h["id"] for h in published] == [task_id]
    assert len(during) == 1
    assert during[0] is not None
    assert during[0].startswith(f"{task_id}:0:")
    # And the lock is released when the body ends
    assert holder_of(goes_on.lock_backend, goes_on.lock_key_for()) is None


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_a_retried_attempt_that_finds_its_key_held_by_another_task_waits_whatever_the_policy(
    app: celery.Celery, published: list[dict[str, Any]], policy: str
) -> None:
    """The reservation for a retry lasts its countdown plus ``lock_ttl``: a retry that comes
    later (a busy worker, a broker outage) may find another task holding the key. It is the
    attempt the body asked for, so it is not dropped as a duplicate (interaction campaign seed
    1770154341): it waits as a lock retry, as for a rate or a limit without room."""
    ran: list[str] = []

    # Given a task of policy "skip" or "raise", and its key held by another task
    @app.task(base=SingletonTask, bind=True, shared=False, lazy=False,
              name=f"retrying.late.{policy}", lock_policy=policy)  # fmt: skip
    def late(self: Any) -> None:
        ran.append(self.request.id)

    key = late.lock_key_for()
    holder = execution_token(str(uuid.uuid4()), 0)
    assert late.lock_backend.acquire(key, holder, 30.0).acquired
    task_id = str(uuid.uuid4())

    # When the attempt its body asked for (retries 1) runs on a worker, its reservation gone
    result = run_on_worker(late, task_id, retries=1)

    # Then it is sent again as a lock retry (the same attempt), neither skipped nor failed
    assert result.info.state == states.RETRY
    assert ran == []
    (headers,) = published
    assert headers["id"] == task_id
    assert headers["retries"] == 1
    assert int(headers[LOCK_RETRIES_HEADER]) == 1
    # And the holder keeps the key
    held = holder_of(late.lock_backend, key)
    assert held is not None
    assert held.token == holder

    # And a first attempt (a duplicate send) still gets the policy
    first = run_on_worker(late, str(uuid.uuid4()))
    assert len(published) == 1
    if policy == "raise":
        assert first.info.state == states.FAILURE
    else:
        assert isinstance(first.retval, Skipped)
