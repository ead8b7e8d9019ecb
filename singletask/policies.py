"""What an execution does when it cannot take its lock: the lock policies, and what comes first.

An execution that finds its key held is *locked out*, described by a :class:`Conflict`.
:func:`locked_out` first sorts out the holders that are no rival (another delivery or attempt of
the same message; with ``lock_scope`` "coalesce", the run a follow-up waits for), then hands the
conflict to the task's :class:`Policy`:

=========  ==============================================================================
policy     a locked-out execution
=========  ==============================================================================
``skip``   returns a :class:`~singletask.Skipped` value (state SUCCESS)
``retry``  is sent again after ``lock_retry_countdown`` (plus jitter), at most
           ``lock_retry_max`` times, then raises; in eager mode or a direct call it raises
``raise``  fails with :class:`~singletask.TaskLocked`
=========  ==============================================================================

A new policy is one :class:`Policy` subclass in :data:`POLICIES` (and its name in
:data:`singletask.config.POLICIES`, which validates it). Every policy sends the
:data:`~singletask.signals.lock_conflict` signal and logs what it did.

:func:`store_unreachable` is the same kind of decision for an execution that could not reach
the lock store at all (``lock_on_backend_error``).
"""

from __future__ import annotations

import logging
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Final, NoReturn

from celery.exceptions import Ignore

from .exceptions import BackendTimeout, BackendUnavailable, RateLimited, TaskLocked
from .messages import (
    BACKEND_RETRIES_HEADER,
    LOCK_RETRIES_HEADER,
    PREVIOUS_WAITS_HEADER,
    REDELIVERED_HEADER,
    attempt_count,
    header_count,
    republish,
)
from .result import Skipped
from .signals import lock_conflict
from .tokens import parse_token

if TYPE_CHECKING:
    from celery import Task

    from .backends.base import Holder, LockBackend
    from .options import LockOptions

__all__ = [
    "BACKEND_RETRY_CAP",
    "POLICIES",
    "Conflict",
    "Policy",
    "Raise",
    "Retry",
    "Skip",
    "claim_follow_up",
    "locked_out",
    "store_unreachable",
]

logger = logging.getLogger("singletask")

#: Longest wait, in seconds, between two retries of an execution that could not reach the lock
#: store (they back off 1, 2, 4, ... up to this).
BACKEND_RETRY_CAP = 30.0


@dataclass(frozen=True)
class Conflict:
    """An execution of ``task`` that found ``key`` held by ``holder``.

    Attributes:
        task: The task (its ``request`` is the locked-out execution's).
        options: The task's lock options.
        backend: This process's lock store.
        key: The lock key.
        holder: Who holds the key, when the store said.
        direct: Whether the execution is a direct call ``task(...)``.
        holders: With ``lock_limit`` above 1, every holder of the key (``holder`` is the first).
        retry_after: Set when the key is not held but started too recently for its
            ``lock_rate``: seconds until it may start again.
    """

    task: Task[Any, Any]
    options: LockOptions
    backend: LockBackend
    key: str
    holder: Holder | None
    direct: bool
    holders: tuple[Holder, ...] = ()
    retry_after: float | None = None

    @property
    def holder_id(self) -> str | None:
        """The holder's task id, when known."""
        return self.holder.task_id if self.holder else None

    @property
    def holder_ids(self) -> tuple[str | None, ...]:
        """With ``lock_limit`` above 1, the task id of every holder (empty for a singleton)."""
        return tuple(h.task_id for h in self.holders) if len(self.holders) > 1 else ()

    @property
    def who(self) -> str:
        """The holder or holders, for a log line."""
        if len(self.holders) > 1:
            return f"{len(self.holders)} holders ({', '.join(map(str, self.holder_ids))})"
        return str(self.holder_id)

    @property
    def ttl(self) -> float | None:
        """Seconds left on the holder's lease, when known."""
        return self.holder.ttl if self.holder else None

    @property
    def lease_left(self) -> str:
        """The holder's lease left, for a log line."""
        return f"{self.ttl:.1f}s" if self.ttl is not None else "unknown"

    def report(self, action: str) -> None:
        """Send :data:`~singletask.signals.lock_conflict` for ``action``."""
        lock_conflict.send(
            sender=self.task, key=self.key, holder=self.holder_id, ttl=self.ttl,
            task_id=self.task.request.id, action=action,
        )  # fmt: skip

    @property
    def rated(self) -> bool:
        """Whether the key was refused by its ``lock_rate``, not by a holder."""
        return self.retry_after is not None

    def countdown(self) -> float:
        """``lock_retry_countdown`` plus up to 25% jitter; for a rate refusal, the time until
        a start is allowed less 5 ms and up to 10% of it: the message comes back a little
        early, finds the start allowed within ``acquire.RATE_WAIT`` and waits for it in its
        process, so that the start is not late by a trip through the broker."""
        if self.retry_after is not None:
            # At most 0.125 s early: well within the 0.25 s an execution waits in its process.
            early = 0.005 + random.uniform(0, min(0.12, self.retry_after / 10))
            return max(0.0, self.retry_after - early)
        base = self.options.retry_countdown
        return base + random.uniform(0, base / 4)

    def refusal(self) -> TaskLocked:
        """The exception that reports this conflict: ``RateLimited`` or ``TaskLocked``."""
        if self.retry_after is not None:
            return RateLimited(self.key, self.retry_after, self.options.rate)
        return TaskLocked(self.key, self.holder_id, self.ttl, self.holder_ids)


