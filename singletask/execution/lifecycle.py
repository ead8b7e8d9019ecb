"""The lock lifecycle of one execution: acquire before the body, renew while it runs, release once.

:func:`execute` is what :meth:`SingletonTask.__call__ <singletask.SingletonTask>` does, in this
order (``docs/lifecycle.rst`` tells the same story for users):

1. **Who is running.** A worker or eager execution has a task id and ``retries``: its owner
   token names that *attempt* and its process, and it may take over the reservation made for
   that attempt (by ``apply_async`` with ``lock_scope`` "queue"/"coalesce", or by the previous
   attempt's body retry). A direct call ``task(...)`` has neither. A direct call from inside the
   execution that holds the same key is re-entrant: it runs the body and takes nothing.
2. **Acquire**, in one atomic step of the store. If the holder's process is gone (same host),
   take the lock over at once. Every execution that does not get to run its body ends in
   :mod:`singletask.execution.outcomes`: superseded by a later send of its debounce window
   (:func:`~singletask.execution.outcomes.superseded`), the store unreachable
   (:func:`~singletask.execution.outcomes.store_unreachable`), or its key refused, held or too soon
   for its rate (:func:`~singletask.execution.outcomes.refused`). None of them releases the lock:
   they hold nothing (what the store keeps for the message alone, they give back). With
   ``lock_policy`` "replace", a newer execution takes a held key over first
   (:mod:`singletask.execution.replace`).
3. **Run the body**, the lease renewed by the process's renewer, the
   :class:`~singletask.LockHandle` reachable as ``self.lock``. A lease found lost is logged and
   sent as :data:`~singletask.signals.lock_lost`, once.
4. **End the hold exactly once**, in the ``finally`` around the body, whatever the ending: stop
   renewing, then act as :data:`ENDINGS` says for the way the body ended.

The endings the ``finally`` tells apart (rows of the table "Which hook releases on which ending"
in ``docs/lifecycle.rst``; the endings where this process never gets there are the worker main
process's, in :mod:`singletask.execution.recovery`):

==================  ====================================================  ========  =========
ending              the body                                              the lock  completed
==================  ====================================================  ========  =========
``returned``        returned                                              released  yes
``raised``          raised an exception (none of the ones below)          released  yes
``rejected``        raised ``Reject(requeue=False)``                      released  yes
``requeued``        raised ``Reject(requeue=True)``                       released  no
``ignored``         raised ``Ignore`` (so did ``self.replace()``)         released  no
``retried``         retried itself on a worker: ``self.retry()``          reserved  no
``retried-inline``  retried itself in eager mode (Celery runs it again    released  no
                    at once) or in a direct call (nothing runs it again)
``stopped``         was unwound by ``SystemExit``, ``KeyboardInterrupt``  released  no
``replaced``        preempted by a newer execution (``lock_policy``       released  no
                    "replace"): raised ``LockLost``, or returned
==================  ====================================================  ========  =========

*Released* is an owner-checked release; *reserved* turns the lock into a reservation only the
retried attempt takes over (for the retry's countdown plus one lease). *Completed* releases
record the attempt as the key's completion marker, so a redelivered copy of a message that ran
to completion is dropped instead of running again; only for tasks with ``acks_late``: any other
message is acknowledged before its body starts, so no copy of it comes back once it has run,
and its key keeps nothing after the release.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from celery.exceptions import Ignore, Reject, Retry
from celery.utils.nodenames import gethostname

from ..conf.runtime import app_state
from ..exceptions import BackendTimeout, BackendUnavailable, LockLost
from ..lease import LockHandle
from ..observe import report
from ..policies import Conflict
from ..protocol.headers import LATEST_HEADER, header_count, is_redelivery, seconds_until
from ..protocol.slots import base_key
from ..protocol.tokens import direct_token, execution_token, reservation_token
from ..send.records import clear_follow_up
from ..signals import lock_acquired
from . import replace
from .acquire import gone_holder, take, twin_of, waits_for_rate
from .outcomes import refused, store_unreachable, superseded, superseded_retry

if TYPE_CHECKING:
    from celery import Task

    from ..backends.base import LockBackend
    from ..conf.options import LockOptions

__all__ = ["ENDINGS", "Ending", "current_lock", "ending_of", "execute"]

logger = logging.getLogger("singletask")


class Ending(NamedTuple):
    """What the end of a hold does, for one way a body can end."""

    #: Keep the lock as a reservation for the retried attempt instead of releasing it.
    reserve: bool
    #: Record the attempt as the key's completion marker (the message is done with).
    completed: bool


#: The way a body ended -> what its hold's end does (see the table above).
ENDINGS: Final[Mapping[str, Ending]] = {
    "returned": Ending(reserve=False, completed=True),
    "raised": Ending(reserve=False, completed=True),
    "rejected": Ending(reserve=False, completed=True),
    "requeued": Ending(reserve=False, completed=False),
    "ignored": Ending(reserve=False, completed=False),
    "retried": Ending(reserve=True, completed=False),
    "retried-inline": Ending(reserve=False, completed=False),
    "stopped": Ending(reserve=False, completed=False),
    "replaced": Ending(reserve=False, completed=False),
}


def ending_of(exc: BaseException, *, worker: bool) -> str:
    """The :data:`ENDINGS` row of a body that raised ``exc``; ``worker``: neither a direct call
    nor eager mode (only a worker execution's retry is published for later)."""
    if isinstance(exc, Retry):
        return "retried" if worker and getattr(exc, "sig", None) is not None else "retried-inline"
    if isinstance(exc, Reject):
        return "requeued" if getattr(exc, "requeue", False) else "rejected"
    if isinstance(exc, Ignore):
        return "ignored"
    if isinstance(exc, Exception):
        return "raised"
    return "stopped"


class _Frame(NamedTuple):
    """One execution in progress in the current thread / greenlet."""

    task: str
    request_id: str | None
    handle: LockHandle


_frames: contextvars.ContextVar[tuple[_Frame, ...]] = contextvars.ContextVar(
    "singletask_frames", default=()
)


def current_lock(task_name: str) -> LockHandle | None:
    """The lock held by the innermost execution of ``task_name`` in this thread, if any."""
    for frame in reversed(_frames.get()):
        if frame.task == task_name:
            return frame.handle
    return None


def execute(
    task: Task[Any, Any],
    options: LockOptions,
    body: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> Any:
    """Run ``body(*args, **kwargs)`` as an execution of ``task`` holding its lock (see above)."""
    # 1. Who is running.
    request = task.request
    frames = _frames.get()
    task_id: str | None = request.id
    # A call from inside a running execution of this same task inherits its request.
    nested = any(f.task == task.name and f.request_id == task_id for f in frames)
    direct = bool(request.called_directly) or task_id is None or nested
    key = options.key(args, kwargs)
    if direct and any(base_key(f.handle.key) == key for f in frames):
        # Re-entrant: the body of the execution holding this key calls the task directly.
        return body(*args, **kwargs)
    state = app_state(task.app)
    backend = state.backend
    # ``attempt`` names one execution attempt of one message: a redelivered copy of the
    # message has the same one, the body's own retry the next one.
    attempt: str | None = None
    retries = int(request.retries or 0)
    if direct:
        token, takeover = direct_token(), None
    else:
        attempt = f"{task_id}:{retries}"
        token = execution_token(str(task_id), retries)
        # Take over the reservation made for this attempt: by apply_async when the message
        # was sent (lock_scope "queue" / "coalesce"), or by the previous attempt when it
        # ended with a retry (see _end); never a running attempt itself.
        takeover = reservation_token(str(task_id), retries)
    meta = {
        "task": task.name,
        "scope": options.scope,  # for `singletask locks`; same round trip
        "hostname": request.hostname or gethostname(),  # Celery's, memoized
        "pid": str(os.getpid()),
        "since": f"{time.time():.3f}",
    }
    if attempt is not None:
        meta["task_id"] = str(task_id)

    # 2. Acquire.
    # The store starts the lease at some moment after the request leaves: the holder's deadline
    # counts from the send (LockHandle's sent_at), not from the reply or what follows it.
    sent_at = time.monotonic()
    latest: str | None = None  # the latest send of the window (lock_debounce, coalesce "latest")
    try:
        windowed = options.debounce is not None or header_count(request, LATEST_HEADER)
        if windowed and attempt is not None:
            # Only the latest send of a window runs (lock_debounce; the follow-ups of
            # lock_coalesce "latest", whose sends carry the header); its run closes it.
            latest = backend.debounce_take(key, str(task_id))
            if latest is not None and latest != task_id:
                # It gives back a reservation it holds (a body retry's; coalescing, its send's).
                reserved = retries > 0 or options.scope == "coalesce"
                reservation = str(takeover) if reserved else None
                return superseded(task, options, backend, key, latest, reservation)
            sent_at = time.monotonic()
        result = take(backend, options, key, token, meta, takeover)
        retried = superseded_retry(result, str(task_id)) if latest == task_id else None
        if retried is not None:
            # The latest send of its window supersedes an earlier send's body retry: that retry
            # will not run (it ends superseded), so its reservation is this send's to take.
            sent_at = time.monotonic()
            result = take(backend, options, key, token, meta, retried.token)
            if result.acquired:
                logger.info(
                    "Task %s[%s] took over lock %r reserved for the retry of %s, which it "
                    "supersedes (the latest send of its window)",
                    task.name, task_id, key, retried.task_id,
                )  # fmt: skip
        holder = gone_holder(result) if attempt is not None else None
        if holder is not None:
            # Same host, and the holder's process is gone: no need to wait for its lease.
            sent_at = time.monotonic()
            result = take(backend, options, key, token, meta, holder.token)
            if result.acquired:
                logger.warning(
                    "Task %s[%s] took over lock %r from %s, whose process is gone",
                    task.name, task_id, key, holder.task_id,
                )  # fmt: skip
        if waits_for_rate(result, options, request, direct):
            # A start is allowed very soon: waiting here for it beats a trip through the broker,
            # which would make the start late (and evenly spaced starts never make that up).
            time.sleep(float(result.retry_after or 0))
            sent_at = time.monotonic()
            result = take(backend, options, key, token, meta, takeover)
    except (BackendUnavailable, BackendTimeout) as exc:
        return store_unreachable(task, options, exc, direct, body, args, kwargs)
    if not result.acquired:
        conflict = Conflict(
            task, options, backend, key, result.holder, direct, result.holders, result.retry_after
        )
        try:
            sent_at = time.monotonic()
            taken = replace.preempt(conflict, token, meta)  # lock_policy "replace" takes it over
            if taken is None:
                return refused(conflict)
        except (BackendUnavailable, BackendTimeout) as exc:
            # The preemption, or a coalescing follow-up's claim: as for the acquire itself.
            return store_unreachable(task, options, exc, direct, body, args, kwargs)
        result = taken
    # With lock_limit above 1 the execution holds one of the key's slots: renew and release it.
    lock_key, key = key, result.key or key
    if options.limit > 1:
        try:
            twin = twin_of(backend, options, request, lock_key, key)
        except (BackendUnavailable, BackendTimeout) as exc:
            # Whether a copy of this message runs in another slot is unknown: give the slot
            # back (its lease ends it if the store stays away) and do as for the acquire.
            _end(task, options, backend, key, token, None)
            return store_unreachable(task, options, exc, direct, body, args, kwargs)
        except BaseException:
            _end(task, options, backend, key, token, None)  # never leave the slot taken
            raise
        if twin is not None:
            # A copy of a message that still runs in another slot: it must not run twice.
            _end(task, options, backend, key, token, None)
            return refused(Conflict(task, options, backend, lock_key, twin, direct, (twin,)))

    if attempt is not None and result.completed == attempt and is_redelivery(request):
        # This very message already ran to completion: a redelivered copy must not run.
        _end(task, options, backend, key, token, None)
        logger.warning(
            "Task %s[%s] dropped: this message already ran to completion under lock %r "
            "(a redelivered copy)",
            task.name, task_id, key,
        )  # fmt: skip
        raise Ignore()
    if options.scope == "coalesce" and attempt is not None:
        clear_follow_up(task, backend, key, str(task_id))

    # 3. Run the body, renewed.
    watch = report.Watch.of(task, None if direct else task_id)
    handle = LockHandle(
        key,
        token,
        None if direct else task_id,
        result.fence,
        options.ttl,
        max_hold=options.max_hold,
        on_lost=functools.partial(report.lease_lost, task, watch),
        sent_at=sent_at,
        preemptible=options.policy == "replace",
    )
    if options.renew:
        state.renewer.add(handle)
    if lock_acquired.receivers:
        lock_acquired.send(sender=task, key=key, task_id=handle.task_id, fence=result.fence)
    report.acquired(task, watch, handle)
    reset = _frames.set((*frames, _Frame(task.name, None if direct else task_id, handle)))
    ending = "returned"
    raised: BaseException | None = None
    value: Any = None
    try:
        value = body(*args, **kwargs)
    except BaseException as exc:
        ending = ending_of(exc, worker=not direct and not request.is_eager)
        raised = exc
        if not (isinstance(exc, LockLost) and handle.preemptible):
            raise
        ending = "replaced"  # if it was: see below, after the release
    finally:
        # 4. End the hold, exactly once.
        _frames.reset(reset)
        handle.lost  # noqa: B018 - reports a lease that ran out unnoticed by the body
        state.renewer.remove(handle)  # before the release: no renewal starts after this
        row = ENDINGS[ending]
        retry = raised if row.reserve else None
        completed = attempt if row.completed and task.acks_late else None
        released = _end(task, options, backend, key, token, retry, completed=completed, meta=meta)
        report.released(task, watch, handle)
    outcome = replace.replaced(task, handle, backend, released) if handle.preemptible else None
    if outcome is not None:
        return outcome  # a newer execution took over: the run ends as replaced
    if raised is not None:
        raise raised  # a LockLost that was no preemption
    return value


def _end(
    task: Task[Any, Any],
    options: LockOptions,
    backend: LockBackend,
    key: str,
    token: str,
    retry: BaseException | None,
    *,
    completed: str | None = None,
    meta: Mapping[str, str] | None = None,
) -> bool:
    """End the execution's hold: release, or turn it into a reservation for the body's retry.

    The reservation is the lock under a token only the retried attempt (same task id,
    ``retries + 1``) takes over; it lasts the retry's countdown plus one lease. Never raises.
    Returns False when a release found the lock no longer held, else True.
    """
    try:
        if retry is not None:
            request = task.request
            # At most the store's longest lease: a retry delayed longer loses its reservation.
            delay = seconds_until(getattr(retry, "when", None))
            reserve = min(backend.max_lease, delay + options.ttl)
            retries = int(request.retries or 0)
            retry_token = reservation_token(str(request.id), retries + 1)
            reserved = backend.acquire(key, retry_token, reserve, meta=meta, takeover_prefix=token)
            if reserved.acquired:
                logger.info(
                    "Task %s[%s] retries: lock %r stays reserved for the retry (%.0fs at most)",
                    task.name, request.id, key, reserve,
                )  # fmt: skip
            return True
        if not backend.release(key, token, completed=completed):
            logger.warning(
                "Task %s[%s]: lock %r was no longer held when the task ended (its lease "
                "ran out, or the worker released it for this task)",
                task.name, task.request.id, key,
            )  # fmt: skip
            return False
    except Exception:
        # Never let release break the task's outcome; the lease ends by itself.
        logger.exception(
            "Task %s[%s]: could not release lock %r; it expires by itself within %.0fs",
            task.name, task.request.id, key, options.ttl,
        )  # fmt: skip
    return True
