"""A body's retry: published at the end of the hold, once the lock is the retry's reservation.

Celery's ``Task.retry`` publishes the retry message (same task id, ``retries`` + 1), then raises
``Retry``; once the body has unwound, the worker stores RETRY. The retried attempt can start as
soon as its countdown is over, and Celery's result store keeps a SUCCESS only against the writes
that read it: a RETRY read before the retried attempt's outcome and written after it replaces it
for good (the task id then stays RETRY). Whatever comes between Celery's publish and its RETRY
widens that window. The end of the hold, the round trip that turns the lock into the retry's
reservation (sent again for up to ``END_PERSISTENCE`` seconds while the lock store is
unreachable), used to come there (issue 37, interaction campaign seed 697186904).

So :meth:`SingletonTask.retry <singletask.SingletonTask>` runs Celery's inside :func:`retrying`,
and the publish of that retry (``SingletonTask.apply_async``, :func:`published`) is kept for the
end of the hold: ``__call__``'s ``finally`` turns the hold into the reservation, then publishes
(:func:`singletask.execution.endings.reserve_and_publish`), and Celery stores RETRY right after.
The same round trips as before, in another order; and the retried attempt, published once the
body has unwound (its ``finally`` blocks, or the rest of a body that caught the ``Retry``), never
runs beside it. A publish that fails there releases the reservation and raises ``Reject``, as
Celery's ``Task.retry`` does.

Only a publish Celery makes for the execution in progress waits: not in eager mode or a direct
call (Celery publishes nothing), nor with ``throw=False`` (the body asked for its retry to be
sent now, and goes on holding its lock: the retried attempt waits for it, as for any holder),
nor a second retry of the same attempt, nor a ``Retry`` the body raises itself.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from .endings import PendingRetry
from .lifecycle import current_execution

if TYPE_CHECKING:
    from celery import Task
    from celery.result import AsyncResult

__all__ = ["intercepts", "published", "retrying"]

#: The task id whose ``SingletonTask.retry`` is in progress in this thread, if any.
_retrying: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "singletask_retrying", default=None
)


@contextlib.contextmanager
def retrying(task: Task[Any, Any], *, throw: bool) -> Iterator[None]:
    """While Celery's ``Task.retry`` runs for the current request: its publish waits for the
    end of the hold (not with ``throw=False``)."""
    if not throw or task.request.id is None:
        yield
        return
    reset = _retrying.set(str(task.request.id))
    try:
        yield
    finally:
        _retrying.reset(reset)


def intercepts(task_id: str | None) -> bool:
    """Whether :func:`published` may keep a send of ``task_id`` for the end of the hold: only
    the retry that ``Task.retry`` is making for the execution in progress in this thread."""
    return bool(task_id) and _retrying.get() == task_id


def published(
    task: Task[Any, Any],
    task_id: str | None,
    options: Mapping[str, Any],
    publish: Callable[[], AsyncResult[Any]],
) -> AsyncResult[Any]:
    """``publish()``, unless it publishes the retry that ``Task.retry`` is making for the
    execution in progress: that one is kept for the end of the hold, and its ``AsyncResult``
    returned now."""
    run = current_execution(task) if task_id and _retrying.get() == task_id else None
    if not task_id or run is None or run.retry is not None:
        return publish()
    if options.get("retries") != run.retries + 1:
        return publish()
    run.retry = PendingRetry(options.get("eta") or options.get("countdown"), publish)
    return task.AsyncResult(task_id)
