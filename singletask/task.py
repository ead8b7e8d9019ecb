"""SingletonTask: a Celery base task that lets one execution per lock key run at a time.

The lock is taken when a worker *executes* the task (in :meth:`SingletonTask.__call__`), so it
covers every way a message reaches a worker: ``delay``, ``apply_async``, ``send_task``, beat and
canvas. It is released in ``__call__``'s ``finally`` (which runs on every ending inside the
executing process, before Celery stores the result), and, for the endings where that process
cannot do it, by the worker's main process (hard time limit, revoke with terminate, a lost
worker process). See ``docs/lifecycle.rst`` for the table of which hook releases on which path.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import os
import random
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, ClassVar

from billiard.exceptions import TimeLimitExceeded, WorkerLostError
from celery import Task
from celery import signals as celery_signals
from celery.exceptions import Reject, Retry

from .backends import backend_from_url
from .config import Settings, check_count, check_policy, check_seconds
from .exceptions import TaskLocked
from .keys import KeySpec, run_signature
from .result import Skipped
from .signals import lock_conflict

if TYPE_CHECKING:
    from celery import Celery

    from .backends.base import Holder, LockBackend

__all__ = ["LockHandle", "SingletonTask"]

logger = logging.getLogger("singletask")

#: Message header counting the lock retries of one attempt (the task's own ``retries`` stays
#: untouched, so lock retries never spend ``max_retries``).
LOCK_RETRIES_HEADER = "singletask_lock_retries"

#: Seconds of lease left to a holder whose process the worker is stopping (hard time limit,
#: revoke with terminate): long enough for that process to be gone, short enough to not matter.
TERMINATION_GRACE = 2.0

#: A parent-side release for the same task id within this many seconds is a repeat (Celery
#: reports a hard time limit through two hooks and two signals).
_REPEAT_WINDOW = 10.0


@dataclass(frozen=True)
class LockHandle:
    """The lock held by the running execution, as ``self.lock`` inside the task body.

    Attributes:
        key: The lock key.
        token: The owner token stored with the lock.
        task_id: The holding execution's task id (None for a direct call).
        acquired_at: When it was acquired (``time.time()``).
        ttl: The lease it was acquired with, in seconds.
    """

    key: str
    token: str
    task_id: str | None
    acquired_at: float
    ttl: float


@dataclass(frozen=True)
class _Frame:
    """One ``SingletonTask.__call__`` in progress in the current thread / greenlet."""

    task: str
    request_id: str | None
    handle: LockHandle


_frames: contextvars.ContextVar[tuple[_Frame, ...]] = contextvars.ContextVar(
    "singletask_frames", default=()
)


@dataclass(frozen=True)
class _Options:
    """A task's lock options with the app's defaults filled in."""

    prefix: str
    policy: str
    ttl: float
    retry_countdown: float
    retry_max: int


class _AppState:
    """Per app and per process: the validated settings and the backend, built on first use."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self._mutex = threading.Lock()
        self._settings: Settings | None = None
        self._backend: LockBackend | None = None
        self._pid: int | None = None
        self._released: dict[str, float] = {}

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            self._settings = Settings.from_app(self.app)
        return self._settings

    @property
    def backend(self) -> LockBackend:
        pid = os.getpid()
        if self._backend is None or self._pid != pid:
            with self._mutex:
                if self._backend is None or self._pid != pid:
                    self._backend = backend_from_url(self.settings.backend_url)
                    self._pid = pid
        return self._backend

    def first_release(self, task_id: str) -> bool:
        """True the first time a parent-side release for ``task_id`` is asked for lately."""
        now = time.monotonic()
        with self._mutex:
            for stale in [t for t, at in self._released.items() if now - at > _REPEAT_WINDOW]:
                del self._released[stale]
            if task_id in self._released:
                return False
            self._released[task_id] = now
            return True


def _app_state(app: Celery) -> _AppState:
    state = app.__dict__.get("_singletask_state")
    if state is None:
        state = app.__dict__.setdefault("_singletask_state", _AppState(app))
    assert isinstance(state, _AppState)
    return state


def _seconds_until(when: object) -> float:
    """The delay of a ``Retry.when`` (seconds or an ETA), never negative."""
    if isinstance(when, int | float):
        return max(0.0, float(when))
    if isinstance(when, datetime):
        now = datetime.now(when.tzinfo or timezone.utc) if when.tzinfo else datetime.now()
        return max(0.0, (when - now).total_seconds())
    return 0.0


if TYPE_CHECKING:
    _TaskBase = Task[Any, Any]
else:
    _TaskBase = Task


