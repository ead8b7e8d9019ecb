"""An acquire cut short by an exception that is not an outcome (a soft time limit firing during
the store's round trip, whose reply the execution never reads) gives back what the store may
hold for it: its own hold, if the acquire took effect, and the reservation and follow-up claim
its send made. Before, they stayed until they expired, and later sends of the key met them
(interaction campaign, seed 1805178049: a ``lock_coalesce = "latest"`` follow-up on
PostgreSQL, its soft limit in the acquire; the next follow-up waited behind its reservation).

Each test runs one execution as a worker's pool process does (Celery's tracer), on a real
store: the memory store and a private Redis; the soft limit is raised as the store's acquire
returns, as Celery's signal handler raises it in the middle of a round trip.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import celery
import pytest
from billiard.exceptions import SoftTimeLimitExceeded
from celery import states
from celery.app.trace import build_tracer

from singletask import SingletonTask
from singletask.conf.runtime import app_state
from singletask.protocol.tokens import reservation_token


@pytest.fixture(params=["memory", "redis"])
def app(request: pytest.FixtureRequest, key_prefix: str) -> Iterator[celery.Celery]:
    url = "memory://" if request.param == "memory" else request.getfixturevalue("redis_url")
    app = celery.Celery(
        "abandon", set_as_current=False, broker="memory://", backend="cache+memory://"
    )
    app.conf.update(singletask_backend_url=url, singletask_key_prefix=key_prefix)
    yield app
    app.close()


def run_on_worker(task: Any, task_id: str) -> Any:
    """Run one execution of ``task`` as a worker's pool process does (not eagerly)."""
    tracer = build_tracer(task.name, task, eager=False, propagate=False, app=task.app)
    return tracer(task_id, (), {}, {"id": task_id, "retries": 0, "hostname": "worker@test"})


@pytest.mark.parametrize("acquired", [True, False], ids=["acquire-took-effect", "before-it"])
def test_a_follow_up_cut_short_in_its_acquire_leaves_nothing_behind(
    app: celery.Celery, monkeypatch: pytest.MonkeyPatch, acquired: bool
) -> None:
    ran: list[str] = []

    @app.task(base=SingletonTask, bind=True, shared=False, lazy=False, name="abandon.follow",
              lock_scope="coalesce", lock_coalesce="latest")  # fmt: skip
    def follow(self: Any) -> None:
        ran.append(str(self.request.id))

    # Given a follow-up whose send reserved the key and claimed it, as a send does
    backend = app_state(app).backend
    key, task_id = follow.lock_key_for(), str(uuid.uuid4())
    assert backend.acquire(key, reservation_token(task_id, 0), 60).acquired
    assert backend.claim_next(key, task_id, 60) == task_id

    # When its soft time limit fires in the store's acquire (after it took effect, or before)
    acquire = type(backend).acquire

    def cut_short(self: Any, *args: Any, **kwargs: Any) -> Any:
        if acquired:
            acquire(self, *args, **kwargs)
        raise SoftTimeLimitExceeded()

    monkeypatch.setattr(type(backend), "acquire", cut_short)
    run_on_worker(follow, task_id)
    monkeypatch.undo()

    # Then it ends with the soft limit, its body not run
    assert follow.AsyncResult(task_id).state == states.FAILURE
    assert ran == []
    # And the key is free: no hold, no reservation, no follow-up claim
    assert backend.holder(key) is None
    assert backend.claim_next(key, "next-send", 60) == "next-send"
