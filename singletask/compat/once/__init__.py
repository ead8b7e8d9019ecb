"""celery-once's API on singletask: change ``from celery_once import QueueOnce`` to
``from singletask.compat.once import QueueOnce`` (or call :func:`singletask.compat.install`).

What stays and what changes is on docs/migrating.rst.
"""

from __future__ import annotations

from .tasks import AlreadyQueued, QueueOnce

__all__ = ["AlreadyQueued", "QueueOnce"]
