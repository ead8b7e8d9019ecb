"""``lock_coalesce = "latest"``: a coalescing follow-up runs with the latest call's arguments
(issue 30).

Each send is the latest of its key's window (the record ``lock_debounce`` uses) and is published
with the header ``singletask_latest``; a worker runs such a message only while the window still
names it, and ends an earlier one as a ``Skipped`` with reason "superseded" naming the later
call. Here the producer's side is driven directly, against the memory store and the session's
private Redis, with a publish that records the messages; the worker's side in eager mode. Real
workers: tests/e2e/test_replace.py.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import celery
import pytest
from celery.result import AsyncResult

from singletask import ConfigurationError, SingletonTask, Skipped
from singletask.backends.base import LockBackend
from singletask.conf.runtime import lock_options
from singletask.protocol.headers import LATEST_HEADER
from singletask.send.dedup import send_once
from singletask.signals import lock_conflict

LEASE = 30.0


@pytest.fixture(params=["memory", "redis"])
def app(request: pytest.FixtureRequest, key_prefix: str) -> Iterator[celery.Celery]:
    if request.param == "memory":
        url = "memory://"
    else:
        url = request.getfixturevalue("redis_url")
        request.getfixturevalue("redis_client")
    app = celery.Celery("coalesce-latest", set_as_current=False)
    app.conf.update(singletask_backend_url=url, singletask_key_prefix=key_prefix)
    yield app
    app.close()


class Sent:
    """A publish that records each message instead of sending it."""

    def __init__(self, task: Any, fail: bool = False) -> None:
        self.task = task
        self.fail = fail
        self.messages: list[tuple[str, Mapping[str, Any]]] = []

    def __call__(self, task_id: str, options: Mapping[str, Any] | None = None) -> AsyncResult:
        if self.fail:
            raise OSError("the broker is down")
        self.messages.append((task_id, options or {}))
        return self.task.AsyncResult(task_id)


def define(app: celery.Celery) -> Any:
    @app.task(
        base=SingletonTask, shared=False, lazy=False, name="latest.rebuild", lock_args=("index",),
        lock_scope="coalesce", lock_coalesce="latest",
    )  # fmt: skip
    def rebuild(index: str, reason: str = "") -> str:
        return reason

    return rebuild


def send(task: Any, sent: Sent, task_id: str, reason: str) -> AsyncResult:
    backend: LockBackend = task.lock_backend
    options = lock_options(task)
    return send_once(task, options, backend, sent, task_id, ("products",), {"reason": reason}, {})


def test_calls_during_a_run_each_become_the_latest_follow_up(app: celery.Celery) -> None:
    """Given a run in progress, when three calls arrive, then each is published with the
    header, the window names the last, and the signal says follow, then supersede."""
    rebuild = define(app)
    backend: LockBackend = rebuild.lock_backend
    key = rebuild.lock_key_for(("products",))
    backend.acquire(key, "running-token", LEASE, meta={"task_id": "running"})
    sent = Sent(rebuild)
    actions: list[tuple[str, str | None]] = []

    def record(sender: Any, action: str, holder: str | None, **kwargs: Any) -> None:
        actions.append((action, holder))

    lock_conflict.connect(record)
    try:
        results = [send(rebuild, sent, f"call-{n}", f"edit {n}") for n in range(3)]
    finally:
        lock_conflict.disconnect(record)

    # Then every call is a message of its own, carrying the header
    assert [r.id for r in results] == ["call-0", "call-1", "call-2"]
    assert [m[0] for m in sent.messages] == ["call-0", "call-1", "call-2"]
    assert all(m[1]["headers"][LATEST_HEADER] == 1 for m in sent.messages)
    # And the first followed the run, each later one superseded the one before
    assert actions == [("follow", "running"), ("supersede", "call-0"), ("supersede", "call-1")]
    # And only the last is still the window's latest
    assert backend.debounce_take(key, "call-0") == ("call-2", 0.0)
    assert backend.debounce_take(key, "call-2") == ("call-2", 0.0)


def test_a_call_that_finds_the_key_free_supersedes_a_follow_up_on_its_way(
    app: celery.Celery,
) -> None:
    """The run ended while its follow-up is still in the broker: a new call reserves the free
    key and becomes the window's latest, so the follow-up will not run older arguments."""
    rebuild = define(app)
    backend: LockBackend = rebuild.lock_backend
    key = rebuild.lock_key_for(("products",))
    sent = Sent(rebuild)
    backend.acquire(key, "running-token", LEASE, meta={"task_id": "running"})
    send(rebuild, sent, "follow-up", "edit 1")
    backend.release(key, "running-token")  # the run ends; its follow-up has not started

    newer = send(rebuild, sent, "newer", "edit 2")

    assert newer.id == "newer"
    holder = backend.holder(key)
    assert holder is not None
    assert holder.task_id == "newer"  # its reservation
    assert backend.debounce_take(key, "follow-up") == ("newer", 0.0)


