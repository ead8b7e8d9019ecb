"""The lock lifecycle of one execution: acquire before the body, renew while it runs, release once.

:func:`execute` is what :meth:`SingletonTask.__call__ <singletask.SingletonTask>` does, a ladder
of four steps, each a function below it in this order (``docs/lifecycle.rst`` tells the same
story for users):

1. **Who is running** (``_Run.of``). A worker or eager execution has a task id and
   ``retries``: its owner token names that *attempt* and its process, and it may take over the
   reservation made for that attempt (by ``apply_async`` with ``lock_scope`` "queue"/"coalesce",
   or by the previous attempt's body retry). A direct call ``task(...)`` has neither. A direct
   call from inside the execution that holds the same key is re-entrant: it runs the body and
   takes nothing.
2. **Acquire** (``_acquire``), in one atomic step of the store: the debounce window
   (``_window``), the take and its takeovers (``_take_over``: a superseded retry's
   reservation, a holder whose process is gone), the short rate wait, the preemption or refusal
   of a held key (``_preempt_or_refuse``), the last checks of a taken slot or redelivered
   copy (``_admit``). Every execution that does not get to run its body ends in
   :mod:`singletask.execution.outcomes` and holds nothing when it does.
3. **Hold** (``_hold``): the :class:`~singletask.LockHandle` (``self.lock``) whose lease the
   process's renewer renews; a lease found lost is logged and sent as
   :data:`~singletask.signals.lock_lost`, once.
4. **Run the body and end the hold exactly once** (``_run_body``), in the ``finally``
   around the body, whatever the ending: stop renewing, then release or reserve as
   :data:`singletask.execution.endings.ENDINGS` says for the way the body ended.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from celery.exceptions import Ignore, Reject, Retry
from celery.utils.nodenames import gethostname

from ..conf.runtime import app_state
from ..exceptions import BackendTimeout, BackendUnavailable, LockLost, SingletaskError, TaskLocked
from ..lease import LockHandle
from ..observe import report
from ..policies import POLICIES, Conflict
from ..protocol.headers import LATEST_HEADER, header_count, is_redelivery
from ..protocol.slots import base_key, slot_keys
from ..protocol.tokens import direct_token, execution_token, reservation_token, this_pid_text
from ..send.records import clear_follow_up
from ..signals import lock_acquired
from . import replace, units
from .acquire import gone_holder, take, twin_of, waits_for_rate
from .endings import ENDINGS, PendingRetry, ending_of, release_or_reserve, reserve_and_publish
from .outcomes import give_back, refused, store_unreachable, superseded, superseded_retry
from .pending import take_window
from .units import Wanted, own_key, wanted

if TYPE_CHECKING:
    from celery import Task

    from ..backends.base import AcquireResult, LockBackend, Units
    from ..conf.options import LockOptions
    from ..conf.runtime import AppState

__all__ = ["Ended", "current_execution", "current_lock", "ended_here", "execute"]

logger = logging.getLogger("singletask")


class _Frame(NamedTuple):
    """One execution in progress in the current thread / greenlet."""

    task: str
    request_id: str | None
    handle: LockHandle
    run: _Run


_frames: contextvars.ContextVar[tuple[_Frame, ...]] = contextvars.ContextVar(
    "singletask_frames", default=()
)


#: The task id of the execution that last began or ended in this thread / greenlet (a worker or
#: eager execution, not a direct call). Celery calls the task's ``on_success``, ``on_failure``
#: and ``after_return`` in the same thread right after ``__call__``; the hooks ask
#: :func:`ended_here` instead of reading Celery's request stack, a pure-Python thread local
#: (several thousand instructions a read, twice per execution).
_last: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "singletask_last_execution", default=None
)


def ended_here(task_id: str) -> bool:
    """Whether the execution of ``task_id`` is the one that last began or ended in this thread:
    Celery's hooks calling for it come from its own execution, not from the worker's main
    process (a hard time limit) or a call of the hook by hand."""
    return _last.get() == task_id


def current_lock(task_name: str) -> LockHandle | None:
    """The lock held by the innermost execution of ``task_name`` in this thread, if any."""
    for frame in reversed(_frames.get()):
        if frame.task == task_name:
            return frame.handle
    return None


def current_execution(task: Task[Any, Any]) -> _Run | None:
    """The innermost execution of ``task`` in this thread if it runs the current request (a
    worker or eager execution, not a direct call); None outside one."""
    for frame in reversed(_frames.get()):
        if frame.task == task.name:
            run = frame.run
            return None if run.direct or run.task_id != task.request.id else run
    return None


def execute(
    task: Task[Any, Any],
    options: LockOptions,
    body: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> Any:
    """Run ``body(*args, **kwargs)`` as an execution of ``task`` holding its lock (see above)."""
    run = _Run.of(task, options, body, args, kwargs)  # 1. who is running
    if run is None:
        # Re-entrant: the body of the execution holding this key calls the task directly.
        return body(*args, **kwargs)
    try:
        return _steps(run)
    finally:
        if not run.direct:  # for the hooks Celery calls next (ended_here)
            _last.set(run.task_id)


def _steps(run: _Run) -> Any:
    """2 to 4: acquire, hold, run the body and end the hold."""
    try:
        taken = _acquire(run)  # 2. acquire, or end without the body
    except BaseException as exc:
        if not isinstance(exc, OUTCOMES):
            _abandon(run)  # a time limit or a shutdown cut the acquire short
        raise
    if isinstance(taken, Ended):
        return taken.value
    handle, watch = _hold(run, taken)  # 3. hold: renewed, announced
    return _run_body(run, handle, watch)  # 4. run the body, end the hold once


#: What an execution's steps raise as its outcome (a refusal by its policy, a republish): the
#: store holds nothing more of it than that outcome leaves. Any other exception that cuts
#: :func:`_acquire` short (a soft time limit, a shutdown) leaves the store to :func:`_abandon`.
OUTCOMES = (SingletaskError, Retry, Ignore, Reject)


def _abandon(run: _Run) -> None:
    """Give back, best effort, what the store may hold for an execution whose acquire an
    exception that is not an outcome cut short (a soft time limit firing during a round trip,
    whose reply it never read): its own hold, if the acquire took effect, and the reservation
    and follow-up claim its send made (:func:`~singletask.execution.outcomes.give_back`), so
    that no later send meets them until they expire. Never raises."""
    lock_key = run.lock_key or run.key
    try:
        for slot in slot_keys(lock_key, run.options.limit):
            if run.backend.release(slot, run.token):
                break
    except Exception:  # the store's own lease ends it
        logger.warning(
            "Task %s[%s] was cut short while acquiring lock %r; what it may hold expires by "
            "itself", run.task.name, run.task_id, lock_key, exc_info=True,
        )  # fmt: skip
    if run.takeover is not None:
        give_back(run.task, run.options, run.backend, lock_key, run.takeover)
    if run.want:
        units.give_back(run.task, run.backend, run.token, run.want)


class Ended(NamedTuple):
    """An execution that ends without its body: what :func:`execute` returns for it."""

    value: Any


@dataclass(slots=True)
class _Run:
    """One execution on its way through :func:`execute`: who runs, under which key and token."""

    task: Task[Any, Any]
    options: LockOptions
    body: Callable[..., Any]
    args: Sequence[Any]
    kwargs: Mapping[str, Any]
    request: Any
    frames: tuple[_Frame, ...]
    task_id: str | None
    direct: bool
    key: str
    state: AppState
    backend: LockBackend
    retries: int
    token: str
    takeover: str | None
    meta: dict[str, str]
    #: Names one execution attempt of one message: a redelivered copy of the message has the
    #: same one, the body's own retry the next one; None for a direct call.
    attempt: str | None
    #: The store starts the lease at some moment after the request leaves: the holder's
    #: deadline counts from the send (LockHandle's sent_at), not from the reply.
    sent_at: float = 0.0
    #: The latest send of the key's window (lock_debounce, lock_coalesce "latest"), if read.
    latest: str | None = None
    #: The lock key itself, where ``key`` became one of its holder slots (lock_limit).
    lock_key: str = ""
    #: When (``time.monotonic()``) this execution began: its time limits count from about then.
    started: float = dataclasses.field(default_factory=time.monotonic)
    #: The retry the body asked for (``self.retry()``), published at the end of the hold, once
    #: the lock is its reservation (:mod:`singletask.execution.retrying`).
    retry: PendingRetry | None = None
    #: The units of named limits this execution takes (``lock_limits``, ``lock_cost``).
    want: Wanted | None = None

    @classmethod
    def of(
        cls,
        task: Task[Any, Any],
        options: LockOptions,
        body: Callable[..., Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
    ) -> _Run | None:
        """Who is running: a worker or eager execution (a task id and ``retries``: its token
        names that attempt, and it may take over the reservation made for it), or a direct
        call (neither). None for a direct call from inside the execution holding the key."""
        request = task.request  # a lookup in Celery's request stack: read once
        frames = _frames.get()
        task_id: str | None = request.id
        name = task.name
        # A call from inside a running execution of this same task inherits its request.
        nested = bool(frames) and any(f.task == name and f.request_id == task_id for f in frames)
        direct = bool(request.called_directly) or task_id is None or nested
        if not direct:  # before anything here can fail: its hooks follow (ended_here)
            _last.set(task_id)
        key = options.key(args, kwargs)
        if direct and frames and any(base_key(f.handle.key) == key for f in frames):
            return None
        retries = int(request.retries or 0)
        state = app_state(task.app)
        want = None
        limited = options.limits is not None or options.cost is not None
        if limited:
            want = wanted(task, options, state, key, args, kwargs)  # a bad cost fails here
            waits = options.policy == "retry" or retries > 0  # see _no_room
            turns = state.settings.limit_turns and state.backend.supports_turns
            if want and waits and turns and not (direct or request.is_eager):
                want.turn = units.turn(task, options, key, str(task_id), args, kwargs)
        if direct:
            attempt, token, takeover = None, direct_token(), None
        else:
            attempt = f"{task_id}:{retries}"
            token = execution_token(str(task_id), retries)
            # Take over the reservation made for this attempt: by apply_async when the message
            # was sent (lock_scope "queue" / "coalesce"), or by the previous attempt when it
            # ended with a retry (see endings.release_or_reserve); never a running attempt
            # itself. A first attempt sent with lock_scope "execution" has none to take over.
            reserved = retries > 0 or options.scope != "execution"
            takeover = reservation_token(str(task_id), retries) if reserved else None
        meta = {
            "task": name,
            "scope": options.scope,  # for `singletask locks`; same round trip
            "hostname": request.hostname or gethostname(),  # Celery's, memoized
            "pid": this_pid_text(),
            "since": f"{time.time():.3f}",
        }
        if attempt is not None:
            meta["task_id"] = str(task_id)
        if options.policy == "replace":  # newer or older, and whether its pool can terminate it
            meta.update(replace.holder_fields(request, meta["since"]))
        if limited and options.keyless:  # limits alone hold it back: a key of its own (lease)
            key = own_key(key, token if direct else str(task_id))
        return cls(task, options, body, args, kwargs, request, frames, task_id, direct, key,
                   state, state.backend, retries, token, takeover, meta, attempt,
                   want=want)  # fmt: skip

    def take(self, takeover: str | None) -> AcquireResult:
        """One acquire of the key, taking over ``takeover``'s hold if it is the holder."""
        self.sent_at = time.monotonic()
        units = self.want.taking if self.want else ()
        return take(self.backend, self.options, self.key, self.token, self.meta, takeover, units)

    def unreachable(self, exc: BackendUnavailable | BackendTimeout) -> Ended:
        """The lock store could not be reached: the task's ``lock_on_backend_error`` decides."""
        return Ended(store_unreachable(
            self.task, self.options, exc, self.direct, self.body, self.args, self.kwargs
        ))  # fmt: skip

    @property
    def held(self) -> tuple[Units, ...]:
        """The concurrency units of named limits this execution holds with its key."""
        return self.want.held if self.want else ()

    def give_back(self) -> None:
        """End a hold taken for an execution that will not run its body (never raises)."""
        release_or_reserve(self.task, self.options, self.backend, self.key, self.token, None,
                           units=self.held)  # fmt: skip


