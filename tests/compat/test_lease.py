"""Under the compat bases a running task's lock is a lease: renewed while the body runs on the
stock stores, so a run longer than the lock's lifetime keeps it (the old libraries let it end
mid-run)."""

from __future__ import annotations

import time
from typing import Any

import redis
from celery import Celery

from singletask.compat.heimdall import HeimdallTask
from singletask.compat.heimdall import task as heimdall_task
from singletask.compat.once import QueueOnce
from singletask.compat.singleton import Singleton


def test_once_renews_its_timeout_while_the_body_runs(
    app: Celery, compat_redis: tuple[str, redis.Redis]
) -> None:
    url, client = compat_redis
    app.conf.ONCE = {"backend": "singletask.compat.once.backends.Redis", "settings": {"url": url}}

    @app.task(shared=False, name="l.once", base=QueueOnce, once={"timeout": 0.6})
    def long_run() -> int:
        time.sleep(1.0)
        return int(client.pttl("qo_l.once"))

    assert long_run.delay().get() > 0  # still held after 1.0 s of a 0.6 s timeout
    assert client.exists("qo_l.once") == 0


def test_singleton_renews_its_lock_expiry_while_the_body_runs(
    app: Celery, compat_redis: tuple[str, redis.Redis]
) -> None:
    url, client = compat_redis
    app.conf.singleton_backend_url = url

    @app.task(shared=False, name="l.singleton", base=Singleton, lock_expiry=1, bind=True)
    def long_run(self: Any) -> bytes | None:
        time.sleep(1.4)
        return client.get(self.generate_lock("l.singleton"))  # type: ignore[no-any-return]

    result = long_run.delay()
    assert result.get() == result.id.encode()


def test_heimdall_renews_its_unique_timeout_while_the_body_runs(
    app: Celery, compat_redis: tuple[str, redis.Redis]
) -> None:
    app.conf.result_backend = compat_redis[0]
    client = compat_redis[1]

    @app.task(
        shared=False,
        name="l.heimdall",
        base=HeimdallTask,
        heimdall={"unique": True, "unique_timeout": 1, "key": "long"},
    )
    def long_run() -> bytes | None:
        time.sleep(1.4)
        return client.get("h-lock:long")  # type: ignore[no-any-return]

    assert long_run.delay().get() is not None
    assert heimdall_task.unique_key_for_task(long_run, [], {}, prefix="h-lock:") == "h-lock:long"
