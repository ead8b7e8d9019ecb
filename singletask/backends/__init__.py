"""Lock backends, chosen by the scheme of ``singletask_backend_url``.

The contract every store implements is :mod:`singletask.backends.base`; the stores are grouped
by family:

* :mod:`~singletask.backends.memory` (``memory://``) and :mod:`~singletask.backends.django`
  (``django://<cache alias>``, extra
  ``singletask[django]``), small enough to be one module each;
* :mod:`~singletask.backends.redis`: ``redis://``, ``rediss://``, ``unix://``
  (:class:`~singletask.backends.redis.RedisBackend`), ``sentinel://``
  (:class:`~singletask.backends.redis.RedisSentinelBackend`), ``redis+cluster://`` and
  ``rediss+cluster://`` (:class:`~singletask.backends.redis.RedisClusterBackend`);
* ``sql``: ``postgresql://``, ``postgres://``
  (:class:`~singletask.backends.sql.postgres.PostgresBackend`, extra ``singletask[postgres]``),
  ``mysql://``, ``mariadb://`` (:class:`~singletask.backends.sql.mysql.MySQLBackend`, extra
  ``singletask[mysql]``) and ``sqlite://``
  (:class:`~singletask.backends.sql.sqlite.SQLiteBackend`);
* :mod:`~singletask.backends.memcached`: ``memcached://``
  (:class:`~singletask.backends.memcached.MemcachedBackend`, extra ``singletask[memcached]``).

A third-party package adds a scheme through the ``singletask.backends`` entry-point group::

    [project.entry-points."singletask.backends"]
    etcd = "singletask_etcd:EtcdBackend"
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any
from urllib.parse import urlsplit

from kombu.utils.imports import symbol_by_name

from ..exceptions import ConfigurationError, UnknownBackendError
from .base import AcquireResult, Holder, LockBackend
from .urls import mask_url

__all__ = [
    "BACKEND_ALIASES",
    "AcquireResult",
    "Holder",
    "LockBackend",
    "backend_class",
    "backend_from_url",
    "check_url",
    "known_schemes",
]

#: URL scheme -> "module:Class" of the built-in backends.
BACKEND_ALIASES: dict[str, str] = {
    "redis": "singletask.backends.redis.store:RedisBackend",
    "rediss": "singletask.backends.redis.store:RedisBackend",
    "unix": "singletask.backends.redis.store:RedisBackend",
    "sentinel": "singletask.backends.redis.deploy:RedisSentinelBackend",
    "redis+cluster": "singletask.backends.redis.deploy:RedisClusterBackend",
    "rediss+cluster": "singletask.backends.redis.deploy:RedisClusterBackend",
    "memory": "singletask.backends.memory:MemoryBackend",
    "sqlite": "singletask.backends.sql.sqlite:SQLiteBackend",
    "postgresql": "singletask.backends.sql.postgres:PostgresBackend",
    "postgres": "singletask.backends.sql.postgres:PostgresBackend",
    "postgresql+psycopg": "singletask.backends.sql.postgres:PostgresBackend",
    "mysql": "singletask.backends.sql.mysql:MySQLBackend",
    "mariadb": "singletask.backends.sql.mysql:MySQLBackend",
    "mysql+pymysql": "singletask.backends.sql.mysql:MySQLBackend",
    "memcached": "singletask.backends.memcached:MemcachedBackend",
    "django": "singletask.backends.django:DjangoCacheBackend",
}

#: Module of a built-in backend -> the extra that installs its driver.
EXTRAS: dict[str, str] = {
    "singletask.backends.sql.postgres": "postgres",
    "singletask.backends.sql.mysql": "mysql",
}

ENTRY_POINT_GROUP = "singletask.backends"


def _plugins() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def known_schemes() -> list[str]:
    """Every URL scheme a backend is registered for, built-in or plug-in."""
    return sorted({*BACKEND_ALIASES, *_plugins()})


def backend_class(url: str) -> type[LockBackend]:
    """Return the backend class that serves ``url``.

    Raises:
        UnknownBackendError: No backend is registered for the URL's scheme.
        ConfigurationError: The driver of that backend is not installed.
    """
    scheme = urlsplit(url).scheme.lower() if "://" in url else ""
    target = BACKEND_ALIASES.get(scheme) or _plugins().get(scheme)
    if target is None:
        what = f"unknown scheme {scheme!r}" if scheme else "it is not a URL (no '://')"
        raise UnknownBackendError(
            f"no singletask backend for {mask_url(url)!r}: {what}; known schemes: "
            f"{', '.join(known_schemes())}"
        )
    try:
        cls = symbol_by_name(target)
    except ImportError as exc:
        extra = EXTRAS.get(target.partition(":")[0])
        if extra is None:
            raise
        raise ConfigurationError(
            f"the {scheme}:// lock store needs its driver: pip install 'singletask[{extra}]' "
            f"({exc})"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, LockBackend)):
        raise ConfigurationError(f"{target!r} (scheme {scheme!r}) is not a LockBackend subclass")
    return cls


def backend_from_url(
    url: str, *, transport_options: Mapping[str, Any] | None = None, **options: Any
) -> LockBackend:
    """Build the backend for ``url``.

    ``transport_options`` (the setting ``singletask_backend_transport_options``) go to backends
    whose ``from_url`` takes them (the Redis ones); giving any to another backend is an error.

    Raises:
        UnknownBackendError: No backend is registered for the URL's scheme.
        ConfigurationError: The backend rejected the URL or an option.
    """
    cls = backend_class(url)
    if transport_options:
        if "transport_options" not in inspect.signature(cls.from_url).parameters:
            raise ConfigurationError(
                f"setting singletask_backend_transport_options: {cls.__name__} "
                f"({mask_url(url)!r}) takes no transport options"
            )
        return cls.from_url(url, transport_options=transport_options, **options)
    return cls.from_url(url, **options)


def check_url(url: str) -> None:
    """Check ``url`` as its backend would, without building the backend or connecting.

    Raises:
        UnknownBackendError: No backend is registered for the URL's scheme.
        ConfigurationError: The URL or one of its options is invalid.
    """
    backend_class(url).check_url(url)
