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


def call_partner(self: SingletonTask, label: str) -> str:
    """A call to a partner with a quota: its starts are what the rate bounds."""
    with probe().running(label, self.request.id):
        pass
    return str(self.request.id)


def rebuild(self: SingletonTask, label: str, version: int) -> int:
    """A rebuild that only the latest of a burst of sends should run."""
    with probe().running(label, self.request.id, version=version):
        pass
    return version


#: The tasks of this module, each with the store feature it needs, and its options.
TASKS: list[tuple[Any, str, dict[str, Any]]] = [
    (export, "supports_limit", {"lock_limit": 2, "lock_args": ("label",)}),
    (
        call_partner, "supports_rate",
        {"lock_rate": "5/s", "lock_args": ("label",), "lock_policy": "retry",
         "lock_retry_max": 200, "name": PREFIX + "call_partner_retry"},
    ),
    (
        call_partner, "supports_rate",
        {"lock_rate": "1/m", "lock_limit": 5, "lock_args": ("label",),
         "name": PREFIX + "call_partner_skip"},
    ),
    (rebuild, "supports_debounce", {"lock_debounce": 1.0, "lock_args": ("label",)}),
    (
        rebuild, "supports_debounce",
        {"lock_debounce": 1.0, "lock_debounce_max": 2.0, "lock_args": ("label",),
         "name": PREFIX + "rebuild_bounded"},
    ),
    (
        rebuild, "supports_debounce",
        {"lock_debounce": 1.5, "lock_debounce_max": 3.0, "lock_args": ("label",),
         "name": PREFIX + "rebuild_slow"},
    ),
]  # fmt: skip


@connect_on_app_finalize
def _register(app: Celery) -> None:
    """Like ``shared_task``, but only on apps whose lock store has what each task needs: on
    the others (memcached) binding the task is refused, which would stop their workers."""
    url = app.conf.get("singletask_backend_url")
    store = backend_class(url) if url else None
    for body, feature, options in TASKS:
        if store is not None and getattr(store, feature):
            name = options.get("name", PREFIX + body.__name__)
            # shared=False: a shared task would be bound to every app made later, whatever
            # its store.
            app.task(
                base=SingletonTask, bind=True, shared=False, lock_ttl=TTL,
                **{**options, "name": name},
            )(body)  # fmt: skip


for _app in _get_active_apps():  # apps finalized before this module was imported (a worker's)
    if _app.finalized:
        _register(_app)
