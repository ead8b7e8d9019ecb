"""What becomes of an execution that does not run its body, decided in one place.

:func:`singletask.execution.lifecycle.execute` reads top to bottom (who is running, acquire, run,
end); an execution that does not get to run its body leaves it at one of three points, each a
function here:

* **superseded** (:func:`superseded`): a later send of its window (``lock_debounce``, or a
  coalescing follow-up's with ``lock_coalesce = "latest"``) replaced it; it ends as a
  :class:`~singletask.Skipped` naming that send;
* **the store could not be reached** (:func:`store_unreachable`): ``lock_on_backend_error``
  says whether it runs unlocked, is sent again with backoff, or fails;
* **refused** (:func:`refused`): its key is held, or its start is too soon for its
  ``lock_rate``. In this order:

  1. refused by the rate: a retried attempt of the body waits for the allowed start as the
     ``"retry"`` policy does, whatever the policy, and keeps its reservation for it (the retry
     the body asked for is not lost to the task's own rate); any other execution ends as its
     policy says;
  2. held under this task id: by another delivery of this very message (it checks again once
     the holder's lease could have run out), by the attempt that asked for this retry (it
     checks again shortly, then takes its reservation), or by a newer attempt (this copy is
     stale and dropped);
  3. coalescing: the key's one pending follow-up waits for the run in progress to end;
  4. the task's ``lock_policy`` (:mod:`singletask.policies`). With "replace", only an
     execution that may not preempt the holder (:func:`singletask.execution.replace.preempt`) gets
     this far: a retried attempt or a redelivered copy, older than the holder, stands aside.
     With "skip" or "raise", a retried attempt of the body that finds its key held by another
     task (its reservation ended before it came, or was never made) waits as the ``"retry"``
     policy does: the retry the body asked for is not lost to a duplicate either.

Besides the lock, the store can keep something for one message alone: the reservation
``apply_async`` made for it (``lock_scope`` "queue" or "coalesce"), the reservation the previous
attempt left when the body retried itself, or its follow-up claim. Every path here that ends
the execution without its body gives them back (:func:`give_back`) unless the message is sent
again (it then comes back for them): no execution that has ended keeps its key, so a later send
is never deduplicated onto it, joined to it or locked out by it.
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from celery.exceptions import Ignore
from celery.exceptions import Retry as CeleryRetry

from ..exceptions import BackendError, BackendTimeout, BackendUnavailable
from ..observe import report
from ..policies import POLICIES
from ..protocol.headers import (
    BACKEND_RETRIES_HEADER,
    LATEST_HEADER,
    LOCK_RETRIES_HEADER,
    PREVIOUS_WAITS_HEADER,
    REDELIVERED_HEADER,
    attempt_count,
    header_count,
    republish,
)
from ..protocol.slots import slot_keys
from ..protocol.tokens import parse_token, process_state, reservation_token
from ..result import Skipped
from ..send.records import claim_follow_up, take_back
from ..signals import lock_conflict
from .endings import persist

if TYPE_CHECKING:
    from celery import Task

    from ..backends.base import AcquireResult, Holder, LockBackend
    from ..conf.options import LockOptions
    from ..policies import Conflict

__all__ = [
    "BACKEND_RETRY_CAP",
    "give_back",
    "previous_attempt_wait",
    "refused",
    "store_unreachable",
    "superseded",
    "superseded_retry",
]

logger = logging.getLogger("singletask")

#: Longest wait, in seconds, between two retries of an execution that could not reach the lock
#: store (they back off 1, 2, 4, ... up to this).
BACKEND_RETRY_CAP = 30.0


def refused(conflict: Conflict, request: Any = None) -> Any:
    """Act for an execution that could not take its key: return its value, or raise to end it.

    The order of the module's docstring: the rate, then holders under this task id, then a
    coalescing follow-up's wait, then the task's policy. ``request``: the task's current
    request, when the caller has it at hand (else it is read).
    """
    if conflict.rated:
        return _rate_refused(conflict)
    if request is None:
        request = conflict.task.request
    for holder in conflict.holders or ((conflict.holder,) if conflict.holder else ()):
        if not conflict.direct and holder.task_id == request.id:
            _held_by_same_task(conflict, holder)
    if conflict.options.scope == "coalesce" and not conflict.direct and not request.is_eager:
        _wait_as_follow_up(conflict)
    policy = conflict.options.policy
    if policy in ("skip", "raise") and _asked_for(conflict, request):
        logger.info(
            "Task %s[%s]: lock %r is held by another task, not reserved for this retry (its "
            "reservation ended before it came, or was never made); it waits as a lock retry",
            conflict.task.name, request.id, conflict.key,
        )  # fmt: skip
        policy = "retry"
    return POLICIES[policy].apply(conflict)


def _asked_for(conflict: Conflict, request: Any) -> bool:
    """Whether the refused execution is an attempt its body asked for (``self.retry()``), run
    by a worker: it is not dropped as a duplicate."""
    return int(request.retries or 0) > 0 and not conflict.direct and not request.is_eager


def superseded(
    task: Task[Any, Any],
    options: LockOptions,
    backend: LockBackend,
    key: str,
    latest: str,
    reservation: str | None,
) -> Skipped:
    """A send that a later send of its key's window superseded: it ends without its body, as a
    ``Skipped`` with reason "debounced" (``lock_debounce``) or "superseded" (a coalescing
    follow-up of ``lock_coalesce = "latest"``).

    ``reservation``: one this message may hold (a body retry's; coalescing, its send's), given
    back first (owner-checked: it will not run).
    """
    if reservation is not None:
        give_back(task, options, backend, key, reservation)
    debounced = options.debounce is not None
    reason = "debounced" if debounced else "superseded"
    option = "lock_debounce" if debounced else "lock_coalesce 'latest'"
    logger.info(
        "Task %s[%s] skipped: a later send (%s) of lock %r superseded it (%s)",
        task.name, task.request.id, latest, key, option,
    )  # fmt: skip
    lock_conflict.send(
        sender=task, key=key, holder=latest, ttl=None, task_id=task.request.id,
        action="superseded",
    )  # fmt: skip
    report.emit(task, "superseded", key, holder=latest, reason=reason)
    return Skipped(key, latest, reason=reason)


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
    _store_error(task, options, exc, args, kwargs)
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


def _store_error(
    task: Task[Any, Any],
    options: LockOptions,
    exc: Exception,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> None:
    """Tell the ``store_error`` outcome; the key, if it can be built (it was, to acquire)."""
    try:
        key = options.key(args, kwargs)
    except Exception:
        return
    report.emit(task, "store_error", key, reason=f"{type(exc).__name__}: {exc}"[:200])


def _rate_refused(conflict: Conflict) -> Any:
    """An execution whose start the ``lock_rate`` refused: its value, or raise to end it."""
    options, request = conflict.options, conflict.task.request
    retries = int(request.retries or 0)
    if conflict.direct:
        return POLICIES[options.policy].apply(conflict)  # nothing to keep or give back
    reservation = None  # an execution-scope send reserved nothing; a body retry did
    if retries > 0 or options.scope != "execution":
        reservation = reservation_token(str(request.id), retries)
    spent = header_count(request, LOCK_RETRIES_HEADER)
    if reservation and retries > 0 and not request.is_eager and spent < options.retry_max:
        # The body asked for this retry: it waits for the allowed start, reserved meanwhile.
        _keep(conflict, reservation, float(conflict.retry_after or 0) + options.ttl)
        POLICIES["retry"].apply(conflict)
    try:
        value = POLICIES[options.policy].apply(conflict)
    except (CeleryRetry, Ignore):
        raise  # sent again: it comes back for its reservation, claim and killed delivery's hold
    except BaseException:
        _give_back_all(conflict, reservation)
        raise
    _give_back_all(conflict, reservation)
    return value


def _give_back_all(conflict: Conflict, reservation: str | None) -> None:
    """A message refused by the rate that ends here gives back what is kept for it: its
    reservation (and claim), and the hold of a delivery of it whose process is gone."""
    if reservation is not None:
        give_back(conflict.task, conflict.options, conflict.backend, conflict.key, reservation)
    _release_dead_delivery(conflict)


def _release_dead_delivery(conflict: Conflict) -> None:
    """Release the hold of an earlier delivery of this very message whose process is gone (a
    killed pool process; with ``acks_late`` and ``reject_on_worker_lost`` the worker delivers the
    message again and releases nothing). Its redelivered copy takes that hold over, unless the
    rate refuses the takeover: it is a start. Ending here, the copy must not leave the key held
    by a message that has ended for the rest of that lease (a send of ``lock_scope`` "queue"
    would be deduplicated onto it). Owner-checked by the dead hold's token. Never raises."""
    request_id = conflict.task.request.id
    holders = conflict.holders or ((conflict.holder,) if conflict.holder else ())
    for holder in holders:
        if holder.task_id != request_id or process_state(holder.token) != "gone":
            continue
        slots = slot_keys(conflict.key, conflict.options.limit)
        release = functools.partial(_release_in_slots, conflict.backend, slots, holder.token)
        try:
            released, _ = persist(release, conflict.options.ttl)
        except BackendError as exc:
            logger.warning(
                "Task %s[%s]: could not release lock %r, held by a delivery of it whose "
                "process is gone (%s): it stays until its lease ends",
                conflict.task.name, request_id, conflict.key, exc,
            )  # fmt: skip
            continue
        if released:
            logger.warning(
                "Task %s[%s]: lock %r, held by a delivery of it whose process is gone, "
                "released as the message ends",
                conflict.task.name, request_id, conflict.key,
            )  # fmt: skip


