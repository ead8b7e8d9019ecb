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
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, NoReturn

import celery
from celery import Task
from celery.app.task import Context
from celery.exceptions import Ignore, Reject, Retry
from celery.result import AsyncResult
from celery.utils import uuid
from celery.utils.nodenames import gethostname

from .backends import backend_from_url
from .config import (
    Settings,
    check_backend_error_policy,
    check_bool,
    check_count,
    check_policy,
    check_scope,
    check_seconds,
)
from .enqueue import seconds_until, send_once
from .exceptions import BackendError, BackendTimeout, BackendUnavailable, TaskLocked
from .keys import KeySpec, run_signature
from .lease import LockHandle, Renewer
from .recovery import release_dead, watch_and_release
from .result import Skipped
from .signals import lock_conflict, lock_lost
from .tokens import direct_token, execution_token, parse_token, process_state, reservation_token
from .worker import CheckLockStore

if TYPE_CHECKING:
    from celery import Celery

    from .backends.base import Holder, LockBackend

__all__ = ["SingletonTask"]

logger = logging.getLogger("singletask")

#: Message header counting the lock retries of a task id (the task's own ``retries`` stays
#: untouched, so lock retries never spend ``max_retries``).
LOCK_RETRIES_HEADER = "singletask_lock_retries"

#: Message header counting the retries made because the lock store could not be reached.
BACKEND_RETRIES_HEADER = "singletask_backend_retries"

#: Message header marking a copy deferred because another delivery of it held the lock.
REDELIVERED_HEADER = "singletask_redelivered"

#: Longest wait between those retries, in seconds (they back off 1, 2, 4, ... up to this).
BACKEND_RETRY_CAP = 30.0

#: A parent-side release for the same task id within this many seconds is a repeat (Celery
#: reports a hard time limit through two hooks and two signals).
_REPEAT_WINDOW = 10.0

#: Celery before 5.5 pushes a blank request in ``Task.__call__`` (see SingletonTask.push_request).
_PUSHES_BLANK_REQUEST = tuple(celery.VERSION[:2]) < (5, 5)


class _Frame(NamedTuple):
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
    scope: str
    queue_ttl: float
    ttl: float
    renew: bool
    max_hold: float | None
    retry_countdown: float
    retry_max: int
    on_backend_error: str
    backend_retry_max: int


