"""Tasks of test_scopes.py, test_beat.py and test_canvas.py: lock scopes, beat and canvas.

Every singleton here is locked per ``label`` (``lock_args=("label",)``), so each test has keys of
its own. Bodies run inside ``probe().running(label, ...)``; a body asked to ``hold`` blocks on the
gate of its label (a Redis list in the probe database) until the test opens it.

Lock conflicts decided in a worker are recorded in the probe (event ``"conflict"``) through the
``lock_conflict`` signal. Conflicts decided by a producer (``apply_async`` of a "queue" or
"coalesce" task) are not: a producer has no request to read the label from, so the tests
listen to the signal in their own process.
"""

from __future__ import annotations

import inspect
import time
from typing import Any

from celery import shared_task

from singletask import SingletonTask, Skipped
from singletask.signals import lock_conflict

from .probe import probe

PREFIX = "e2e.scopes."

#: Lease of every lock here: far above any body, short enough that a failed test's leftover
#: lock cannot outlive the session.
TTL = 30

#: How long a sent message keeps its key reserved before a worker starts it (plus any delay).
QUEUE_TTL = 30

#: How long a held body waits for its gate before giving up (a test failed to open it).
GATE_TIMEOUT = 25


def gate_key(label: str) -> str:
    return f"scopes-gate:{label}"


def wait_gate(label: str) -> None:
    """Block until the test opens the gate of ``label`` (one opening lets one body through)."""
    if probe().client.blpop([gate_key(label)], timeout=GATE_TIMEOUT) is None:
        raise TimeoutError(f"gate {label!r} was not opened within {GATE_TIMEOUT}s")


@lock_conflict.connect(weak=False)
def _record_conflict(
    sender: Any = None,
    key: str | None = None,
    holder: str | None = None,
    task_id: str | None = None,
    action: str | None = None,
    **_: Any,
) -> None:
    """Record each conflict a worker decides for a task of this module, under its label."""
    if not isinstance(sender, SingletonTask) or not sender.name.startswith(PREFIX):
        return
    request = sender.request
    if request.id is None or request.id != task_id:
        return  # decided by a producer, outside an execution of this task
    try:
        bound = inspect.signature(sender.run).bind(*(request.args or ()), **(request.kwargs or {}))
    except TypeError:
        return
    label = bound.arguments.get("label")
    if label:
        probe().mark(label, "conflict", task_id, action=action, holder=holder, key=key)


def _singleton(name: str, **options: Any) -> Any:
    """``shared_task`` for a singleton of this module, locked per label."""
    return shared_task(
        base=SingletonTask,
        name=PREFIX + name,
        bind=True,
        lock_args=("label",),
        lock_ttl=TTL,
        lock_queue_ttl=QUEUE_TTL,
        **options,
    )


# -- lock_scope "queue" --------------------------------------------------------------------


@_singleton("queued", lock_scope="queue")
def queued(self: SingletonTask, label: str, hold: bool = False, note: str = "") -> dict[str, Any]:
    """Deduplicated when sent (skip policy at execution time); returns its id and note."""
    with probe().running(label, self.request.id, note=note):
        if hold:
            wait_gate(label)
    return {"task_id": self.request.id, "note": note}


@_singleton("queued_raise", lock_scope="queue", lock_policy="raise")
def queued_raise(self: SingletonTask, label: str, hold: bool = False) -> str:
    """Deduplicated when sent; a duplicate's producer gets TaskLocked."""
    with probe().running(label, self.request.id):
        if hold:
            wait_gate(label)
    return str(self.request.id)


@_singleton("queued_retrying", lock_scope="queue", max_retries=1)
def queued_retrying(self: SingletonTask, label: str) -> dict[str, Any]:
    """Deduplicated when sent; its first attempt retries itself with a one second countdown."""
    retries = int(self.request.retries or 0)
    with probe().running(label, self.request.id, retries=retries):
        pass
    if retries == 0:
        probe().mark(label, "retrying", self.request.id)
        raise self.retry(countdown=1)
    return {"task_id": self.request.id, "retries": retries}


# -- lock_scope "coalesce" -----------------------------------------------------------------


@_singleton("coalesced", lock_scope="coalesce", lock_retry_countdown=0.2)
def coalesced(self: SingletonTask, label: str, tag: str = "", hold: bool = False) -> str:
    """One run plus one pending follow-up per label; ``tag`` is not part of the key."""
    with probe().running(label, self.request.id, tag=tag):
        if hold:
            wait_gate(label)
    return tag


# -- beat ----------------------------------------------------------------------------------


@_singleton("beat_skip")
def beat_skip(self: SingletonTask, label: str, seconds: float) -> str:
    """A periodic job that can outlast its period (execution scope, skip policy)."""
    with probe().running(label, self.request.id):
        time.sleep(seconds)
    return str(self.request.id)


@_singleton("beat_queue_raise", lock_scope="queue", lock_policy="raise")
def beat_queue_raise(self: SingletonTask, label: str, seconds: float) -> str:
    """The same, deduplicated when beat sends it: a tick meets TaskLocked inside beat."""
    with probe().running(label, self.request.id):
        time.sleep(seconds)
    return str(self.request.id)


# -- canvas --------------------------------------------------------------------------------


@_singleton("canvas_skip")
def canvas_skip(self: SingletonTask, label: str, hold: bool = False, tag: str = "ran") -> str:
    with probe().running(label, self.request.id, tag=tag):
        if hold:
            wait_gate(label)
    return tag


@_singleton("canvas_raise", lock_policy="raise")
def canvas_raise(self: SingletonTask, label: str, hold: bool = False, tag: str = "ran") -> str:
    with probe().running(label, self.request.id, tag=tag):
        if hold:
            wait_gate(label)
    return tag


@_singleton("canvas_retry", lock_policy="retry", lock_retry_countdown=0.2, lock_retry_max=200)
def canvas_retry(self: SingletonTask, label: str, hold: bool = False, tag: str = "ran") -> str:
    with probe().running(label, self.request.id, tag=tag):
        if hold:
            wait_gate(label)
    return tag


def describe(value: Any) -> Any:
    """A JSON-friendly account of a value a canvas part received: a Skipped names its holder."""
    if isinstance(value, Skipped):
        return {"skipped_by": value.holder}
    if isinstance(value, list | tuple):
        return [describe(item) for item in value]
    return value


@shared_task(name=PREFIX + "record", bind=True)
def record(self: Any, value: Any, label: str, step: str) -> dict[str, Any]:
    """A plain task (no lock) for canvas links: records and returns what it received."""
    got = describe(value)
    probe().mark(label, "record", self.request.id, step=step, got=got)
    return {"step": step, "got": got}


@shared_task(name=PREFIX + "on_error")
def on_error(request: Any, exc: BaseException, traceback: Any, label: str) -> None:
    """An errback: records which task failed, and with what.

    It takes ``(request, exc, traceback)``, so every Celery calls it that way. (With the old
    one-argument form, ``on_error(task_id, label)``, Celery before 5.7 counted the bound
    ``label`` as a parameter, called it with three arguments, and the call failed.)
    """
    probe().mark(label, "errback", request.id, error=type(exc).__name__)