def _acquire(run: _Run) -> AcquireResult | Ended:
    """2. Take the key in one atomic step of the store, or end without the body: superseded in
    its window, the store unreachable, the key refused, held or too soon for its rate (all in
    :mod:`singletask.execution.outcomes`, none releasing anything: they hold nothing). With
    ``lock_policy`` "replace", a held key is taken over first (:mod:`.replace`)."""
    try:
        ended = _window(run)
        if ended is not None:
            return ended
        result = _take_over(run, run.take(run.takeover))
        if waits_for_rate(result, run.options, run.request, run.direct):
            # A start is allowed very soon: waiting here for it beats a trip through the broker,
            # which would make the start late (and evenly spaced starts never make that up).
            time.sleep(float(result.retry_after or 0))
            result = run.take(run.takeover)
    except (BackendUnavailable, BackendTimeout) as exc:
        return run.unreachable(exc)
    if not result.acquired and result.limit is not None:
        return _no_room(run, result)
    if not result.acquired:
        taken = _preempt_or_refuse(run, result)
        if isinstance(taken, Ended):
            return taken
        result = taken
    # With lock_limit above 1 the execution holds one of the key's slots: renew and release it.
    run.lock_key, run.key = run.key, result.key or run.key
    ended = _admit(run, result)
    return result if ended is None else ended


