"""django:// specifics: which caches are accepted, which refused and why, and what is shared.

The shared behaviour is in test_contract.py (the ``django-memcached`` and ``django-redis``
params). The ``django_caches`` fixture configures Django in this process with one alias per
kind of cache.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from singletask.backends import backend_from_url
from singletask.backends.django import DjangoCacheBackend
from singletask.backends.memcached import MemcachedBackend
from singletask.backends.redis import RedisBackend
from singletask.exceptions import ConfigurationError, UnsupportedOperation

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
