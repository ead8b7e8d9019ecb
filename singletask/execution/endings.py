"""How the hold of an execution ends, by the way its body ended.

The endings the ``finally`` of :func:`singletask.execution.lifecycle.execute` tells apart (rows
of the table "Which hook releases on which ending" in ``docs/lifecycle.rst``; the endings where
this process never gets there are the worker main process's, in
:mod:`singletask.execution.recovery`):

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

The end of a hold goes through even when the lock store is briefly unreachable
(``persist``): the release (or the retry's reservation) is sent again for up to
``END_PERSISTENCE`` seconds, before Celery stores the result. A hold whose end were given up
at the first error would keep the key for the rest of its lease after the execution ended, and
with ``lock_scope`` "queue" or "coalesce" a send meanwhile would be deduplicated onto an
execution that has ended: it would get that result and never run.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, NamedTuple, TypeVar

from celery.exceptions import Ignore, Reject, Retry

from ..exceptions import BackendTimeout, BackendUnavailable
from ..protocol.headers import seconds_until
from ..protocol.tokens import reservation_token

if TYPE_CHECKING:
    from celery import Task

    from ..backends.base import LockBackend, Units
    from ..conf.options import LockOptions

__all__ = [
    "ENDINGS",
    "END_PERSISTENCE",
    "Ending",
    "PendingRetry",
    "ending_of",
    "persist",
    "release_or_reserve",
    "reserve_and_publish",
    "reserve_for_retry",
]

logger = logging.getLogger("singletask")

T = TypeVar("T")

#: The longest time, in seconds, the end of a hold (or of a reservation an execution gives
#: back) keeps trying while the lock store cannot be reached, never longer than the lease itself:
#: a store that is back within it (a restart, a failover, a dropped link) gets the release.
END_PERSISTENCE: Final = 2.0

#: The first wait between two tries, doubled after each, up to :data:`_LONGEST_WAIT`.
_FIRST_WAIT = 0.05
_LONGEST_WAIT = 0.4


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


class PendingRetry(NamedTuple):
    """The retry a body asked for with ``self.retry()``, whose publish waits for the end of the
    hold (:mod:`singletask.execution.retrying`)."""

    #: When it is due: its countdown in seconds, or its ETA.
    when: object
    #: Publishes it, as Celery's ``Task.retry`` would have.
    publish: Callable[[], object]


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


def persist(operation: Callable[[], T], lease: float) -> tuple[T, int]:
    """Return ``operation()`` and how many tries failed first: while it raises
    ``BackendUnavailable`` or ``BackendTimeout``, it is tried again after a short wait (50 ms,
    doubling up to 0.4 s), for ``END_PERSISTENCE`` seconds at most and never longer than
    ``lease`` (the lock is gone by then anyway); then the last error is raised. Only for
    operations that are safe to repeat: an owner-checked release, a takeover by the same token.
    """
    deadline = time.monotonic() + min(END_PERSISTENCE, max(0.0, lease))
    wait, failed = _FIRST_WAIT, 0
    while True:
        try:
            return operation(), failed
        except (BackendUnavailable, BackendTimeout):
            if time.monotonic() + wait > deadline:
                raise
        failed += 1
        time.sleep(wait)
        wait = min(wait * 2, _LONGEST_WAIT)


def release_or_reserve(
    task: Task[Any, Any],
    options: LockOptions,
    backend: LockBackend,
    key: str,
    token: str,
    retry: BaseException | None,
    *,
    completed: str | None = None,
    meta: Mapping[str, str] | None = None,
    units: Sequence[Units] = (),
) -> bool:
    """End the execution's hold: release, or turn it into a reservation for the body's retry.
    With ``units`` (the concurrency units of named limits it holds), they are given back with
    the release, in the same step where the store can, or just before the reservation.

    The reservation is the lock under a token only the retried attempt (same task id,
    ``retries + 1``) takes over; it lasts the retry's countdown plus one lease. Either is sent
    again while the store cannot be reached (``persist``). Never raises. Returns False when
    a release found the lock no longer held, else True.
    """
    if retry is not None:
        if units:
            with contextlib.suppress(Exception):  # else their lease gives them back
                backend.give_units(token, units)
        reserve_for_retry(task, options, backend, key, token, getattr(retry, "when", None), meta)
        return True
    with_units: dict[str, Any] = {"units": units} if units else {}
    try:
        released, failed = persist(
            lambda: backend.release(key, token, completed=completed, **with_units), options.ttl
        )
        if not released and failed:
            # A try whose reply was lost may have released it, or the lease ran out meanwhile.
            logger.info(
                "Task %s[%s]: lock %r was free after %d failed tries to release it (one of "
                "them may have released it)",
                task.name, task.request.id, key, failed,
            )  # fmt: skip
            return False
        if not released:
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


def reserve_for_retry(
    task: Task[Any, Any],
    options: LockOptions,
    backend: LockBackend,
    key: str,
    token: str,
    when: object,
    meta: Mapping[str, str] | None = None,
) -> str | None:
    """Turn the execution's hold (``token``) into the reservation for its retry, due ``when``
    (a countdown in seconds, or an ETA): the lock under the token only the retried attempt
    (same task id, ``retries + 1``) takes over, for the retry's delay plus one lease (at most
    the store's longest). Sent again while the store cannot be reached (``persist``). Never
    raises. Returns the reservation's token, or None if the lock was not reserved."""
    request = task.request
    retry_token = reservation_token(str(request.id), int(request.retries or 0) + 1)
    # At most the store's longest lease: a retry delayed longer loses its reservation.
    reserve = min(backend.max_lease, seconds_until(when) + options.ttl)
    try:
        reserved, _ = persist(
            lambda: backend.acquire(key, retry_token, reserve, meta=meta, takeover_prefix=token),
            options.ttl,
        )
        if reserved.acquired:
            logger.info(
                "Task %s[%s] retries: lock %r stays reserved for the retry (%.0fs at most)",
                task.name, request.id, key, reserve,
            )  # fmt: skip
            return retry_token
    except Exception:
        # Never let the reservation break the task's outcome; the lease ends by itself.
        logger.exception(
            "Task %s[%s]: could not reserve lock %r for the retry; it expires by itself "
            "within %.0fs",
            task.name, request.id, key, options.ttl,
        )  # fmt: skip
    return None


def reserve_and_publish(
    task: Task[Any, Any],
    options: LockOptions,
    backend: LockBackend,
    key: str,
    token: str,
    retry: PendingRetry,
    *,
    completed: str | None = None,
    meta: Mapping[str, str] | None = None,
) -> bool:
    """End the hold of a body that asked for a retry: reserve the lock for the retry, then
    publish the retry (Celery stores RETRY next, with nothing of singletask's in between).

    A publish that fails leaves no reservation: it is released (``completed`` recorded as for a
    rejected message), and ``Reject(exc, requeue=False)`` is raised, as Celery's
    ``Task.retry`` raises it. Returns True.
    """
    retry_token = reserve_for_retry(task, options, backend, key, token, retry.when, meta)
    try:
        retry.publish()
    except Exception as exc:
        logger.warning(
            "Task %s[%s]: its retry could not be published (%r); lock %r is released",
            task.name, task.request.id, exc, key,
        )  # fmt: skip
        release_or_reserve(
            task, options, backend, key, retry_token or token, None, completed=completed
        )
        raise Reject(exc, requeue=False) from exc
    return True
