"""SingletonTask: a Celery base task that lets one execution per lock key run at a time.

The lock is taken when a worker *executes* the task (in :meth:`SingletonTask.__call__`), so it
covers every way a message reaches a worker: ``delay``, ``apply_async``, ``send_task``, beat and
canvas. It is released in ``__call__``'s ``finally`` (which runs on every ending inside the
executing process, before Celery stores the result), and, for the endings where that process
cannot do it, by the worker's main process (hard time limit, revoke with terminate, a lost
worker process). See ``docs/lifecycle.rst`` for the table of which hook releases on which path.

This class is the face of the library: each Celery hook it overrides hands the work to one
module, so the whole lifecycle reads top to bottom here:

* definition time: :class:`~singletask.conf.options.TaskOptions` validates the ``lock_*``
attributes;
* ``apply_async``: :mod:`singletask.send.dedup` (send-time deduplication) and
  :mod:`singletask.send.debounce` (``lock_debounce``);
* ``__call__``: :mod:`singletask.execution.lifecycle` (acquire, renew, release; every execution that
  does not run its body ends in :mod:`singletask.execution.outcomes`, which applies the
  :mod:`singletask.policies`);
* ``on_success`` / ``on_failure`` / ``after_return`` called by the worker's main process, and
  Celery's signals there: :mod:`singletask.execution.recovery`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar

import celery
from celery import Task
from celery.app.task import Context
from celery.exceptions import Retry

from .conf.options import TaskOptions
from .conf.runtime import app_state, check_lease_options, lock_options
from .exceptions import ConfigurationError, TaskLocked
from .execution import lifecycle, outcomes, recovery, retrying, units
from .execution.bootstep import CheckLockStore, ServeWorker
from .observe import report
from .protocol import headers
from .send import debounce, dedup

if TYPE_CHECKING:
    from celery import Celery
    from celery.result import AsyncResult

    from .backends.base import LockBackend
    from .lease import LockHandle

__all__ = ["SingletonTask", "override_lock_backend"]

#: Message header counting the lock retries of a task id (the task's own ``retries`` stays
#: untouched, so lock retries never spend ``max_retries``).
LOCK_RETRIES_HEADER = headers.LOCK_RETRIES_HEADER

#: Message header counting the retries made because the lock store could not be reached.
BACKEND_RETRIES_HEADER = headers.BACKEND_RETRIES_HEADER

#: Longest wait between those retries, in seconds (they back off 1, 2, 4, ... up to this).
BACKEND_RETRY_CAP = outcomes.BACKEND_RETRY_CAP

#: Celery before 5.5 pushes a blank request in ``Task.__call__`` (see SingletonTask.push_request).
_PUSHES_BLANK_REQUEST = tuple(celery.VERSION[:2]) < (5, 5)


if TYPE_CHECKING:
    _TaskBase = Task[Any, Any]
else:
    _TaskBase = Task


class SingletonTask(_TaskBase):
    """A Celery task of which one execution per lock key runs at a time, on every worker.

    Configure it with ``lock_*`` class attributes or ``@app.task(...)`` options (``lock_policy``,
    ``lock_scope``, ``lock_args``, ``lock_key``, ``lock_ttl``, ...); ``None`` means "use the
    app-wide ``singletask_<attribute>`` setting, else the library default". The options, their
    defaults and bounds are listed once, in the configuration reference (docs/configuration.rst).

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
    lock_limit: ClassVar[int | None] = None
    lock_rate: ClassVar[str | None] = None
    lock_debounce: ClassVar[float | None] = None
    lock_debounce_max: ClassVar[float | None] = None
    lock_coalesce: ClassVar[str | None] = None
    lock_replace_terminate: ClassVar[bool | None] = None
    lock_limits: ClassVar[Sequence[str] | Mapping[str, Any] | None] = None
    lock_cost: ClassVar[int | Callable[..., int] | None] = None
    lock_weight: ClassVar[float | Callable[..., float] | None] = None
    lock_priority: ClassVar[int | Callable[..., int] | None] = None

    _singletask_options: ClassVar[TaskOptions]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._singletask_options = TaskOptions.from_class(cls, known=_LOCK_ATTRIBUTES)
        # A locked-out execution failing with TaskLocked is an expected outcome: Celery logs
        # exceptions listed in ``throws`` at INFO, without a traceback.
        throws = tuple(getattr(cls, "throws", ()) or ())
        if TaskLocked not in throws:
            cls.throws = (*throws, TaskLocked)

    @classmethod
    def on_bound(cls, app: Celery) -> None:
        """Make the app's workers check the lock store at start (see
        :mod:`singletask.execution.bootstep`), and refuse lease options longer than the configured
        store accepts."""
        super().on_bound(app)
        app.steps["worker"].add(CheckLockStore)
        app.steps["worker"].add(ServeWorker)
        # Definition time: binding has read the app's configuration, so a lease option longer
        # than the configured store accepts is refused now, naming the task and the store.
        check_lease_options(app, cls.name, cls._singletask_options)

    # -- the lock, for callers and the task body -------------------------------------------

    @property
    def lock_backend(self) -> LockBackend:
        """This process's backend for this task's app (created on first use, per process)."""
        return app_state(self.app).backend

    def lock_key_for(
        self, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
    ) -> str:
        """The lock key an execution with these arguments takes.

        Raises:
            LockKeyError: The key cannot be built from these arguments.
            ConfigurationError: The task has no name yet (a task class not registered with an
                app): its keys start with its name.
        """
        if self.name is None:
            raise ConfigurationError(
                f"task class {type(self).__qualname__} has no name yet, so no lock key: "
                "register it with an app (app.register_task) or give it a name"
            )
        return lock_options(self).key(args, kwargs or {})

    @property
    def lock(self) -> LockHandle | None:
        """The lock held by the current execution of this task (None outside one)."""
        return lifecycle.current_lock(self.name)

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

        ``args`` and ``kwargs`` reach Celery as they were given (a list is sent as a list), so
        Celery checks them as for any task: ``args`` that are neither a list nor a tuple (a
        ``str`` missing its comma, a dict) raise ``TypeError``. Where the key is built at send
        time (deduplication, ``lock_debounce``), such arguments raise
        :class:`~singletask.LockKeyError`, a ``TypeError`` too, before anything is reserved.

        The other options reach Celery as given too, unless a feature of this send needs a
        header of singletask's: the first send's time where its wait is measured
        (``singletask.observe.report.reports_wait``) and for ``lock_policy`` "replace" (which
        tells the later send by it), the mark of ``lock_coalesce`` "latest". ``headers`` that
        are not a mapping are left to Celery; "latest" refuses them with ``TypeError`` before
        anything is reserved.
        """

        lock = lock_options(self)
        if lock.limits is not None or lock.cost is not None:
            # A cost that can never fit its limit is refused here, before anything is sent.
            units.wanted(self, lock, app_state(self.app), lock_key_of(self, lock, args, kwargs),
                         args or (), kwargs or {})  # fmt: skip
        # "replace" orders its holders by send time; else the options reach Celery as given
        if lock.policy == "replace" or report.reports_wait(self.app, lock):
            options = dict(headers.with_sent_at(options))
        if lock.scope == "execution" and lock.debounce is None and not retrying.intercepts(task_id):
            # Nothing to deduplicate, debounce or keep for a hold's end: Celery's send, at once.
            send = super().apply_async
            return send(args, kwargs, task_id, producer, link, link_error, shadow, **options)  # type: ignore[arg-type]

        def publish(task_id: str | None, send: Mapping[str, Any] = options) -> AsyncResult[Any]:
            # As given: Celery checks them (a str is not a tuple), and sends a list as a list.
            # (Celery's stubs say tuple and dict; it takes any list or tuple, and any mapping.)
            # The retry of the execution in progress (self.retry) waits for its hold's end.
            return retrying.published(
                self,
                task_id,
                send,
                lambda: super(SingletonTask, self).apply_async(
                    args,  # type: ignore[arg-type]
                    kwargs,  # type: ignore[arg-type]
                    task_id,
                    producer,
                    link,
                    link_error,
                    shadow,
                    **send,
                ),
            )

        if lock.debounce is not None:
            return debounce.send(
                self, lock, publish, task_id, args, kwargs,
                linked=bool(link or link_error), send_options=options,
            )  # fmt: skip
        return dedup.send(
            self, lock, publish, task_id, args, kwargs,
            linked=bool(link or link_error), send_options=options,
        )  # fmt: skip

    def retry(
        self,
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
        exc: Exception | None = None,
        throw: bool = True,
        eta: datetime | None = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Retry:
        """Celery's ``Task.retry``; in a worker execution, the retry is published as the body
        ends, once the lock is the retried attempt's reservation (see
        :mod:`singletask.execution.retrying`): nothing of singletask's comes between Celery's
        publish and its storing of RETRY, and the retried attempt never runs beside the rest of
        this one. With ``throw=False`` it is published at once, as by Celery, and the body goes
        on holding its lock."""
        with retrying.retrying(self, throw=throw):
            return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)

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
        if self.name is None:
            # A task class not registered yet (no name) can only be called directly: no
            # message can name it, so no worker runs it. It has no lock key either; its body
            # runs as Celery runs it, without a lock (``self.lock`` is None).
            return super().__call__(*args, **kwargs)
        return lifecycle.execute(self, lock_options(self), super().__call__, args, kwargs)

    # -- Celery hooks ----------------------------------------------------------------------
    #
    # Inside the executing process, __call__'s ``finally`` has already released the lock when
    # these run, so they do nothing there. Celery also calls them from the worker's main
    # process, with no request, for an execution that process can no longer finish (a hard
    # time limit on Celery >= 5.7): there they release for it.

    def _outside_execution(self, task_id: str) -> bool:
        # Not the execution of task_id that last began or ended in this thread: the worker's
        # main process, or a hook called by hand.
        return not lifecycle.ended_here(task_id)

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
        return recovery.release_for(self, task_id, args, kwargs, reason=reason)

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
        return recovery.release_reservation(self, task_id, retries, args, kwargs)


def lock_key_of(
    task: SingletonTask, lock: Any, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None
) -> str:
    """The task's key for a send's arguments (named limits read it only with ``lock_cost``)."""
    return str(lock.key(args or (), kwargs or {})) if lock.cost is not None else ""


def override_lock_backend(app: Celery, backend: LockBackend | None) -> None:
    """Make every SingletonTask of ``app`` use ``backend`` in this process; None undoes it.

    For test suites (:mod:`singletask.testing` installs its stores with it): while it is set,
    the app needs no ``singletask_backend_url`` (none is read) and the store built from the
    settings, if any, is left alone. The other settings still apply and are validated.
    """
    app_state(app).override(backend)


#: Every ``lock_*`` name SingletonTask defines (its options and its ``lock_*`` methods): any other
#: ``lock_*`` attribute of a subclass is a misspelt option, refused when the class is created.
_LOCK_ATTRIBUTES = frozenset(name for name in dir(SingletonTask) if name.startswith("lock_"))
