"""What became of an execution, told outside the process: Celery events and OpenTelemetry.

The modules that decide an outcome (:mod:`singletask.execution.lifecycle`,
:mod:`singletask.execution.outcomes`,
:mod:`singletask.policies`, :mod:`singletask.execution.replace`, :mod:`singletask.send.dedup`) call
:func:`emit` (or a helper here) where they decide it; nothing here decides anything. Each call

* sets singletask's attributes on the span recording in the thread (:mod:`singletask.observe.spans`,
  when OpenTelemetry is installed): the execution's ``run/<task>`` span;
* sends one Celery event ``task-singletask-<outcome>`` with the task id as ``uuid``, when
  events are on for this process (:func:`sends_events`), through :mod:`singletask.observe.events`,
  which never makes the execution wait for the broker: an error is logged, never raised.

The outcomes are :data:`OUTCOMES`; the ``lock_conflict`` actions map onto them as
:data:`CONFLICT_OUTCOMES` says (the others send nothing). ``docs/visibility.rst`` is the
reference of the events' fields.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from ..conf.runtime import app_state
from ..protocol.headers import SENT_AT_HEADER, header_value
from ..signals import lock_lost
from . import events, spans

if TYPE_CHECKING:
    from celery import Celery, Task

    from ..conf.options import LockOptions
    from ..lease import LockHandle

__all__ = [
    "CONFLICT_OUTCOMES",
    "EVENT_PREFIX",
    "OUTCOMES",
    "Watch",
    "conflict",
    "emit",
    "first_sent",
    "heard",
    "lease_lost",
    "reports_wait",
    "sends_events",
    "worker_started",
]

logger = logging.getLogger("singletask")

#: The type of an event is this prefix and the outcome.
EVENT_PREFIX: Final = "task-singletask-"

#: Every outcome an event or a span can tell.
OUTCOMES: Final = frozenset(
    {
        "acquired", "released", "skipped", "raised", "retried", "superseded", "preempted",
        "rate_limited", "joined", "lease_lost", "store_error",
    }
)  # fmt: skip

#: ``lock_conflict`` action -> outcome, for a key refused by a holder (a refusal by
#: ``lock_rate`` is ``rate_limited`` whatever the action). ``defer``, ``drop``, ``follow``,
#: ``replace`` (the preemptor's: it sends ``acquired``) and ``supersede`` (at send: the
#: superseded message sends ``superseded`` when it runs) send nothing.
CONFLICT_OUTCOMES: Final[Mapping[str, str]] = {
    "skip": "skipped",
    "raise": "raised",
    "retry": "retried",
    "replaced": "skipped",  # lock_policy "replace": an older message stands aside
    "superseded": "superseded",
    "dedupe": "joined",
    "join": "joined",
}

#: The attribute of the Celery app where a worker's start leaves ``(send_events, hostname)``.
_WORKER: Final = "_singletask_worker_events"


def worker_started(app: Celery, send_events: bool, hostname: str | None) -> None:
    """Remember, for the worker of ``app`` and the pool processes it forks, whether it sends
    task events (``-E``, ``worker_send_task_events``) and its node name."""
    app.__dict__[_WORKER] = (bool(send_events), hostname)


def sends_events(app: Celery, *, producer: bool = False) -> bool:
    """Whether this process sends singletask's events: ``singletask_send_events`` if set, else
    the worker's ``-E`` (in a worker) or ``task_send_sent_event`` (``producer``)."""
    try:
        forced = app_state(app).settings.send_events
    except Exception:
        return False
    if forced is not None:
        return forced
    if producer:
        return bool(app.conf.get("task_send_sent_event"))
    worker = app.__dict__.get(_WORKER)
    return bool(worker and worker[0])


def reports_wait(app: Celery, options: LockOptions) -> bool:
    """Whether a send of a task with ``options`` carries the first send's time
    (:data:`~singletask.protocol.headers.SENT_AT_HEADER`) for the ``wait`` of the ``acquired``
    outcome (an event field and a span attribute). (``lock_policy`` "replace" also orders its
    holders by it: ``SingletonTask.apply_async`` adds it for such a task whatever this says.)

    True when singletask itself may make the execution wait for its lock (``lock_policy``
    "retry", ``lock_scope`` "coalesce", ``lock_debounce``), and otherwise when the producer can
    tell that the wait is reported: ``singletask_send_events`` is True, or unset with
    ``worker_send_task_events`` (what ``-E`` turns on) in the configuration (read with
    singletask's settings, when they are first used in the process), or OpenTelemetry's Celery
    instrumentation is active in this process (it instruments the workers too). A worker given
    ``-E`` on its command line alone is not known to the producer.
    """
    if options.policy == "retry" or options.scope == "coalesce" or options.debounce is not None:
        return True
    try:
        settings = app_state(app).settings
    except Exception:
        settings = None
    if settings is not None and settings.send_events is not None:
        return settings.send_events or spans.instrumented()
    if spans.instrumented():
        return True
    if settings is not None:
        return settings.worker_events  # read with the settings, on their first use
    return bool(app.conf.get("worker_send_task_events"))


def first_sent(request: Any) -> float | None:
    """When the message's task id was first sent (``time.time()``), if its header says."""
    value = header_value(request, SENT_AT_HEADER)
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


