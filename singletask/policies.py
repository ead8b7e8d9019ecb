"""The lock policies: what an execution locked out by a rival holder, or by the rate, does.

An execution that finds its key held is described by a :class:`Conflict`; once
:func:`singletask.execution.outcomes.refused` has sorted out what comes before the policy (another
delivery or attempt of the same message, a coalescing follow-up, a reservation to keep or give
back), it hands the conflict to the task's :class:`Policy`:

===========  ============================================================================
policy       a locked-out execution
===========  ============================================================================
``skip``     returns a :class:`~singletask.Skipped` value (state SUCCESS)
``retry``    is sent again after ``lock_retry_countdown`` (plus jitter), at most
             ``lock_retry_max`` times, then raises; in eager mode or a direct call it raises
``raise``    fails with :class:`~singletask.TaskLocked`
``replace``  is not locked out: it preempts the holder first (:mod:`singletask.execution.replace`);
             only a retried or redelivered message, older than the holder, stands aside
===========  ============================================================================

A new policy is one :class:`Policy` subclass in :data:`POLICIES` (and its name in
:data:`singletask.conf.settings.POLICIES`, which validates it). Every policy sends the
:data:`~singletask.signals.lock_conflict` signal and logs what it did.
"""

from __future__ import annotations

import logging
import random
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Final, NoReturn

from .exceptions import RateLimited, TaskLocked
from .observe import report
from .protocol.headers import LOCK_RETRIES_HEADER, header_count, republish
from .result import Skipped
from .signals import lock_conflict

if TYPE_CHECKING:
    from celery import Task

    from .backends.base import Holder, LockBackend
    from .conf.options import LockOptions

__all__ = ["POLICIES", "Conflict", "Policy", "Raise", "Replace", "Retry", "Skip"]

logger = logging.getLogger("singletask")