class Policy(ABC):
    """What a locked-out execution does (``lock_policy``), and what a duplicate send does."""

    #: The ``lock_policy`` value that selects it.
    name: ClassVar[str]

    #: The ``lock_conflict`` action of a duplicate sent while the key is held, with
    #: ``lock_scope`` "queue": ``"dedupe"`` (the caller gets the holder's ``AsyncResult``) or
    #: ``"raise"`` (the caller gets :class:`~singletask.TaskLocked`).
    at_send: ClassVar[str] = "dedupe"

    @abstractmethod
    def apply(self, conflict: Conflict) -> Any:
        """Return the locked-out execution's value, or raise to end it otherwise."""


class Skip(Policy):
    """Return a :class:`~singletask.Skipped` value: the execution succeeds without its body."""

    name = "skip"

    def apply(self, conflict: Conflict) -> Skipped:
        conflict.report("skip")
        if conflict.rated:
            logger.warning(
                "Task %s[%s] skipped: lock %r started too recently for its lock_rate %s "
                "(next start in %.1fs)",
                conflict.task.name, conflict.task.request.id, conflict.key,
                conflict.options.rate, conflict.retry_after,
            )  # fmt: skip
            return Skipped(conflict.key, reason="rate", retry_after=conflict.retry_after)
        logger.warning(
            "Task %s[%s] skipped: lock %r is held by %s (lease left: %s)",
            conflict.task.name, conflict.task.request.id, conflict.key, conflict.who,
            conflict.lease_left,
        )  # fmt: skip
        return Skipped(conflict.key, conflict.holder_id, conflict.ttl, conflict.holder_ids)


class Raise(Policy):
    """Fail with :class:`~singletask.TaskLocked`."""

    name = "raise"
    at_send = "raise"

    def apply(self, conflict: Conflict) -> NoReturn:
        self.refuse(conflict)

    def refuse(self, conflict: Conflict, why: str = "") -> NoReturn:
        """Fail with ``TaskLocked``; ``why`` says why, when another policy fell back to this."""
        conflict.report("raise")
        if conflict.rated:
            logger.warning(
                "Task %s[%s] raises RateLimited: lock %r started too recently for its "
                "lock_rate %s (next start in %.1fs)%s",
                conflict.task.name, conflict.task.request.id, conflict.key,
                conflict.options.rate, conflict.retry_after, why,
            )  # fmt: skip
            raise conflict.refusal()
        logger.warning(
            "Task %s[%s] raises TaskLocked: lock %r is held by %s (lease left: %s)%s",
            conflict.task.name, conflict.task.request.id, conflict.key, conflict.who,
            conflict.lease_left, why,
        )  # fmt: skip
        raise conflict.refusal()


