"""``republish`` (singletask/protocol/headers.py): how an execution sent again ends when its
publish does not go through.

Issue 37 (seed 530434469): a ``"retry"``-policy execution whose soft time limit fired while it
published itself again ended as ``FAILURE(Reject)``, as if the broker had refused the message;
the time limit is what ended it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, Task
from celery.canvas import Signature
from celery.exceptions import Reject, SoftTimeLimitExceeded
from kombu.exceptions import OperationalError

from singletask.protocol.headers import republish


@pytest.fixture
def running() -> Iterator[Task[Any, Any]]:
    """A task with the request of a worker execution pushed (an attempt of message "m1")."""
    app = Celery("republish", broker="memory://", set_as_current=False)

    @app.task(bind=True, shared=False, name="republish.t")
    def t(self: Task[Any, Any]) -> None: ...

    t.push_request(id="m1", retries=0, called_directly=False, headers={}, args=(), kwargs={})
    try:
        yield t
    finally:
        t.pop_request()
        app.close()


def publish_raising(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    def apply_async(self: Signature[Any], *args: Any, **kwargs: Any) -> None:
        raise error

    monkeypatch.setattr(Signature, "apply_async", apply_async)


def test_a_soft_time_limit_during_the_publish_ends_the_execution_as_the_time_limit(
    running: Task[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given the soft time limit firing while the message is published again
    publish_raising(monkeypatch, SoftTimeLimitExceeded("soft time limit (0.4s) exceeded"))

    # Then the execution ends with the time limit (FAILURE SoftTimeLimitExceeded), not Reject
    with pytest.raises(SoftTimeLimitExceeded):
        republish(running, 0.3, {"x": 1}, None)


def test_a_publish_the_broker_refuses_still_ends_as_reject(
    running: Task[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a broker that refuses the message
    publish_raising(monkeypatch, OperationalError("broker down"))

    # Then the execution is rejected without requeue, as Task.retry() does
    with pytest.raises(Reject) as raised:
        republish(running, 0.3, {}, None)
    assert raised.value.requeue is False
    assert isinstance(raised.value.__cause__, OperationalError)