@dataclass(frozen=True, init=False)
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
            ``lock_rate``: seconds until it may start again; with ``limit``, a rate's
            seconds until it has room.
        limit: Set when the key was taken but a limit had no room for the execution's units
            (:mod:`singletask.execution.units`): the limit's name.
        used: With ``limit``: its units in use.
    """

    task: Task[Any, Any]
    options: LockOptions
    backend: LockBackend
    key: str
    holder: Holder | None
    direct: bool
    holders: tuple[Holder, ...] = ()
    retry_after: float | None = None
    limit: str | None = None
    used: int | None = None

    # The __init__ the dataclass would generate, written out: every refusal makes one, and
    # setting the frozen fields in the instance's dict costs a fraction of the generated one's
    # object.__setattr__ per field.
    def __init__(
        self,
        task: Task[Any, Any],
        options: LockOptions,
        backend: LockBackend,
        key: str,
        holder: Holder | None,
        direct: bool,
        holders: tuple[Holder, ...] = (),
        retry_after: float | None = None,
        limit: str | None = None,
        used: int | None = None,
    ) -> None:
        fields = self.__dict__
        fields["task"] = task
        fields["options"] = options
        fields["backend"] = backend
        fields["key"] = key
        fields["holder"] = holder
        fields["direct"] = direct
        fields["holders"] = holders
        fields["retry_after"] = retry_after
        fields["limit"] = limit
        fields["used"] = used

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
        """Send :data:`~singletask.signals.lock_conflict` for ``action`` (and its outcome's
        event, ``singletask.observe.report.conflict``)."""
        if lock_conflict.receivers:  # else nothing to build: nobody listens
            lock_conflict.send(
                sender=self.task, key=self.key, holder=self.holder_id, ttl=self.ttl,
                task_id=self.task.request.id, action=action,
            )  # fmt: skip
        if report.heard(self.task):  # else no span records and no event is sent
            report.conflict(self.task, self.key, self.holder_id, action, rated=self.rated)

    @property
    def rated(self) -> bool:
        """Whether the key was refused by its ``lock_rate``, not by a holder or a limit."""
        return self.retry_after is not None and self.limit is None

    @property
    def why(self) -> str:
        """Why the execution was refused, for a log line."""
        if self.limit is not None:
            used = f" ({self.used} units in use)" if self.used is not None else ""
            when = f", room in {self.retry_after:.1f}s" if self.retry_after is not None else ""
            return f"limit {self.limit!r} has no room for it{used}{when}"
        if self.rated:
            return (
                f"lock {self.key!r} started too recently for its lock_rate "
                f"{self.options.rate} (next start in {self.retry_after:.1f}s)"
            )
        return f"lock {self.key!r} is held by {self.who} (lease left: {self.lease_left})"

    def countdown(self) -> float:
        """``lock_retry_countdown`` plus up to 25% jitter; for a rate refusal, the time until
        a start is allowed less 5 ms and up to 10% of it: the message comes back a little
        early, finds the start allowed within ``acquire.RATE_WAIT`` and waits for it in its
        process, so that the start is not late by a trip through the broker."""
        if self.limit is not None and self.retry_after is not None:
            # A limit's rate: exact, a little late rather than early (it is not waited for).
            return self.retry_after + 0.005 + random.uniform(0, min(0.1, self.retry_after / 10))
        if self.retry_after is not None:
            # At most 0.125 s early: well within the 0.25 s an execution waits in its process.
            early = 0.005 + random.uniform(0, min(0.12, self.retry_after / 10))
            return max(0.0, self.retry_after - early)
        base = self.options.retry_countdown
        return base + random.uniform(0, base / 4)

    def refusal(self) -> TaskLocked:
        """The exception that reports this conflict: ``RateLimited`` or ``TaskLocked``."""
        if self.limit is not None:
            return TaskLocked(self.key, limit=self.limit, retry_after=self.retry_after)
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
        # At INFO, as Celery logs the messages it does not run ("Discarding revoked task"): a
        # skipped duplicate is the lock working. The line's parts are built only for it.
        if conflict.limit is not None:
            if logger.isEnabledFor(logging.INFO):
                logger.info(
                    "Task %s[%s] skipped: %s", conflict.task.name, conflict.task.request.id,
                    conflict.why,
                )  # fmt: skip
            return Skipped(conflict.key, reason="limit", retry_after=conflict.retry_after,
                           limit=conflict.limit)  # fmt: skip
        if conflict.rated:
            if logger.isEnabledFor(logging.INFO):
                logger.info(
                    "Task %s[%s] skipped: lock %r started too recently for its lock_rate %s "
                    "(next start in %.1fs)",
                    conflict.task.name, conflict.task.request.id, conflict.key,
                    conflict.options.rate, conflict.retry_after,
                )  # fmt: skip
            return Skipped(conflict.key, reason="rate", retry_after=conflict.retry_after)
        if logger.isEnabledFor(logging.INFO):
            logger.info(
                "Task %s[%s] skipped: lock %r is held by %s (lease left: %s)",
                conflict.task.name, conflict.task.request.id, conflict.key, conflict.who,
                conflict.lease_left,
            )  # fmt: skip
        holder = conflict.holder  # holder_id and ttl, read once
        ids = conflict.holder_ids if len(conflict.holders) > 1 else ()
        if holder is None:
            return Skipped(conflict.key, None, None, ids)
        return Skipped(conflict.key, holder.task_id, holder.ttl, ids)


class Raise(Policy):
    """Fail with :class:`~singletask.TaskLocked`."""

    name = "raise"
    at_send = "raise"

    def apply(self, conflict: Conflict) -> NoReturn:
        self.refuse(conflict)

    def refuse(self, conflict: Conflict, why: str = "") -> NoReturn:
        """Fail with ``TaskLocked``; ``why`` says why, when another policy fell back to this."""
        conflict.report("raise")
        if conflict.limit is not None:
            logger.warning(
                "Task %s[%s] raises TaskLocked: %s%s", conflict.task.name,
                conflict.task.request.id, conflict.why, why,
            )  # fmt: skip
            raise conflict.refusal()
        if conflict.rated:
            logger.warning(
                "Task %s[%s] raises RateLimited: lock %r started too recently for its "
                "lock_rate %s (next start in %.1fs)%s",
                conflict.task.name, conflict.task.request.id, conflict.key,
                conflict.options.rate, conflict.retry_after, why,
            )  # fmt: skip
            raise conflict.refusal()
        if logger.isEnabledFor(logging.WARNING):  # the line's parts are built only for it
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
        logger.info(
            "Task %s[%s] retries in %.1fs (lock retry %d of %d): %s",
            conflict.task.name, request.id, countdown, spent + 1, options.retry_max,
            conflict.why,
        )  # fmt: skip
        republish(conflict.task, countdown, {LOCK_RETRIES_HEADER: spent + 1}, conflict.refusal())


class Replace(Policy):
    """Preempt the holder (:func:`singletask.execution.replace.preempt` does, before this); here
    only an execution that may not (retried, redelivered, or every holder a later send: older
    than the holder) stands aside, a ``Skipped`` "replaced" naming the holder."""

    name = "replace"

    def apply(self, conflict: Conflict) -> Skipped:
        conflict.report("replaced")
        logger.info(
            "Task %s[%s] skipped: lock %r is held by %s, newer than this message (a later send, "
            "or this one is retried or redelivered) (lock_policy 'replace')",
            conflict.task.name, conflict.task.request.id, conflict.key, conflict.who,
        )  # fmt: skip
        return Skipped(conflict.key, conflict.holder_id, conflict.ttl, reason="replaced")


#: The policies by ``lock_policy`` name.
POLICIES: Final[Mapping[str, Policy]] = {p.name: p for p in (Skip(), Retry(), Raise(), Replace())}
