"""What a send writes to the lock store before its message is published, each with its undo.

A send of a deduplicated or debounced task writes to the store first and publishes after, so
that the message a worker gets finds the record made for it. Three kinds of record, each written
by one function here that returns, with the store's answer, the :class:`Written` record: what it
is and how to take it back.

* a **reservation** of the key (:func:`reserve`, an ``acquire`` under the message's
  reservation token), taken back by an owner-checked ``release``;
* a **follow-up claim** (:func:`claim_follow_up`, ``claim_next``), taken back by ``clear_next``,
  which ends only the claim of this task id;
* the **debounce window**'s latest send (:func:`enter_window`, ``debounce``), taken back by
  ``debounce_undo``, only while the window still names this send: the send it superseded is
  the latest again, or the window it opened is removed, or closed again naming the send that
  closed the window it replaced (``lock_debounce``, and every send of ``lock_coalesce =
  "latest"``, which may also have reserved the key: :func:`together` takes both back).

:func:`publish_or_undo` publishes, and if the publish raises (the broker is down, the serializer
refuses an argument), takes the record back in one atomic step before the error reaches the
caller: a send whose publish fails leaves the store as it was. A published reservation or
follow-up claim costs nothing more; a published debounced send tells the store that its window
entry, pending until then, was published (``window_published``, one more round trip). A
producer that dies between the write and the publish leaves the record until it expires (a
pending window entry: until its publish deadline), ``docs/guarantees.rst`` bounds it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from celery import states

from ..exceptions import BackendError, SingletaskError

if TYPE_CHECKING:
    from celery import Celery, Task

    from ..backends.base import AcquireResult, LockBackend

__all__ = [
    "MAX_PENDING",
    "Written",
    "claim_follow_up",
    "clear_follow_up",
    "enter_window",
    "publish_or_undo",
    "publish_time",
    "reserve",
    "take_back",
    "together",
    "window_published",
]

logger = logging.getLogger("singletask")

#: The longest a send stays pending in its window (seconds), whatever its publish retry policy
#: allows (``max_retries`` None: for ever).
MAX_PENDING = 60.0
#: Seconds added to the publish time the retry policy allows, for the store round trips.
_PENDING_MARGIN = 1.0


def publish_time(app: Celery, send_options: Mapping[str, Any]) -> float:
    """Seconds a publish of ``app`` may take before it fails, at most :data:`MAX_PENDING`: a
    connection attempt (``broker_connection_timeout``) for each try kombu's publish retry policy
    makes (``retry``, ``retry_policy``, or the settings ``task_publish_retry`` and
    ``task_publish_retry_policy``), the waits between them, and a margin."""
    conf = app.conf
    connect = float(conf.get("broker_connection_timeout") or 4.0)
    retry = send_options.get("retry", conf.get("task_publish_retry", True))
    policy = {
        **(conf.get("task_publish_retry_policy") or {}),
        **(send_options.get("retry_policy") or {}),
    }
    retries = policy.get("max_retries") if retry else 0  # kombu's ensure: None is for ever
    if retries is None:
        return MAX_PENDING
    start = float(policy.get("interval_start", 1))
    step = float(policy.get("interval_step", 1))
    longest = float(policy.get("interval_max", 1))
    waits = sum(min(start + step * n, longest) for n in range(int(retries)))
    return min(MAX_PENDING, (int(retries) + 1) * connect + waits + _PENDING_MARGIN)


T = TypeVar("T")


@dataclass(frozen=True)
class Written:
    """A record a send wrote to the lock store for its message, before publishing it.

    Attributes:
        what: What it is, for a log line: ``"reservation"``, ``"follow-up claim"`` or
            ``"debounce window"`` (or several, :func:`together`).
        undo: One atomic store call that takes it back, acting only while the record still
            names the send's message.
        joinable: Whether other calls may have joined the message through it (a reservation
            or a follow-up claim: they hold its ``AsyncResult``).
    """

    what: str
    undo: Callable[[], object]
    joinable: bool = False


def reserve(
    backend: LockBackend, key: str, token: str, ttl: float, meta: Mapping[str, str]
) -> tuple[AcquireResult, Written]:
    """Reserve ``key`` under the message's reservation ``token`` for ``ttl`` seconds."""
    result = backend.acquire(key, token, ttl, meta=meta)
    return result, Written("reservation", partial(backend.release, key, token), joinable=True)


