"""The wait of a message for a pending send of its debounce window (``lock_debounce``, and the
follow-ups of ``lock_coalesce = "latest"``).

A send's entry in its key's window is *pending* from its write to the lock store until its
publish ends (:mod:`singletask.send.records`). A message that starts and finds a later pending
send as its window's latest waits here, in its worker process, for that send to be published
(it then ends superseded by it) or taken back (it runs), bounded by the producer's publish
deadline and by this execution's own time limit (docs/limits.rst, "While a send is being
published").
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from ..exceptions import BackendTimeout, BackendUnavailable
from ..send.records import MAX_PENDING

if TYPE_CHECKING:
    from celery import Task

    from ..backends.base import LockBackend

__all__ = ["Waiter", "take_window"]

logger = logging.getLogger("singletask")

#: Seconds between two looks at a pending latest send of a debounce window.
_PENDING_POLL = 0.25
#: The wait for a pending send ends this share of the execution's time limit before it, at
#: most _LIMIT_MARGIN seconds before it (``_wait_cutoff``).
_LIMIT_SHARE = 0.25
_LIMIT_MARGIN = 1.0


class Waiter(Protocol):
    """What the wait reads of the execution (:func:`singletask.execution.lifecycle.execute`'s)."""

    @property
    def task(self) -> Task[Any, Any]: ...
    @property
    def task_id(self) -> str | None: ...
    @property
    def request(self) -> Any: ...
    @property
    def backend(self) -> LockBackend: ...
    @property
    def key(self) -> str: ...
    @property
    def started(self) -> float: ...


def take_window(run: Waiter) -> str | None:
    """The window's latest send, the window closed if it is this one. While the latest is a
    later send whose message is still being published (pending), this waits for it, polling
    the store, at most until its publish deadline (the store's answer, at most MAX_PENDING):
    published, it supersedes this send; taken back, or never published by its deadline, it
    does not. The wait also ends a little before this execution's time limit
    (``_wait_cutoff``): the pending send is then treated as one whose publish outlasted
    its deadline, and this send takes the window. A wait that an exception other than a store
    error ends (a time limit, SIGTERM) takes the window the same way first, so that a pending
    send taken back later never leaves the window naming this message, which will not run."""
    task_id = str(run.task_id)
    latest, left = run.backend.debounce_take(run.key, task_id)
    if left <= 0:
        return latest
    began = time.monotonic()
    cutoff = min(began + MAX_PENDING, _wait_cutoff(run))
    logger.info(
        "Task %s[%s] waits up to %.1fs for the publish of %s, the latest send of its "
        "debounce window",
        run.task.name, run.task_id, min(left, max(0.0, cutoff - began)), latest,
    )  # fmt: skip
    try:
        while left > 0 and time.monotonic() < cutoff:
            time.sleep(min(left, _PENDING_POLL, max(0.0, cutoff - time.monotonic())))
            latest, left = run.backend.debounce_take(run.key, task_id)
        if left > 0:  # the time limit is near (or MAX_PENDING passed): wait no longer
            pending = latest
            latest, _ = run.backend.debounce_take(run.key, task_id, overdue=True)
            logger.warning(
                "Task %s[%s] waited %.1fs for the publish of %s and can wait no longer (its "
                "time limit is near): it takes its debounce window, as after a late publish",
                run.task.name, run.task_id, time.monotonic() - began, pending,
            )  # fmt: skip
    except (BackendUnavailable, BackendTimeout):
        raise  # lock_on_backend_error decides; a retried message finds the window as it was
    except BaseException:
        _leave_window(run, task_id)
        raise
    return latest


def _wait_cutoff(run: Waiter) -> float:
    """When (``time.monotonic()``) the wait for a pending publish must end: a margin before
    the first time limit of this execution (Celery's soft and hard limits count from its
    start in the pool process, just before ``__call__``): the message's, else the task's,
    else the app's setting. Infinity without one, or outside a worker (eager mode enforces
    none)."""
    if run.request.is_eager:
        return float("inf")
    hard, soft = tuple(run.request.timelimit or (None, None))[:2]
    conf = run.task.app.conf
    limits = [
        float(value)
        for value in (
            soft or run.task.soft_time_limit or conf.get("task_soft_time_limit"),
            hard or run.task.time_limit or conf.get("task_time_limit"),
        )
        if value
    ]
    if not limits:
        return float("inf")
    limit = min(limits)
    return run.started + limit - min(_LIMIT_MARGIN, limit * _LIMIT_SHARE)


def _leave_window(run: Waiter, task_id: str) -> None:
    """A wait for a pending publish ended by an exception: take the window (closed, naming
    this send) so that it never names this message again once the pending send is settled.
    Best effort, never raises (the exception that ended the wait goes on)."""
    try:
        run.backend.debounce_take(run.key, task_id, overdue=True)
    except Exception as exc:
        logger.warning(
            "Task %s[%s]: its wait for a pending publish ended, and its debounce window could "
            "not be taken (%s): if that publish is taken back, the window names this message "
            "until it expires",
            run.task.name, run.task_id, exc,
        )  # fmt: skip
