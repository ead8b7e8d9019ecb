"""pytest plugin: every task of Celery's own unit suite gets SingletonTask as its base.

Loaded with ``-p bench.celery_suite.plugin`` into a run of Celery's ``t/unit`` tests. Every app's
default task class (``Celery.task_cls``) becomes :class:`UniqueSingletonTask`, whose lock key
never repeats, so no execution is ever refused: what differs from a run with Celery's own Task is
what SingletonTask changes for a task that needs nothing from it. The lock store is the
in-process one (Celery's test apps configure none).
"""

from __future__ import annotations

import uuid
from typing import Any

from celery import Celery

from singletask import SingletonTask
from singletask.conf import settings

__all__ = ["UniqueSingletonTask", "unique_key"]


def unique_key(*args: Any, **kwargs: Any) -> str:
    """A lock key no other call has."""
    return uuid.uuid4().hex


class UniqueSingletonTask(SingletonTask):
    """SingletonTask with a key per call (abstract: Celery's apps subclass it per task)."""

    abstract = True
    lock_key = staticmethod(unique_key)


# The harness's own configuration: Celery's test apps name no lock store.
settings.DEFAULTS["singletask_backend_url"] = "memory://"
Celery.task_cls = f"{__name__}:UniqueSingletonTask"
