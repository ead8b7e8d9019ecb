"""``lock_policy = "replace"``: the newer execution wins, the one holding the key is preempted.

An execution that finds its key held does not wait or give up: :func:`preempt` takes the key
over from its holder (with ``lock_limit`` above 1 and every slot held, from the *oldest* holder:
the smallest fencing token), in one atomic step of the store
(:meth:`~singletask.backends.base.LockBackend.preempt`) that gives it a fencing token larger than
the preempted holder's. So a preempted body that keeps running a little longer cannot do harm
where its writes are fenced: they carry the older token.

The preempted execution learns it from its renewer, at its next renewal (within a third of
``lock_ttl``): the renewal fails, one read of the store's preemption record
(:meth:`~singletask.backends.base.LockBackend.replaced_by`, kept a lease long, so even a newer
execution that has ended by then is named), and the handle reports the loss as a preemption
(``self.lock.lost``, ``self.lock.check()`` raising :class:`~singletask.LockPreempted`, the
``lock_lost`` signal). :func:`replaced` turns the end of such an execution into a
:class:`~singletask.Skipped` with ``reason == "replaced"`` naming its successor. With
``lock_replace_terminate``, the preemptor also revokes it with ``terminate=True``.

Who never preempts: another delivery or attempt of the holder's own message, an execution
that is itself a retried attempt or a redelivered copy (its message is older than the holder,
which started after it first did), and an execution whose holders are all *later sends* (by
the send-time header each holder keeps in its metadata, field ``sent``): it is superseded. So a
replace send never fails for being locked: it runs, or ends as a ``Skipped`` "replaced" naming
the newer execution that preempted it or holds the key. :func:`preempt` leaves them to
:func:`singletask.execution.outcomes.refused`, as every refused execution: the former is deferred or
dropped as for every policy, the latter stands aside (a ``Skipped`` naming the holder).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import TYPE_CHECKING, Any, Final

import billiard

from ..lease import native_threads
from ..observe import report
from ..protocol.headers import SENT_AT_HEADER, header_value, is_redelivery
from ..protocol.slots import slot_keys
from ..result import Skipped
from ..signals import lock_conflict

if TYPE_CHECKING:
    from collections.abc import Mapping

    from celery import Task

    from ..backends.base import AcquireResult, Holder, LockBackend
    from ..lease import LockHandle
    from ..policies import Conflict

__all__ = ["REPLACES", "SENT", "TERMINABLE", "holder_fields", "oldest", "preempt", "replaced"]

logger = logging.getLogger("singletask")

#: The metadata field in which the preempting holder names the owner token it replaced.
REPLACES: Final = "replaces"

#: The metadata field with the time its message was first sent (the send-time header), by which
#: executions of ``lock_policy = "replace"`` tell the newer from the older.
SENT: Final = "sent"

#: The metadata field saying whether the holder's pool can terminate it (``"1"``: prefork,
#: gevent, eventlet; ``"0"``: solo, threads, eager): ``lock_replace_terminate`` revokes only then.
TERMINABLE: Final = "terminable"


def holder_fields(request: Any, since: str) -> dict[str, str]:
    """The metadata fields of a ``lock_policy = "replace"`` holder: when its message was first
    sent (the send-time header; its start, ``since``, without one) and whether its pool can
    terminate it (:data:`TERMINABLE`)."""
    sent = header_value(request, SENT_AT_HEADER)
    return {SENT: str(sent if sent is not None else since), TERMINABLE: _terminable(request)}


def _terminable(request: Any) -> str:
    """``"1"`` when a revoke with ``terminate=True`` can stop this execution: a worker's prefork
    child (Celery signals it), or a gevent/eventlet green thread (Celery kills it); ``"0"`` in the
    worker's own process (solo, threads: ``terminate_job`` is not implemented), eagerly, or in
    a direct call."""
    if request.called_directly or request.is_eager:
        return "0"
    green = native_threads() is not None
    child = billiard.process.current_process().name != "MainProcess"
    return "1" if green or child else "0"


def _order(meta: Mapping[str, str], task_id: str | None, token: str) -> tuple[float, str]:
    """How new an execution is: the send time of its message (its start without one; a holder
    that says neither is the oldest), then its task id, so that any two compare."""
    try:
        sent = float(meta.get(SENT) or meta.get("since") or "-inf")
    except ValueError:
        sent = -math.inf
    return (sent if math.isfinite(sent) else -math.inf), task_id or token


def oldest(holders: tuple[Holder, ...]) -> Holder | None:
    """The holder with the smallest fencing token (a holder without one counts as oldest)."""
    return min(holders, key=lambda h: -1 if h.fence is None else h.fence, default=None)


def preempt(
    conflict: Conflict, token: str, meta: Mapping[str, str]
) -> AcquireResult | Conflict | None:
    """Take the key of ``conflict`` over from its oldest holder older than this execution.

    Returns the acquisition; or a Conflict naming the holders when every holder is newer (a
    later send): :func:`~singletask.execution.outcomes.refused` ends it then, as a ``Skipped``
    "replaced" naming the newest, as for a retried or redelivered execution; or None when the
    execution does not preempt (its policy is not "replace"; a holder is another delivery or
    attempt of its own message; it is itself a retried attempt or a redelivered copy): then
    ``refused(conflict)`` decides. Never raises ``TaskLocked``.

    Bounded without a count: each round reads the holders, then either ends (taken, superseded
    by a newer holder, or a delivery of its own message holds) or preempts the oldest older
    holder in one atomic step, which fails only when another execution took that slot in
    between; an execution takes the key over only from an older one, so the holders it can meet
    that way are the finitely many sends older than this one.
    """
    options = conflict.options
    if options.policy != "replace" or conflict.rated:
        return None
    request = conflict.task.request
    holders = conflict.holders or ((conflict.holder,) if conflict.holder else ())
    if not conflict.direct and (
        int(request.retries or 0) > 0
        or is_redelivery(request)
        or any(h.task_id == request.id for h in holders)
    ):
        return None
    backend, key, limit = conflict.backend, conflict.key, options.limit
    mine = _order(meta, None if conflict.direct else request.id, token)
    names = [key] if limit == 1 else slot_keys(key, limit)
    while True:
        holders = tuple(h for h in map(backend.holder, names) if h is not None)
        if not conflict.direct and any(h.task_id == request.id for h in holders):
            return None  # another delivery of this message took it meanwhile
        older = tuple(h for h in holders if _order(h.meta, h.task_id, h.token) < mine)
        if holders and not older:  # superseded: every holder is a later send
            newest = max(holders, key=lambda h: _order(h.meta, h.task_id, h.token))
            return dataclasses.replace(
                conflict, holder=newest, holders=holders if limit > 1 else ()
            )
        victim = oldest(older)
        if victim is None:  # free meanwhile: taken as any free key
            result = (
                backend.acquire(key, token, options.ttl, meta=meta)
                if limit == 1
                else backend.acquire_slot(key, limit, token, options.ttl, meta=meta)
            )
        else:
            result = backend.preempt(
                key, limit, token, options.ttl, victim.token,
                meta={**meta, REPLACES: victim.token},
            )  # fmt: skip
        if result.acquired:
            if victim is not None:
                _report(conflict, victim, result)
            return result


def _report(conflict: Conflict, victim: Holder, result: AcquireResult) -> None:
    """Log and signal a preemption; revoke the preempted task with ``lock_replace_terminate``."""
    task = conflict.task
    logger.warning(
        "Task %s[%s] replaced %s on lock %r (lock_policy 'replace'): fence %s, newer than its %s",
        task.name, task.request.id, victim.task_id, result.key or conflict.key, result.fence,
        victim.fence,
    )  # fmt: skip
    lock_conflict.send(
        sender=task, key=conflict.key, holder=victim.task_id, ttl=victim.ttl,
        task_id=task.request.id, action="replace",
    )  # fmt: skip
    if not (conflict.options.replace_terminate and victim.task_id is not None):
        return
    if victim.meta.get(TERMINABLE) != "1":
        logger.info(
            "Task %s[%s] does not revoke %s (lock_replace_terminate): its pool cannot terminate "
            "it; it stops at its next check of its lock",
            task.name, task.request.id, victim.task_id,
        )  # fmt: skip
        return
    try:
        task.app.control.revoke(victim.task_id, terminate=True)
    except Exception:  # the cooperative stop still applies
        logger.warning(
            "Task %s[%s] could not revoke the execution it replaced (%s)",
            task.name, task.request.id, victim.task_id, exc_info=True,
        )  # fmt: skip


def replaced(
    task: Task[Any, Any], handle: LockHandle, backend: LockBackend, released: bool
) -> Skipped | None:
    """The outcome of an execution under ``lock_policy = "replace"`` that has ended: a
    ``Skipped`` naming its successor if it was preempted, else None.

    The renewer may have told the handle already; otherwise a release that found the lock gone
    (``released`` False) reads the preemption record once to tell a preemption from a lost
    lease.
    """
    if not handle.preempted and not released:
        try:
            successor = backend.replaced_by(handle.key, handle.token)
        except Exception:
            successor = None
        if successor is not None:
            handle.preempt(successor or None)
    if not handle.preempted:
        return None
    logger.warning(
        "Task %s[%s] was replaced on lock %r by a newer execution (%s): it ends as replaced",
        task.name, task.request.id, handle.key, handle.successor,
    )  # fmt: skip
    lock_conflict.send(
        sender=task, key=handle.key, holder=handle.successor, ttl=None,
        task_id=task.request.id, action="replaced",
    )  # fmt: skip
    report.emit(
        task, "preempted", handle.key, holder=handle.successor, fence=handle.fence,
        reason="a newer execution took the lock over (lock_policy 'replace')",
    )  # fmt: skip
    return Skipped(handle.key, handle.successor, reason="replaced")
