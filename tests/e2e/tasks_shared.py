"""Tasks of tests/e2e/test_named_limits.py: named limits shared by two task types, on a real
worker.

The app's ``singletask_limits`` is :func:`tests.e2e.app.e2e_limits`, a callable: each test's
limits are named after its probe label (``"{e2e}-db:<label>"``), so tests never share one.
Every body records its start and end with the units it took, under the test's label.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from celery import Celery
from celery._state import _get_active_apps, connect_on_app_finalize

from singletask import SingletonTask
from singletask.backends import backend_class

from .probe import probe
from .tasks_policies import wait_gate

PREFIX = "e2e.shared."

#: Lease of the units and keys here: far above any body.
TTL = 30


def cost(args: Sequence[Any], kwargs: Mapping[str, Any]) -> int:
    """The units a send asks for: its ``cost`` keyword (1 when none)."""
    return int(kwargs.get("cost", 1))


def estimate(args: Sequence[Any], kwargs: Mapping[str, Any]) -> int:
    """The estimated tokens of a call: its ``estimate`` keyword."""
    return int(kwargs["estimate"])


def query(
    self: SingletonTask, label: str, cost: int = 1, pause: float = 0.0, hold: bool = False
) -> int:
    """A heavy query: takes ``cost`` units of the label's database limit."""
    with probe().running(label, self.request.id, units=cost, task=self.name):
        if hold:
            wait_gate(label)
        time.sleep(pause)
    return cost


def complete(self: SingletonTask, label: str, estimate: int, used: int) -> int:
    """A model call: estimated at ``estimate`` tokens, charged ``used`` once it returns."""
    with probe().running(label, self.request.id, units=estimate, task=self.name):
        assert self.lock is not None
        self.lock.charge(f"{{e2e}}-tokens:{label}", used)
    return used


_QUERY = {"lock_limits": {"{e2e}-db:{label}": cost}, "lock_policy": "retry",
          "lock_retry_countdown": 0.1, "lock_retry_max": 500}  # fmt: skip

#: The tasks of this module: two task types sharing the database limit, one that skips, and
#: the model call.
TASKS: list[tuple[Any, dict[str, Any]]] = [
    (query, {**_QUERY, "name": PREFIX + "report"}),
    (query, {**_QUERY, "name": PREFIX + "export"}),
    (query, {**_QUERY, "lock_policy": "skip", "name": PREFIX + "report_skip"}),
    (complete, {"lock_limits": {"{e2e}-tokens:{label}": estimate}, "lock_policy": "retry",
                "lock_retry_countdown": 0.1, "lock_retry_max": 500,
                "name": PREFIX + "complete"}),
    (complete, {"lock_limits": {"{e2e}-tokens:{label}": estimate}, "lock_policy": "skip",
                "name": PREFIX + "complete_skip"}),
]  # fmt: skip


def register_where_units(tasks: Sequence[tuple[Any, dict[str, Any]]], ttl: float) -> None:
    """Register ``tasks`` (body, options) on every app whose lock store keeps named limits
    (memcached refuses them at bind): the apps finalized from now on, and those finalized
    before this module was imported (a worker's)."""

    def register(app: Celery) -> None:
        url = app.conf.get("singletask_backend_url")
        store = backend_class(url) if url else None
        if store is None or not store.supports_units:
            return
        for body, options in tasks:
            app.task(base=SingletonTask, bind=True, shared=False, lock_ttl=ttl, **options)(body)

    connect_on_app_finalize(register)
    for app in _get_active_apps():
        if app.finalized:
            register(app)


register_where_units(TASKS, TTL)
