"""A body's retry: its hold becomes the retry's reservation *before* Celery publishes the retry.

Celery's ``Task.retry`` publishes the retry message (same task id, ``retries`` + 1), then raises
``Retry``; once the body has unwound, the worker stores RETRY. The retried attempt can start as
soon as its countdown is over: whatever the ending attempt does between the publish and that
store widens the time in which the retried attempt can end first, and Celery's result store
keeps a SUCCESS only against the writes that read it (a RETRY read before and written after it
replaces it for good: the task id then stays RETRY). So the end of the hold, a round trip to the
lock store that is sent again for up to ``END_PERSISTENCE`` seconds while the store is
unreachable, must not come in between: :meth:`SingletonTask.retry <singletask.SingletonTask>`
calls Celery's inside :func:`retrying`, and the publish of the retry (through
``SingletonTask.apply_async``, :func:`published`) first turns the hold into the reservation
(:func:`singletask.execution.endings.reserve_for_retry`). The end of the hold then leaves it as
it is: the same round trips, in another order.

Only a publish Celery makes for the execution in progress does so: not in eager mode or a direct
call (Celery publishes nothing: the hold is released as before), nor with ``throw=False`` (the body
goes on after asking for its retry, so it keeps its lock until it ends, as before), nor for a
``Retry`` the body raises itself. A publish that fails leaves the reservation to the end of the
hold, which releases it as for any body ending that way (Celery raises ``Reject``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from .endings import reserve_for_retry
from .lifecycle import current_execution

if TYPE_CHECKING:
    from celery import Task

__all__ = ["published", "retrying"]

T = TypeVar("T")

#: The task id whose ``SingletonTask.retry`` is in progress in this thread, if any.
_retrying: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "singletask_retrying", default=None
)


@contextlib.contextmanager
def retrying(task: Task[Any, Any], *, throw: bool) -> Iterator[None]:
    """While Celery's ``Task.retry`` runs for the current request: its publish reserves first
    (not with ``throw=False``: the body goes on holding its lock)."""
    if not throw or task.request.id is None:
        yield
        return
    reset = _retrying.set(str(task.request.id))
    try:
        yield
    finally:
        _retrying.reset(reset)


def published(
    task: Task[Any, Any], task_id: str | None, options: Mapping[str, Any], publish: Callable[[], T]
) -> T:
    """``publish()``; if it publishes the retry ``Task.retry`` is making for the execution in
    progress, that execution's hold becomes the retry's reservation first. If the publish
    fails, the end of the hold releases the reservation instead (as it would have released the
    hold)."""
    execution = current_execution(task) if task_id is not None else None
    if execution is None or _retrying.get() != task_id:
        return publish()
    run, handle = execution
    if run.reserved or options.get("retries") != run.retries + 1:
        return publish()
    handle.lost  # noqa: B018 - reports a lease that ran out unnoticed by the body
    run.state.renewer.remove(handle)  # before the reservation: no renewal starts after this
    when = options.get("eta") or options.get("countdown")
    token = reserve_for_retry(task, run.options, run.backend, run.key, run.token, when, run.meta)
    run.reserved = True
    try:
        return publish()
    except BaseException:
        # No retry will take the reservation over: the end of the hold ends it, as the hold.
        run.reserved, run.token = False, token or run.token
        raise
