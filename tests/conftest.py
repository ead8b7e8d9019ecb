"""Session fixtures shared by every test module."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from singletask.backends import backend_from_url
from singletask.backends.base import LockBackend
from singletask.backends.memory import MemoryBackend
from singletask.backends.redis import RedisBackend
from singletask.backends.sqlite import SQLiteBackend

from .servers import (
    SQL_URLS,
    MemcachedServer,
    private_memcached,
    private_redis,
    sql_test_table,
    unavailable,
)

_redis_failure: list[str] = []
_memcached_failure: list[str] = []


@pytest.fixture(scope="session")
def redis_base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL (no database number) of the session's private Redis server."""
    if _redis_failure:
        unavailable(_redis_failure[0])
    try:
        with private_redis(Path(tmp_path_factory.mktemp("redis"))) as url:
            yield url
    except RuntimeError as exc:
        _redis_failure.append(f"cannot start a private redis-server: {exc}")
        unavailable(_redis_failure[0])


@pytest.fixture(scope="session")
def redis_url(redis_base_url: str) -> str:
    """URL of database 0 of the private Redis server (lock store of the unit and contract tests)."""
    return f"{redis_base_url}/0"


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    try:
        client.ping()
    except redis.ConnectionError as exc:
        unavailable(f"Redis at {redis_url} does not answer: {exc}")
    yield client
    client.close()


@pytest.fixture(scope="session")
def memcached_server() -> Iterator[MemcachedServer]:
    """The session's private memcached server (64 MB); tests must not stop it."""
    if _memcached_failure:
        unavailable(_memcached_failure[0])
    try:
        with private_memcached() as server:
            yield server
    except RuntimeError as exc:
        _memcached_failure.append(f"cannot start a private memcached: {exc}")
        unavailable(_memcached_failure[0])


@pytest.fixture(scope="session")
def memcached_url(memcached_server: MemcachedServer) -> str:
    return memcached_server.url


@pytest.fixture(scope="session")
def django_caches(request: pytest.FixtureRequest) -> dict[str, dict[str, object]]:
    """Django settings for this process, with a cache alias per kind of cache the tests use.

    ``memcached`` and ``redis`` point at the session's private servers (present only when that
    server is); the others are the caches singletask refuses.
    """
    from django.conf import settings

    caches: dict[str, dict[str, object]] = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "locmem": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "dummy": {"BACKEND": "django.core.cache.backends.dummy.DummyCache"},
        "files": {
            "BACKEND": "django.core.cache.backends.filebased.FileBasedCache",
            "LOCATION": str(Path(request.getfixturevalue("tmp_path_factory").mktemp("django"))),
        },
        "database": {
            "BACKEND": "django.core.cache.backends.db.DatabaseCache",
            "LOCATION": "singletask_cache",
        },
    }
    servers = {
        "memcached": ("memcached_url", "django.core.cache.backends.memcached.PyMemcacheCache"),
        "redis": ("redis_url", "django.core.cache.backends.redis.RedisCache"),
    }
    for alias, (fixture, backend) in servers.items():
        try:
            url = request.getfixturevalue(fixture)
        except (pytest.skip.Exception, pytest.fail.Exception):
            continue  # the tests of that alias skip / fail on the same fixture themselves
        location = url.removeprefix("memcached://") if alias == "memcached" else url
        caches[alias] = {"BACKEND": backend, "LOCATION": location}
    if not settings.configured:
        settings.configure(CACHES=caches, USE_TZ=True)
    return caches


@pytest.fixture
def key_prefix() -> str:
    """A key prefix no other test uses, so tests never need to flush anything."""
    return f"test:{uuid.uuid4().hex[:12]}:"


@pytest.fixture
def sql_store(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """``(url, table)`` of a fresh table of the SQL server named by the test's parameter
    (``postgresql`` or ``mysql``), dropped after the test."""
    with sql_test_table(request.param) as table:
        yield SQL_URLS[request.param], table


@pytest.fixture(
    params=[
        "memory",
        "redis",
        "redis-client",
        "sqlite",
        "postgresql",
        "mysql",
        "memcached",
        "django-memcached",
        "django-redis",
    ]
)
def backend(request: pytest.FixtureRequest) -> Iterator[LockBackend]:
    """Every backend, for the contract suite.

    ``redis`` is built from a URL (it sends its scripts on connections of its own);
    ``redis-client`` is given a ready client (it calls that client's methods);
    ``postgresql`` and ``mysql`` use a table of their own on the machine's servers.
    ``django-memcached`` and ``django-redis`` are ``django://`` stores over Django caches of
    the session's memcached and Redis servers.
    """
    client: redis.Redis | None = None
    if request.param in SQL_URLS:
        with sql_test_table(request.param) as table:
            instance = backend_from_url(SQL_URLS[request.param], table=table)
            yield instance
            instance.close()
        return
    if request.param == "memcached":
        instance: LockBackend = backend_from_url(request.getfixturevalue("memcached_url"))
    elif request.param.startswith("django-"):
        alias = request.param.removeprefix("django-")
        request.getfixturevalue(f"{alias}_url")  # fails / skips when the server is missing
        request.getfixturevalue("django_caches")
        instance = backend_from_url(f"django://{alias}")
    elif request.param == "memory":
        instance = MemoryBackend()
    elif request.param == "sqlite":
        tmp_path = request.getfixturevalue("tmp_path")
        instance = SQLiteBackend.from_url(f"sqlite:///{tmp_path}/locks.db")
    elif request.param == "redis-client":
        client = redis.Redis.from_url(request.getfixturevalue("redis_url"))
        request.getfixturevalue("redis_client")  # fails / skips when the server is missing
        instance = RedisBackend(client=client)
    else:
        url = request.getfixturevalue("redis_url")
        request.getfixturevalue("redis_client")  # fails / skips when the server is missing
        instance = RedisBackend.from_url(url)
    yield instance
    instance.close()
    if client is not None:
        client.close()  # the backend leaves a client it was given open
