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

Who never preempts: another delivery or attempt of the holder's own message, and an execution
that is itself a retried attempt or a redelivered copy (its message is older than the holder,
which started after it first did). :func:`preempt` leaves them to
:func:`singletask.execution.outcomes.refused`, as every refused execution: the former is deferred or
dropped as for every policy, the latter stands aside (a ``Skipped`` naming the holder).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Final

from ..observe import report
from ..policies import Raise
from ..protocol.headers import is_redelivery
from ..result import Skipped
from ..signals import lock_conflict

if TYPE_CHECKING:
    from collections.abc import Mapping

    from celery import Task

    from ..backends.base import AcquireResult, Holder, LockBackend
    from ..lease import LockHandle
    from ..policies import Conflict

__all__ = ["ATTEMPTS", "REPLACES", "oldest", "preempt", "replaced"]

logger = logging.getLogger("singletask")

#: How many times :func:`preempt` tries when the holder it names changes meanwhile (it ended,
#: or another newer execution preempted it first) before it gives up with ``TaskLocked``.
ATTEMPTS: Final = 3

#: The metadata field in which the preempting holder names the owner token it replaced.
REPLACES: Final = "replaces"


def oldest(holders: tuple[Holder, ...]) -> Holder | None:
    """The holder with the smallest fencing token (a holder without one counts as oldest)."""
    return min(holders, key=lambda h: -1 if h.fence is None else h.fence, default=None)


def preempt(conflict: Conflict, token: str, meta: Mapping[str, str]) -> AcquireResult | None:
    """Take the key of ``conflict`` over from its (oldest) holder for ``token``.

    Returns the acquisition, or None when the execution does not preempt (its policy is not
    "replace"; a holder is another delivery or attempt of its own message; it is itself a
    retried attempt or a redelivered copy): :func:`~singletask.execution.outcomes.refused` decides
    then. Raises ``TaskLocked`` when the holders kept changing.
    """
    request, options = conflict.task.request, conflict.options
    if options.policy != "replace" or conflict.rated:
        return None
    holders = conflict.holders or ((conflict.holder,) if conflict.holder else ())
    if not conflict.direct and (
        int(request.retries or 0) > 0
        or is_redelivery(request)
        or any(h.task_id == request.id for h in holders)
    ):
        return None
    for _ in range(ATTEMPTS):
        victim = oldest(holders)
        if victim is None:
            break
        result = conflict.backend.preempt(
            conflict.key, options.limit, token, options.ttl, victim.token,
            meta={**meta, REPLACES: victim.token},
        )  # fmt: skip
        if result.acquired:
            _report(conflict, victim, result)
            return result
        holders = result.holders or ((result.holder,) if result.holder else ())
        if any(h.task_id == request.id for h in holders if not conflict.direct):
            break  # another delivery of this message took it meanwhile: not ours to preempt
    Raise().refuse(conflict, " (lock_policy 'replace': its holders kept changing)")


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
    if conflict.options.replace_terminate and victim.task_id is not None:
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