class SingletonTask(_TaskBase):
    """A Celery task of which one execution per lock key runs at a time, on every worker.

    Configure it with class attributes or ``@app.task(...)`` options; ``None`` means "use the
    app-wide ``singletask_<attribute>`` setting, else the library default":

    * ``lock_policy``: what a locked-out execution does: ``"skip"`` (default: return a
      :class:`~singletask.Skipped`), ``"retry"`` (retry later) or ``"raise"`` (fail with
      :class:`~singletask.TaskLocked`).
    * ``lock_args``: None (one lock per task name), a sequence of parameter names, or ``"*"``.
    * ``lock_key``: a format string over parameter names, or a callable taking the task's
      arguments; replaces the suffix derived from ``lock_args``.
    * ``lock_ttl``: the lease in seconds (default 3600).
    * ``lock_retry_countdown``: seconds between lock retries, plus up to 25% jitter (default 10).
    * ``lock_retry_max``: lock retries before failing with ``TaskLocked`` (default 30).

    Every attribute is validated when the task class is created.
    """

    lock_policy: ClassVar[str | None] = None
    lock_args: ClassVar[Sequence[str] | str | None] = None
    lock_key: ClassVar[str | Callable[..., str] | None] = None
    lock_ttl: ClassVar[float | None] = None
    lock_retry_countdown: ClassVar[float | None] = None
    lock_retry_max: ClassVar[int | None] = None

    _singletask_spec: ClassVar[KeySpec]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name") or getattr(cls, "name", None) or cls.__qualname__
        where = f"task {name!r} attribute"
        if cls.lock_policy is not None:
            check_policy(cls.lock_policy, f"{where} lock_policy")
        if cls.lock_ttl is not None:
            check_seconds(cls.lock_ttl, f"{where} lock_ttl")
        if cls.lock_retry_countdown is not None:
            check_seconds(
                cls.lock_retry_countdown, f"{where} lock_retry_countdown", allow_zero=True
            )
        if cls.lock_retry_max is not None:
            check_count(cls.lock_retry_max, f"{where} lock_retry_max")
        lock_key = inspect.getattr_static(cls, "lock_key")
        if isinstance(lock_key, staticmethod | classmethod):
            lock_key = lock_key.__get__(None, cls)
        cls._singletask_spec = KeySpec(name, run_signature(cls), cls.lock_args, lock_key)
        # A locked-out execution failing with TaskLocked is an expected outcome: Celery logs
        # exceptions listed in ``throws`` at INFO, without a traceback.
        throws = tuple(getattr(cls, "throws", ()) or ())
        if TaskLocked not in throws:
            cls.throws = (*throws, TaskLocked)
        time_limit = getattr(cls, "time_limit", None)
        if cls.lock_ttl is not None and time_limit and cls.lock_ttl <= time_limit:
            logger.warning(
                "task %r: lock_ttl (%ss) is not longer than time_limit (%ss): the lock can "
                "expire while the task still runs",
                name,
                cls.lock_ttl,
                time_limit,
            )

    # -- configuration -------------------------------------------------------------------

    def _options(self) -> _Options:
        options = self.__dict__.get("_singletask_options")
        if options is None:
            settings = _app_state(self.app).settings

            def pick(attribute: Any, default: Any) -> Any:
                return default if attribute is None else attribute

            options = _Options(
                prefix=settings.key_prefix,
                policy=pick(self.lock_policy, settings.lock_policy),
                ttl=float(pick(self.lock_ttl, settings.lock_ttl)),
                retry_countdown=float(
                    pick(self.lock_retry_countdown, settings.lock_retry_countdown)
                ),
                retry_max=pick(self.lock_retry_max, settings.lock_retry_max),
            )
            self.__dict__["_singletask_options"] = options
        return options

    @property
    def lock_backend(self) -> LockBackend:
        """This process's backend for this task's app (created on first use, per process)."""
        return _app_state(self.app).backend

    def lock_key_for(
        self, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
    ) -> str:
        """The lock key an execution with these arguments takes.

        Raises:
            LockKeyError: The key cannot be built from these arguments.
        """
        return self._singletask_spec.key(self._options().prefix, self.name, args, kwargs or {})

    @property
    def lock(self) -> LockHandle | None:
        """The lock held by the current execution of this task (None outside one)."""
        for frame in reversed(_frames.get()):
            if frame.task == self.name:
                return frame.handle
        return None

    # -- execution -------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        frames = _frames.get()
        task_id: str | None = request.id
        # A call from inside a running execution of this same task inherits its request.
        nested = any(f.task == self.name and f.request_id == task_id for f in frames)
        direct = bool(request.called_directly) or task_id is None or nested
        options = self._options()
        key = self.lock_key_for(args, kwargs)
        if direct and any(f.handle.key == key for f in frames):
            # Re-entrant: the body of the execution holding this key calls the task directly.
            return super().__call__(*args, **kwargs)

        backend = self.lock_backend
        if direct:
            token, takeover = f"direct:{secrets.token_hex(8)}", None
        else:
            retries = int(request.retries or 0)
            token = f"{task_id}:{retries}:{secrets.token_hex(4)}"
            # The body's own retry republished this message: take over the reservation that
            # the previous attempt left (see _finish).
            takeover = f"{task_id}:{retries - 1}:" if retries > 0 else None
        meta = {
            "task": self.name,
            "hostname": request.hostname or socket.gethostname(),
            "pid": str(os.getpid()),
            "since": f"{time.time():.3f}",
        }
        if task_id is not None and not direct:
            meta["task_id"] = task_id
        result = backend.acquire(key, token, options.ttl, meta=meta, takeover_prefix=takeover)
        if not result.acquired:
            return self._locked(key, result.holder, direct, options)

        handle = LockHandle(key, token, None if direct else task_id, time.time(), options.ttl)
        reset = _frames.set((*frames, _Frame(self.name, None if direct else task_id, handle)))
        retry: Retry | None = None
        try:
            return super().__call__(*args, **kwargs)
        except Retry as exc:
            retry = exc
            raise
        finally:
            _frames.reset(reset)
            keep = retry is not None and getattr(retry, "sig", None) is not None and not direct
            self._finish(backend, handle, retry if keep and not request.is_eager else None, options)

    def _finish(
        self, backend: LockBackend, handle: LockHandle, retry: Retry | None, options: _Options
    ) -> None:
        """End the execution's hold: release, or keep the lock reserved for the body's retry."""
        try:
            if retry is not None:
                reserve = _seconds_until(retry.when) + options.ttl
                if backend.extend(handle.key, handle.token, reserve):
                    logger.info(
                        "Task %s[%s] retries: lock %r stays reserved for the retry (%.0fs at most)",
                        self.name,
                        handle.task_id,
                        handle.key,
                        reserve,
                    )
                return  # not extended: the retried attempt has taken the lock over already
            if not backend.release(handle.key, handle.token):
                logger.warning(
                    "Task %s[%s]: lock %r was no longer held when the task ended (lease of "
                    "%.0fs ran out, or it was released for this task by the worker)",
                    self.name,
                    handle.task_id,
                    handle.key,
                    handle.ttl,
                )
        except Exception:
            # Never let release break the task's outcome; the lease ends by itself.
            logger.exception(
                "Task %s[%s]: could not release lock %r; it expires by itself within %.0fs",
                self.name,
                handle.task_id,
                handle.key,
                handle.ttl,
            )

    def _locked(self, key: str, holder: Holder | None, direct: bool, options: _Options) -> Any:
        """Apply the lock policy to an execution that found ``key`` held by someone else."""
        request = self.request
        holder_id = holder.task_id if holder else None
        ttl = holder.ttl if holder else None
        action, why = options.policy, ""
        spent = 0
        if action == "retry":
            if direct or request.is_eager:
                action, why = "raise", " (retry cannot wait in eager mode or a direct call)"
            else:
                spent = _lock_retries(request)
                if spent >= options.retry_max:
                    action, why = "raise", f" (lock retries spent: {spent} of {options.retry_max})"
        lock_conflict.send(
            sender=self, key=key, holder=holder_id, ttl=ttl, task_id=request.id, action=action
        )
        left = f"{ttl:.1f}s" if ttl is not None else "unknown"
        if action == "skip":
            logger.warning(
                "Task %s[%s] skipped: lock %r is held by %s (lease left: %s)",
                self.name, request.id, key, holder_id, left,
            )  # fmt: skip
            return Skipped(key, holder_id, ttl)
        locked = TaskLocked(key, holder_id, ttl)
        if action == "raise":
            logger.warning(
                "Task %s[%s] raises TaskLocked: lock %r is held by %s (lease left: %s)%s",
                self.name, request.id, key, holder_id, left, why,
            )  # fmt: skip
            raise locked
        countdown = options.retry_countdown + random.uniform(0, options.retry_countdown / 4)
        logger.info(
            "Task %s[%s] retries in %.1fs (lock retry %d of %d): lock %r is held by %s",
            self.name, request.id, countdown, spent + 1, options.retry_max, key, holder_id,
        )  # fmt: skip
        headers = {**(request.headers or {}), LOCK_RETRIES_HEADER: spent + 1}
        signature = self.signature_from_request(request, countdown=countdown, headers=headers)
        try:
            signature.apply_async()
        except Exception as exc:
            raise Reject(exc, requeue=False) from exc
        raise Retry(exc=locked, when=countdown, sig=signature)  # type: ignore[arg-type]

    # -- Celery hooks ----------------------------------------------------------------------
    #
    # Inside the executing process, __call__'s ``finally`` has already released the lock when
    # these run, so they do nothing there. Celery also calls them from the worker's main
    # process, with no request, for an execution that process can no longer finish (a hard
    # time limit on Celery >= 5.7): there they release for it.

    def _outside_execution(self, task_id: str) -> bool:
        request = self.request
        return bool(request.called_directly) or request.id != task_id

    def on_success(self, retval: Any, task_id: str, args: Any, kwargs: Any) -> None:
        if self._outside_execution(task_id):
            self.release_for(task_id, args, kwargs, reason="on_success from the main process")
        super().on_success(retval, task_id, args, kwargs)

    def on_failure(self, exc: Exception, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        if self._outside_execution(task_id):
            self.release_for(
                task_id, args, kwargs, reason=f"{type(exc).__name__} in the main process"
            )
        super().on_failure(exc, task_id, args, kwargs, einfo)

    def after_return(
        self, status: str, retval: Any, task_id: str, args: Any, kwargs: Any, einfo: Any
    ) -> None:
        if self._outside_execution(task_id):
            self.release_for(
                task_id, args, kwargs, reason=f"after_return({status}) in the main process"
            )
        super().after_return(status, retval, task_id, args, kwargs, einfo)

    def release_for(
        self,
        task_id: str,
        args: Sequence[Any] | None,
        kwargs: Mapping[str, Any] | None,
        *,
        reason: str,
        grace: float = TERMINATION_GRACE,
    ) -> bool:
        """Release the lock of execution ``task_id`` from a process that is not running it.

        Used by the worker's main process when the executing process cannot release (hard time
        limit, revoke with terminate, lost worker process). It acts only if that task id still
        holds the lock, and with ``grace > 0`` it shortens the lease to ``grace`` seconds instead
        of deleting it, so that a process being stopped is gone before another execution starts.
        Never raises; returns whether it changed the lock.
        """
        state = _app_state(self.app)
        if not state.first_release(task_id):
            return False
        try:
            key = self.lock_key_for(args or (), kwargs or {})
            backend = state.backend
            holder = backend.holder(key)
            if holder is None or holder.task_id != task_id:
                return False
            if grace > 0:
                done = backend.extend(key, holder.token, min(grace, holder.ttl or grace))
            else:
                done = backend.release(key, holder.token)
        except Exception:
            logger.exception(
                "Task %s[%s]: could not release its lock after %s; it expires by itself",
                self.name, task_id, reason,
            )  # fmt: skip
            return False
        if done:
            logger.warning(
                "Task %s[%s]: lock %r released by the worker after %s%s",
                self.name, task_id, key, reason, f" (in {grace:.0f}s)" if grace > 0 else "",
            )  # fmt: skip
        return done


def _lock_retries(request: Any) -> int:
    value = getattr(request, LOCK_RETRIES_HEADER, None)
    if value is None:
        value = (getattr(request, "headers", None) or {}).get(LOCK_RETRIES_HEADER)
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


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
    if not isinstance(sender, SingletonTask) or task_id is None:
        return
    if isinstance(exception, WorkerLostError):
        # The executing process is gone: nothing can still be running under this lock.
        sender.release_for(task_id, args, kwargs, reason="its worker process was lost", grace=0)
    elif isinstance(exception, TimeLimitExceeded):
        # Celery < 5.7 calls no task hook on a hard time limit; this signal is all there is.
        sender.release_for(task_id, args, kwargs, reason="a hard time limit")


#: In the worker's main process: the requests of singleton tasks it has received and not yet
#: dropped, by task id. The ``task_revoked`` signal carries a request context without the
#: arguments, which a per-argument lock key needs.
_received: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def _remember_request(sender: Any = None, request: Any = None, **_: Any) -> None:
    if isinstance(getattr(request, "task", None), SingletonTask):
        _received[request.id] = request


def _release_after_revoke(
    sender: Any = None, request: Any = None, terminated: bool = False, **_: Any
) -> None:
    if not (terminated and isinstance(sender, SingletonTask) and request is not None):
        return
    task_id = request.id
    args, kwargs = getattr(request, "args", None), getattr(request, "kwargs", None)
    received = _received.get(task_id)
    if args is None and received is not None:
        args, kwargs = received.args, received.kwargs
    if task_id:
        sender.release_for(task_id, args, kwargs, reason="revoke with terminate")


celery_signals.task_failure.connect(_release_after_failure, weak=False)
celery_signals.task_revoked.connect(_release_after_revoke, weak=False)
celery_signals.task_received.connect(_remember_request, weak=False)