def claim_follow_up(
    backend: LockBackend, key: str, task_id: str, holder_id: str | None, ttl: float
) -> tuple[str, Written]:
    """Claim the follow-up slot of ``key`` for ``task_id``; return the pending follow-up.

    A claim naming ``holder_id`` (the holder, read just before) is stale: that follow-up has
    started and clears it next. It is ended here and the slot claimed again, so that no call
    joins a run that has started.
    """
    follow_up = backend.claim_next(key, task_id, ttl)
    if follow_up != task_id and follow_up == holder_id:
        backend.clear_next(key, follow_up)
        follow_up = backend.claim_next(key, task_id, ttl)
    undo = partial(backend.clear_next, key, task_id)
    return follow_up, Written("follow-up claim", undo, joinable=True)


def enter_window(
    backend: LockBackend, key: str, task_id: str, ttl: float, *, pending: float = 0.0
) -> tuple[str | None, float, Written]:
    """Make ``task_id`` the latest send of the debounce window of ``key``, pending ``pending``
    seconds unless ``window_published`` says it was published; return the send it
    superseded (None when it opened the window) and the window's age in seconds."""
    previous, age, closed = backend.debounce(key, task_id, ttl, pending=pending)
    undo = partial(backend.debounce_undo, key, task_id, previous, closed=closed)
    return previous, age, Written("debounce window", undo)


def window_published(task: Task[Any, Any], backend: LockBackend, key: str, task_id: str) -> None:
    """The message of ``task_id``, a pending latest send of the window of ``key``, was
    published: the earlier sends of the window that start now end superseded by it, without
    waiting for its publish. Never raises: if the store fails, a WARNING says so, and the send
    stays pending until its deadline, when it is treated as taken back (one of the window's
    sends still runs, maybe an earlier one)."""
    try:
        backend.debounce_published(key, task_id)
    except BackendError as exc:
        logger.warning(
            "Task %s[%s] was published, but the lock store could not be told (%s): the "
            "earlier sends of its debounce window wait for it until its publish deadline",
            task.name, task_id, exc,
        )  # fmt: skip


def together(*written: Written) -> Written:
    """The records one send wrote, in the order it wrote them, as one: taken back last first
    (``lock_coalesce = "latest"``: a reservation, then the window's latest send)."""

    def undo() -> None:
        for record in reversed(written):
            record.undo()

    what = " and ".join(record.what for record in written)
    return Written(what, undo, joinable=any(record.joinable for record in written))


def publish_or_undo(
    task: Task[Any, Any], task_id: str, publish: Callable[[], T], written: Written
) -> T:
    """Return ``publish()``; if it raises, take ``written`` back first, then raise its error.

    If the undo fails too (the store is unreachable), a WARNING says what stays in the store
    until it expires, and the caller still gets the publish's error. Calls that joined the
    message while its publish was failing (deduplicated onto its reservation, or joined to its
    follow-up claim) hold its ``AsyncResult``: the publish's error is stored as its result, so
    that it ends FAILURE instead of staying PENDING.
    """
    try:
        return publish()
    except BaseException as exc:
        take_back(task, task_id, written)
        if written.joinable and isinstance(exc, Exception):
            _store_failure(task, task_id, exc)
        raise


def _store_failure(task: Task[Any, Any], task_id: str, exc: Exception) -> None:
    """Store ``exc`` as the result of the unsent message ``task_id``. Never raises."""
    try:
        task.backend.store_result(task_id, exc, states.FAILURE)
    except Exception as error:  # the result store may be down with the broker
        logger.warning(
            "Task %s[%s] was not published, and its failure could not be stored for the calls "
            "that joined it (%s): their AsyncResult stays PENDING",
            task.name, task_id, error,
        )  # fmt: skip


def take_back(task: Task[Any, Any], task_id: str, written: Written) -> None:
    """Take ``written`` back: its message ``task_id`` was never sent. Never raises a store error:
    if the store fails, a WARNING says what stays in it until it expires."""
    try:
        written.undo()
    except SingletaskError as exc:
        logger.warning(
            "Task %s[%s] was not published, and its %s in the lock store could not be "
            "taken back (%s): it stays until it expires",
            task.name, task_id, written.what, exc,
        )  # fmt: skip


def clear_follow_up(task: Task[Any, Any], backend: LockBackend, key: str, task_id: str) -> None:
    """A coalescing follow-up started: later submissions form the next follow-up. Never raises."""
    try:
        backend.clear_next(key, task_id)
    except BackendError:
        logger.warning(
            "Task %s[%s]: could not clear its follow-up claim on %r; it expires by itself",
            task.name, task_id, key, exc_info=True,
        )  # fmt: skip