def test_a_call_whose_publish_fails_is_taken_back(app: celery.Celery) -> None:
    """The window names the follow-up before again, and the reservation is released."""
    rebuild = define(app)
    backend: LockBackend = rebuild.lock_backend
    key = rebuild.lock_key_for(("products",))
    backend.acquire(key, "running-token", LEASE, meta={"task_id": "running"})
    send(rebuild, Sent(rebuild), "follow-up", "edit 1")

    with pytest.raises(OSError, match="broker is down"):
        send(rebuild, Sent(rebuild, fail=True), "unsent", "edit 2")

    assert backend.debounce_take(key, "follow-up") == ("follow-up", 0.0)


def test_a_call_that_reserved_the_free_key_and_whose_publish_fails_takes_both_back(
    app: celery.Celery,
) -> None:
    """The key was free: the send reserved it and became the window's latest. Its publish
    fails: the reservation is released and the follow-up on its way is the latest again."""
    rebuild = define(app)
    backend: LockBackend = rebuild.lock_backend
    key = rebuild.lock_key_for(("products",))
    backend.acquire(key, "running-token", LEASE, meta={"task_id": "running"})
    send(rebuild, Sent(rebuild), "follow-up", "edit 1")
    backend.release(key, "running-token")  # the run ends; its follow-up has not started

    with pytest.raises(OSError, match="broker is down"):
        send(rebuild, Sent(rebuild, fail=True), "unsent", "edit 2")

    assert backend.holder(key) is None
    assert backend.debounce_take(key, "follow-up") == ("follow-up", 0.0)


def test_a_superseded_follow_up_ends_naming_the_later_call_and_the_latest_runs(
    app: celery.Celery,
) -> None:
    """On the worker's side (eager here): a message with the header runs only while the
    window names it."""
    app.conf.task_always_eager = True
    rebuild = define(app)
    backend: LockBackend = rebuild.lock_backend
    key = rebuild.lock_key_for(("products",))
    backend.debounce(key, "older", LEASE)
    backend.debounce(key, "latest", LEASE)
    headers = {LATEST_HEADER: 1}

    older = rebuild.apply(("products",), {"reason": "old"}, task_id="older", headers=headers)
    latest = rebuild.apply(("products",), {"reason": "new"}, task_id="latest", headers=headers)

    value = older.get()
    assert isinstance(value, Skipped)
    assert (value.reason, value.holder) == ("superseded", "latest")
    assert latest.get() == "new"


def test_latest_with_another_scope_is_refused_naming_task_and_attribute() -> None:
    """Declared with another scope: refused when the class is created."""
    app = celery.Celery("latest-bad", set_as_current=False)
    with pytest.raises(
        ConfigurationError, match=r"'latest\.bad' attribute lock_coalesce: .*'queue'"
    ):

        @app.task(base=SingletonTask, shared=False, lazy=False, name="latest.bad",
                  lock_scope="queue", lock_coalesce="latest")  # fmt: skip
        def bad() -> None: ...


def test_latest_with_the_apps_execution_scope_is_refused_when_bound() -> None:
    """The scope from the app's setting: refused when the task is bound to the app."""
    app = celery.Celery("latest-app", set_as_current=False)
    app.conf.update(singletask_backend_url="memory://")
    with pytest.raises(ConfigurationError, match=r"lock_coalesce: .*singletask_lock_scope 'exec"):

        @app.task(base=SingletonTask, shared=False, lazy=False, name="latest.app",
                  lock_coalesce="latest")  # fmt: skip
        def bad() -> None: ...


def test_an_unknown_choice_is_refused() -> None:
    app = celery.Celery("latest-choice", set_as_current=False)
    with pytest.raises(ConfigurationError, match=r"lock_coalesce: unknown follow-up choice"):

        @app.task(base=SingletonTask, shared=False, lazy=False, name="latest.c",
                  lock_scope="coalesce", lock_coalesce="last")  # fmt: skip
        def bad() -> None: ...


@pytest.mark.parametrize("url", ["memcached://127.0.0.1:1", "django://default"])
def test_a_store_without_windows_refuses_latest_when_the_task_is_bound(url: str) -> None:
    app = celery.Celery("latest-store", set_as_current=False)
    app.conf.update(singletask_backend_url=url)
    scheme = url.split(":", 1)[0]
    with pytest.raises(ConfigurationError, match=rf"lock_coalesce: the {scheme}:// lock store"):

        @app.task(base=SingletonTask, shared=False, lazy=False, name="latest.m",
                  lock_scope="coalesce", lock_coalesce="latest")  # fmt: skip
        def bad() -> None: ...
