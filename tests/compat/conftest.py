"""Fixtures of the compat tests: an eager app per test, and a clean database of the session's
private Redis server (never a server of the machine's)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from celery import Celery

import singletask.compat.once.backends.redis as once_redis
import singletask.compat.singleton.backends as singleton_backends


@pytest.fixture
def compat_redis(redis_base_url: str) -> Iterator[tuple[str, redis.Redis]]:
    """Database 9 of the session's Redis, emptied before and after the test."""
    url = f"{redis_base_url}/9"
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield url, client
    client.flushdb()
    client.close()


@pytest.fixture
def app(monkeypatch: pytest.MonkeyPatch) -> Celery:
    """An eager app; the old libraries' per-process caches emptied."""
    monkeypatch.setattr(once_redis, "redis", None)
    monkeypatch.setattr(singleton_backends, "_backend", None)
    app = Celery("compat", set_as_current=False)
    app.conf.task_always_eager = True
    return app
