"""singletask.compat.once: celery-once's API and keys, with singletask's execution guarantees."""

from __future__ import annotations

import pickle
from typing import Any, ClassVar

import pytest
import redis
from celery import Celery
from celery.exceptions import Ignore
from celery.result import EagerResult

from singletask import ConfigurationError, SingletaskError
from singletask.compat.once import AlreadyQueued, QueueOnce


class Recording:
    """A backend written to celery-once's protocol, keeping its locks in a class dict."""

    locks: ClassVar[dict[str, float]] = {}
    calls: ClassVar[list[tuple[str, str]]] = []

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings

    def raise_or_lock(self, key: str, timeout: float) -> None:
        Recording.calls.append(("lock", key))
        if key in Recording.locks:
            raise AlreadyQueued(Recording.locks[key])
        Recording.locks[key] = timeout

    def clear_lock(self, key: str) -> None:
        Recording.calls.append(("clear", key))
        Recording.locks.pop(key, None)


@pytest.fixture
def recording(app: Celery) -> Celery:
    Recording.locks = {}
    Recording.calls = []
    app.conf.ONCE = {"backend": f"{__name__}.Recording", "settings": {"default_timeout": 60}}
    return app


def test_keys_are_celery_onces(recording: Celery) -> None:
    @recording.task(shared=False, name="t.keys", base=QueueOnce, once={"keys": ["a"]})
    def keyed(a: int, b: int = 2) -> None: ...

    @recording.task(shared=False, name="t.all", base=QueueOnce, bind=True)
    def every(self: Any, a: int, b: dict[str, int]) -> None: ...

    assert keyed.get_key((1,), {"b": 5}) == "qo_t.keys_a-1"
    assert every.get_key((1,), {"b": {"y": 1, "x": 2}}) == "qo_t.all_a-1_b-{'x': 2, 'y': 1}"


def test_a_send_locks_the_key_and_the_execution_frees_it(recording: Celery) -> None:
    @recording.task(shared=False, name="t.sent", base=QueueOnce)
    def sent(a: int) -> int:
        assert Recording.locks == {"qo_t.sent_a-1": 60}
        return a

    assert sent.delay(1).get() == 1
    assert Recording.calls == [("lock", "qo_t.sent_a-1"), ("clear", "qo_t.sent_a-1")]


def test_a_duplicate_raises_already_queued_with_its_countdown(recording: Celery) -> None:
    @recording.task(shared=False, name="t.dup", base=QueueOnce)
    def dup() -> None: ...

    Recording.locks["qo_t.dup"] = 42
    with pytest.raises(AlreadyQueued) as caught:
        dup.delay()
    assert caught.value.countdown == 42
    assert caught.value.message == "Expires in 42 seconds"
    assert isinstance(caught.value, SingletaskError)
    assert pickle.loads(pickle.dumps(caught.value)).countdown == 42


def test_graceful_returns_celery_onces_rejected_eager_result(recording: Celery) -> None:
    @recording.task(shared=False, name="t.graceful", base=QueueOnce, once={"graceful": True})
    def graceful() -> None: ...

    @recording.task(shared=False, name="t.strict", base=QueueOnce)
    def strict() -> None: ...

    Recording.locks.update({"qo_t.graceful": 5, "qo_t.strict": 5})
    result = graceful.delay()
    assert isinstance(result, EagerResult)
    assert (result.state, result.result) == ("REJECTED", None)
    # per call: graceful and timeout
    assert strict.apply_async(once={"graceful": True}).state == "REJECTED"
    Recording.locks.clear()
    strict.apply_async(once={"timeout": 7})
    assert ("lock", "qo_t.strict") in Recording.calls


def test_the_timeout_comes_from_the_call_the_task_then_the_settings(recording: Celery) -> None:
    seen: list[float] = []

    class Seeing(Recording):
        def raise_or_lock(self, key: str, timeout: float) -> None:
            seen.append(timeout)

    recording.conf.ONCE = {"backend": f"{__name__}.Seeing", "settings": {"default_timeout": 9}}
    globals()["Seeing"] = Seeing

    @recording.task(shared=False, name="t.timeout", base=QueueOnce, once={"timeout": 30})
    def timed() -> None: ...

    @recording.task(shared=False, name="t.default", base=QueueOnce)
    def default() -> None: ...

    timed.delay()
    timed.apply_async(once={"timeout": 3})
    default.delay()
    assert seen == [30, 3, 9]


def test_celery_once_under_a_django_namespace(app: Celery) -> None:
    app.conf.CELERY_ONCE = {"backend": f"{__name__}.Recording", "settings": {}}

    @app.task(shared=False, name="t.django", base=QueueOnce)
    def django_task() -> None: ...

    assert django_task.once_config["backend"].endswith("Recording")
    assert django_task.default_timeout == 3600


def test_without_once_the_error_names_the_task(app: Celery) -> None:
    @app.task(shared=False, name="t.unset", base=QueueOnce)
    def unset() -> None: ...

    with pytest.raises(ConfigurationError, match=r"t\.unset"):
        unset.delay()


def test_bad_once_options_fail_when_the_task_is_made(app: Celery) -> None:
    def bad(a: int) -> None: ...

    with pytest.raises(ConfigurationError, match=r"t\.bad.*unknown keys \['grace'\]"):
        assert app.task(shared=False, name="t.bad", base=QueueOnce, once={"grace": True})(bad).run
    with pytest.raises(ConfigurationError, match=r"t\.bad2.*no argument \['b'\]"):
        assert app.task(shared=False, name="t.bad2", base=QueueOnce, once={"keys": ["b"]})(bad).run


