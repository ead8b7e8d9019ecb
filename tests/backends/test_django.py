"""django:// specifics: which caches are accepted, which refused and why, and what is shared.

The shared behaviour is in tests/contract/test_contract.py (the ``django-memcached`` and
``django-redis`` params). The ``django_caches`` fixture configures Django in this process with one
alias per kind of cache.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import override_settings

from singletask.backends import backend_from_url
from singletask.backends.django import DjangoCacheBackend
from singletask.backends.memcached import MemcachedBackend
from singletask.backends.redis import RedisBackend
from singletask.exceptions import BackendTimeout, ConfigurationError, UnsupportedOperation

LEASE = 60.0


@pytest.fixture(autouse=True)
def _django(django_caches: dict[str, dict[str, object]]) -> None:
    """Django is configured for every test of this module."""


@pytest.fixture
def key(key_prefix: str) -> str:
    return f"{key_prefix}lock"


@pytest.mark.parametrize(
    ("alias", "reason"),
    [
        ("locmem", "memory of one process"),
        ("dummy", "add() always succeeds"),
        ("files", "not atomic across processes"),
        ("database", "two workers can both take an expired lock"),
    ],
)
def test_caches_without_atomic_cross_process_operations_are_refused(
    alias: str, reason: str
) -> None:
    """LocMem, dummy, file and database caches are refused when the backend is built, with why."""
    # When a django:// URL names such a cache (Django is configured, as in a worker)
    with pytest.raises(ConfigurationError) as caught:
        backend_from_url(f"django://{alias}")

    # Then the error names the alias, the cache class and the reason
    message = str(caught.value)
    assert f"django://{alias}" in message
    assert "refuses the cache django.core.cache.backends." in message
    assert reason in message


def test_a_refused_cache_is_refused_on_first_use_too() -> None:
    """Built before Django was configured, the backend refuses the cache on its first call."""
    backend = DjangoCacheBackend("locmem")
    with pytest.raises(ConfigurationError, match="memory of one process"):
        backend.acquire("any:key", "token-a", LEASE)


def test_an_unknown_alias_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match=r"no cache 'nope' in the CACHES setting"):
        backend_from_url("django://nope")


def test_django_without_an_alias_means_default_and_a_path_is_refused() -> None:
    """``django://`` is the default alias (LocMem here, so refused); a path is a mistake."""
    with pytest.raises(ConfigurationError, match="django://default"):
        backend_from_url("django://")
    with pytest.raises(ConfigurationError, match="django://<alias of CACHES>"):
        backend_from_url("django://redis/1")


def test_a_redis_cache_runs_the_redis_store_on_the_same_keys(redis_url: str, key: str) -> None:
    """django:// over a RedisCache and redis:// to the same server see the same locks."""
    # Given a lock taken through the Django cache
    through_django = backend_from_url("django://redis")
    assert isinstance(through_django, DjangoCacheBackend)
    assert isinstance(through_django.store(), RedisBackend)
    held = through_django.acquire(key, "token-a", LEASE, meta={"task_id": "a"})
    assert held.acquired

    # When the same server is used directly
    direct = backend_from_url(redis_url)

    # Then it sees that holder, and cannot take the lock
    holder = direct.holder(key)
    assert holder is not None
    assert (holder.token, holder.fence) == ("token-a", held.fence)
    assert not direct.acquire(key, "token-b", LEASE).acquired
    assert through_django.release(key, "token-a")
    direct.close()
    through_django.close()


@pytest.fixture
def django_memcached(memcached_url: str) -> Iterator[DjangoCacheBackend]:
    backend = backend_from_url("django://memcached")
    assert isinstance(backend, DjangoCacheBackend)
    yield backend
    backend.close()


def test_a_memcached_cache_runs_the_memcached_store(
    django_memcached: DjangoCacheBackend, memcached_url: str, key: str
) -> None:
    """django:// over a PyMemcacheCache is the memcached store on the cache's servers."""
    assert isinstance(django_memcached.store(), MemcachedBackend)
    assert django_memcached.acquire(key, "token-a", LEASE).acquired
    direct = backend_from_url(memcached_url)
    holder = direct.holder(key)
    assert holder is not None
    assert holder.token == "token-a"
    direct.close()


