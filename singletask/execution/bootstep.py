"""A worker's start: a lock store that refuses its configuration stops the start.

:class:`~singletask.SingletonTask` adds :class:`CheckLockStore` to the worker blueprint of every
app it is bound to. When the worker starts, it builds the app's lock store from its URL, without
connecting to it, and closes it again. A store that refuses its configuration raises
:class:`~singletask.exceptions.ConfigurationError` there, and the worker does not start: for
example ``django://`` naming a process-local Django cache, which would give no exclusion at all
between the worker's processes, or a singleton task whose ``lock_ttl`` (or ``lock_queue_ttl``)
is longer than the store's ``max_lease``. Settings that cannot be read, or a URL of no known
scheme, are left to the first execution (which fails with the same error).

It adds :class:`ServeWorker` too, which ends the app's lease renewer threads when the worker
stops.
"""

from __future__ import annotations

from typing import Any

from celery import bootsteps

from ..backends import backend_class
from ..conf.runtime import app_state, check_lease_options, is_singleton
from ..conf.settings import Settings
from ..exceptions import ConfigurationError

__all__ = ["CheckLockStore", "ServeWorker"]


class CheckLockStore(bootsteps.Step):
    """Worker bootstep: build the app's lock store once; its ConfigurationError stops the start."""

    name = "singletask.CheckLockStore"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        try:
            settings = Settings.from_app(parent.app)
            store = backend_class(settings.backend_url)
        except ConfigurationError:
            return  # not the store's refusal: each execution reports it
        store.from_url(settings.backend_url, **settings.backend_options()).close()
        # Lease options longer than the store accepts (the app may have been configured after
        # its tasks were bound, when nothing could check them).
        # Every task is checked, and every refusal named in one error.
        refused = []
        for name, task in sorted(parent.app.tasks.items()):
            if is_singleton(task):
                try:
                    check_lease_options(parent.app, name, task._singletask_options)
                except ConfigurationError as exc:
                    refused.append(str(exc))
        if len(refused) == 1:
            raise ConfigurationError(refused[0])
        if refused:
            raise ConfigurationError(f"{len(refused)} tasks: " + "; ".join(refused))


class ServeWorker(bootsteps.StartStopStep):
    """Worker bootstep: once the worker stops (warm or cold), the app's lease renewer threads in
    this process end with their last lease, and now if they have none. (From ``worker_init``
    on they waited for the next lease, so that back-to-back executions share one thread.) An
    in-process worker of a test suite leaves no renewer thread behind."""

    name = "singletask.ServeWorker"

    def stop(self, parent: Any) -> None:
        app_state(parent.app).serve_worker(False)

    def terminate(self, parent: Any) -> None:
        app_state(parent.app).serve_worker(False)
