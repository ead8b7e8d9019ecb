"""The demo's singleton tasks, one per scenario of the write-ups singletask grew from.

Each body pretends to work for ``duration`` seconds and appends ``start`` and ``end`` events to
the run's event log. ``start`` is written after the lock was taken and ``end`` before it is
released, so two runs of one lock key overlap in the log only if they overlapped for real.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from ..backends import backend_class
from ..exceptions import SingletaskError
from ..task import SingletonTask
from .app import app
from .events import EventLog
from .local import FOLDER_SETTING
from .scenarios import PARTNER_RATE, REPLACE_TTL

__all__ = [
    "call_partner", "export_report", "import_feed", "nightly_report", "rebuild_index",
    "refresh_dashboard", "send_invoices", "sync_customer",
]  # fmt: skip


def work(task: SingletonTask, duration: float, checked: bool = False) -> dict[str, Any]:
    """Hold the lock for ``duration`` seconds; return who ran, when, and on which attempt.

    ``checked``: work in steps of 20 ms and check the lock before each, so that a run a newer
    one replaced (``lock_policy = "replace"``) stops at once, raising ``LockPreempted``."""
    lock = task.lock
    folder = task.app.conf.get(FOLDER_SETTING)
    log = EventLog(Path(folder) / "events.jsonl") if folder else None
    fields = {"task_id": task.request.id, "task": task.name, "key": lock.key if lock else None}
    started = time.time()
    if log is not None:
        log.record("start", **fields, fence=lock.fence if lock else None)
    try:
        if checked and lock is not None:
            deadline = time.monotonic() + duration
            while time.monotonic() < deadline:
                lock.check()
                time.sleep(min(0.02, max(0.0, deadline - time.monotonic())))
        else:
            time.sleep(duration)
    finally:
        if log is not None:
            log.record("end", **fields)
    return {
        "pid": os.getpid(),
        "started": started,
        "finished": time.time(),
        # Lock retries have a budget of their own: the task's retry count stays 0.
        "retries": task.request.retries,
    }


# A global singleton: one lock for the task. A duplicate is skipped (the default policy).
@app.task(base=SingletonTask, bind=True, name="demo.nightly_report")
def nightly_report(self: SingletonTask, duration: float) -> dict[str, Any]:
    return work(self, duration)


# One lock per customer: customers sync side by side, one customer never twice at once.
@app.task(base=SingletonTask, bind=True, name="demo.sync_customer", lock_args=("customer_id",))
def sync_customer(self: SingletonTask, customer_id: int, duration: float) -> dict[str, Any]:
    return work(self, duration)


# One lock per customer; a duplicate waits its turn, sent again every ~0.3 s.
@app.task(
    base=SingletonTask,
    bind=True,
    name="demo.send_invoices",
    lock_args=("customer_id",),
    lock_policy="retry",
    lock_retry_countdown=0.3,
    lock_retry_max=200,
)
def send_invoices(self: SingletonTask, customer_id: int, duration: float) -> dict[str, Any]:
    return work(self, duration)


# The Celery cookbook's feed importer: one import per feed URL, with a readable key
# ("singletask:demo.import_feed:feed:<url>"). A duplicate fails with TaskLocked.
@app.task(
    base=SingletonTask, bind=True, name="demo.import_feed", lock_key="feed:{url}",
    lock_policy="raise",
)  # fmt: skip
def import_feed(self: SingletonTask, url: str, duration: float) -> dict[str, Any]:
    return work(self, duration)


# A periodic task whose run can outlast its period: ticks that come while it runs are skipped.
@app.task(base=SingletonTask, bind=True, name="demo.refresh_dashboard")
def refresh_dashboard(self: SingletonTask, duration: float) -> dict[str, Any]:
    return work(self, duration)


def store_keeps(feature: str) -> bool:
    """Whether the app's lock store has ``feature`` (``"supports_rate"``, ...). The tasks that
    need a feature are defined only then: a task the store cannot serve would stop the worker
    (the demo leaves its scenario out and says why). True when the store is not known yet."""
    url = app.conf.get("singletask_backend_url")
    try:
        return not url or bool(getattr(backend_class(url), feature))
    except (SingletaskError, ImportError):
        return True  # the task's own check says what is wrong


# Up to two exports per customer at once (the customer's API takes two connections); a third
# waits its turn, sent again every ~0.3 s.
if store_keeps("supports_limit"):

    @app.task(
        base=SingletonTask,
        bind=True,
        name="demo.export_report",
        lock_args=("customer_id",),
        lock_limit=2,
        lock_policy="retry",
        lock_retry_countdown=0.3,
        lock_retry_max=200,
    )
    def export_report(self: SingletonTask, customer_id: int, duration: float) -> dict[str, Any]:
        return work(self, duration)


# A partner's API, at most PARTNER_RATE calls fleet-wide: starts are spaced evenly; a call over
# the rate is sent again when its turn comes. Up to 3 calls may be in flight at once, so that
# only the rate makes a call wait.
if store_keeps("supports_rate"):

    @app.task(
        base=SingletonTask,
        bind=True,
        name="demo.call_partner",
        lock_args=("partner",),
        lock_rate=PARTNER_RATE,
        lock_limit=3,
        lock_policy="retry",
        lock_retry_max=200,
    )
    def call_partner(self: SingletonTask, partner: str, duration: float) -> dict[str, Any]:
        return work(self, duration)


# A search index whose newer rebuild makes the running one worthless: the newer rebuild takes the
# lock over at once, and the one it replaces stops at its next check of the lock.
if store_keeps("supports_replace"):

    @app.task(
        base=SingletonTask,
        bind=True,
        name="demo.rebuild_index",
        lock_args=("index",),
        lock_policy="replace",
        lock_ttl=REPLACE_TTL,
    )
    def rebuild_index(
        self: SingletonTask, index: str, version: int, duration: float
    ) -> dict[str, Any]:
        return work(self, duration, checked=True)
