"""A send whose publish fails leaves the lock store as it was before the send (issue 29).

``apply_async`` writes to the lock store before it publishes: a debounced send becomes its key's
latest, a coalescing follow-up claims the follow-up slot. When the publish then raises (here:
an argument the JSON serializer refuses, ``EncodeError``; a broker that is down is covered by
the e2e tests, tests/e2e/test_rates.py and test_scopes.py), that write is taken back before the
error reaches the caller, so the sends that were published still run. In one process, against
the memory store, SQLite and the session's private Redis; the messages go to an in-memory
broker that no worker reads.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import celery
import pytest
from celery.signals import before_task_publish
from kombu.exceptions import EncodeError

from singletask import SingletonTask, Skipped
from singletask.protocol.tokens import execution_token


class Unserializable:
    """An argument the JSON serializer refuses: its message can never be published."""


@pytest.fixture(params=["memory", "redis", "sqlite"])
def app(request: pytest.FixtureRequest, key_prefix: str, tmp_path: Path) -> Iterator[celery.Celery]:
    """A producer app (not eager: its sends are published, to an in-memory broker) whose locks
    live in the in-process store, the session's Redis or a SQLite file."""
    if request.param == "memory":
        url = "memory://"
    elif request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/locks.db"
    else:
        url = request.getfixturevalue("redis_url")
        request.getfixturevalue("redis_client")  # fails / skips when the server is missing
    app = celery.Celery("publish-failure", set_as_current=False, broker="memory://")
    app.conf.update(
        singletask_backend_url=url, singletask_key_prefix=key_prefix, task_serializer="json"
    )
    yield app
    app.close()


def test_a_debounced_send_that_cannot_be_published_leaves_the_last_published_send_latest(
    app: celery.Celery,
) -> None:
    """The burst's published send still runs: the window names it again, not the send that
    never left."""

    @app.task(base=SingletonTask, shared=False, lazy=False, lock_debounce=5, lock_args=("key",))
    def rebuild(key: str, version: object) -> None:
        raise AssertionError("no worker runs this")

    backend, key = rebuild.lock_backend, rebuild.lock_key_for(("k", 0))

    # Given a first send of a burst whose publish fails: nothing is left in the store
    with pytest.raises(EncodeError):
        rebuild.delay("k", Unserializable())
    assert backend.debounce_take(key, "any-send") == (None, 0.0)

    # And a send that is published
    published = rebuild.delay("k", 1)

    # When a later send of the burst cannot be published
    with pytest.raises(EncodeError):
        rebuild.apply_async(("k", Unserializable()), task_id="never-sent")

    # Then the published send is still the window's latest: when it starts, it runs (it is not
    # skipped as superseded by "never-sent", which no worker will ever run)
    assert backend.debounce_take(key, published.id) == (published.id, 0.0)


def test_a_debounced_send_that_cannot_be_published_after_a_run_began_keeps_that_burst_superseded(
    app: celery.Celery,
) -> None:
    """A send that opened a new window over the closed one of a burst whose run began, and
    cannot be published, puts the closed window back: an earlier send of that burst that a
    worker starts late still ends superseded by the send that ran, and the burst runs one body,
    not two."""
    ran: list[object] = []

    @app.task(base=SingletonTask, shared=False, lazy=False, lock_debounce=5, lock_args=("key",))
    def rebuild(key: str, version: object) -> object:
        ran.append(version)
        return version

    # Given a burst of two published sends whose latest ran (its run closed the window)
    earlier = rebuild.delay("k", 1)
    latest = rebuild.delay("k", 2)
    assert rebuild.apply(("k", 2), task_id=latest.id).get() == 2

    # When a send of the next burst, which opens a new window over the closed one, cannot be
    # published
    with pytest.raises(EncodeError):
        rebuild.apply_async(("k", Unserializable()), task_id="never-sent")

    # Then the burst's earlier send, started late, ends superseded by the send that ran
    late = rebuild.apply(("k", 1), task_id=earlier.id).get()
    assert isinstance(late, Skipped)
    assert late.reason == "debounced"
    assert late.holder == latest.id
    assert ran == [2]
    # And the next send opens a new window, and runs
    following = rebuild.delay("k", 3)
    assert rebuild.apply(("k", 3), task_id=following.id).get() == 3
    assert ran == [2, 3]


