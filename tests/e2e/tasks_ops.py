"""Tasks of tests/e2e/test_operations.py: holders for the operator commands to list and release.

``e2e.ops.hold`` locks ``singletask:e2e.ops.hold:<label>:<name>`` with a 3 s lease (renewed every
second) and runs until the test sets its stop flag, or until it finds its lock lost: then it
records what it saw (``lost``, and whether ``self.lock.check()`` raised ``LockLost``) and returns.
"""

from __future__ import annotations

import time
from typing import Any

from celery import shared_task

import singletask.signals
from singletask import LockLost, SingletonTask

from .probe import probe

PREFIX = "e2e.ops."

#: Probe label under which every lock_lost signal of these tasks is recorded (tests filter by id).
LOST_LABEL = "e2e-ops-lock-lost"

#: The lease of the holders: a lost lock is noticed within a third of it (the renewal interval).
LEASE = 3.0


def stop_flag(label: str) -> str:
    return f"probe:{label}:stop"


@shared_task(
    base=SingletonTask, name="e2e.ops.hold", bind=True, lock_key="{label}:{name}", lock_ttl=LEASE
)
def hold(self: SingletonTask, label: str, name: str, seconds: float = 60.0) -> dict[str, Any]:
    """Hold the lock until the stop flag is set, ``seconds`` pass, or the lock is lost."""
    outcome: dict[str, Any] = {"lost": False, "raised": None}
    deadline = time.monotonic() + seconds
    with probe().running(label, self.request.id, name=name):
        while time.monotonic() < deadline and not probe().client.exists(stop_flag(label)):
            assert self.lock is not None
            if self.lock.lost:
                outcome["lost"] = True
                try:
                    self.lock.check()
                except LockLost as exc:
                    outcome["raised"] = type(exc).__name__
                break
            time.sleep(0.1)
    probe().mark(label, "outcome", self.request.id, name=name, **outcome)
    return outcome


@shared_task(base=SingletonTask, name="e2e.ops.other", bind=True, lock_key="{label}")
def other(self: SingletonTask, label: str) -> str:
    """Another task name, for the --task filter."""
    return "done"


def _record_lock_lost(
    sender: Any = None, key: str | None = None, task_id: str | None = None, **_: Any
) -> None:
    """Record each ``lock_lost`` signal of a task of this module (under LOST_LABEL)."""
    if isinstance(sender, SingletonTask) and sender.name.startswith(PREFIX):
        probe().mark(LOST_LABEL, "lock_lost", task_id, key=key)


singletask.signals.lock_lost.connect(_record_lock_lost, weak=False)
