"""celery-singleton's backends; :func:`get_backend` keeps one per process, as it did."""

from __future__ import annotations

from typing import Any

from .base import BaseBackend
from .redis import RedisBackend

__all__ = ["BaseBackend", "RedisBackend", "get_backend"]

_backend: Any = None


def get_backend(config: Any) -> Any:
    """The process's backend, made on first use from ``config`` (celery-singleton's cache:
    the first app's settings win)."""
    global _backend
    if not _backend:
        _backend = config.backend_class(config.backend_url, **config.backend_kwargs)
    return _backend