def _keep(conflict: Conflict, reservation: str, lease: float) -> None:
    """Make the reservation (if this attempt has one) last ``lease`` seconds from now."""
    try:
        for slot in slot_keys(conflict.key, conflict.options.limit):
            if conflict.backend.extend(slot, reservation, lease):
                return
    except BackendError as exc:
        logger.warning(
            "Task %s[%s]: could not extend its reservation of lock %r (%s); it waits for "
            "its start all the same",
            conflict.task.name, conflict.task.request.id, conflict.key, exc,
        )  # fmt: skip


def give_back(
    task: Task[Any, Any], options: LockOptions, backend: LockBackend, key: str, reservation: str
) -> None:
    """Release ``reservation`` (held in one of the slots of ``key``) and, coalescing, the
    follow-up claim of this task id: the execution ends without its body, and later sends must
    not meet them. Owner-checked: what another task holds is left alone. Sent again while the
    store cannot be reached (``singletask.execution.endings.persist``). Never raises."""
    task_id = str(task.request.id)

    def release() -> bool:
        released = _release_in_slots(backend, slot_keys(key, options.limit), reservation)
        if options.scope == "coalesce":
            backend.clear_next(key, task_id)
        return released

    try:
        released, _ = persist(release, options.queue_ttl)
    except BackendError as exc:
        logger.warning(
            "Task %s[%s] ends without its body, and its reservation of lock %r could not be "
            "released (%s): it stays until its lease ends",
            task.name, task_id, key, exc,
        )  # fmt: skip
        return
    if released:
        logger.info(
            "Task %s[%s] ends without its body: its reservation of lock %r is released",
            task.name, task_id, key,
        )  # fmt: skip


