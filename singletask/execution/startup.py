"""What a worker checks when it starts: can it run its singleton tasks as documented?

When a worker is ready (Celery's ``worker_ready`` signal) and its app has singleton tasks:

* if the lock store's URL is missing or invalid, it logs an ERROR with the
  :class:`~singletask.ConfigurationError` every execution of those tasks will then fail with
  (the worker still starts: its other tasks do not need locks);
* if the lock store is ``memory://`` (any store whose class is
  :attr:`~singletask.backends.base.LockBackend.in_process`), which keeps locks inside one
  process, it logs an ERROR when the pool runs tasks in more than one process (they would not
  exclude each other), and a WARNING otherwise (another worker with the same setting would not
  be excluded either).

Two more hooks serve singletask's Celery events (:mod:`singletask.observe.report`): when a worker is
made (``worker_init``), its processes learn whether it sends task events (``-E``); when a pool
process or the worker ends, the events it still has queued are sent first, briefly. From
``worker_init`` until the worker stops (:class:`~singletask.execution.bootstep.ServeWorker`),
its lease renewer threads wait for the next lease instead of ending with the last
(:class:`~singletask.lease.Renewer`).

Nothing here raises: a check that fails is logged.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import current_app, signals

from ..backends import backend_class
from ..conf.runtime import app_state, is_singleton
from ..conf.settings import Settings
from ..exceptions import ConfigurationError
from ..observe import events, report

__all__ = ["check_worker", "pool_processes"]

logger = logging.getLogger("singletask")

#: How long a process that ends waits at most for its queued events to be sent.
FLUSH_TIMEOUT = 2.0

#: Pools that run tasks in child processes (one per unit of concurrency).
_PROCESS_POOLS = ("prefork", "processes")


def pool_processes(pool_cls: object, concurrency: object) -> tuple[str, int]:
    """The name of a worker's pool and how many processes run its tasks."""
    module = getattr(pool_cls, "__module__", "") or ""
    name = module.rsplit(".", 1)[-1] if module.startswith("celery.concurrency") else ""
    name = name or getattr(pool_cls, "__name__", None) or str(pool_cls)
    if name in _PROCESS_POOLS and isinstance(concurrency, int):
        return name, concurrency
    return name, 1


def check_worker(app: Any, pool_cls: object, concurrency: object) -> list[str]:
    """Log what keeps this worker from running its singleton tasks as documented.

    Returns the messages logged (empty when all is well, or when the app has no singleton task).
    """
    names = sorted(name for name, task in app.tasks.items() if is_singleton(task))
    if not names:
        return []
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    try:
        settings = Settings.from_app(app)
    except ConfigurationError as exc:
        return [_error(f"an invalid setting keeps this worker from running its singleton tasks "
                       f"({shown}): every execution of them will fail: {exc}")]  # fmt: skip
    try:
        url = settings.backend_url
        in_process = backend_class(url).in_process
    except ConfigurationError as exc:
        return [_error(f"this worker has no usable lock store, so every execution of its "
                       f"singleton tasks ({shown}) will fail: {exc}")]  # fmt: skip
    if not in_process:
        return []
    scheme = url.split("://", 1)[0].lower()
    pool, processes = pool_processes(pool_cls, concurrency)
    if processes > 1:
        message = (
            f"singletask: the lock store is {scheme}://, which keeps locks inside one process, "
            f"but this worker's {pool} pool runs tasks in {processes} processes: its singleton "
            f"tasks ({shown}) are NOT exclusive between them, nor with other workers. Set "
            "singletask_backend_url to a shared store (redis://, or sqlite:// on one host)"
        )
        logger.error("%s", message)
    else:
        message = (
            f"singletask: the lock store is {scheme}://, which keeps locks inside this worker "
            f"process ({pool} pool): singleton tasks ({shown}) are exclusive only within it, "
            "not with any other worker using the same setting"
        )
        logger.warning("%s", message)
    return [message]


def _error(text: str) -> str:
    message = f"singletask: {text}"
    logger.error("%s", message)
    return message


@signals.worker_ready.connect(weak=False, dispatch_uid="singletask.execution.startup.check_worker")
def _on_worker_ready(sender: Any = None, **kwargs: Any) -> None:
    """Run :func:`check_worker` for the worker whose consumer is ``sender``; never raises."""
    try:
        worker = getattr(sender, "controller", None)
        app = getattr(sender, "app", None) or getattr(worker, "app", None)
        if app is None:
            return
        check_worker(app, getattr(worker, "pool_cls", None), getattr(worker, "concurrency", None))
    except Exception:
        logger.exception("singletask: the worker start-up checks failed")


@signals.worker_init.connect(weak=False, dispatch_uid="singletask.execution.startup.worker_events")
def _on_worker_init(sender: Any = None, **kwargs: Any) -> None:
    """Tell :mod:`singletask.observe.report` whether this worker (``sender``, the WorkController)
    sends task events: ``-E`` does not reach ``app.conf``, and the pool processes it forks
    inherit what is set here. Never raises."""
    try:
        app = getattr(sender, "app", None)
        if app is not None:
            events = getattr(sender, "task_events", None)
            report.worker_started(app, bool(events), getattr(sender, "hostname", None))
            app_state(app).serve_worker(True)
    except Exception:
        logger.exception("singletask: could not read whether the worker sends task events")


@signals.worker_process_shutdown.connect(
    weak=False, dispatch_uid="singletask.execution.startup.flush"
)
@signals.worker_shutdown.connect(weak=False, dispatch_uid="singletask.execution.startup.flush_main")
def _on_shutdown(sender: Any = None, **kwargs: Any) -> None:
    """A pool process (or the worker) ends: send the events it still has queued first, for at
    most :data:`FLUSH_TIMEOUT` seconds. Never raises."""
    try:
        events.flush(current_app, FLUSH_TIMEOUT)
    except Exception:
        logger.exception("singletask: could not send the events still queued")