def _no_room(run: _Run, result: AcquireResult) -> Ended:
    """The key was free but a named limit had no room for the execution's units: nothing was
    taken, and it is refused as for a held key (a retried attempt of the body retries,
    whatever the policy: the retry it asked for is not lost to a limit)."""
    assert run.want is not None
    conflict = units.no_room(run.task, run.options, run.backend, run.key, run.want, result,
                             run.direct)  # fmt: skip
    try:
        if run.retries > 0 and not run.direct and not run.request.is_eager:
            return Ended(POLICIES["retry"].apply(conflict))
        return Ended(refused(conflict))
    except TaskLocked:
        # It stops waiting (its lock retries are spent): its place in line goes to the next,
        # and the reservation its body retry left (put back at each refusal) to the key's
        # next execution.
        units.leave_line(run.task, run.backend, run.token, run.want)
        if run.takeover is not None:
            give_back(run.task, run.options, run.backend, run.key, run.takeover)
        raise


def _window(run: _Run) -> Ended | None:
    """Only the latest send of a window runs (lock_debounce; the follow-ups of lock_coalesce
    "latest", whose sends carry the header); its run closes it. An earlier send ends
    superseded, giving back a reservation it holds (a body retry's; coalescing, its send's)."""
    windowed = run.options.debounce is not None or header_count(run.request, LATEST_HEADER)
    if not windowed or run.attempt is None:
        return None
    run.latest = take_window(run)
    if run.latest is None or run.latest == run.task_id:
        return None
    reserved = run.retries > 0 or run.options.scope == "coalesce"
    reservation = str(run.takeover) if reserved else None
    return Ended(superseded(run.task, run.options, run.backend, run.key, run.latest, reservation))


