"""What an execution that does not run its body does with what was kept for its message.

Besides the lock, the store can keep something for one message alone: the reservation
``apply_async`` made for it (``lock_scope`` "queue" or "coalesce"), the reservation the previous
attempt left when the body retried itself, or its follow-up claim ("coalesce").
:func:`singletask.lifecycle.execute` takes a reservation over when it takes the lock, and clears
the claim; this module decides what happens to them when it does not, so that no execution that
has ended keeps its key (a later send deduplicated onto it, joined to it or locked out by it
would get an outcome that is not its own):

* refused by the task's ``lock_rate`` (:func:`rate_refused`): a retried attempt of the body
  waits for the allowed start as the ``"retry"`` policy does, whatever the policy, and keeps its
  reservation for it (the retry the body asked for is not lost to the task's own rate); any
  other execution ends as its policy says, and gives its reservation and claim back first,
  unless it is sent again (it then comes back for them);
* a retried attempt superseded by a later send of its debounce window gives its reservation back
  (:func:`give_back`);
* the latest send of a debounce window that finds the key reserved for the body retry of an
  earlier send (:func:`superseded_retry`) takes that reservation over: the retry, superseded by
  it, will not run.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from celery.exceptions import Ignore
from celery.exceptions import Retry as CeleryRetry

from .exceptions import BackendError
from .messages import LOCK_RETRIES_HEADER, header_count
from .policies import POLICIES
from .slots import slot_keys
from .tokens import parse_token, reservation_token

if TYPE_CHECKING:
    from celery import Task

    from .backends.base import AcquireResult, Holder, LockBackend
    from .options import LockOptions
    from .policies import Conflict

__all__ = ["give_back", "rate_refused", "superseded_retry"]

logger = logging.getLogger("singletask")


def rate_refused(conflict: Conflict) -> Any:
    """An execution whose start the ``lock_rate`` refused: its value, or raise to end it."""
    task, options, request = conflict.task, conflict.options, conflict.task.request
    retries = int(request.retries or 0)
    if conflict.direct or (retries == 0 and options.scope == "execution"):
        # Nothing can be kept for it: no reservation (or claim) to keep or to give back.
        return POLICIES[options.policy].apply(conflict)
    reservation = reservation_token(str(request.id), retries)
    spent = header_count(request, LOCK_RETRIES_HEADER)
    if retries > 0 and not request.is_eager and spent < options.retry_max:
        # The body asked for this retry: it waits for the allowed start, reserved meanwhile.
        _keep(conflict, reservation, float(conflict.retry_after or 0) + options.ttl)
        POLICIES["retry"].apply(conflict)
    try:
        value = POLICIES[options.policy].apply(conflict)
    except (CeleryRetry, Ignore):
        raise  # sent again: it comes back for its reservation and claim
    except BaseException:
        give_back(task, options, conflict.backend, conflict.key, reservation)
        raise
    give_back(task, options, conflict.backend, conflict.key, reservation)
    return value


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
    not meet them. Owner-checked: what another task holds is left alone. Never raises."""
    task_id = str(task.request.id)
    try:
        for slot in slot_keys(key, options.limit):
            if backend.release(slot, reservation):
                logger.info(
                    "Task %s[%s] ends without its body: its reservation of lock %r is released",
                    task.name, task_id, key,
                )  # fmt: skip
                break
        if options.scope == "coalesce":
            backend.clear_next(key, task_id)
    except BackendError as exc:
        logger.warning(
            "Task %s[%s] ends without its body, and its reservation of lock %r could not be "
            "released (%s): it stays until its lease ends",
            task.name, task_id, key, exc,
        )  # fmt: skip


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