class _AppState:
    """Per app and per process: the validated settings and the backend, built on first use."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self._mutex = threading.Lock()
        self._settings: Settings | None = None
        self._backend: LockBackend | None = None
        self._renewer: Renewer | None = None
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
                    self._renewer = Renewer(self._backend)
                    self._pid = pid
        return self._backend

    @property
    def renewer(self) -> Renewer:
        """The renewer of this process's backend."""
        self.backend  # noqa: B018 - (re)creates backend and renewer in a new process
        assert self._renewer is not None
        return self._renewer

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
    * ``lock_scope``: where duplicates are stopped: ``"execution"`` (default: when a worker
      runs them), ``"queue"`` (already in ``apply_async``: a duplicate gets the holder's
      ``AsyncResult``) or ``"coalesce"`` (one run plus at most one pending follow-up).
    * ``lock_queue_ttl``: the longest a sent message keeps its key reserved before a worker
      starts it (default 3600, plus any countdown / ETA).
    * ``lock_args``: None (one lock per task name), a sequence of parameter names, or ``"*"``.
    * ``lock_key``: a format string over parameter names, or a callable taking the task's
      arguments; replaces the suffix derived from ``lock_args``.
    * ``lock_ttl``: the lease in seconds (default 30), renewed while the body runs.
    * ``lock_renew``: renew the lease while the body runs (default True).
    * ``lock_max_hold``: seconds after which renewal stops (default None: no cap).
    * ``lock_retry_countdown``: seconds between lock retries, plus up to 25% jitter (default 10).
    * ``lock_retry_max``: lock retries before failing with ``TaskLocked`` (default 30).
    * ``lock_on_backend_error``: ``"retry"`` (default) or ``"run"`` when the lock store cannot
      be reached as the task starts.
    * ``lock_backend_retry_max``: retries while the lock store is unreachable (default 10).

    Every attribute is validated when the task class is created.
    """

    lock_policy: ClassVar[str | None] = None
    lock_scope: ClassVar[str | None] = None
    lock_queue_ttl: ClassVar[float | None] = None
    lock_args: ClassVar[Sequence[str] | str | None] = None
    lock_key: ClassVar[str | Callable[..., str] | None] = None
    lock_ttl: ClassVar[float | None] = None
    lock_renew: ClassVar[bool | None] = None
    lock_max_hold: ClassVar[float | None] = None
    lock_retry_countdown: ClassVar[float | None] = None
    lock_retry_max: ClassVar[int | None] = None
    lock_on_backend_error: ClassVar[str | None] = None
    lock_backend_retry_max: ClassVar[int | None] = None

    _singletask_spec: ClassVar[KeySpec]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name") or getattr(cls, "name", None) or cls.__qualname__
        where = f"task {name!r} attribute"
        checks: dict[str, Callable[[object, str], object]] = {
            "lock_policy": check_policy,
            "lock_scope": check_scope,
            "lock_queue_ttl": check_seconds,
            "lock_ttl": check_seconds,
            "lock_renew": check_bool,
            "lock_max_hold": check_seconds,
            "lock_retry_countdown": lambda v, w: check_seconds(v, w, allow_zero=True),
            "lock_retry_max": check_count,
            "lock_on_backend_error": check_backend_error_policy,
            "lock_backend_retry_max": check_count,
        }
        for attribute, check in checks.items():
            value = getattr(cls, attribute)
            if value is not None:
                check(value, f"{where} {attribute}")
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
        if cls.lock_renew is False and cls.lock_ttl and time_limit and cls.lock_ttl <= time_limit:
            logger.warning(
                "task %r: lock_ttl (%ss) is not longer than time_limit (%ss) and lock_renew is "
                "False: the lock can expire while the task still runs",
                name,
                cls.lock_ttl,
                time_limit,
            )

    @classmethod
    def on_bound(cls, app: Celery) -> None:
        """Make the app's workers check the lock store at start (see :mod:`singletask.worker`)."""
        super().on_bound(app)
        app.steps["worker"].add(CheckLockStore)

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
                scope=pick(self.lock_scope, settings.lock_scope),
                queue_ttl=float(pick(self.lock_queue_ttl, settings.lock_queue_ttl)),
                ttl=float(pick(self.lock_ttl, settings.lock_ttl)),
                renew=pick(self.lock_renew, settings.lock_renew),
                max_hold=pick(self.lock_max_hold, settings.lock_max_hold),
                retry_countdown=float(
                    pick(self.lock_retry_countdown, settings.lock_retry_countdown)
                ),
                retry_max=pick(self.lock_retry_max, settings.lock_retry_max),
                on_backend_error=pick(self.lock_on_backend_error, settings.lock_on_backend_error),
                backend_retry_max=pick(
                    self.lock_backend_retry_max, settings.lock_backend_retry_max
                ),
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

    # -- sending ---------------------------------------------------------------------------

    def apply_async(
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> AsyncResult[Any]:
        """Send the task; with ``lock_scope`` "queue" or "coalesce", deduplicate it first.

        The key is reserved for the new message, atomically, before it is published; the
        worker's execution then takes that reservation over as its lock. A duplicate sent while
        the key is reserved or held gets the holder's ``AsyncResult`` instead of a new message
        (``lock_policy = "raise"``: :class:`~singletask.TaskLocked` here instead). With
        "coalesce", a duplicate sent while a run is in progress becomes (or joins) the key's one
        pending follow-up. Messages republished for an execution (its own retries, lock
        retries), canvas parts (links, chains, chords, groups) and frozen signatures are never
        deduplicated here: for them, and for ``send_task``, the execution-time lock alone
        applies.
        """

        def send(task_id: str | None) -> AsyncResult[Any]:
            return super(SingletonTask, self).apply_async(
                tuple(args) if args is not None else None,
                dict(kwargs) if kwargs is not None else None,
                task_id,
                producer,
                link,
                link_error,
                shadow,
                **options,
            )

        settings = self._options()
        # Canvas parts, frozen signatures (``freeze()`` sets ``reply_to``: a chord's callback, for
        # one, carries nothing else before Celery 5.6), and messages a worker sends for a task it
        # finished (a chain's next link, with ``chain=[]`` for the last one; a link callback,
        # with ``parent_id``) or replaced (Task.replace): their callers already hold this task
        # id's AsyncResult, so the message must be published; the execution-time lock alone
        # applies to them.
        if (
            settings.scope == "execution"
            or self.app.conf.task_always_eager
            or "retries" in options  # republished for an execution (Task.retry and ours)
            or link
            or link_error
            or any(options.get(name) for name in ("chord", "group_id"))
            or any(
                name in options
                for name in ("chain", "parent_id", "reply_to", "replaced_task_nesting")
            )
        ):
            return send(task_id)
        task_id = task_id or uuid()
        try:
            return send_once(
                self,
                send,
                task_id,
                args or (),
                kwargs or {},
                scope=settings.scope,
                policy=settings.policy,
                queue_ttl=settings.queue_ttl,
                options=options,
            )
        except BackendError as exc:
            logger.warning(
                "Task %s[%s] sent without deduplication: the lock store is unreachable (%s); "
                "the execution-time lock still applies",
                self.name, task_id, exc,
            )  # fmt: skip
            return send(task_id)

    # -- execution -------------------------------------------------------------------------

    if _PUSHES_BLANK_REQUEST:

        def push_request(self, *args: Any, **kwargs: Any) -> None:
            """Push a copy of the current request updated with ``kwargs``, as Celery 5.5 does.

            Celery before 5.5 pushes a blank request in ``Task.__call__``. Outside a worker
            (eager mode, where no stack protection skips that push) the body of a task class
            with its own ``__call__`` would then run without its request: no ``request.id``,
            and ``self.retry()`` could not retry.
            """
            self.request_stack.push(Context(*args, **{**self.request.__dict__, **kwargs}))

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

        state = _app_state(self.app)
        backend = state.backend
        # ``attempt`` names one execution attempt of one message: a redelivered copy of the
        # message has the same one, the body's own retry the next one.
        attempt: str | None = None
        if direct:
            token, takeover = direct_token(), None
        else:
            retries = int(request.retries or 0)
            attempt = f"{task_id}:{retries}"
            token = execution_token(str(task_id), retries)
            # Take over the reservation made for this attempt: by apply_async when the message
            # was sent (lock_scope "queue" / "coalesce"), or by the previous attempt when it
            # ended with a retry (see _finish); never a running attempt itself.
            takeover = reservation_token(str(task_id), retries)
        meta = {
            "task": self.name,
            "hostname": request.hostname or gethostname(),  # Celery's, memoized
            "pid": str(os.getpid()),
            "since": f"{time.time():.3f}",
        }
        if attempt is not None:
            meta["task_id"] = str(task_id)
        try:
            result = backend.acquire(key, token, options.ttl, meta=meta, takeover_prefix=takeover)
            holder = result.holder
            if holder is not None and attempt is not None and process_state(holder.token) == "gone":
                # Same host, and the holder's process is gone: no need to wait for its lease.
                result = backend.acquire(
                    key, token, options.ttl, meta=meta, takeover_prefix=holder.token
                )
                if result.acquired:
                    logger.warning(
                        "Task %s[%s] took over lock %r from %s, whose process is gone",
                        self.name, task_id, key, holder.task_id,
                    )  # fmt: skip
        except (BackendUnavailable, BackendTimeout) as exc:
            return self._backend_unreachable(exc, direct, options, args, kwargs)
        if not result.acquired:
            return self._locked(key, result.holder, direct, options)

        if attempt is not None and result.completed == attempt and _is_redelivery(request):
            # This very message already ran to completion: a redelivered copy must not run.
            self._finish(backend, key, token, None, options)
            logger.warning(
                "Task %s[%s] dropped: this message already ran to completion under lock %r "
                "(a redelivered copy)",
                self.name, task_id, key,
            )  # fmt: skip
            raise Ignore()

        if options.scope == "coalesce" and attempt is not None:
            self._clear_follow_up(backend, key, str(task_id))

        handle = LockHandle(
            key,
            token,
            None if direct else task_id,
            result.fence,
            options.ttl,
            max_hold=options.max_hold,
            on_lost=self._lock_lost,
        )
        if options.renew:
            state.renewer.add(handle)
        reset = _frames.set((*frames, _Frame(self.name, None if direct else task_id, handle)))
        retry: Retry | None = None
        # Whether this message is done with, so that a redelivered copy must not run it again:
        # not when it is requeued, retried, replaced (Ignore) or its process is being stopped.
        completed = False
        try:
            value = super().__call__(*args, **kwargs)
            completed = True
            return value
        except Retry as exc:
            retry = exc
            raise
        except Reject as exc:
            completed = not getattr(exc, "requeue", False)
            raise
        except Ignore:
            raise
        except Exception:
            completed = True
            raise
        finally:
            _frames.reset(reset)
            handle.lost  # noqa: B018 - reports a lease that ran out unnoticed by the body
            state.renewer.remove(handle)  # before the release: no renewal starts after this
            keep = retry is not None and getattr(retry, "sig", None) is not None and not direct
            self._finish(
                backend,
                key,
                token,
                retry if keep and not request.is_eager else None,
                options,
                completed=attempt if completed else None,
                meta=meta,
            )

    def _finish(
        self,
        backend: LockBackend,
        key: str,
        token: str,
        retry: Retry | None,
        options: _Options,
        *,
        completed: str | None = None,
        meta: Mapping[str, str] | None = None,
    ) -> None:
        """End the execution's hold: release, or turn it into a reservation for the body's retry.

        The reservation is the lock under a token only the retried attempt (same task id,
        ``retries + 1``) takes over; it lasts the retry's countdown plus one lease.
        """
        try:
            if retry is not None:
                reserve = seconds_until(retry.when) + options.ttl
                retries = int(self.request.retries or 0)
                reserved = backend.acquire(
                    key,
                    reservation_token(str(self.request.id), retries + 1),
                    reserve,
                    meta=meta,
                    takeover_prefix=token,
                )
                if reserved.acquired:
                    logger.info(
                        "Task %s[%s] retries: lock %r stays reserved for the retry (%.0fs at most)",
                        self.name, self.request.id, key, reserve,
                    )  # fmt: skip
                return
            if not backend.release(key, token, completed=completed):
                logger.warning(
                    "Task %s[%s]: lock %r was no longer held when the task ended (its lease "
                    "ran out, or the worker released it for this task)",
                    self.name, self.request.id, key,
                )  # fmt: skip
        except Exception:
            # Never let release break the task's outcome; the lease ends by itself.
            logger.exception(
                "Task %s[%s]: could not release lock %r; it expires by itself within %.0fs",
                self.name, self.request.id, key, options.ttl,
            )  # fmt: skip

    def _lock_lost(self, handle: LockHandle, reason: str) -> None:
        """Called (from the renewer thread) when a running execution's lock is lost."""
        logger.error(
            "Task %s[%s]: lock %r lost while the task runs: %s. Another execution may start; "
            "self.lock.check() now raises LockLost",
            self.name, handle.task_id, handle.key, reason,
        )  # fmt: skip
        lock_lost.send(sender=self, key=handle.key, task_id=handle.task_id, reason=reason)

    def _backend_unreachable(
        self,
        exc: BackendUnavailable | BackendTimeout,
        direct: bool,
        options: _Options,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
    ) -> Any:
        """The lock store could not be reached to acquire: run unlocked, retry later, or fail."""
        request = self.request
        if options.on_backend_error == "run":
            logger.warning(
                "Task %s[%s] runs WITHOUT its lock: the lock store is unreachable (%s) and "
                "lock_on_backend_error is 'run'",
                self.name, request.id, exc,
            )  # fmt: skip
            return super().__call__(*args, **kwargs)
        spent = _header_count(request, BACKEND_RETRIES_HEADER)
        if direct or request.is_eager or spent >= options.backend_retry_max:
            why = (
                "cannot wait in eager mode or a direct call"
                if direct or request.is_eager
                else f"gave up after {spent} retries"
            )
            logger.error(
                "Task %s[%s] fails: the lock store is unreachable (%s); %s",
                self.name, request.id, exc, why,
            )  # fmt: skip
            if isinstance(exc, BackendUnavailable):
                raise exc
            raise BackendUnavailable(str(exc)) from exc
        countdown = min(BACKEND_RETRY_CAP, 2.0**spent * random.uniform(1.0, 1.25))
        logger.warning(
            "Task %s[%s] retries in %.1fs (%d of %d): the lock store is unreachable: %s",
            self.name, request.id, countdown, spent + 1, options.backend_retry_max, exc,
        )  # fmt: skip
        self._republish(request, countdown, {BACKEND_RETRIES_HEADER: spent + 1}, exc)

    def _republish(
        self,
        request: Any,
        countdown: float,
        headers: Mapping[str, Any],
        reason: Exception | None,
        *,
        quietly: bool = False,
    ) -> NoReturn:
        """Send this message again (same id and ``retries``) after ``countdown``; end this one.

        Like ``Task.retry()`` but without touching ``retries``: it raises ``Retry`` (state
        RETRY), or with ``quietly`` ``Ignore`` (nothing stored). A failed publish raises
        ``Reject``, as ``Task.retry()`` does.
        """
        merged = {**(request.headers or {}), **headers}
        signature = self.signature_from_request(request, countdown=countdown, headers=merged)
        try:
            signature.apply_async()
        except Exception as exc:
            raise Reject(exc, requeue=False) from exc
        if quietly:
            raise Ignore()
        raise Retry(exc=reason, when=countdown, sig=signature)  # type: ignore[arg-type]

    def _locked(self, key: str, holder: Holder | None, direct: bool, options: _Options) -> Any:
        """Apply the lock policy to an execution that found ``key`` held by someone else."""
        request = self.request
        holder_id = holder.task_id if holder else None
        ttl = holder.ttl if holder else None
        if holder is not None and not direct and holder_id == request.id:
            self._held_by_same_task(key, holder, options)
        if options.scope == "coalesce" and not direct and not request.is_eager:
            self._wait_as_follow_up(key, holder, options)
        action, why = options.policy, ""
        spent = 0
        if action == "retry":
            if direct or request.is_eager:
                action, why = "raise", " (retry cannot wait in eager mode or a direct call)"
            else:
                spent = _header_count(request, LOCK_RETRIES_HEADER)
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
        self._republish(request, countdown, {LOCK_RETRIES_HEADER: spent + 1}, locked)

    def _clear_follow_up(self, backend: LockBackend, key: str, task_id: str) -> None:
        """The follow-up started: later submissions form the next follow-up."""
        try:
            backend.clear_next(key, task_id)
        except BackendError:
            logger.warning(
                "Task %s[%s]: could not clear its follow-up claim on %r; it expires by itself",
                self.name, task_id, key, exc_info=True,
            )  # fmt: skip

    def _wait_as_follow_up(self, key: str, holder: Holder | None, options: _Options) -> None:
        """Coalescing: the key's one pending follow-up waits for the run in progress to end.

        Returns (so the lock policy applies) when another execution is already the follow-up.
        """
        request = self.request
        follow_up = self.lock_backend.claim_next(key, str(request.id), options.queue_ttl)
        if follow_up != request.id:
            return
        countdown = options.retry_countdown + random.uniform(0, options.retry_countdown / 4)
        logger.info(
            "Task %s[%s] is the follow-up of lock %r (held by %s): starting when it is free, "
            "checking again in %.1fs",
            self.name, request.id, key, holder.task_id if holder else None, countdown,
        )  # fmt: skip
        lock_conflict.send(
            sender=self, key=key, holder=holder.task_id if holder else None,
            ttl=holder.ttl if holder else None, task_id=request.id, action="follow",
        )  # fmt: skip
        self._republish(request, countdown, {}, None, quietly=True)

    def _held_by_same_task(self, key: str, holder: Holder, options: _Options) -> NoReturn:
        """The lock is held under this task id: by another delivery of this very message (a
        broker redelivery), or by a newer attempt of the task (this copy is stale).

        Neither may store a result under the task id, which belongs to the holder: a stale
        copy is dropped, a redelivered one checks again once the holder's lease could have
        run out. If the holder is alive it keeps renewing and the copy keeps waiting, until the
        holder completes (then the copy is dropped) or dies (then the copy runs).
        """
        request = self.request
        parsed = parse_token(holder.token)
        retries = int(request.retries or 0)
        if parsed is not None and parsed[1] == retries - 1:
            # The attempt that asked for this retry has not ended yet (Celery publishes the
            # retry before the body returns): look again shortly, then take its reservation.
            countdown = 0.5 + random.uniform(0, 0.25)
            logger.info(
                "Task %s[%s]: the previous attempt still holds lock %r; retrying in %.1fs",
                self.name, request.id, key, countdown,
            )  # fmt: skip
            self._republish(request, countdown, {}, None, quietly=True)
        if parsed is not None and parsed[1] > retries:
            logger.warning(
                "Task %s[%s] dropped: a newer attempt of this task (retry %d) holds lock %r",
                self.name, request.id, parsed[1], key,
            )  # fmt: skip
            lock_conflict.send(
                sender=self, key=key, holder=holder.task_id, ttl=holder.ttl,
                task_id=request.id, action="drop",
            )  # fmt: skip
            raise Ignore()
        countdown = min(options.ttl, max(1.0, holder.ttl or options.ttl)) + random.uniform(0, 0.5)
        logger.info(
            "Task %s[%s]: another delivery of this message holds lock %r (lease left: %s); "
            "checking again in %.1fs",
            self.name, request.id, key,
            f"{holder.ttl:.1f}s" if holder.ttl is not None else "unknown", countdown,
        )  # fmt: skip
        lock_conflict.send(
            sender=self, key=key, holder=holder.task_id, ttl=holder.ttl,
            task_id=request.id, action="defer",
        )  # fmt: skip
        self._republish(request, countdown, {REDELIVERED_HEADER: True}, None, quietly=True)

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
    ) -> bool:
        """Release the lock of execution ``task_id`` for a process that cannot release it.

        Used by the worker's main process after a hard time limit, a revoke with terminate or a
        lost pool process. It acts only while that task id holds the lock, and never before the
        holding process has ended: a process told to stop may still be running its body (Python
        handles SIGTERM only once it is back from C code). If the process is gone the lock is
        released at once; if it is still running, a watcher thread releases it the moment the
        process ends (until then the process keeps renewing its own lease). Never raises.

        Returns:
            True if the lock was released now; False if there was nothing to release, or the
            release was left to the watcher or to the lease.
        """
        state = _app_state(self.app)
        if not state.first_release(task_id):
            return False
        try:
            key = self.lock_key_for(args or (), kwargs or {})
            backend = state.backend
            holder = backend.holder(key)
        except Exception:
            logger.exception(
                "Task %s[%s]: could not look up its lock after %s; it expires by itself",
                self.name, task_id, reason,
            )  # fmt: skip
            return False
        if holder is None or holder.task_id != task_id:
            return False
        process = process_state(holder.token)
        if process == "gone":
            return release_dead(self.name, backend, key, holder.token, task_id, reason)
        if process == "alive":
            watch_and_release(self.name, backend, key, holder.token, task_id, reason)
            return False
        logger.info(
            "Task %s[%s]: after %s, lock %r is left to its lease (its holder's process cannot "
            "be checked from here)",
            self.name, task_id, reason, key,
        )  # fmt: skip
        return False

    def release_reservation(
        self,
        task_id: str,
        retries: int,
        args: Sequence[Any] | None,
        kwargs: Mapping[str, Any] | None,
    ) -> bool:
        """Release the key reserved for a message that will not run (revoked or expired).

        Never raises; returns whether a reservation was released.
        """
        try:
            key = self.lock_key_for(args or (), kwargs or {})
            backend = self.lock_backend
            released = backend.release(key, reservation_token(task_id, retries))
            # A follow-up that will not run frees its slot, so the next call can take it.
            freed = self._options().scope == "coalesce" and backend.clear_next(key, task_id)
        except Exception:
            logger.exception(
                "Task %s[%s]: could not release its reservation; it expires by itself",
                self.name, task_id,
            )  # fmt: skip
            return False
        if released:
            logger.info(
                "Task %s[%s] will not run (revoked or expired): reservation of %r released",
                self.name, task_id, key,
            )  # fmt: skip
        if freed:
            logger.info(
                "Task %s[%s] will not run (revoked or expired): follow-up slot of %r freed",
                self.name, task_id, key,
            )  # fmt: skip
        return released


def _is_redelivery(request: Any) -> bool:
    """Whether the broker delivered this message before (or singletask deferred such a copy)."""
    if (getattr(request, "delivery_info", None) or {}).get("redelivered"):
        return True
    return bool(_header_count(request, REDELIVERED_HEADER))


def _header_count(request: Any, header: str) -> int:
    """A counter this library keeps in the message headers (0 when absent)."""
    value = getattr(request, header, None)
    if value is None:
        value = (getattr(request, "headers", None) or {}).get(header)
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0