def _take_over(run: _Run, result: AcquireResult) -> AcquireResult:
    """Take the key over from a holder that will never release it: the reservation of a body
    retry that this latest send of its window supersedes, or (same host) a holder whose process
    is gone, without waiting for its lease."""
    retried = superseded_retry(result, str(run.task_id)) if run.latest == run.task_id else None
    if retried is not None:
        # That retry will not run (it ends superseded), so its reservation is this send's.
        result = run.take(retried.token)
        if result.acquired:
            logger.info(
                "Task %s[%s] took over lock %r reserved for the retry of %s, which it "
                "supersedes (the latest send of its window)",
                run.task.name, run.task_id, run.key, retried.task_id,
            )  # fmt: skip
    holder = gone_holder(result) if run.attempt is not None else None
    if holder is not None:
        result = run.take(holder.token)
        if result.acquired:
            logger.warning(
                "Task %s[%s] took over lock %r from %s, whose process is gone",
                run.task.name, run.task_id, run.key, holder.task_id,
            )  # fmt: skip
        elif result.retry_after is not None and not result.holders:
            # The rate refused the takeover (it is a start): the refusal names the gone holder,
            # which it releases if it was a delivery of this message and the message ends.
            result = dataclasses.replace(result, holders=(holder,))
    return result


def _preempt_or_refuse(run: _Run, result: AcquireResult) -> AcquireResult | Ended:
    """A held key: lock_policy "replace" takes it over; every other execution is refused."""
    conflict = Conflict(run.task, run.options, run.backend, run.key, result.holder, run.direct,
                        result.holders, result.retry_after)  # fmt: skip
    try:
        if run.options.policy != "replace":  # only "replace" preempts: the others are refused
            return Ended(refused(conflict, run.request))
        run.sent_at = time.monotonic()
        taken = replace.preempt(conflict, run.token, run.meta)
        if taken is None:
            return Ended(refused(conflict))
        if isinstance(taken, Conflict):  # superseded: every holder is a later send
            return Ended(refused(taken))
    except (BackendUnavailable, BackendTimeout) as exc:
        # The preemption, or a coalescing follow-up's claim: as for the acquire itself.
        return run.unreachable(exc)
    return taken


def _admit(run: _Run, result: AcquireResult) -> Ended | None:
    """The last checks of a taken key before the body: no copy of this message running in
    another slot, and no redelivered copy of a message that ran to completion; a coalescing
    follow-up's claim is cleared."""
    if run.options.limit > 1:
        ended = _no_twin(run)
        if ended is not None:
            return ended
    if run.attempt is not None and result.completed == run.attempt and is_redelivery(run.request):
        # This very message already ran to completion: a redelivered copy must not run.
        run.give_back()
        logger.warning(
            "Task %s[%s] dropped: this message already ran to completion under lock %r "
            "(a redelivered copy)",
            run.task.name, run.task_id, run.key,
        )  # fmt: skip
        raise Ignore()
    if run.options.scope == "coalesce" and run.attempt is not None:
        clear_follow_up(run.task, run.backend, run.key, str(run.task_id))
    return None


