"""Locks in a cache of Django's ``CACHES`` setting: ``django://default``, or any other alias.

Needs ``pip install singletask[django]`` and a configured Django project. The alias is looked
up in :data:`django.core.cache.caches` lazily, in each process, on first use; the store makes a
cache object of its own from the alias's settings (``caches.create_connection``), so its
connections are singletask's and closing the store closes them.

Django's cache API cannot hold a lock correctly: it has ``add``, but no owner-checked delete or
renew, and ``add`` itself is atomic across processes only on some caches. So this store uses
the cache's *connection*, never its API, and runs singletask's own atomic primitives on it:

* ``django.core.cache.backends.redis.RedisCache``: the Redis lock store
  (:class:`~singletask.backends.redis.RedisBackend`) over the cache's own redis-py client for
  its first (write) server: the same Lua scripts, keys and guarantees as ``redis://``. Socket
  timeouts the cache's ``OPTIONS`` leave unset get the Redis store's defaults (5 s), on every
  redis-py (before 8, redis-py has none, and Django sets none).
* ``django.core.cache.backends.memcached.PyMemcacheCache``: the memcached lock store
  (:class:`~singletask.backends.memcached.MemcachedBackend`) over the cache's servers and
  timeouts (5 s where unset: pymemcache has none), with ``add``/``gets``/``cas``, and
  memcached's limits (eviction, no listing).

Every other cache is refused with a :class:`~singletask.exceptions.ConfigurationError` that says
why, when the backend is built where Django is configured (a worker builds it at start) and
again on first use.

Keys are singletask's own (``singletask_key_prefix``); the cache's ``KEY_PREFIX``, ``VERSION``
and ``KEY_FUNCTION`` do not apply to them, so ``django://`` and a ``redis://`` URL of the same
server see the same locks.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast
from urllib.parse import urlsplit

from ..exceptions import ConfigurationError, UnsupportedOperation
from .base import AcquireResult, Holder, LockBackend, Units
from .memcached.store import MemcachedBackend
from .urls import mask_url

__all__ = ["REFUSED", "DjangoCacheBackend"]

_REDIS = "django.core.cache.backends.redis.RedisCache"
_PYMEMCACHE = "django.core.cache.backends.memcached.PyMemcacheCache"

#: Cache backends singletask refuses, and why.
REFUSED: dict[str, str] = {
    "django.core.cache.backends.locmem.LocMemCache": (
        "it keeps its entries in the memory of one process, so every worker process would have "
        "locks of its own and duplicates would run side by side"
    ),
    "django.core.cache.backends.filebased.FileBasedCache": (
        "its add() checks for the file and then writes it, which is not atomic across processes, "
        "and it culls entries at random, live locks included"
    ),
    "django.core.cache.backends.dummy.DummyCache": (
        "it stores nothing and its add() always succeeds, so every duplicate would run"
    ),
    "django.core.cache.backends.db.DatabaseCache": (
        "its add() of an expired entry reads the row and then overwrites it, so two workers can "
        "both take an expired lock; it has no owner-checked delete or renew, uses the app "
        "servers' clocks in whole seconds, and culls live entries past MAX_ENTRIES. Point "
        "singletask_backend_url at the database itself instead (the SQL lock stores)"
    ),
    "django.core.cache.backends.memcached.PyLibMCCache": (
        "singletask runs memcached through pymemcache: use "
        "django.core.cache.backends.memcached.PyMemcacheCache (same LOCATION)"
    ),
}


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _memcached_server(location: str) -> tuple[str, int]:
    location = location.strip().removeprefix("unix:")
    if location.startswith("/"):
        return location, 0
    host, _, port = location.rpartition(":")
    return (host, int(port)) if host else (location, 11211)


class DjangoCacheBackend(LockBackend):
    """Locks in the Django cache ``alias``, through that cache's Redis or memcached connection.

    Args:
        alias: A key of Django's ``CACHES`` setting.
    """

    def __init__(self, alias: str = "default") -> None:
        try:
            import django  # noqa: F401
        except ImportError as exc:  # pragma: no cover - the extra is not installed
            raise ConfigurationError(
                "the django:// lock store needs Django: pip install 'singletask[django]'"
            ) from exc
        self.alias = alias
        self._mutex = threading.Lock()
        self._store: LockBackend | None = None
        self._redis: Any = None  # the client of a Redis cache, whose pool the store closes
        self._pid: int | None = None

    #: As memcached's (a Django cache may be one): 30 days less the two seconds an item is kept
    #: longer.
    max_lease = MemcachedBackend.max_lease

    @classmethod
    def from_url(cls, url: str, **options: Any) -> DjangoCacheBackend:
        """``django://alias`` (``django://`` alone is ``default``).

        Where Django's settings are configured already (as in a worker), the cache is checked
        here, so an unsafe cache fails the worker's start.

        Raises:
            ConfigurationError: The URL is malformed, or the cache is one singletask refuses.
        """
        parts = urlsplit(url)
        if "@" in url:
            # Not the alias: user info, maybe a password (the message masks it).
            raise ConfigurationError(
                f"{mask_url(url)!r}: a Django cache lock URL is django://<alias of CACHES>, with "
                "no user or password (the cache's own are in its CACHES entry)"
            )
        if parts.path.strip("/") or parts.query or options:
            raise ConfigurationError(
                f"{mask_url(url)!r}: a Django cache lock URL is django://<alias of CACHES>, with "
                "no path or options (configure the cache in CACHES)"
            )
        backend = cls(parts.netloc or "default")
        from django.conf import settings

        if settings.configured:
            backend.check()
        return backend

    def __repr__(self) -> str:
        return f"<DjangoCacheBackend {self.alias!r}>"

    def _cache(self) -> Any:
        """A cache object of the alias's settings of our own (not the thread's shared one)."""
        from django.core.cache import InvalidCacheBackendError, caches

        if self.alias not in caches.settings:
            raise ConfigurationError(
                f"django://{self.alias}: no cache {self.alias!r} in the CACHES setting "
                f"(it has: {', '.join(sorted(caches.settings)) or 'none'})"
            )
        try:
            return caches.create_connection(self.alias)
        except (InvalidCacheBackendError, ValueError, TypeError, ImportError) as exc:
            raise ConfigurationError(f"django://{self.alias}: {exc}") from exc

    def check(self) -> None:
        """Refuse a cache whose operations cannot be made atomic across processes.

        Raises:
            ConfigurationError: The alias is missing, or names a cache singletask refuses.
        """
        self._kind(self._cache())

    def _kind(self, cache: object) -> str:
        from django.core.cache.backends.memcached import PyMemcacheCache
        from django.core.cache.backends.redis import RedisCache

        if isinstance(cache, RedisCache):
            return "redis"
        if isinstance(cache, PyMemcacheCache):
            return "memcached"
        path = _path(type(cache))
        bases = {_path(base) for base in type(cache).__mro__}
        why = next(
            (reason for name, reason in REFUSED.items() if name in bases),
            "singletask cannot tell whether its add() and owner checks are atomic across "
            f"processes; supported: {_REDIS} and {_PYMEMCACHE}",
        )
        raise ConfigurationError(
            f"django://{self.alias}: singletask refuses the cache {path} as a lock store: {why}"
        )

    def store(self) -> LockBackend:
        """The Redis or memcached store over the cache's connection, built once per process.

        Raises:
            ConfigurationError: The cache is one singletask refuses.
        """
        pid = os.getpid()
        if self._store is None or self._pid != pid:
            with self._mutex:
                if self._store is None or self._pid != pid:
                    self._store, self._pid = self._build(self._cache()), pid
        return self._store

    def _build(self, cache: Any) -> LockBackend:
        """The store over ``cache``'s connection; a setting it cannot use is refused.

        Raises:
            ConfigurationError: The cache's ``LOCATION`` or ``OPTIONS`` cannot be used.
        """
        try:
            if self._kind(cache) == "redis":
                return self._redis_store(cache)
            return self._memcached_store(cache)
        except ConfigurationError:
            raise
        except (ValueError, TypeError, ImportError) as exc:
            raise ConfigurationError(
                f"django://{self.alias}: the cache's LOCATION or OPTIONS cannot be used: {exc}"
            ) from exc

    def _redis_store(self, cache: Any) -> LockBackend:
        from .redis.options import parse_redis_url
        from .redis.store import CLIENT_DEFAULTS, RedisBackend

        # The server Django writes to, checked as singletask checks its own Redis URLs:
        # redis-py's parse errors quote parts of a malformed URL, password included.
        location = cache._cache._servers[0]
        try:
            parse_redis_url(location)
        except ConfigurationError as exc:
            raise ConfigurationError(f"django://{self.alias}: LOCATION: {exc}") from exc
        try:
            client = cache._cache.get_client(write=True)
        except (TypeError, ValueError):
            # (not chained: redis-py's message may quote the password)
            raise ConfigurationError(
                f"django://{self.alias}: LOCATION {mask_url(location)!r} is not a Redis URL "
                "redis-py accepts"
            ) from None
        # Django sets no socket timeout, and redis-py before 8 has none by default: a Redis that
        # stops answering would block a worker for ever. The pool is this store's own (a new
        # cache object, no connection made yet), so the connections it makes get the Redis
        # store's timeouts wherever the cache's OPTIONS leave them unset (or None).
        kwargs = getattr(client.connection_pool, "connection_kwargs", None)
        if not isinstance(kwargs, dict):
            raise ConfigurationError(
                f"django://{self.alias}: cannot give the connections of the cache's pool "
                f"({type(client.connection_pool).__name__}) a socket timeout; use a redis-py "
                "ConnectionPool (the default)"
            )
        for name in ("socket_timeout", "socket_connect_timeout"):
            if kwargs.get(name) is None:
                kwargs[name] = CLIENT_DEFAULTS[name]
        # A connection object (not connected) checks the options now, not on the first call.
        client.connection_pool.connection_class(**kwargs)
        self._redis = client
        return RedisBackend(client=client)

    def _memcached_store(self, cache: Any) -> LockBackend:
        # Options left unset (or None) take the memcached store's defaults (5 s timeouts):
        # pymemcache's own default is to wait for ever.
        options = {
            name: value
            for name, value in (cache._options or {}).items()
            if name in ("connect_timeout", "timeout", "max_pool_size", "tls_context")
            and value is not None
        }
        return MemcachedBackend([_memcached_server(s) for s in cache._servers], **options)

    def acquire(
        self,
        key: str,
        token: str,
        ttl: float,
        *,
        meta: Mapping[str, str] | None = None,
        takeover_prefix: str | None = None,
        units: Sequence[Units] = (),
    ) -> AcquireResult:
        if units:
            self.take_units(token, ttl, units)  # refused: a Django cache keeps no named limits
        return self.store().acquire(key, token, ttl, meta=meta, takeover_prefix=takeover_prefix)

    def release(
        self, key: str, token: str, *, completed: str | None = None, units: Sequence[Units] = ()
    ) -> bool:
        if units:
            self.give_units(token, units)  # refused: a Django cache keeps no named limits
        return self.store().release(key, token, completed=completed)

    def extend(self, key: str, token: str, ttl: float) -> bool:
        return self.store().extend(key, token, ttl)

    def extend_many(self, leases: Sequence[tuple[str, str, float]]) -> list[bool]:
        return self.store().extend_many(leases)

    def claim_next(self, key: str, task_id: str, ttl: float) -> str:
        return self.store().claim_next(key, task_id, ttl)

    def clear_next(self, key: str, task_id: str) -> bool:
        return self.store().clear_next(key, task_id)

    def holder(self, key: str) -> Holder | None:
        return self.store().holder(key)

    # The operator primitives: every store has them once they are part of LockBackend; until
    # then a store without them (Redis here) says so.
    def _operator(self, name: str) -> Any:
        method = getattr(self.store(), name, None)
        if method is None:
            raise UnsupportedOperation(f"{self!r}: {self.store()!r} has no {name}()")
        return method

    def iter_locks(self, prefix: str, *, page_size: int = 500) -> Iterator[tuple[str, Holder]]:
        """The underlying store's listing (memcached cannot list: UnsupportedOperation)."""
        yield from cast(
            "Iterator[tuple[str, Holder]]",
            self._operator("iter_locks")(prefix, page_size=page_size),
        )

    def release_held_by(self, key: str, task_id: str) -> Holder | None:
        return cast("Holder | None", self._operator("release_held_by")(key, task_id))

    def force_release(self, key: str) -> Holder | None:
        return cast("Holder | None", self._operator("force_release")(key))

    def close(self) -> None:
        with self._mutex:
            store, self._store = (self._store if self._pid == os.getpid() else None), None
        if store is not None:
            store.close()
        redis, self._redis = self._redis, None
        if redis is not None:  # a RedisBackend leaves a client it was given open
            redis.connection_pool.disconnect()
