"""singletask.compat.singleton: celery-singleton's API and keys, with singletask's execution
guarantees."""

from __future__ import annotations

import json
import pickle
from hashlib import md5
from typing import Any, ClassVar

import pytest
import redis
from celery import Celery

from singletask import ConfigurationError, SingletaskError
from singletask.compat.singleton import DuplicateTaskError, Singleton, clear_locks
from singletask.compat.singleton.backends import BaseBackend
from singletask.compat.singleton.exceptions import CelerySingletonException


class InMemory(BaseBackend):
    """A backend of the user's own, written to celery-singleton's BaseBackend."""

    locks: ClassVar[dict[str, str]] = {}
    made_with: ClassVar[list[tuple[Any, dict[str, Any]]]] = []

    def __init__(self, url: Any, **kwargs: Any) -> None:
        InMemory.made_with.append((url, kwargs))

    def lock(self, lock: str, task_id: str, expiry: float | None = None) -> bool:
        return InMemory.locks.setdefault(lock, task_id) == task_id

    def unlock(self, lock: str) -> None:
        InMemory.locks.pop(lock, None)

    def get(self, lock: str) -> str | None:
        return InMemory.locks.get(lock)

    def clear(self, key_prefix: str) -> None:
        for key in [k for k in InMemory.locks if k.startswith(key_prefix)]:
            del InMemory.locks[key]


@pytest.fixture
def own(app: Celery) -> Celery:
    InMemory.locks = {}
    InMemory.made_with = []
    app.conf.singleton_backend_class = InMemory
    app.conf.singleton_backend_url = "memory://here"
    app.conf.singleton_backend_kwargs = {"flavour": "plain"}
    return app


def expected_key(name: str, args: Any, kwargs: Any, prefix: str = "SINGLETONLOCK_") -> str:
    text = name + json.dumps(args, sort_keys=True) + json.dumps(kwargs, sort_keys=True)
    return prefix + md5(text.encode()).hexdigest()


def test_keys_are_celery_singletons(own: Celery) -> None:
    @own.task(shared=False, name="s.keys", base=Singleton)
    def every(a: int, b: int = 2) -> None: ...

    @own.task(shared=False, name="s.on", base=Singleton, unique_on="a")
    def on_a(a: int, b: int = 2) -> None: ...

    assert every.generate_lock("s.keys", [1], {"b": 3}) == expected_key("s.keys", [1], {"b": 3})
    assert on_a.generate_lock("s.on", [1], {"b": 3}) == expected_key("s.on", [], {"a": 1})
    own.conf.singleton_key_prefix = "MINE_"
    every._singleton_config = None
    assert every.generate_lock("s.keys", [], {}).startswith("MINE_")


def test_a_duplicate_gets_the_running_tasks_async_result(own: Celery) -> None:
    @own.task(shared=False, name="s.dup", base=Singleton)
    def dup() -> None: ...

    InMemory.locks[expected_key("s.dup", [], {})] = "holder-id"
    result = dup.delay()
    assert result.id == "holder-id"
    assert InMemory.made_with == [("memory://here", {"flavour": "plain"})]


def test_raise_on_duplicate_from_the_task_or_the_settings(own: Celery) -> None:
    @own.task(shared=False, name="s.raise", base=Singleton, raise_on_duplicate=True)
    def raises() -> None: ...

    @own.task(shared=False, name="s.conf", base=Singleton)
    def by_setting() -> None: ...

    InMemory.locks[expected_key("s.raise", [], {})] = "holder-id"
    with pytest.raises(DuplicateTaskError) as caught:
        raises.delay()
    assert caught.value.task_id == "holder-id"
    assert isinstance(caught.value, CelerySingletonException)
    assert isinstance(caught.value, SingletaskError)
    copy = pickle.loads(pickle.dumps(caught.value))
    assert (copy.task_id, str(copy)) == ("holder-id", str(caught.value))
    own.conf.singleton_raise_on_duplicate = True
    InMemory.locks[expected_key("s.conf", [], {})] = "other"
    with pytest.raises(DuplicateTaskError):
        by_setting.delay()


def test_the_lock_is_freed_on_success_and_failure(own: Celery) -> None:
    @own.task(shared=False, name="s.ends", base=Singleton)
    def ends(fail: bool) -> None:
        assert list(InMemory.locks) == [expected_key("s.ends", [fail], {})]
        if fail:
            raise ValueError("boom")

    ends.delay(False)
    ends.apply_async((True,), throw=False)
    assert InMemory.locks == {}