def _no_twin(run: _Run) -> Ended | None:
    """A copy of a message that still runs in another slot must not run twice: its slot is
    given back and it is refused as for a held key."""
    try:
        twin = twin_of(run.backend, run.options, run.request, run.lock_key, run.key)
    except (BackendUnavailable, BackendTimeout) as exc:
        # Whether a copy of this message runs in another slot is unknown: give the slot
        # back (its lease ends it if the store stays away) and do as for the acquire.
        run.give_back()
        return run.unreachable(exc)
    except BaseException:
        run.give_back()  # never leave the slot taken
        raise
    if twin is None:
        return None
    run.give_back()
    conflict = Conflict(run.task, run.options, run.backend, run.lock_key, twin, run.direct, (twin,))
    return Ended(refused(conflict))


def _hold(run: _Run, result: AcquireResult) -> tuple[LockHandle, report.Watch]:
    """3. The hold: the handle (``self.lock``) whose lease the process's renewer renews, and
    the execution announced (the lock_acquired signal, the event and span attributes)."""
    task_id = None if run.direct else run.task_id
    watch = report.Watch.of(run.task, task_id)
    handle = LockHandle(
        run.key,
        run.token,
        task_id,
        result.fence,
        run.options.ttl,
        max_hold=run.options.max_hold,
        on_lost=functools.partial(report.lease_lost, run.task, watch),
        sent_at=run.sent_at,
        preemptible=run.options.policy == "replace",
        units=run.want.held if run.want else (),
        task=run.task.name,
        charge=functools.partial(units.charge, run.task, run.backend, run.token, run.want)
        if run.want
        else None,
    )
    if run.options.renew:
        run.state.renewer.add(handle)
    if lock_acquired.receivers:
        lock_acquired.send(sender=run.task, key=run.key, task_id=task_id, fence=result.fence)
    report.acquired(run.task, watch, handle)
    return handle, watch


def _run_body(run: _Run, handle: LockHandle, watch: report.Watch) -> Any:
    """4. Run the body, then end the hold exactly once, whatever the ending (:data:`ENDINGS`).
    A preempted body (lock_policy "replace") ends as replaced."""
    task_id = None if run.direct else run.task_id
    reset = _frames.set((*run.frames, _Frame(run.task.name, task_id, handle, run)))
    ending = "returned"
    raised: BaseException | None = None
    value: Any = None
    try:
        value = run.body(*run.args, **run.kwargs)
    except BaseException as exc:
        ending = ending_of(exc, worker=not run.direct and not run.request.is_eager)
        raised = exc
        if not (isinstance(exc, LockLost) and handle.preemptible):
            raise
        ending = "replaced"  # if it was: see below, after the release
    finally:
        _frames.reset(reset)
        released = _end_hold(run, handle, watch, ending, raised)
    outcome = (
        replace.replaced(run.task, handle, run.backend, released) if handle.preemptible else None
    )
    if outcome is not None:
        return outcome  # a newer execution took over: the run ends as replaced
    if raised is not None:
        raise raised  # a LockLost that was no preemption
    return value


def _end_hold(
    run: _Run, handle: LockHandle, watch: report.Watch, ending: str, raised: BaseException | None
) -> bool:
    """Stop renewing, then release or reserve as the ending's row of :data:`ENDINGS` says; a
    retry the body asked for (``self.retry()``) is reserved for, then published."""
    handle.lost  # noqa: B018 - reports a lease that ran out unnoticed by the body
    run.state.renewer.remove(handle)  # before the release: no renewal starts after this
    if run.retry is not None:  # self.retry(): reserve for the retry, then publish it
        if run.want:
            units.give_back(run.task, run.backend, run.token, run.want)
        completed = run.attempt if run.task.acks_late else None
        try:
            return reserve_and_publish(run.task, run.options, run.backend, run.key, run.token,
                                       run.retry, completed=completed, meta=run.meta)  # fmt: skip
        finally:
            report.released(run.task, watch, handle)
    row = ENDINGS[ending]
    retry = raised if row.reserve else None
    completed = run.attempt if row.completed and run.task.acks_late else None
    # The units of its limits are given back with the key (before it, where not in one step).
    released = release_or_reserve(run.task, run.options, run.backend, run.key, run.token,
                                  retry, completed=completed, meta=run.meta,
                                  units=run.held)  # fmt: skip
    report.released(run.task, watch, handle)
    return released
