"""A worker's start: build the lock store of the app once, so that a wrong store stops the start.

:class:`~singletask.SingletonTask` adds :class:`CheckLockStore` to the worker blueprint of every
app it is bound to. It reads the settings and builds the backend from its URL, then closes it:
an invalid setting, an unknown scheme or a store singletask refuses (such as a ``django://`` alias
of a process-local cache) raises :class:`~singletask.exceptions.ConfigurationError` there, and the
worker does not start, instead of failing each task later. It does not connect to the store: a
store that is down at start is the lock-time error policy's business.
"""

from __future__ import annotations

from typing import Any

from celery import bootsteps

from .backends import backend_from_url
from .config import Settings

__all__ = ["CheckLockStore"]


class CheckLockStore(bootsteps.Step):
    """Worker bootstep: raise ConfigurationError at start when the lock store is misconfigured."""

    name = "singletask.CheckLockStore"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        backend_from_url(Settings.from_app(parent.app).backend_url).close()
