"""celery-singleton's API on singletask: change ``from celery_singleton import Singleton`` to
``from singletask.compat.singleton import Singleton`` (or call :func:`singletask.compat.install`).
"""

from __future__ import annotations

from .exceptions import DuplicateTaskError
from .singleton import Singleton, clear_locks

__all__ = ["DuplicateTaskError", "Singleton", "clear_locks"]
