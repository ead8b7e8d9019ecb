"""Deduplication when a task is sent (``lock_scope`` "queue" and "coalesce").

``SingletonTask.apply_async`` hands every message to :func:`send`. When the message is to be
deduplicated (:func:`deduplicates`), :func:`send_once` reserves the key for it before publishing
it; the worker's execution of that message then takes the reservation over as its lock. A
duplicate sent meanwhile is answered here, without a message: it gets the holder's
``AsyncResult`` (or, when coalescing, the pending follow-up's), or ``TaskLocked``. A message
whose publish fails takes back what its send wrote to the store first
(:func:`singletask.send.records.publish_or_undo`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from celery.utils import uuid
from celery.utils.time import maybe_iso8601

from ..backends.base import MAX_LEASE
from ..conf.runtime import app_state
from ..exceptions import BackendError, LockKeyError, TaskLocked
from ..observe import report
from ..policies import POLICIES
from ..protocol.headers import LATEST_HEADER, seconds_until, with_header
from ..protocol.tokens import reservation_token
from ..signals import lock_conflict
from .records import (
    Written,
    claim_follow_up,
    enter_window,
    publish_or_undo,
    publish_time,
    reserve,
    together,
    window_published,
)

if TYPE_CHECKING:
    from celery import Celery, Task
    from celery.result import AsyncResult

    from ..backends.base import LockBackend
    from ..conf.options import LockOptions

__all__ = [
    "call_arguments",
    "deduplicates",
    "published_as_is",
    "queue_lease",
    "send",
    "send_delay",
    "send_latest",
    "send_once",
]

logger = logging.getLogger("singletask")

#: Send options of messages that must be published as they are (see :func:`published_as_is`).
_PUBLISHED_AS_IS = ("chain", "parent_id", "reply_to", "replaced_task_nesting")


def published_as_is(app: Celery, linked: bool, send_options: Mapping[str, Any]) -> bool:
    """Whether a message sent with ``send_options`` is published as it is: neither
    deduplicated (``lock_scope``) nor debounced (``lock_debounce``).

    So is every message in eager mode (``app``'s ``task_always_eager``), and every message
    whose caller already holds its ``AsyncResult``: messages republished for an execution
    (``retries`` given: ``Task.retry`` and singletask's own), canvas parts (links, chords,
    groups), frozen signatures (``freeze()`` sets ``reply_to``: a chord's callback, for one,
    carries nothing else before Celery 5.6), and messages a worker sends for a task it finished
    (a chain's next link, with ``chain=[]`` for the last one; a link callback, with
    ``parent_id``) or replaced (``Task.replace``). The execution-time lock alone applies to them.
    """
    return (
        app.conf.task_always_eager
        or "retries" in send_options
        or linked
        or any(send_options.get(name) for name in ("chord", "group_id"))
        or any(name in send_options for name in _PUBLISHED_AS_IS)
    )


def deduplicates(
    options: LockOptions, app: Celery, linked: bool, send_options: Mapping[str, Any]
) -> bool:
    """Whether a message sent with ``send_options`` is deduplicated before it is published:
    only with ``lock_scope`` "queue" or "coalesce" (``app``'s settings are read only then),
    and never a message :func:`published_as_is`."""
    return options.scope != "execution" and not published_as_is(app, linked, send_options)


def call_arguments(
    args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The ``args`` and ``kwargs`` of a send, as the lock key is built from them.

    Only a send that singletask reads (deduplicated or debounced) goes through here; the
    message itself is published with the values as the caller gave them.

    Raises:
        LockKeyError: A ``TypeError``, as Celery raises for the same values: ``args`` is not a
            list or a tuple (a ``str`` missing its comma, a dict), or ``kwargs`` not a mapping.
    """
    args = args or ()
    kwargs = kwargs or {}
    if not isinstance(args, list | tuple):
        raise LockKeyError(
            f"task args must be a list or tuple, not {type(args).__name__} (a one-item "
            "tuple needs a comma: (value,))"
        )
    if not isinstance(kwargs, Mapping):
        raise LockKeyError(f"task keyword arguments must be a mapping, not {type(kwargs).__name__}")
    return tuple(args), dict(kwargs)


def send_delay(options: Mapping[str, Any]) -> float:
    """Seconds a message sent with ``options`` waits before it may start: its ``countdown``,
    or the time until its ``eta``; 0 without either."""
    if options.get("countdown") is not None:
        return max(0.0, float(options["countdown"]))
    if options.get("eta") is not None:
        return seconds_until(maybe_iso8601(options["eta"]))
    return 0.0


def send(
    task: Task[Any, Any],
    options: LockOptions,
    publish: Callable[[str | None], AsyncResult[Any]],
    task_id: str | None,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    *,
    linked: bool,
    send_options: Mapping[str, Any],
) -> AsyncResult[Any]:
    """Publish a message of ``task`` with ``publish``; deduplicate it first if it should be.

    If the lock store cannot be reached, the message is published without the check (the
    execution-time lock still applies). Raises ``TaskLocked`` for a duplicate under the
    "raise" policy.
    """
    if options.scope == "execution" or not deduplicates(options, task.app, linked, send_options):
        return publish(task_id)  # the common case first: no lookup in the app's settings
    key_args, key_kwargs = call_arguments(args, kwargs)
    if options.scope == "coalesce" and options.coalesce == "latest":
        latest_headers(task, send_options)  # refused before anything is reserved
    task_id = task_id or uuid()
    try:
        backend = app_state(task.app).backend
        return send_once(
            task, options, backend, publish, task_id, key_args, key_kwargs, send_options
        )
    except BackendError as exc:
        logger.warning(
            "Task %s[%s] sent without deduplication: the lock store is unreachable (%s); "
            "the execution-time lock still applies",
            task.name, task_id, exc,
        )  # fmt: skip
        return publish(task_id)


def send_once(
    task: Task[Any, Any],
    options: LockOptions,
    backend: LockBackend,
    publish: Callable[..., AsyncResult[Any]],
    task_id: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    send_options: Mapping[str, Any],
) -> AsyncResult[Any]:
    """Reserve the key for message ``task_id`` and ``publish`` it, or answer a duplicate.

    Returns the new message's ``AsyncResult``, or the holder's (or pending follow-up's) for a
    duplicate. Raises ``TaskLocked`` for a duplicate under the "raise" policy, and
    ``BackendError`` when the lock store fails.
    """
    key = options.key(args, kwargs)
    ttl = min(queue_lease(options.queue_ttl, send_options), backend.max_lease)
    token = reservation_token(task_id, 0)
    meta = {
        "task_id": task_id,
        "task": task.name,
        "scope": options.scope,  # for `singletask locks`; same round trip
        "since": f"{time.time():.3f}",
    }
    reserved, reservation = reserve(backend, key, token, ttl, meta)
    latest = options.scope == "coalesce" and options.coalesce == "latest"
    if reserved.acquired and latest:  # it supersedes a follow-up still on its way
        return send_latest(task, backend, publish, key, task_id, ttl, send_options, reservation)
    if reserved.acquired:  # the message never left if publish raises: nothing will run it
        return publish_or_undo(task, task_id, partial(publish, task_id), reservation)
    holder = reserved.holder
    if holder is None or holder.task_id is None:
        return publish(task_id)  # held by a direct call: leave it to the execution-time lock
    holder_id = holder.task_id
    queued = holder.token == reservation_token(holder_id, 0)
    follow_up = holder_id
    if latest and not queued:  # the key's latest follow-up now: it supersedes the pending one
        return send_latest(task, backend, publish, key, task_id, ttl, send_options, None, holder_id)
    if options.scope == "coalesce" and not queued:
        follow_up, claim = claim_follow_up(backend, key, task_id, holder_id, ttl)
        action = "follow" if follow_up == task_id else "join"
    else:
        action = POLICIES[options.policy].at_send
    lock_conflict.send(
        sender=task, key=key, holder=holder_id, ttl=holder.ttl, task_id=task_id, action=action
    )
    if action == "follow":
        logger.info(
            "Task %s[%s] sent as the follow-up of the run in progress on %r (%s)",
            task.name, task_id, key, holder_id,
        )  # fmt: skip
        # Unpublished, its claim would make later calls join a follow-up that never runs.
        return publish_or_undo(task, task_id, partial(publish, task_id), claim)
    if action in ("join", "dedupe"):  # the caller gets the result of the message it joined
        report.emit(task, "joined", key, task_id=follow_up, holder=holder_id, producer=True)
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


def send_latest(
    task: Task[Any, Any],
    backend: LockBackend,
    publish: Callable[..., AsyncResult[Any]],
    key: str,
    task_id: str,
    ttl: float,
    send_options: Mapping[str, Any],
    reservation: Written | None,
    running: str | None = None,
) -> AsyncResult[Any]:
    """``lock_coalesce = "latest"``: make ``task_id`` the latest send of the key's window
    (:func:`~singletask.send.records.enter_window`, the window ``lock_debounce`` uses) and publish
    it with :data:`~singletask.protocol.headers.LATEST_HEADER`. The follow-up it supersedes, if any,
    ends as a :class:`~singletask.Skipped` naming it when a worker starts it
    (:func:`singletask.execution.lifecycle.execute`). ``reservation``: the key's reservation this
    send made (the key was free), ``running``: the task id of the run in progress (this send is its
    follow-up). A failed publish takes both the window's entry and the reservation back; the
    entry is pending until the publish ends, as a debounced send's is."""
    pending = publish_time(task.app, send_options)
    previous, _, window = enter_window(backend, key, task_id, ttl, pending=pending)
    action = "follow" if running is not None and previous is None else "supersede"
    if running is not None or previous is not None:
        lock_conflict.send(
            sender=task, key=key, holder=previous or running, ttl=None, task_id=task_id,
            action=action,
        )  # fmt: skip
        logger.info(
            "Task %s[%s] sent as the latest follow-up of %r%s",
            task.name, task_id, key, f" (it supersedes {previous})" if previous else "",
        )  # fmt: skip
    written = window if reservation is None else together(reservation, window)
    message = partial(publish, task_id, latest_headers(task, send_options))
    result = publish_or_undo(task, task_id, message, written)
    window_published(task, backend, key, task_id)
    return result


def latest_headers(task: Task[Any, Any], send_options: Mapping[str, Any]) -> dict[str, Any]:
    """``send_options`` with :data:`~singletask.protocol.headers.LATEST_HEADER` in its headers.

    Raises:
        TypeError: The given ``headers`` are not a mapping, so the header that makes the send
            its key's latest cannot be added (a publish of such headers fails in Celery too).
    """
    stamped = with_header(send_options, LATEST_HEADER, 1)
    if stamped is None:
        given = type(send_options.get("headers")).__name__
        raise TypeError(
            f"{task.name}: headers must be a mapping (a dict) for lock_coalesce 'latest', "
            f"which sends its header {LATEST_HEADER!r} with each message; got {given}"
        )
    return stamped


def queue_lease(queue_ttl: float, options: Mapping[str, Any]) -> float:
    """How long a sent message keeps its key reserved: its delay plus ``queue_ttl``, never past
    its ``expires`` (a worker discards an expired message), and never more than the lock
    stores' ``MAX_LEASE`` (366 days: a message delayed longer loses its reservation then)."""
    lease = send_delay(options) + queue_ttl
    expires = options.get("expires")
    if isinstance(expires, int | float):
        lease = min(lease, max(0.001, float(expires)))
    elif expires is not None:
        lease = min(lease, max(0.001, seconds_until(maybe_iso8601(expires))))
    return min(lease, MAX_LEASE)