def test_unlock_before_run_frees_before_the_body(recording: Celery) -> None:
    @recording.task(shared=False, name="t.early", base=QueueOnce, once={"unlock_before_run": True})
    def early() -> None:
        assert Recording.locks == {}

    early.delay()
    assert Recording.calls == [("lock", "qo_t.early"), ("clear", "qo_t.early")]


@pytest.mark.parametrize("ending", ["ignore", "error"])
def test_the_key_is_freed_on_every_ending(recording: Celery, ending: str) -> None:
    @recording.task(shared=False, name=f"t.end.{ending}", base=QueueOnce)
    def ends() -> None:
        raise Ignore() if ending == "ignore" else ValueError("boom")

    ends.apply_async(throw=False) if ending == "error" else ends.delay()
    assert Recording.locks == {}


def test_the_key_sent_is_the_key_freed_even_if_the_arguments_change(recording: Celery) -> None:
    """celery-once rebuilt the key on the worker from str() of the arguments: a tuple sent
    arrives as a list, so "qo_..._a-(1, 2)" was never freed. The sent key travels with the
    message now."""

    @recording.task(shared=False, name="t.tuple", base=QueueOnce)
    def tupled(a: Any) -> None: ...

    key = tupled.get_key(((1, 2),), {})
    Recording.locks[key] = 60
    tupled.apply(([1, 2],), headers={"singletask_compat_key": key})
    assert Recording.locks == {}


def test_a_message_sent_without_the_lock_takes_it_at_execution(recording: Celery) -> None:
    """send_task() and beat's fallback skip apply_async: the execution takes the key, and a
    held key makes it a duplicate (graceful: skipped; else AlreadyQueued)."""

    @recording.task(shared=False, name="t.worker", base=QueueOnce)
    def body() -> str:
        return "ran"

    def execute() -> Any:
        body.push_request(id="m-1", is_eager=False, called_directly=False, retries=0)
        try:
            return body()
        finally:
            body.pop_request()

    assert execute() == "ran"
    assert Recording.calls == [("lock", "qo_t.worker"), ("clear", "qo_t.worker")]
    Recording.locks["qo_t.worker"] = 5
    with pytest.raises(AlreadyQueued):
        execute()
    assert Recording.locks == {"qo_t.worker": 5}  # the holder keeps its lock


def test_the_stock_redis_backend_keeps_celery_onces_keys(
    app: Celery, compat_redis: tuple[str, redis.Redis]
) -> None:
    url, client = compat_redis
    app.conf.ONCE = {"backend": "singletask.compat.once.backends.Redis", "settings": {"url": url}}

    @app.task(shared=False, name="t.redis", base=QueueOnce)
    def stored(a: int) -> int:
        assert 0 < client.pttl("qo_t.redis_a-1") <= 3_600_000
        return a

    assert stored.delay(1).get() == 1
    assert client.keys("qo_*") == []
    stored.once_backend.raise_or_lock("qo_t.redis_a-1", timeout=30)
    with pytest.raises(AlreadyQueued) as caught:
        stored.delay(1)
    assert 0 < caught.value.countdown <= 30


def test_owner_checked_release_is_an_option(
    app: Celery, compat_redis: tuple[str, redis.Redis]
) -> None:
    url, client = compat_redis
    app.conf.ONCE = {
        "backend": "singletask.compat.once.backends.Redis",
        "settings": {"url": url, "owner_checked_release": True},
    }

    @app.task(shared=False, name="t.owner", base=QueueOnce)
    def owned() -> None:
        client.set("qo_t.owner", "somebody-else")  # the lock ran out and another took it

    owned.delay()
    assert client.get("qo_t.owner") == b"somebody-else"


def test_the_file_backend(app: Celery, tmp_path: Any) -> None:
    app.conf.ONCE = {
        "backend": "singletask.compat.once.backends.File",
        "settings": {"location": str(tmp_path)},
    }

    @app.task(shared=False, name="t.file", base=QueueOnce)
    def filed() -> None:
        assert len(list(tmp_path.iterdir())) == 1

    filed.delay()
    assert list(tmp_path.iterdir()) == []


def test_the_class_level_once_dict_is_shared_as_in_celery_once(recording: Celery) -> None:
    @recording.task(shared=False, name="t.shared", base=QueueOnce)
    def shared() -> None: ...

    Recording.locks["qo_t.shared"] = 1
    QueueOnce.once["graceful"] = True
    try:
        assert shared.delay().state == "REJECTED"
    finally:
        QueueOnce.once["graceful"] = False


def test_a_retry_keeps_the_lock_and_its_last_run_frees_it(recording: Celery) -> None:
    held: list[bool] = []

    @recording.task(shared=False, name="t.retry", base=QueueOnce, bind=True, max_retries=2)
    def flaky(self: Any) -> str:
        held.append("qo_t.retry" in Recording.locks)
        if self.request.retries < 2:
            raise self.retry(countdown=0)
        return "done"

    assert flaky.delay().get() == "done"
    assert held == [True, True, True]
    assert Recording.locks == {}
    assert Recording.calls.count(("clear", "qo_t.retry")) == 1


class DjangoSettings:
    """Settings as Django holds them, read under the ``CELERY`` namespace."""

    CELERY_ONCE: ClassVar[dict[str, Any]] = {
        "backend": f"{__name__}.Recording",
        "settings": {"default_timeout": 12},
    }


def test_once_read_under_a_django_namespace(app: Celery) -> None:
    app.config_from_object(DjangoSettings, namespace="CELERY")

    @app.task(shared=False, name="t.namespace", base=QueueOnce)
    def namespaced() -> None: ...

    assert namespaced.default_timeout == 12
