"""The messages singletask republishes for an execution, the headers it reads back, and delays.

An execution that must run later (a lock retry, a wait for the store, a copy deferred behind
another delivery of its message) is sent again under the same task id and ``retries``, with a
header of singletask's own counting what it has spent, so that the task's ``max_retries`` is
never touched.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, NoReturn

from celery.exceptions import Ignore, Reject, Retry, SoftTimeLimitExceeded

if TYPE_CHECKING:
    from celery import Task

__all__ = [
    "BACKEND_RETRIES_HEADER",
    "LATEST_HEADER",
    "LOCK_RETRIES_HEADER",
    "PREVIOUS_WAITS_HEADER",
    "REDELIVERED_HEADER",
    "SENT_AT_HEADER",
    "attempt_count",
    "header_count",
    "header_value",
    "is_redelivery",
    "message_headers",
    "republish",
    "seconds_until",
    "with_header",
    "with_sent_at",
]

#: Message header counting the lock retries of a task id (the task's own ``retries`` stays
#: untouched, so lock retries never spend ``max_retries``).
LOCK_RETRIES_HEADER = "singletask_lock_retries"

#: Message header counting the retries made because the lock store could not be reached.
BACKEND_RETRIES_HEADER = "singletask_backend_retries"

#: Message header marking a send of a task with ``lock_coalesce = "latest"`` that its key's
#: window names when it was sent: it runs only while it is still that window's latest send.
LATEST_HEADER = "singletask_latest"

#: Message header marking a copy deferred because another delivery of it held the lock.
REDELIVERED_HEADER = "singletask_redelivered"

#: Message header counting the checks of a retried attempt that found the attempt before it
#: still running: ``"<retries>:<checks>"``, so that the count of one attempt does not carry
#: over (Celery copies headers into the next retry) to the next.
PREVIOUS_WAITS_HEADER = "singletask_previous_waits"


#: Message header with the time (``time.time()``) a task id was first sent, set by
#: ``SingletonTask.apply_async`` when the wait it measures is reported (see
#: :func:`singletask.observe.report.reports_wait`) and carried by every message sent again for
#: it (lock retries, the body's retries), so that an execution knows how long it waited.
SENT_AT_HEADER = "singletask_sent_at"


def message_headers(request: Any) -> Mapping[str, Any]:
    """The headers of the request being executed, or ``{}`` when it has none or they are not a
    mapping (Celery keeps whatever ``apply(headers=...)`` was given, an int included)."""
    given = getattr(request, "headers", None)
    return given if type(given) is dict or isinstance(given, Mapping) else {}


def with_header(options: Mapping[str, Any], header: str, value: Any) -> dict[str, Any] | None:
    """The send ``options`` with ``header`` set to ``value`` in their ``headers``.

    Empty ``headers`` (None, ``{}``, ``0``...), which Celery ignores, become ``{header: value}``.
    Returns None when the given ``headers`` are not a mapping: singletask cannot add to them,
    and leaves them for Celery (a publish then fails in ``dict.update`` as Celery's own does;
    ``apply()`` keeps them as ``request.headers``).
    """
    given = options.get("headers")
    if not given:
        return {**options, "headers": {header: value}}
    if not isinstance(given, Mapping):
        return None
    return {**options, "headers": {**given, header: value}}


def with_sent_at(options: Mapping[str, Any]) -> Mapping[str, Any]:
    """``options`` with :data:`SENT_AT_HEADER` set to now, unless it is set (a message sent
    again keeps its first send's time) or the given ``headers`` are not a mapping (then as
    given: the wait of that execution is not known)."""
    given = options.get("headers")
    if isinstance(given, Mapping) and SENT_AT_HEADER in given:
        return options
    return with_header(options, SENT_AT_HEADER, time.time()) or options


def header_value(request: Any, header: str) -> Any:
    """A header of the message being executed (None when absent)."""
    value = getattr(request, header, None)
    if value is None:
        value = message_headers(request).get(header)
    return value


def header_count(request: Any, header: str) -> int:
    """A counter this library keeps in the message headers (0 when absent)."""
    value = header_value(request, header)
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def attempt_count(request: Any, header: str) -> int:
    """A counter kept as ``"<retries>:<count>"`` in the message headers: the count if it was
    kept by this attempt (same ``retries``), else 0."""
    value = header_value(request, header)
    retries, _, count = str(value or "").partition(":")
    try:
        return int(count) if int(retries) == int(request.retries or 0) else 0
    except (TypeError, ValueError):
        return 0


def is_redelivery(request: Any) -> bool:
    """Whether the broker delivered this message before (or singletask deferred such a copy)."""
    if (getattr(request, "delivery_info", None) or {}).get("redelivered"):
        return True
    return bool(header_count(request, REDELIVERED_HEADER))


def republish(
    task: Task[Any, Any],
    countdown: float,
    headers: Mapping[str, Any],
    reason: Exception | None,
    *,
    quietly: bool = False,
) -> NoReturn:
    """Send the running message again (same id and ``retries``) after ``countdown``; end this one.

    Like ``Task.retry()`` but without touching ``retries``: it raises ``Retry`` (state
    RETRY), or with ``quietly`` ``Ignore`` (nothing stored). A failed publish raises
    ``Reject``, as ``Task.retry()`` does; a soft time limit that fires during the publish is
    no failed publish: it ends the execution as it would have ended the body
    (``SoftTimeLimitExceeded``, state FAILURE).
    """
    request = task.request
    merged = {**message_headers(request), **headers}
    signature = task.signature_from_request(request, countdown=countdown, headers=merged)
    try:
        signature.apply_async()
    except SoftTimeLimitExceeded:
        raise
    except Exception as exc:
        raise Reject(exc, requeue=False) from exc
    if quietly:
        raise Ignore()
    raise Retry(exc=reason, when=countdown, sig=signature)  # type: ignore[arg-type]


def seconds_until(when: object) -> float:
    """The delay of a ``Retry.when`` or a message's ETA (seconds or a datetime), never negative."""
    if isinstance(when, int | float):
        return max(0.0, float(when))
    if isinstance(when, datetime):
        now = datetime.now(when.tzinfo or timezone.utc) if when.tzinfo else datetime.now()
        return max(0.0, (when - now).total_seconds())
    return 0.0