def test_a_coalescing_follow_up_that_cannot_be_published_gives_its_claim_back(
    app: celery.Celery,
) -> None:
    """Later calls during the run do not join a follow-up that was never sent: the next one
    becomes the follow-up itself."""

    @app.task(
        base=SingletonTask, shared=False, lazy=False, lock_scope="coalesce", lock_args=("key",)
    )
    def sync(key: str, tag: object) -> None:
        raise AssertionError("no worker runs this")

    backend, key = sync.lock_backend, sync.lock_key_for(("k", "any"))
    # Given a run in progress (an execution holds the key)
    running = backend.acquire(key, execution_token("run-1", 0), 60, meta={"task_id": "run-1"})
    assert running.acquired

    # When a call during the run, the would-be follow-up, cannot be published
    with pytest.raises(EncodeError):
        sync.apply_async(("k", Unserializable()), task_id="never-sent")

    # Then the next call becomes the follow-up, with a message of its own (it does not join
    # "never-sent", whose result would stay PENDING for ever)
    later = sync.delay("k", "later")
    assert later.id not in ("never-sent", "run-1")
    assert backend.claim_next(key, "probe", 60) == later.id


@pytest.mark.parametrize("scope", ["queue", "coalesce"])
def test_a_call_that_joined_a_send_whose_publish_then_fails_gets_its_failure(
    app: celery.Celery, scope: str
) -> None:
    """A call made while a send's publish is failing finds the key reserved for that send and
    joins it; the send's message never leaves, so its AsyncResult would stay PENDING for ever.
    The publish's error is stored as the unsent message's result: the joined call sees it."""
    app.conf.result_backend = "cache+memory://"  # a result store in this process

    @app.task(base=SingletonTask, shared=False, lazy=False, lock_scope=scope, lock_args=("key",))
    def sync(key: str, payload: object) -> None:
        raise AssertionError("no worker runs this")

    joined: list[celery.result.AsyncResult[None]] = []

    def join_meanwhile(headers: dict[str, object] | None = None, **_: object) -> None:
        if headers and headers.get("id") == "never-sent" and not joined:
            joined.append(sync.delay("k", 1))  # between the reservation and the failing publish

    # Given a call that joins a send while that send is being published
    celery.signals.before_task_publish.connect(join_meanwhile, weak=False)
    try:
        # When the send's publish fails
        with pytest.raises(EncodeError):
            sync.apply_async(("k", Unserializable()), task_id="never-sent")
    finally:
        celery.signals.before_task_publish.disconnect(join_meanwhile)

    # Then the joined call got the unsent message's AsyncResult, which ends with its error
    assert [result.id for result in joined] == ["never-sent"]
    assert joined[0].state == "FAILURE"
    assert isinstance(joined[0].result, EncodeError)


def test_a_debounced_send_is_pending_while_it_is_published_and_published_after(
    app: celery.Celery,
) -> None:
    """While its message is being published, a send is pending: an earlier message that starts
    then is told to wait for it. Once published, the earlier ones are superseded at once."""

    @app.task(base=SingletonTask, shared=False, lazy=False, lock_debounce=5, lock_args=("key",))
    def rebuild(key: str, version: object) -> None:
        raise AssertionError("no worker runs this")

    backend, key = rebuild.lock_backend, rebuild.lock_key_for(("k", 0))
    first = rebuild.delay("k", 1)
    seen: list[tuple[str | None, float]] = []

    def during_publish(sender: str | None = None, **_: object) -> None:
        if sender == rebuild.name:
            seen.append(backend.debounce_take(key, first.id))

    before_task_publish.connect(during_publish, weak=False)
    try:
        second = rebuild.delay("k", 2)
    finally:
        before_task_publish.disconnect(during_publish)

    # During the publish, the first message would have waited for the second send
    assert len(seen) == 1
    assert seen[0][0] == second.id
    assert seen[0][1] > 0
    # After it, the second send is published: the first message ends superseded at once
    assert backend.debounce_take(key, first.id) == (second.id, 0.0)
