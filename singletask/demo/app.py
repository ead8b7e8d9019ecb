"""The demo's Celery app: ``celery -A singletask.demo.app worker``, as ``singletask demo`` runs it.

The worker subprocess builds it from the environment variables that
:meth:`singletask.demo.local.Setup.environ` exports; the demo process applies the same
:class:`~singletask.demo.local.Setup` itself with :func:`~singletask.demo.local.configure`.
"""

from __future__ import annotations

from celery import Celery

from .local import configure

__all__ = ["app"]

app = Celery("singletask.demo", include=["singletask.demo.tasks"])
configure(app)
