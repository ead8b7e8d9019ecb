"""Releases the worker's main process makes for executions that cannot make their own.

A pool process that is killed, hard-time-limited or revoked with terminate may never reach
``SingletonTask.__call__``'s ``finally``. Celery tells the worker's main process through
signals (and, on Celery 5.7, hooks called there); singletask then releases the lock for that
task id, but only once the holding process has ended, so that no other execution can start
beside a body that is still running.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from billiard.exceptions import TimeLimitExceeded, WorkerLostError
from celery import signals as celery_signals

from .tokens import process_state

if TYPE_CHECKING:
    from .backends.base import LockBackend

__all__ = ["release_dead", "release_when_gone", "watch_and_release"]

logger = logging.getLogger("singletask")


def watch_and_release(
    task_name: str, backend: LockBackend, key: str, token: str, task_id: str, reason: str
) -> None:
    """Release ``key`` for ``token`` from a watcher thread once its process has ended."""
    watcher = threading.Thread(
        target=release_when_gone,
        args=(task_name, backend, key, token, task_id, reason),
        name="singletask-release-watch",
        daemon=True,
    )
    watcher.start()


def release_dead(
    task_name: str, backend: LockBackend, key: str, token: str, task_id: str, reason: str
) -> bool:
    """Release ``key`` for ``token``, whose process has ended. Never raises."""
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
    task_name: str, backend: LockBackend, key: str, token: str, task_id: str, reason: str
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
    release_dead(task_name, backend, key, token, task_id, reason)


def _is_singleton(task: Any) -> bool:
    from .task import SingletonTask

    return isinstance(task, SingletonTask)


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
    if not _is_singleton(sender) or task_id is None:
        return
    if isinstance(exception, WorkerLostError):
        # The executing process is gone: nothing can still be running under this lock.
        sender.release_for(task_id, args, kwargs, reason="its worker process was lost")
    elif isinstance(exception, TimeLimitExceeded):
        # Celery < 5.7 calls no task hook on a hard time limit; this signal is all there is.
        sender.release_for(task_id, args, kwargs, reason="a hard time limit")


#: In the worker's main process: the requests of singleton tasks it has received and not yet
#: dropped, by task id. The ``task_revoked`` signal carries a request context without the
#: arguments, which a per-argument lock key needs.
_received: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def _remember_request(sender: Any = None, request: Any = None, **_: Any) -> None:
    if _is_singleton(getattr(request, "task", None)):
        _received[request.id] = request


def _release_after_revoke(
    sender: Any = None, request: Any = None, terminated: bool = False, **_: Any
) -> None:
    if not (_is_singleton(sender) and request is not None and request.id):
        return
    task_id = request.id
    args, kwargs = getattr(request, "args", None), getattr(request, "kwargs", None)
    received = _received.get(task_id)
    if args is None and received is not None:
        args, kwargs = received.args, received.kwargs
    if terminated:
        sender.release_for(task_id, args, kwargs, reason="revoke with terminate")
    else:
        # Revoked or expired before it started: it will never run, so its reservation goes.
        sender.release_reservation(task_id, int(request.retries or 0), args, kwargs)


celery_signals.task_failure.connect(_release_after_failure, weak=False)
celery_signals.task_revoked.connect(_release_after_revoke, weak=False)
celery_signals.task_received.connect(_remember_request, weak=False)