class Retry(Policy):
    """Send the execution again after ``lock_retry_countdown``, ``lock_retry_max`` times at most.

    Retries are counted in a header of their own (the task's ``max_retries`` is untouched).
    Eager mode and direct calls cannot wait, and a spent budget cannot retry: those raise.
    """

    name = "retry"

    def apply(self, conflict: Conflict) -> NoReturn:
        request = conflict.task.request
        options = conflict.options
        if conflict.direct or request.is_eager:
            Raise().refuse(conflict, " (retry cannot wait in eager mode or a direct call)")
        spent = header_count(request, LOCK_RETRIES_HEADER)
        if spent >= options.retry_max:
            Raise().refuse(conflict, f" (lock retries spent: {spent} of {options.retry_max})")
        conflict.report("retry")
        countdown = conflict.countdown()
        why = (
            f"started too recently for its lock_rate {options.rate}"
            if conflict.rated
            else f"is held by {conflict.who}"
        )
        logger.info(
            "Task %s[%s] retries in %.1fs (lock retry %d of %d): lock %r %s",
            conflict.task.name, request.id, countdown, spent + 1, options.retry_max,
            conflict.key, why,
        )  # fmt: skip
        republish(conflict.task, countdown, {LOCK_RETRIES_HEADER: spent + 1}, conflict.refusal())


#: The policies by ``lock_policy`` name.
POLICIES: Final[Mapping[str, Policy]] = {p.name: p for p in (Skip(), Retry(), Raise())}


def locked_out(conflict: Conflict) -> Any:
    """Act for an execution that found its key held: return its value, or raise to end it."""
    request = conflict.task.request
    for holder in conflict.holders or ((conflict.holder,) if conflict.holder else ()):
        if not conflict.direct and holder.task_id == request.id:
            _held_by_same_task(conflict, holder)
    if conflict.rated:
        return POLICIES[conflict.options.policy].apply(conflict)
    if conflict.options.scope == "coalesce" and not conflict.direct and not request.is_eager:
        _wait_as_follow_up(conflict)
    return POLICIES[conflict.options.policy].apply(conflict)


def superseded(task: Task[Any, Any], key: str, latest: str) -> Skipped:
    """A debounced send that a later send of its key superseded: it ends without its body."""
    logger.info(
        "Task %s[%s] skipped: a later send (%s) of lock %r superseded it (lock_debounce)",
        task.name, task.request.id, latest, key,
    )  # fmt: skip
    lock_conflict.send(
        sender=task, key=key, holder=latest, ttl=None, task_id=task.request.id,
        action="superseded",
    )  # fmt: skip
    return Skipped(key, latest, reason="debounced")


def _wait_as_follow_up(conflict: Conflict) -> None:
    """Coalescing: the key's one pending follow-up waits for the run in progress to end.

    Returns (so the lock policy applies) when another execution is already the follow-up.
    """
    task, request = conflict.task, conflict.task.request
    queue_ttl = conflict.options.queue_ttl
    follow_up = claim_follow_up(
        conflict.backend, conflict.key, str(request.id), conflict.holder_id, queue_ttl
    )
    if follow_up != request.id:
        return
    countdown = conflict.countdown()
    logger.info(
        "Task %s[%s] is the follow-up of lock %r (held by %s): starting when it is free, "
        "checking again in %.1fs",
        task.name, request.id, conflict.key, conflict.holder_id, countdown,
    )  # fmt: skip
    conflict.report("follow")
    republish(task, countdown, {}, None, quietly=True)


def claim_follow_up(
    backend: LockBackend, key: str, task_id: str, holder_id: str | None, ttl: float
) -> str:
    """Claim the follow-up slot of ``key`` for ``task_id``; return the pending follow-up. A
    claim naming ``holder_id`` (the holder, read before) is stale: that follow-up has started
    and clears it next. It is cleared here and the slot claimed again: no call joins a run."""
    follow_up = backend.claim_next(key, task_id, ttl)
    if follow_up != task_id and follow_up == holder_id:
        backend.clear_next(key, follow_up)
        follow_up = backend.claim_next(key, task_id, ttl)
    return follow_up


