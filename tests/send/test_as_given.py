"""A send reaches Celery as it was given, unless a feature of the send needs singletask's header
(issue 37, item 6).

Celery's own tests, and users' tests, expect the exact call to ``send_task_message``; a header
singletask adds to every send breaks them. Here each send goes through a real Celery app and
Celery's own publish path (``amqp.send_task_message`` and kombu's producer over the in-memory
transport, both recorded and then run); a plain ``celery.Task`` of the same name, sent the same
way, is the reference. ``headers`` that are not a mapping (Celery's own tests pass an int) are
Celery's business when singletask needs nothing from them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import celery
import pytest
from kombu import Producer

from singletask import SingletonTask
from singletask.protocol.headers import LATEST_HEADER, SENT_AT_HEADER

NAME = "as_given.work"
TASK_ID = "as-given-0001"
KOMBU_PUBLISH = Producer.publish


def body(*args: Any, **kwargs: Any) -> None:
    return None


class Capture:
    """Records every ``send_task_message`` call of ``app`` and every message kombu's producer
    publishes from then on, then lets Celery send it (to the in-memory broker)."""

    def __init__(self, app: celery.Celery, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[dict[str, Any]] = []
        self.published: list[dict[str, Any]] = []
        send = app.amqp.send_task_message

        def send_task_message(producer: Any, name: str, message: Any, **options: Any) -> Any:
            self.calls.append({"name": name, **options})
            return send(producer, name, message, **options)

        publish = KOMBU_PUBLISH  # kombu's own, not an earlier capture's

        def recording_publish(producer: Any, body: Any, **options: Any) -> Any:
            self.published.append(dict(options.get("headers") or {}))
            return publish(producer, body, **options)

        monkeypatch.setattr(app.amqp, "send_task_message", send_task_message)
        monkeypatch.setattr(Producer, "publish", recording_publish)


def make_app(base: type[celery.Task[Any, Any]], **task_options: Any) -> celery.Celery:
    app = celery.Celery("as-given", set_as_current=False, broker="memory://")
    app.conf.update(singletask_backend_url="memory://", task_default_queue="as-given")
    app.task(name=NAME, base=base, shared=False, **task_options)(body)
    return app


@pytest.fixture
def apps() -> Iterator[list[celery.Celery]]:
    made: list[celery.Celery] = []
    yield made
    for app in made:
        app.close()


def sent(
    apps: list[celery.Celery],
    monkeypatch: pytest.MonkeyPatch,
    base: type[celery.Task[Any, Any]],
    options: dict[str, Any],
    **task_options: Any,
) -> Capture:
    """Send ``NAME`` once with ``options`` through an app whose task has ``base``."""
    app = make_app(base, **task_options)
    apps.append(app)
    capture = Capture(app, monkeypatch)
    app.tasks[NAME].apply_async((1,), {"b": 2}, task_id=TASK_ID, **options)
    return capture


SENDS = [
    {},
    {"headers": None},
    {"headers": {}},
    {"headers": {"tenant": "a"}, "priority": 3, "eta": "2030-01-01T00:00:00+00:00"},
    {"headers": 0},
    {"time_limit": 30, "serializer": "json", "queue": "as-given", "shadow": "work"},
]


@pytest.mark.parametrize("options", SENDS, ids=repr)
def test_a_send_that_needs_nothing_reaches_celery_exactly_as_given(
    apps: list[celery.Celery], monkeypatch: pytest.MonkeyPatch, options: dict[str, Any]
) -> None:
    # Given a singleton task with the default options, and a plain Celery task of the same name
    # When each is sent with the same options
    plain = sent(apps, monkeypatch, celery.Task, dict(options))
    singleton = sent(apps, monkeypatch, SingletonTask, dict(options))

    # Then Celery's send_task_message is called with the same options for both
    assert len(singleton.calls) == 1
    assert singleton.calls == plain.calls
    # And kombu's producer publishes the same headers (the origin and the task's own aside)
    assert len(singleton.published) == 1
    assert singleton.published == plain.published
    assert SENT_AT_HEADER not in singleton.published[0]


def test_non_mapping_headers_fail_a_publish_as_they_do_in_celery(
    apps: list[celery.Celery], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given headers that are not a mapping, which Celery cannot merge into its own
    # When a plain task and a singleton task are sent with them
    errors = []
    for base in (celery.Task, SingletonTask):
        with pytest.raises(TypeError) as raised:
            sent(apps, monkeypatch, base, {"headers": 123})
        errors.append(str(raised.value))
    # Then both fail in Celery, with Celery's own error
    assert errors[0] == errors[1]


@pytest.mark.parametrize("base", [celery.Task, SingletonTask], ids=["Task", "SingletonTask"])
def test_non_mapping_headers_of_an_eager_execution_are_its_request_headers(
    base: type[celery.Task[Any, Any]],
) -> None:
    # Given a task that returns its request's headers and the headers of a nested apply()
    app = celery.Celery("as-given-eager", set_as_current=False)
    app.conf.update(singletask_backend_url="memory://")

    keyed = {"lock_args": ["depth"]} if base is SingletonTask else {}

    @app.task(base=base, bind=True, shared=False, name="as_given.eager", **keyed)
    def nested(self: Any, depth: int) -> Any:
        if depth:
            return nested.apply(args=(depth - 1,), headers=456).get()
        return self.request.headers

    # When it runs eagerly with headers that are ints, as Celery's own tests do
    try:
        result = nested.apply(args=(1,), headers=123)
        # Then it runs, and its request has the headers as given
        assert result.get() == 456
        assert nested.apply(args=(0,), headers=123).get() == 123
    finally:
        app.close()


@pytest.mark.parametrize(
    ("task_options", "conf"),
    [
        ({"lock_policy": "retry"}, {}),
        ({"lock_scope": "coalesce"}, {}),
        ({"lock_policy": "replace"}, {}),
        ({}, {"worker_send_task_events": True}),
        ({}, {"singletask_send_events": True}),
    ],
    ids=["retry", "coalesce", "replace", "worker_send_task_events", "singletask_send_events"],
)
def test_a_send_whose_wait_is_measured_or_order_judged_carries_its_send_time(
    apps: list[celery.Celery],
    monkeypatch: pytest.MonkeyPatch,
    task_options: dict[str, Any],
    conf: dict[str, Any],
) -> None:
    # Given a task that may wait for its lock, or whose holders are ordered by send time
    # ("replace": the later send wins), or an app whose workers report the wait
    app = make_app(SingletonTask, **task_options)
    app.conf.update(conf)
    apps.append(app)
    capture = Capture(app, monkeypatch)
    # When it is sent with headers of the caller's
    app.tasks[NAME].apply_async((1,), task_id=TASK_ID, headers={"tenant": "a"})
    # Then its message carries the caller's headers and the send time
    (published,) = capture.published
    assert published["tenant"] == "a"
    assert isinstance(published[SENT_AT_HEADER], float)
    # And an int given as headers is left to Celery (which fails the publish), not refused by
    # singletask with another error (with "coalesce", a second send of the key is joined)
    if task_options.get("lock_scope") != "coalesce":
        with pytest.raises(TypeError, match="not iterable"):
            app.tasks[NAME].apply_async((2,), headers=123)


def test_coalesce_latest_refuses_non_mapping_headers_before_reserving(
    apps: list[celery.Celery], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a task whose sends carry the "latest" mark
    app = make_app(SingletonTask, lock_scope="coalesce", lock_coalesce="latest")
    apps.append(app)
    capture = Capture(app, monkeypatch)
    task = app.tasks[NAME]
    # When it is sent with an int as headers
    with pytest.raises(TypeError, match="headers must be a mapping"):
        task.apply_async((1,), headers=123)
    # Then nothing was published and the key is not reserved
    assert capture.published == []
    assert task.lock_backend.holder(task.lock_key_for((1,))) is None
    # And a send with a dict of headers carries both
    task.apply_async((1,), headers={"tenant": "a"})
    (published,) = capture.published
    assert published["tenant"] == "a"
    assert published[LATEST_HEADER] == 1