def _release_in_slots(backend: LockBackend, slots: Sequence[str], token: str) -> bool:
    """Release ``token`` in whichever of ``slots`` it holds (owner-checked)."""
    return any(backend.release(slot, token) for slot in slots)


def superseded_retry(result: AcquireResult, task_id: str) -> Holder | None:
    """A holder of the refused key that is the reservation a body retry of another message
    left (``<id>:<n>:-:0:reserved``, ``n`` at least 1), or None."""
    for holder in result.holders or ((result.holder,) if result.holder else ()):
        parsed = parse_token(holder.token)
        if (
            parsed is not None
            and parsed[0] != task_id
            and parsed[1] > 0
            and holder.token == reservation_token(parsed[0], parsed[1])
        ):
            return holder
    return None


def _wait_as_follow_up(conflict: Conflict) -> None:
    """Coalescing: the key's one pending follow-up waits for the run in progress to end.

    Returns (so the lock policy applies) when another execution is already the follow-up. A
    follow-up that ends any other way than by being sent again (its message cannot be sent, or
    an exception such as a soft time limit reaches it first) gives its claim back: later calls
    must not join it.
    """
    task, request = conflict.task, conflict.task.request
    task_id = str(request.id)
    queue_ttl = conflict.options.queue_ttl
    claim = None  # lock_coalesce "latest": its window (LATEST_HEADER) says it is the follow-up
    try:
        if not header_count(request, LATEST_HEADER):
            follow_up, claim = claim_follow_up(
                conflict.backend, conflict.key, task_id, conflict.holder_id, queue_ttl
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
    except Ignore:
        raise  # sent again: it comes back as the follow-up
    except BaseException:
        if claim is not None:  # not sent again: nothing runs it
            take_back(task, task_id, claim)
        raise


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
