"""Releases the worker's main process makes for executions that cannot make their own.

A pool process that is killed, hard-time-limited or revoked with terminate may never reach
the ``finally`` of :func:`singletask.execution.lifecycle.execute`. Celery tells the worker's main
process through signals (received here) and, on Celery 5.7, through task hooks called there (which
``SingletonTask`` hands to :func:`release_for`); singletask then releases the lock for that task
id, but only once the holding process has ended, so that no other execution can start beside a
body that is still running. A message revoked or expired before it started gives up the key
reserved for it (:func:`release_reservation`).

Everything here works from a task's :class:`~singletask.conf.options.LockOptions` and its app's
lock store (:mod:`singletask.conf.runtime`); the receivers recognise a singleton task by its
declared options.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from billiard.exceptions import TimeLimitExceeded, WorkerLostError
from celery import signals as celery_signals

from ..conf.runtime import app_state, is_singleton, lock_options
from ..protocol.slots import slot_keys
from ..protocol.tokens import process_state, reservation_token
from .units import give_back, own_key, wanted

if TYPE_CHECKING:
    from celery import Task

    from ..backends.base import Holder, LockBackend
    from ..conf.options import LockOptions
    from ..conf.runtime import AppState

__all__ = [
    "release_dead",
    "release_for",
    "release_reservation",
    "release_when_gone",
    "watch_and_release",
]

logger = logging.getLogger("singletask")


def watch_and_release(
    task_name: str,
    backend: LockBackend,
    key: str,
    token: str,
    task_id: str,
    reason: str,
    after: Callable[[], None] | None = None,
) -> None:
    """Release ``key`` for ``token`` from a watcher thread once its process has ended (then
    call ``after``: the units of its limits given back)."""
    watcher = threading.Thread(
        target=release_when_gone,
        args=(task_name, backend, key, token, task_id, reason, after),
        name="singletask-release-watch",
        daemon=True,
    )
    watcher.start()


def release_dead(
    task_name: str,
    backend: LockBackend,
    key: str,
    token: str,
    task_id: str,
    reason: str,
    after: Callable[[], None] | None = None,
) -> bool:
    """Release ``key`` for ``token``, whose process has ended, after calling ``after`` (the
    units of its limits given back, before the key as at every ending). Never raises."""
    if after is not None:
        after()
    try:
        released = backend.release(key, token)
    except Exception:
        logger.exception(
            "Task %s[%s]: could not release its lock after %s; it expires by itself",
            task_name, task_id, reason,
        )  # fmt: skip
        return False
    if released:
        logger.warning(
            "Task %s[%s]: lock %r released by the worker after %s",
            task_name, task_id, key, reason,
        )  # fmt: skip
    return released


def release_when_gone(
    task_name: str,
    backend: LockBackend,
    key: str,
    token: str,
    task_id: str,
    reason: str,
    after: Callable[[], None] | None = None,
) -> None:
    """Wait for the holding process to end, then release for it (from a watcher thread)."""
    checked = time.monotonic()
    while process_state(token) == "alive":
        time.sleep(0.1)
        if time.monotonic() - checked >= 5.0:  # stop watching once it let go by itself
            checked = time.monotonic()
            try:
                holder = backend.holder(key)
            except Exception:
                continue
            if holder is None or holder.token != token:
                return
    release_dead(task_name, backend, key, token, task_id, reason, after)


def release_for(
    task: Task[Any, Any],
    task_id: str,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    *,
    reason: str,
) -> bool:
    """Release the lock of execution ``task_id`` for a process that cannot release it.

    What :meth:`SingletonTask.release_for <singletask.SingletonTask.release_for>` does (see
    there). Never raises.
    """
    name, state = task.name, app_state(task.app)
    if not state.first_release(task_id):
        return False
    try:
        options = lock_options(task)
        backend = state.backend
        key = options.key(args or (), kwargs or {})
        limit = options.limit
        if options.keyless:
            key, limit = own_key(key, task_id), 1
        key, holder = _held_slot(backend, key, limit, task_id)
    except Exception:
        logger.exception(
            "Task %s[%s]: could not look up its lock after %s; it expires by itself",
            name, task_id, reason,
        )  # fmt: skip
        return False
    if holder is None or holder.task_id != task_id:
        return False
    after = _units_of(task, options, state, holder.token, args, kwargs)
    process = process_state(holder.token)
    if process == "gone":
        return release_dead(name, backend, key, holder.token, task_id, reason, after)
    if process == "alive":
        watch_and_release(name, backend, key, holder.token, task_id, reason, after)
        return False
    logger.info(
        "Task %s[%s]: after %s, lock %r is left to its lease (its holder's process cannot "
        "be checked from here)",
        name, task_id, reason, key,
    )  # fmt: skip
    return False


def _units_of(
    task: Task[Any, Any],
    options: LockOptions,
    state: AppState,
    token: str,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
) -> Callable[[], None] | None:
    """How to give back the units of named limits the execution of ``token`` holds, or None
    (it names none, or they cannot be known: then their lease gives them back)."""
    if options.limits is None and options.cost is None:
        return None
    try:
        key = options.key(args or (), kwargs or {})
        want = wanted(task, options, state, key, args or (), kwargs or {})
    except Exception:
        return None
    return functools.partial(give_back, task, state.backend, token, want)


def _held_slot(
    backend: LockBackend, key: str, limit: int, task_id: str
) -> tuple[str, Holder | None]:
    """The store key (``key`` or one of its ``limit`` slots) that ``task_id`` holds, and its
    holder; ``(key, holder of key)`` when it holds none of them."""
    first = backend.holder(key)
    if limit == 1 or (first is not None and first.task_id == task_id):
        return key, first
    for slot in slot_keys(key, limit)[1:]:
        holder = backend.holder(slot)
        if holder is not None and holder.task_id == task_id:
            return slot, holder
    return key, first


def release_reservation(
    task: Task[Any, Any],
    task_id: str,
    retries: int,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
) -> bool:
    """Release the key reserved for a message that will not run (revoked or expired).

    Never raises; returns whether a reservation was released.
    """
    name = task.name
    try:
        options = lock_options(task)
        key = options.key(args or (), kwargs or {})
        if options.keyless:
            key = own_key(key, task_id)
        backend = app_state(task.app).backend
        token = reservation_token(task_id, retries)
        # With lock_limit above 1 the reservation is in one of the key's slots.
        released = any(backend.release(slot, token) for slot in slot_keys(key, options.limit))
        # A follow-up that will not run frees its slot, so the next call can take it.
        freed = options.scope == "coalesce" and backend.clear_next(key, task_id)
    except Exception:
        logger.exception(
            "Task %s[%s]: could not release its reservation; it expires by itself",
            name, task_id,
        )  # fmt: skip
        return False
    if released:
        logger.info(
            "Task %s[%s] will not run (revoked or expired): reservation of %r released",
            name, task_id, key,
        )  # fmt: skip
    if freed:
        logger.info(
            "Task %s[%s] will not run (revoked or expired): follow-up slot of %r freed",
            name, task_id, key,
        )  # fmt: skip
    return released


# Endings where no task hook runs in the executing process: the worker's main process gets a
# signal and releases for it.


def _release_after_failure(
    sender: Any = None,
    task_id: str | None = None,
    exception: BaseException | None = None,
    args: Any = None,
    kwargs: Any = None,
    **_: Any,
) -> None:
    if not is_singleton(sender) or task_id is None:
        return
    if isinstance(exception, WorkerLostError):
        # The executing process is gone: nothing can still be running under this lock.
        release_for(sender, task_id, args, kwargs, reason="its worker process was lost")
    elif isinstance(exception, TimeLimitExceeded):
        # Celery < 5.7 calls no task hook on a hard time limit; this signal is all there is.
        release_for(sender, task_id, args, kwargs, reason="a hard time limit")


#: In the worker's main process: the requests of singleton tasks it has received and not yet
#: dropped, by task id. The ``task_revoked`` signal carries a request context without the
#: arguments, which a per-argument lock key needs.
_received: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def _remember_request(sender: Any = None, request: Any = None, **_: Any) -> None:
    if is_singleton(getattr(request, "task", None)):
        _received[request.id] = request


def _release_after_revoke(
    sender: Any = None, request: Any = None, terminated: bool = False, **_: Any
) -> None:
    if not (is_singleton(sender) and request is not None and request.id):
        return
    task_id = request.id
    args, kwargs = getattr(request, "args", None), getattr(request, "kwargs", None)
    received = _received.get(task_id)
    if args is None and received is not None:
        args, kwargs = received.args, received.kwargs
    if terminated:
        release_for(sender, task_id, args, kwargs, reason="revoke with terminate")
    else:
        # Revoked or expired before it started: it will never run, so its reservation goes.
        release_reservation(sender, task_id, int(request.retries or 0), args, kwargs)


celery_signals.task_failure.connect(_release_after_failure, weak=False)
celery_signals.task_revoked.connect(_release_after_revoke, weak=False)
celery_signals.task_received.connect(_remember_request, weak=False)
