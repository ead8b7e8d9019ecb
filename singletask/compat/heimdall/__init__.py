"""celery-heimdall's API on singletask: change ``from celery_heimdall import HeimdallTask`` to
``from singletask.compat.heimdall import HeimdallTask`` (or call
:func:`singletask.compat.install`)."""

from __future__ import annotations

from .errors import AlreadyQueuedError
from .task import HeimdallTask, RateLimit, Strategy

__all__ = ["AlreadyQueuedError", "HeimdallTask", "RateLimit", "Strategy"]
