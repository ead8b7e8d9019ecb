"""singletask.compat.heimdall: celery-heimdall's API, its keys, and a sliding-log rate."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import redis
from celery import Celery

from singletask import ConfigurationError, SingletaskError
from singletask.compat.heimdall import AlreadyQueuedError, HeimdallTask, RateLimit
from singletask.compat.heimdall import task as heimdall_task


@pytest.fixture
def hub(app: Celery, compat_redis: tuple[str, redis.Redis]) -> Celery:
    app.conf.result_backend = compat_redis[0]
    app.conf.heimdall_unique_lock_blocking = False
    return app


def test_unique_duplicates_get_the_holder_or_raise(
    hub: Celery, compat_redis: tuple[str, redis.Redis]
) -> None:
    client = compat_redis[1]

    @hub.task(shared=False, name="h.unique", base=HeimdallTask, heimdall={"unique": True})
    def unique(a: int) -> None: ...

    @hub.task(
        shared=False,
        name="h.raises",
        base=HeimdallTask,
        heimdall={"unique": True, "unique_raises": True},
    )
    def raises() -> None: ...

    key = heimdall_task.unique_key_for_task(unique, [1], {}, prefix="h-lock:")
    client.set(key, "holder", ex=100)
    assert unique.delay(1).id == "holder"
    client.set(heimdall_task.unique_key_for_task(raises, [], {}, prefix="h-lock:"), "h", ex=50)
    with pytest.raises(AlreadyQueuedError) as caught:
        raises.delay()
    assert (caught.value.likely_culprit, 0 < caught.value.expires_in <= 50) == ("h", True)
    assert isinstance(caught.value, SingletaskError)
    copy = pickle.loads(pickle.dumps(caught.value))
    assert (copy.likely_culprit, copy.expires_in) == ("h", caught.value.expires_in)


def test_the_lock_is_freed_after_the_run_unless_told_to_wait(
    hub: Celery, compat_redis: tuple[str, redis.Redis]
) -> None:
    client = compat_redis[1]

    @hub.task(
        shared=False, name="h.key", base=HeimdallTask, heimdall={"unique": True, "key": "feed"}
    )
    def keyed() -> None:
        assert client.get("h-lock:feed") is not None

    @hub.task(
        shared=False,
        name="h.wait",
        base=HeimdallTask,
        heimdall={"unique": True, "key": lambda args, kwargs: f"w{args[0]}",
                  "unique_wait_for_expiry": True},
    )  # fmt: skip
    def waits(a: int) -> None: ...

    keyed.delay()
    assert client.get("h-lock:feed") is None
    waits.delay(3)
    assert client.get("h-lock:w3") is not None


def test_a_duplicate_found_at_execution_returns_none_and_keeps_the_holders_lock(
    hub: Celery, compat_redis: tuple[str, redis.Redis]
) -> None:
    client = compat_redis[1]

    @hub.task(
        shared=False, name="h.run", base=HeimdallTask, heimdall={"unique": True, "key": "run"}
    )
    def body() -> str:
        return "ran"

    client.set("h-lock:run", "holder", ex=100)
    body.push_request(id="m-2", is_eager=False, called_directly=False, retries=0)
    try:
        assert body() is None
    finally:
        body.pop_request()
    assert client.get("h-lock:run") == b"holder"  # celery-heimdall deleted it here


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def time(self) -> float:
        return self.now


def test_the_rate_is_a_sliding_log_third_start_of_2_per_10s_at_10s(
    hub: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    monkeypatch.setattr(heimdall_task.time, "time", clock.time)

    @hub.task(
        shared=False, name="h.rate", base=HeimdallTask, heimdall={"rate_limit": RateLimit((2, 10))}
    )
    def rated() -> None: ...

    key = heimdall_task.unique_key_for_task(rated, [], {}, prefix="h-rate:")

    def start(task_id: str) -> float:
        rated.push_request(id=task_id)
        try:
            return heimdall_task.rate_limited_countdown(rated, key, [], {})
        finally:
            rated.pop_request()

    # six sent at once: a GCRA with a burst of 2 would start the third at 5 s
    assert [start(f"t{n}") for n in range(1, 7)] == [0, 0, 10, 10, 20, 20]
    clock.now += 10
    assert [start("t6"), start("t4"), start("t3"), start("t5")] == [10, 0, 0, 10]
    clock.now += 10
    assert [start("t5"), start("t6"), start("t7")] == [0, 0, 10]


def test_times_per_and_a_callable_rate(hub: Celery) -> None:
    @hub.task(shared=False, name="h.tp", base=HeimdallTask, heimdall={"times": 1, "per": 30})
    def legacy() -> None: ...

    @hub.task(
        shared=False,
        name="h.fn",
        base=HeimdallTask,
        heimdall={"rate_limit": RateLimit(lambda key, args: (len(args), 20))},
    )
    def called(a: int, b: int) -> None: ...

    assert heimdall_task.rate_of(legacy, "k", [], {}) == (1, 30.0)
    assert heimdall_task.rate_of(called, "k", [1, 2], {}) == (2, 20.0)


def test_a_rate_limited_start_in_a_worker_is_sent_again_without_spending_retries(
    hub: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    @hub.task(shared=False, name="h.defer", base=HeimdallTask, heimdall={"times": 1, "per": 30})
    def deferred() -> str:
        return "ran"

    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(deferred, "retry", lambda **kw: sent.append(kw) or RuntimeError("retry"))
    deferred.push_request(id="first", is_eager=False, called_directly=False, retries=0)
    try:
        assert deferred() == "ran"
    finally:
        deferred.pop_request()
    deferred.push_request(id="second", is_eager=False, called_directly=False, retries=2)
    try:
        with pytest.raises(RuntimeError):
            deferred()
        assert deferred.request.retries == 1  # the retry sends retries + 1: two again
    finally:
        deferred.pop_request()
    assert 29 < sent[0]["countdown"] <= 30


def test_the_redis_client_comes_from_the_result_backend_or_setup_redis(app: Celery) -> None:
    @app.task(shared=False, name="h.none", base=HeimdallTask, heimdall={"unique": True})
    def nothing() -> None: ...

    with pytest.raises(NotImplementedError, match=r"h\.none"):
        assert nothing.heimdall_redis


def test_bad_heimdall_options_fail_when_the_task_is_made(app: Celery) -> None:
    def body() -> None: ...

    with pytest.raises(ConfigurationError, match=r"h\.bad.*unknown keys \['uniqe'\]"):
        assert app.task(shared=False, name="h.bad", base=HeimdallTask, heimdall={"uniqe": True})(
            body
        ).run
    with pytest.raises(ConfigurationError, match=r"h\.bad2.*'times' and 'per'"):
        assert app.task(shared=False, name="h.bad2", base=HeimdallTask, heimdall={"times": 2})(
            body
        ).run


def test_owner_checked_release_is_an_option(
    hub: Celery, compat_redis: tuple[str, redis.Redis]
) -> None:
    client = compat_redis[1]

    @hub.task(
        shared=False,
        name="h.owner",
        base=HeimdallTask,
        heimdall={"unique": True, "key": "own", "owner_checked_release": True},
    )
    def owned() -> None:
        client.set("h-lock:own", "a-newer-holder")  # the lock ran out and another took it

    owned.delay()
    assert client.get("h-lock:own") == b"a-newer-holder"  # celery-heimdall deleted it


def test_the_holders_own_retry_is_sent(hub: Celery, compat_redis: tuple[str, redis.Redis]) -> None:
    client = compat_redis[1]

    @hub.task(
        shared=False, name="h.retry", base=HeimdallTask, heimdall={"unique": True, "key": "again"}
    )
    def again() -> str:
        return "ran"

    client.set("h-lock:again", "same-id", ex=100)
    result = again.apply_async(task_id="same-id", retries=1)
    assert (result.id, result.get()) == ("same-id", "ran")
    assert client.get("h-lock:again") is None
