"""Tasks of tests/e2e/test_handoffs.py: what an execution that ends without its body leaves
for the sends after it (issue 29, "every send accounted for").

Each body runs inside ``probe().running(label, ...)``; a body that retries itself marks
``"retrying"`` in the probe first, so that a test can act during the retry's countdown.
Registered only on apps whose lock store keeps rates and debounce windows (as in
tasks_limits.py): binding them to a memcached store is refused, which would stop its workers.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery._state import _get_active_apps, connect_on_app_finalize

from singletask import SingletonTask
from singletask.backends import backend_class

from .probe import probe

PREFIX = "e2e.handoffs."

#: Lease of every lock here: far above any body, short enough that a failed test's leftover
#: lock cannot outlive the session.
TTL = 30

#: How long a queued message keeps its key reserved: long enough that a reservation left behind
#: would still stand when the test looks.
QUEUE_TTL = 30


def note(self: SingletonTask, label: str, note: str = "") -> str:
    """Records its start and returns ``note``."""
    with probe().running(label, self.request.id, note=note):
        pass
    return note


def retrying(self: SingletonTask, label: str, countdown: float = 0.2) -> dict[str, Any]:
    """Its first attempt retries itself after ``countdown`` seconds; the retry returns."""
    retries = int(self.request.retries or 0)
    with probe().running(label, self.request.id, retries=retries):
        pass
    if retries == 0:
        probe().mark(label, "retrying", self.request.id)
        raise self.retry(countdown=countdown)
    return {"task_id": self.request.id, "retries": retries}


def versioned(self: SingletonTask, label: str, version: int, countdown: float = 0.0) -> int:
    """Returns ``version``; with a ``countdown``, its first attempt retries itself first."""
    retries = int(self.request.retries or 0)
    with probe().running(label, self.request.id, version=version, retries=retries):
        pass
    if countdown and retries == 0:
        probe().mark(label, "retrying", self.request.id, version=version)
        raise self.retry(countdown=countdown)
    return version


QUEUED = {"lock_queue_ttl": QUEUE_TTL, "lock_rate": "1/s"}

#: The tasks of this module, each with the store feature it needs, and its options.
TASKS: list[tuple[Any, str, dict[str, Any]]] = [
    (note, "supports_rate", {**QUEUED, "lock_scope": "queue", "name": PREFIX + "queued_skip"}),
    (
        note, "supports_rate",
        {**QUEUED, "lock_scope": "queue", "lock_policy": "raise",
         "name": PREFIX + "queued_raise"},
    ),
    (
        note, "supports_rate",
        {**QUEUED, "lock_scope": "coalesce", "name": PREFIX + "coalesced_skip"},
    ),
    (retrying, "supports_rate", {"lock_rate": "1/s", "max_retries": 1}),
    (
        retrying, "supports_rate",
        {"lock_rate": "1/s", "lock_limit": 2, "max_retries": 1,
         "name": PREFIX + "retrying_limited"},
    ),
    (versioned, "supports_debounce", {"lock_debounce": 1.0, "max_retries": 1}),
    # A window longer than a slow store's reply plus a retry's countdown (test_store_errors.py)
    (
        versioned, "supports_debounce",
        {"lock_debounce": 3.0, "max_retries": 1, "name": PREFIX + "versioned_long_window"},
    ),
]  # fmt: skip


@connect_on_app_finalize
def _register(app: Celery) -> None:
    """Like ``shared_task``, but only on apps whose lock store has what each task needs."""
    url = app.conf.get("singletask_backend_url")
    store = backend_class(url) if url else None
    for body, feature, options in TASKS:
        if store is not None and getattr(store, feature):
            name = options.get("name", PREFIX + body.__name__)
            app.task(
                base=SingletonTask, bind=True, shared=False, lock_ttl=TTL,
                lock_args=("label",), **{**options, "name": name},
            )(body)  # fmt: skip


for _app in _get_active_apps():  # apps finalized before this module was imported (a worker's)
    if _app.finalized:
        _register(_app)