@dataclass
class Watch:
    """One execution holding its lock: what its later events need outside its request (the
    renewer thread has none): task id, node name, span; and since when it holds the lock."""

    task_id: str | None
    hostname: str | None
    span: Any = None
    since: float = field(default_factory=time.monotonic)
    #: Whether this process sent events when the execution took its lock.
    events: bool = False

    @classmethod
    def of(cls, task: Task[Any, Any], task_id: str | None) -> Watch:
        # The node name is for the events alone (none is sent while they are off).
        events = sends_events(task.app)
        hostname = _hostname(task) if events else None
        return cls(task_id, hostname, spans.current(), events=events)


def emit(
    task: Task[Any, Any],
    outcome: str,
    key: str,
    *,
    task_id: str | None = None,
    holder: str | None = None,
    fence: int | None = None,
    wait: float | None = None,
    held: float | None = None,
    reason: str | None = None,
    watch: Watch | None = None,
    producer: bool = False,
    span_only: bool = False,
) -> None:
    """Tell ``outcome`` of an execution (or, ``producer``, of a send) of ``task``: on its span,
    and (unless ``span_only``) as a Celery event. Never raises."""
    try:
        span = watch.span if watch is not None else (None if producer else spans.current())
        if span is None:
            pass  # nothing records: no attributes to build
        elif outcome == "lease_lost":
            spans.add_event(span, outcome, {"key": key, "fence": fence, "reason": reason})
        else:
            attributes: dict[str, object] = {"key": key, "fence": fence, "holder": holder}
            attributes.update(wait=wait, held=held)
            if outcome != "released":  # a run's span keeps "acquired"
                attributes["outcome"] = outcome
            spans.annotate(span, attributes)
        if span_only or not sends_events(task.app, producer=producer):
            return
        if task_id is None:
            task_id = watch.task_id if watch is not None else task.request.id
        if task_id is None:
            return  # a direct call has no task id to report under
        fields = {
            "name": task.name, "singletask_outcome": outcome, "singletask_key": key,
            "singletask_holder": holder, "singletask_fence": fence, "singletask_wait": wait,
            "singletask_held": held, "singletask_reason": reason,
        }  # fmt: skip
        hostname = watch.hostname if watch is not None else None
        hostname = hostname or (None if producer else _hostname(task))
        events.send(task.app, EVENT_PREFIX + outcome, hostname, {"uuid": str(task_id), **fields})
    except Exception:
        logger.warning(
            "singletask: could not tell the outcome %s of task %s", outcome,
            task.name, exc_info=True,
        )  # fmt: skip


def heard(task: Task[Any, Any]) -> bool:
    """Whether an outcome of an execution of ``task`` would be told at all: a span records in
    this thread, or this process sends events (else there is nothing to build for it)."""
    return spans.current() is not None or sends_events(task.app)


def conflict(
    task: Task[Any, Any], key: str, holder: str | None, action: str, *, rated: bool
) -> None:
    """Tell the outcome of a ``lock_conflict`` ``action`` (a refusal by ``lock_rate`` if
    ``rated``), if it has one."""
    outcome = "rate_limited" if rated else CONFLICT_OUTCOMES.get(action)
    if outcome is not None:
        emit(task, outcome, key, holder=holder, reason=action if rated else None)


def acquired(task: Task[Any, Any], watch: Watch, handle: LockHandle) -> None:
    """The execution holds its lock: ``acquired``, with its wait since its first send."""
    watch.since = time.monotonic()
    if watch.span is None and not watch.events:
        return  # nothing records and no event is sent: nothing to tell
    sent = first_sent(task.request)
    wait = None if sent is None else round(max(0.0, time.time() - sent), 6)
    emit(task, "acquired", handle.key, fence=handle.fence, wait=wait, watch=watch)


def released(task: Task[Any, Any], watch: Watch, handle: LockHandle) -> None:
    """The execution's hold ended (released, or reserved for its retry): ``released``."""
    if watch.span is None and not watch.events:
        return  # nothing records and no event is sent: nothing to tell
    held = round(time.monotonic() - watch.since, 6)
    emit(task, "released", handle.key, fence=handle.fence, held=held, watch=watch)


def lease_lost(task: Task[Any, Any], watch: Watch, handle: LockHandle, reason: str) -> None:
    """Called (from the renewer thread) when a running execution's lock is lost."""
    logger.error(
        "Task %s[%s]: lock %r lost while the task runs: %s. Another execution may start; "
        "self.lock.check() now raises LockLost",
        task.name, handle.task_id, handle.key, reason,
    )  # fmt: skip
    lock_lost.send(sender=task, key=handle.key, task_id=handle.task_id, reason=reason)
    # A takeover under "replace" is reported once, as the execution's "preempted" at its end;
    # as "lease_lost" it would count (and alert) every ordinary takeover as a fault. Its span
    # still records the moment as an event.
    emit(
        task, "lease_lost", handle.key, fence=handle.fence, reason=reason, watch=watch,
        span_only=handle.preempted,
    )  # fmt: skip


def _hostname(task: Task[Any, Any]) -> str | None:
    """The worker's node name, as its own task events carry it."""
    worker = task.app.__dict__.get(_WORKER)
    return task.request.hostname or (worker[1] if worker else None)