def test_listing_is_not_supported_over_memcached(
    django_memcached: DjangoCacheBackend, key: str
) -> None:
    assert django_memcached.acquire(key, "token-a", LEASE).acquired
    with pytest.raises(UnsupportedOperation, match="not supported on memcached"):
        next(django_memcached.iter_locks(key))


def test_operator_releases_go_through_to_the_store(
    django_memcached: DjangoCacheBackend, key: str
) -> None:
    assert django_memcached.acquire(key, "token-a", LEASE, meta={"task_id": "id-a"}).acquired
    assert django_memcached.release_held_by(key, "id-b") is None
    removed = django_memcached.release_held_by(key, "id-a")
    assert removed is not None
    assert removed.token == "token-a"
    assert django_memcached.acquire(key, "token-b", LEASE).acquired
    forced = django_memcached.force_release(key)
    assert forced is not None
    assert forced.token == "token-b"
    assert django_memcached.holder(key) is None


# -- bounded waits and clear errors ----------------------------------------------------------------


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port whose listener takes connections (the kernel does) and never answers."""
    with socket.create_server(("127.0.0.1", 0), backlog=16) as listener:
        yield listener.getsockname()[1]


def with_cache(
    django_caches: dict[str, dict[str, object]], alias: str, **cache: Any
) -> override_settings:
    return override_settings(CACHES={**django_caches, alias: cache})


@pytest.mark.parametrize(
    "options",
    [{}, {"socket_timeout": None}],
    ids=["no-options", "timeout-none"],
)
def test_a_redis_cache_without_a_socket_timeout_still_times_out(
    django_caches: dict[str, dict[str, object]],
    silent_port: int,
    key: str,
    options: dict[str, object],
) -> None:
    """Django sets no socket timeout and redis-py before 8 has none: a Redis cache that does not
    answer still fails the call with BackendTimeout after the Redis store's 5 s."""
    cache = {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": f"redis://127.0.0.1:{silent_port}",
        "OPTIONS": options,
    }
    with with_cache(django_caches, "silent", **cache):
        backend = backend_from_url("django://silent")
        started = time.monotonic()
        with pytest.raises(BackendTimeout) as caught:
            backend.acquire(key, "token-a", LEASE)
        assert time.monotonic() - started < 5 + 3
        assert caught.value.__cause__ is not None
        backend.close()


def test_a_memcached_cache_with_timeouts_of_none_still_times_out(
    django_caches: dict[str, dict[str, object]], silent_port: int, key: str
) -> None:
    """pymemcache waits for ever by default: timeouts left unset or None get the store's."""
    cache = {
        "BACKEND": "django.core.cache.backends.memcached.PyMemcacheCache",
        "LOCATION": f"127.0.0.1:{silent_port}",
        "OPTIONS": {"timeout": None, "connect_timeout": None},
    }
    with with_cache(django_caches, "silent", **cache):
        backend = backend_from_url("django://silent")
        started = time.monotonic()
        with pytest.raises(BackendTimeout) as caught:
            backend.holder(key)
        assert time.monotonic() - started < 5 + 3
        assert caught.value.__cause__ is not None
        backend.close()


@pytest.mark.parametrize(
    ("backend_path", "location", "options"),
    [
        ("django.core.cache.backends.redis.RedisCache", "not-a-redis-url", {}),
        ("django.core.cache.backends.redis.RedisCache", "redis://127.0.0.1:1", {"nope": 1}),
        ("django.core.cache.backends.memcached.PyMemcacheCache", "cache-1:port", {}),
    ],
    ids=["redis-location", "redis-option", "memcached-location"],
)
def test_a_location_or_option_the_store_cannot_use_is_a_configuration_error(
    django_caches: dict[str, dict[str, object]],
    backend_path: str,
    location: str,
    options: dict[str, object],
) -> None:
    """A cache's LOCATION or OPTIONS the driver refuses: ConfigurationError naming the alias,
    with the driver's error chained, on the first call (not a driver error on some later one)."""
    cache = {"BACKEND": backend_path, "LOCATION": location, "OPTIONS": options}
    with with_cache(django_caches, "broken", **cache):
        backend = DjangoCacheBackend("broken")
        with pytest.raises(ConfigurationError, match="django://broken") as caught:
            backend.acquire("any:key", "token-a", LEASE)
        assert caught.value.__cause__ is not None
