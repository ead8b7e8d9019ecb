"""Tasks of tests/e2e/test_limits.py: ``lock_limit`` on a real worker.

Each body runs inside ``probe().running(label, ...)`` and, asked to ``hold``, blocks on the gate
of tasks_policies.py until the test opens it, so a holder stays exactly as long as a test needs.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery._state import _get_active_apps, connect_on_app_finalize

from singletask import SingletonTask
from singletask.backends import backend_class

from .probe import probe
from .tasks_policies import wait_gate

PREFIX = "e2e.limits."

#: Lease of every lock here: far above any body, short enough that a failed test's leftover
#: lock cannot outlive the session.
TTL = 30


def export(self: SingletonTask, label: str, hold: bool = False) -> dict[str, Any]:
    """Two exports per label at a time; the default policy (skip) for the third."""
    assert self.lock is not None
    with probe().running(label, self.request.id, slot_key=self.lock.key, fence=self.lock.fence):
        if hold:
            wait_gate(label)
    return {"key": self.lock.key, "fence": self.lock.fence}


@connect_on_app_finalize
def _register(app: Celery) -> None:
    """Like ``shared_task``, but only on apps whose lock store keeps holder slots: on the
    others (memcached) binding the task is refused, which would stop their workers."""
    url = app.conf.get("singletask_backend_url")
    if url and backend_class(url).supports_limit:
        app.task(
            base=SingletonTask, name=PREFIX + "export", bind=True, lock_limit=2,
            lock_args=("label",), lock_ttl=TTL,
        )(export)  # fmt: skip


for _app in _get_active_apps():  # apps finalized before this module was imported (a worker's)
    if _app.finalized:
        _register(_app)
