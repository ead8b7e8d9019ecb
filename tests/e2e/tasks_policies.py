"""Tasks of tests/e2e/test_policies.py: one per lock policy and per kind of lock key.

Every body runs inside ``probe().running(label, ...)``, so the tests can see who ran, when, and
how many ran at once. A body asked to ``hold`` blocks on a *gate* (a Redis list in the probe
database) until the test opens it, so a holder stays in place exactly as long as a test needs,
without sleeping for a guessed time.

Every lock conflict of these tasks is also recorded in the probe (event ``"conflict"``, with the
action taken and the deciding process id), through singletask's ``lock_conflict`` signal.
"""

from __future__ import annotations

import inspect
import time
from typing import Any

from celery import shared_task

from singletask import SingletonTask
from singletask.signals import lock_conflict

from .app import app as worker_app
from .probe import probe

PREFIX = "e2e.policies."

#: Lease of every lock here: far above any body, short enough that a failed test's leftover
#: lock cannot outlive the session.
TTL = 30

#: How long a held body waits for its gate before giving up (a test failed to open it).
GATE_TIMEOUT = 20


def gate_key(label: str) -> str:
    return f"gate:{label}"


def wait_gate(label: str) -> None:
    """Block until the test opens the gate of ``label`` (one opening lets one body through).

    It waits in BLPOPs of one second: a longer one would outlast redis-py's socket timeout.
    """
    deadline = time.monotonic() + GATE_TIMEOUT
    while probe().client.blpop([gate_key(label)], timeout=1) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {label!r} was not opened within {GATE_TIMEOUT}s")


@lock_conflict.connect(weak=False)
def _record_conflict(
    sender: Any = None,
    key: str | None = None,
    holder: str | None = None,
    ttl: float | None = None,
    task_id: str | None = None,
    action: str | None = None,
    **_: Any,
) -> None:
    """Record each conflict of a task of this module in the probe, under the call's label."""
    if not isinstance(sender, SingletonTask) or not sender.name.startswith(PREFIX):
        return
    request = sender.request
    try:
        bound = inspect.signature(sender.run).bind(*(request.args or ()), **(request.kwargs or {}))
    except TypeError:
        return
    label = bound.arguments.get("label")
    if label:
        probe().mark(label, "conflict", task_id, action=action, holder=holder, key=key, ttl=ttl)


# -- skip ----------------------------------------------------------------------------------


@shared_task(base=SingletonTask, name=PREFIX + "skip_none", bind=True, lock_ttl=TTL)
def skip_none(self: SingletonTask, label: str, hold: bool = False) -> None:
    """A global singleton (default policy: skip) whose body returns None."""
    with probe().running(label, self.request.id):
        if hold:
            wait_gate(label)


# -- retry ---------------------------------------------------------------------------------


@shared_task(
    base=SingletonTask,
    name=PREFIX + "retry_patient",
    bind=True,
    lock_policy="retry",
    lock_retry_countdown=0.3,
    lock_retry_max=30,
    lock_ttl=TTL,
    max_retries=0,
)
def retry_patient(self: SingletonTask, label: str, hold: bool = False) -> dict[str, Any]:
    """Retry policy on a task that may not retry at all by Celery's own count (max_retries=0)."""
    with probe().running(label, self.request.id):
        if hold:
            wait_gate(label)
    return {"retries": self.request.retries}


@shared_task(
    base=SingletonTask,
    name=PREFIX + "retry_body",
    bind=True,
    lock_policy="retry",
    lock_retry_countdown=0.3,
    lock_retry_max=30,
    lock_ttl=TTL,
    max_retries=1,
)
def retry_body(
    self: SingletonTask, label: str, hold: bool = False, body_retry: bool = False
) -> dict[str, Any]:
    """Retry policy on a task whose body retries once by itself (max_retries=1)."""
    with probe().running(label, self.request.id, retries=self.request.retries):
        if hold:
            wait_gate(label)
    if body_retry and self.request.retries == 0:
        raise self.retry(countdown=0.1)
    return {"retries": self.request.retries}


@shared_task(
    base=SingletonTask,
    name=PREFIX + "retry_short",
    bind=True,
    lock_policy="retry",
    lock_retry_countdown=0.3,
    lock_retry_max=2,
    lock_ttl=TTL,
    max_retries=1,
)
def retry_short(self: SingletonTask, label: str, hold: bool = False) -> str:
    """Retry policy with a budget of two lock retries."""
    with probe().running(label, self.request.id):
        if hold:
            wait_gate(label)
    return "done"


# -- raise ---------------------------------------------------------------------------------


@shared_task(
    base=SingletonTask, name=PREFIX + "raise_locked", bind=True, lock_policy="raise", lock_ttl=TTL
)
def raise_locked(self: SingletonTask, label: str, hold: bool = False) -> str:
    """A global singleton whose duplicates fail with TaskLocked."""
    with probe().running(label, self.request.id):
        if hold:
            wait_gate(label)
    return "done"


# -- per-argument keys ---------------------------------------------------------------------


@shared_task(
    base=SingletonTask,
    name=PREFIX + "sync_customer",
    bind=True,
    lock_args=("customer_id",),
    lock_ttl=TTL,
)
def sync_customer(
    self: SingletonTask, customer_id: int, full: bool = False, label: str = "", hold: bool = False
) -> str:
    """One run per customer at a time; ``full`` (and the test plumbing) is not part of the key.

    Counted under ``label`` (all customers) and ``<label>:<customer_id>`` (this customer).
    """
    with (
        probe().running(label, self.request.id, customer_id=customer_id),
        probe().running(f"{label}:{customer_id}", self.request.id),
    ):
        if hold:
            wait_gate(label)
    return f"synced {customer_id}"


@shared_task(base=SingletonTask, name=PREFIX + "merge", bind=True, lock_args="*", lock_ttl=TTL)
def merge(self: SingletonTask, label: str, items: list[int], options: dict[str, int]) -> str:
    """Locked on every argument; each run holds until the test opens the gate once for it."""
    with probe().running(label, self.request.id, items=items):
        wait_gate(label)
    return "merged"


class ImportFeed(SingletonTask):
    """A class-based task locked per feed URL by a ``lock_key`` template; duplicates raise."""

    name = PREFIX + "import_feed"
    lock_policy = "raise"
    lock_key = "feed:{url}"
    lock_ttl = TTL

    def run(self, url: str, label: str, hold: bool = False) -> str:
        with probe().running(label, self.request.id, url=url):
            if hold:
                wait_gate(label)
        return f"imported {url}"


# Class-based tasks are not registered by ``shared_task``: register this one with the worker's
# app (None in the test process, which reaches the task by name with ``send_task``).
if worker_app is not None:
    worker_app.register_task(ImportFeed())


# -- races ---------------------------------------------------------------------------------


@shared_task(base=SingletonTask, name=PREFIX + "race_skip", bind=True, lock_ttl=TTL)
def race_skip(self: SingletonTask, label: str, seconds: float) -> str:
    """A global singleton (skip) with a short body; returns its own task id when it ran."""
    with probe().running(label, self.request.id):
        time.sleep(seconds)
    return str(self.request.id)


@shared_task(
    base=SingletonTask,
    name=PREFIX + "race_retry",
    bind=True,
    lock_policy="retry",
    lock_retry_countdown=0.1,
    lock_retry_max=1000,
    lock_ttl=TTL,
)
def race_retry(self: SingletonTask, label: str, index: int, seconds: float) -> int:
    """A global singleton (retry) with a short body; returns its index."""
    with probe().running(label, self.request.id, index=index):
        time.sleep(seconds)
    return index
