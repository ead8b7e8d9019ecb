"""Tasks of tests/e2e/test_limits.py: ``lock_limit`` on a real worker.

Each body runs inside ``probe().running(label, ...)`` and, asked to ``hold``, blocks on the gate
of tasks_policies.py until the test opens it, so a holder stays exactly as long as a test needs.
"""

from __future__ import annotations

from typing import Any

from celery import shared_task

from singletask import SingletonTask

from .probe import probe
from .tasks_policies import wait_gate

PREFIX = "e2e.limits."

#: Lease of every lock here: far above any body, short enough that a failed test's leftover
#: lock cannot outlive the session.
TTL = 30


@shared_task(
    base=SingletonTask, name=PREFIX + "export", bind=True, lock_limit=2, lock_args=("label",),
    lock_ttl=TTL,
)  # fmt: skip
def export(self: SingletonTask, label: str, hold: bool = False) -> dict[str, Any]:
    """Two exports per label at a time; the default policy (skip) for the third."""
    assert self.lock is not None
    with probe().running(label, self.request.id, slot_key=self.lock.key, fence=self.lock.fence):
        if hold:
            wait_gate(label)
    return {"key": self.lock.key, "fence": self.lock.fence}
