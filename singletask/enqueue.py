"""Deduplication when a task is sent (``lock_scope`` "queue" and "coalesce").

``SingletonTask.apply_async`` reserves the key for the new message before publishing it; the
worker's execution of that message then takes the reservation over as its lock. A duplicate sent
meanwhile is answered here, without a message: it gets the holder's ``AsyncResult`` (or, when
coalescing, the pending follow-up's), or ``TaskLocked``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from celery.utils.time import maybe_iso8601

from .exceptions import TaskLocked
from .signals import lock_conflict
from .tokens import reservation_token

if TYPE_CHECKING:
    from celery.result import AsyncResult

    from .task import SingletonTask

__all__ = ["queue_lease", "seconds_until", "send_once"]

logger = logging.getLogger("singletask")


def send_once(
    task: SingletonTask,
    send: Callable[[str], AsyncResult[Any]],
    task_id: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    scope: str,
    policy: str,
    queue_ttl: float,
    options: Mapping[str, Any],
) -> AsyncResult[Any]:
    """Reserve the key for message ``task_id`` and ``send`` it, or answer a duplicate.

    Returns the new message's ``AsyncResult``, or the holder's (or pending follow-up's) for a
    duplicate. Raises ``TaskLocked`` for a duplicate under the "raise" policy, and
    ``BackendError`` when the lock store fails.
    """
    backend = task.lock_backend
    key = task.lock_key_for(args, kwargs)
    ttl = queue_lease(queue_ttl, options)
    token = reservation_token(task_id, 0)
    meta = {"task_id": task_id, "task": task.name, "since": f"{time.time():.3f}"}
    reserved = backend.acquire(key, token, ttl, meta=meta)
    if reserved.acquired:
        try:
            return send(task_id)
        except BaseException:
            backend.release(key, token)  # the message never left: nothing will run it
            raise
    holder = reserved.holder
    if holder is None or holder.task_id is None:
        return send(task_id)  # held by a direct call: leave it to the execution-time lock
    holder_id = holder.task_id
    queued = holder.token == reservation_token(holder_id, 0)
    follow_up = holder_id
    if scope == "coalesce" and not queued:
        follow_up = backend.claim_next(key, task_id, ttl)
        action = "follow" if follow_up == task_id else "join"
    else:
        action = "raise" if policy == "raise" else "dedupe"
    lock_conflict.send(
        sender=task, key=key, holder=holder_id, ttl=holder.ttl, task_id=task_id, action=action
    )
    if action == "follow":
        logger.info(
            "Task %s[%s] sent as the follow-up of the run in progress on %r (%s)",
            task.name, task_id, key, holder_id,
        )  # fmt: skip
        return send(task_id)
    if action == "join":
        logger.info(
            "Task %s not sent: it joins the pending follow-up %s of %r",
            task.name, follow_up, key,
        )  # fmt: skip
        return task.AsyncResult(follow_up)
    state = "queued" if queued else "running"
    if action == "raise":
        logger.warning(
            "Task %s not sent: lock %r is held by %s (%s); raising TaskLocked",
            task.name, key, holder_id, state,
        )  # fmt: skip
        raise TaskLocked(key, holder_id, holder.ttl)
    logger.info(
        "Task %s not sent: a duplicate of %s (%s) under lock %r; returning its result",
        task.name, holder_id, state, key,
    )  # fmt: skip
    return task.AsyncResult(holder_id)


def queue_lease(queue_ttl: float, options: Mapping[str, Any]) -> float:
    """How long a sent message keeps its key reserved: its delay plus ``queue_ttl``, and never
    past its ``expires`` (a worker discards an expired message)."""
    delay = 0.0
    if options.get("countdown") is not None:
        delay = max(0.0, float(options["countdown"]))
    elif options.get("eta") is not None:
        delay = seconds_until(maybe_iso8601(options["eta"]))
    lease = delay + queue_ttl
    expires = options.get("expires")
    if isinstance(expires, int | float):
        lease = min(lease, max(0.001, float(expires)))
    elif expires is not None:
        lease = min(lease, max(0.001, seconds_until(maybe_iso8601(expires))))
    return lease


def seconds_until(when: object) -> float:
    """The delay of a ``Retry.when`` (seconds or an ETA), never negative."""
    if isinstance(when, int | float):
        return max(0.0, float(when))
    if isinstance(when, datetime):
        now = datetime.now(when.tzinfo or timezone.utc) if when.tzinfo else datetime.now()
        return max(0.0, (when - now).total_seconds())
    return 0.0