def _held_by_same_task(conflict: Conflict, holder: Holder) -> NoReturn:
    """The lock is held under this task id: by another delivery of this very message (a
    broker redelivery), or by a newer attempt of the task (this copy is stale).

    Neither may store a result under the task id, which belongs to the holder: a stale
    copy is dropped, a redelivered one checks again once the holder's lease could have
    run out. If the holder is alive it keeps renewing and the copy keeps waiting, until the
    holder completes (then the copy is dropped) or dies (then the copy runs).
    """
    task, request, key = conflict.task, conflict.task.request, conflict.key
    parsed = parse_token(holder.token)
    retries = int(request.retries or 0)
    if parsed is not None and parsed[1] == retries - 1:
        # The attempt that asked for this retry has not ended yet (Celery publishes the
        # retry before the body returns): look again shortly, then take its reservation.
        checks = attempt_count(request, PREVIOUS_WAITS_HEADER)
        countdown = previous_attempt_wait(checks, conflict.options.ttl, holder.ttl)
        logger.info(
            "Task %s[%s]: the previous attempt still holds lock %r; retrying in %.1fs",
            task.name, request.id, key, countdown,
        )  # fmt: skip
        count = {PREVIOUS_WAITS_HEADER: f"{retries}:{checks + 1}"}
        republish(task, countdown, count, None, quietly=True)
    if parsed is not None and parsed[1] > retries:
        logger.warning(
            "Task %s[%s] dropped: a newer attempt of this task (retry %d) holds lock %r",
            task.name, request.id, parsed[1], key,
        )  # fmt: skip
        conflict.report("drop")
        raise Ignore()
    ttl = conflict.options.ttl
    countdown = min(ttl, max(1.0, holder.ttl or ttl)) + random.uniform(0, 0.5)
    logger.info(
        "Task %s[%s]: another delivery of this message holds lock %r (lease left: %s); "
        "checking again in %.1fs",
        task.name, request.id, key, conflict.lease_left, countdown,
    )  # fmt: skip
    conflict.report("defer")
    republish(task, countdown, {REDELIVERED_HEADER: True}, None, quietly=True)


def previous_attempt_wait(checks: int, ttl: float, lease_left: float | None) -> float:
    """The countdown of a retried attempt that found the attempt before it still holding the
    lock, after ``checks`` such checks: 0.5 to 0.75 s first (that attempt is usually in its
    last statements), then doubling, with up to 25% jitter, up to the holder's lease left (at
    least 1 s, at most ``ttl``). A body that goes on after asking for its retry
    (``self.retry(throw=False)``, or ``Retry`` caught) so costs a few sends, then one per lease,
    instead of one every 0.5 s for as long as it runs; a holder that died is looked at again
    about when its lease runs out."""
    if checks <= 0:
        return 0.5 + random.uniform(0, 0.25)
    cap = max(1.0, min(ttl, lease_left if lease_left is not None else ttl))
    return min(cap, 0.5 * 2.0**checks) * random.uniform(1.0, 1.25)


def store_unreachable(
    task: Task[Any, Any],
    options: LockOptions,
    exc: BackendUnavailable | BackendTimeout,
    direct: bool,
    body: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> Any:
    """The lock store could not be reached to acquire: run unlocked, retry later, or fail."""
    request = task.request
    if options.on_backend_error == "run":
        logger.warning(
            "Task %s[%s] runs WITHOUT its lock: the lock store is unreachable (%s) and "
            "lock_on_backend_error is 'run'",
            task.name, request.id, exc,
        )  # fmt: skip
        return body(*args, **kwargs)
    spent = header_count(request, BACKEND_RETRIES_HEADER)
    if direct or request.is_eager or spent >= options.backend_retry_max:
        why = (
            "cannot wait in eager mode or a direct call"
            if direct or request.is_eager
            else f"gave up after {spent} retries"
        )
        logger.error(
            "Task %s[%s] fails: the lock store is unreachable (%s); %s",
            task.name, request.id, exc, why,
        )  # fmt: skip
        if isinstance(exc, BackendUnavailable):
            raise exc
        raise BackendUnavailable(str(exc)) from exc
    countdown = min(BACKEND_RETRY_CAP, 2.0**spent * random.uniform(1.0, 1.25))
    logger.warning(
        "Task %s[%s] retries in %.1fs (%d of %d): the lock store is unreachable: %s",
        task.name, request.id, countdown, spent + 1, options.backend_retry_max, exc,
    )  # fmt: skip
    republish(task, countdown, {BACKEND_RETRIES_HEADER: spent + 1}, exc)