def test_apply_runs_and_frees_the_key_as_celery_singleton_did(own: Celery) -> None:
    @own.task(shared=False, name="s.apply", base=Singleton)
    def body(a: int) -> int:
        return a

    InMemory.locks[expected_key("s.apply", [1], {})] = "queued-by-delay"
    assert body.apply(args=(1,)).get() == 1
    assert InMemory.locks == {}


def test_a_message_sent_without_the_lock_takes_it_at_execution(own: Celery) -> None:
    @own.task(shared=False, name="s.worker", base=Singleton)
    def body() -> str:
        return "ran"

    def execute(task_id: str) -> Any:
        body.push_request(id=task_id, is_eager=False, called_directly=False, retries=0)
        try:
            return body()
        finally:
            body.pop_request()

    assert execute("m-1") == "ran"
    assert InMemory.locks == {}
    InMemory.locks[expected_key("s.worker", [], {})] = "holder"
    assert execute("m-2") is None  # a duplicate: skipped, the holder keeps its lock
    assert InMemory.locks == {expected_key("s.worker", [], {}): "holder"}


def test_clear_locks_empties_the_prefix(own: Celery) -> None:
    InMemory.locks.update({"SINGLETONLOCK_a": "1", "SINGLETONLOCK_b": "2", "other": "3"})
    clear_locks(own)
    assert InMemory.locks == {"other": "3"}


def test_challenge_lock_on_startup_takes_over_a_lock_no_worker_knows(
    own: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    @own.task(shared=False, name="s.challenge", base=Singleton, challenge_lock_on_startup=True)
    def challenged() -> None: ...

    key = expected_key("s.challenge", [], {})
    InMemory.locks[key] = "lost-id"
    monkeypatch.setattr(challenged, "holder_is_known", lambda task_id: False)
    assert challenged.delay().id != "lost-id"
    InMemory.locks[key] = "live-id"
    monkeypatch.setattr(challenged, "holder_is_known", lambda task_id: True)
    assert challenged.delay().id == "live-id"


def test_the_stock_redis_backend_and_owner_checked_release(
    app: Celery, compat_redis: tuple[str, redis.Redis]
) -> None:
    url, client = compat_redis
    app.conf.singleton_backend_url = url
    app.conf.singleton_lock_expiry = 60

    @app.task(shared=False, name="s.redis", base=Singleton, bind=True)
    def stored(self: Any) -> None:
        key = expected_key("s.redis", [], {})
        assert client.get(key) == self.request.id.encode()
        assert 0 < client.ttl(key) <= 60
        client.set(key, "a-newer-holder")

    stored.delay()
    assert client.keys("SINGLETONLOCK_*") == []  # by key, as celery-singleton does
    app.conf.singleton_owner_checked_release = True
    stored._singleton_config = None
    stored.delay()
    assert client.get(expected_key("s.redis", [], {})) == b"a-newer-holder"


def test_bad_options_fail_when_the_task_is_made(own: Celery) -> None:
    def body(a: int) -> None: ...

    with pytest.raises(ConfigurationError, match=r"s\.bad.*unique_on names no argument"):
        assert own.task(shared=False, name="s.bad", base=Singleton, unique_on=["b"])(body).run
    with pytest.raises(ConfigurationError, match=r"s\.bad2.*lock_expiry"):
        assert own.task(shared=False, name="s.bad2", base=Singleton, lock_expiry="1h")(body).run


class DjangoSettings:
    """Settings as Django holds them, read under the ``CELERY`` namespace."""

    CELERY_SINGLETON_KEY_PREFIX = "DJANGO_"
    CELERY_SINGLETON_RAISE_ON_DUPLICATE = True


def test_the_settings_under_a_django_namespace(app: Celery) -> None:
    app.config_from_object(DjangoSettings, namespace="CELERY")

    @app.task(shared=False, name="s.django", base=Singleton)
    def django_task() -> None: ...

    assert django_task.generate_lock("s.django").startswith("DJANGO_")
    assert django_task._raise_on_duplicate is True


def test_the_holders_own_retry_is_sent(own: Celery) -> None:
    """self.retry() sends the task again under its id while it holds the key: celery-singleton
    took that for a duplicate, sent nothing and kept the key for ever."""

    @own.task(shared=False, name="s.retry", base=Singleton)
    def again() -> str:
        return "ran"

    InMemory.locks[expected_key("s.retry", [], {})] = "same-id"
    result = again.apply_async(task_id="same-id", retries=1)
    assert (result.id, result.get()) == ("same-id", "ran")
    assert InMemory.locks == {}
