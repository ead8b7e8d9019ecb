"""Prometheus metrics from singletask's signals: acquisitions, skips, retries, raises, lost leases
and operator releases, counted on a real prefork worker and scraped from its exporter.

    python examples/prometheus_metrics.py             # needs prometheus_client, no server
    python examples/prometheus_metrics.py --redis-url redis://localhost:6379/0

The recipe is the first half of this file (``install`` and ``serve``): copy it into your project
and call ``install()`` where your Celery app is defined, so that the worker, its pool processes
and ``celery -A proj singletask release`` all count. docs/metrics.rst explains it, with the
prefork multiprocess mode of prometheus_client that pool processes need.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import tempfile
import time
import urllib.request
from typing import Any

if __name__ == "__main__" and "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
    # The demonstration below: a fresh multiprocess folder and a free port for the worker's
    # exporter, inherited by the worker it starts. Set before prometheus_client is imported.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="singletask-metrics-")
    atexit.register(shutil.rmtree, os.environ["PROMETHEUS_MULTIPROC_DIR"], ignore_errors=True)
    with socket.socket() as _sock:
        _sock.bind(("127.0.0.1", 0))
        os.environ["SINGLETASK_METRICS_PORT"] = str(_sock.getsockname()[1])

from celery import Celery, signals
from prometheus_client import REGISTRY, CollectorRegistry, Counter, multiprocess, start_http_server

from singletask import SingletonTask, TaskLocked
from singletask.signals import (
    lock_acquired,
    lock_conflict,
    lock_lost,
    lock_released_by_operator,
)

# -- the recipe ---------------------------------------------------------------------------------

ACQUIRED = Counter(
    "singletask_lock_acquired", "Executions that took their lock and ran their body", ["task"]
)
CONFLICTS = Counter(
    "singletask_lock_conflicts",
    "Executions (or sends) that found their lock held, by what they did: skip, retry, raise, "
    "defer, drop, follow (executions); dedupe, raise, follow, join (sends)",
    ["task", "action"],
)
LOST = Counter(
    "singletask_lock_lost",
    "Running executions whose lock was lost (lease ran out or taken)",
    ["task"],
)
RELEASED_BY_OPERATOR = Counter(
    "singletask_lock_released_by_operator",
    "Locks released with `singletask release` (forced: --force, else --holder)",
    ["task", "forced"],
)


def _task_name(sender: Any) -> str:
    return str(getattr(sender, "name", None) or "unknown")


def _acquired(sender: Any = None, **_: Any) -> None:
    ACQUIRED.labels(task=_task_name(sender)).inc()


def _conflict(sender: Any = None, action: str = "unknown", **_: Any) -> None:
    CONFLICTS.labels(task=_task_name(sender), action=action).inc()


def _lost(sender: Any = None, **_: Any) -> None:
    LOST.labels(task=_task_name(sender)).inc()


def _released(task: str | None = None, forced: bool = False, **_: Any) -> None:
    RELEASED_BY_OPERATOR.labels(task=task or "unknown", forced=str(forced).lower()).inc()


def install() -> None:
    """Count singletask's signals in this process (idempotent)."""
    lock_acquired.connect(_acquired, weak=False, dispatch_uid="metrics.acquired")
    lock_conflict.connect(_conflict, weak=False, dispatch_uid="metrics.conflict")
    lock_lost.connect(_lost, weak=False, dispatch_uid="metrics.lost")
    lock_released_by_operator.connect(_released, weak=False, dispatch_uid="metrics.released")
    signals.worker_ready.connect(_serve_from_worker, weak=False, dispatch_uid="metrics.serve")


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Serve /metrics on ``port``; with PROMETHEUS_MULTIPROC_DIR, the sum over all processes."""
    registry = REGISTRY
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    start_http_server(port, addr=addr, registry=registry)


def _serve_from_worker(**_: Any) -> None:
    """In the worker's main process (worker_ready), when SINGLETASK_METRICS_PORT is set."""
    port = os.environ.get("SINGLETASK_METRICS_PORT")
    if port:
        serve(int(port), addr="127.0.0.1")


# -- the example --------------------------------------------------------------------------------

from singletask.demo.example import configure, run_example  # noqa: E402

app = Celery("prometheus_metrics")
configure(app)  # broker, results and locks: the embedded ones, or the --redis-url database
install()


@app.task(base=SingletonTask)
def report() -> str:
    time.sleep(1.5)
    return "done"


@app.task(base=SingletonTask, lock_policy="raise")
def export() -> str:
    time.sleep(1.5)
    return "done"


@app.task(base=SingletonTask, lock_policy="retry", lock_retry_countdown=0.5)
def reindex() -> str:
    time.sleep(1.5)
    return "done"


@app.task(base=SingletonTask, bind=True, lock_ttl=1.5)
def long_job(self: SingletonTask) -> str:
    """Runs until its lock is lost (here: released by the operator), for at most 30 s."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert self.lock is not None
        if self.lock.lost:
            return "stopped: lock lost"
        time.sleep(0.1)
    return "done"


def wait_until_held(task: SingletonTask) -> str:
    """Wait until a run of ``task`` holds its lock; return the key."""
    key = task.lock_key_for()
    while task.lock_backend.holder(key) is None:
        time.sleep(0.05)
    return key


def main() -> None:
    from singletask.ops.inventory import release_lock

    # For each task, one run holds the lock while duplicates arrive on the other pool
    # processes: two reports are skipped, an export raises, a reindex retries until it can run.
    for task, duplicates in ((report, 2), (export, 1), (reindex, 1)):
        results = [task.delay()]
        wait_until_held(task)
        results += [task.delay() for _ in range(duplicates)]
        for result in results:
            with contextlib.suppress(TaskLocked):  # the export that found its lock held
                result.get(timeout=60)
    # A running job whose lock an operator releases by force (what `singletask release
    # KEY --force` does); its worker finds the lock gone at its next renewal.
    job = long_job.delay()
    key = wait_until_held(long_job)
    release_lock(long_job.lock_backend, key, holder=None)
    print(f"long_job: {job.get(timeout=60)}")
    time.sleep(0.5)

    url = f"http://127.0.0.1:{os.environ['SINGLETASK_METRICS_PORT']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    print(f"\n{url}:")
    for line in sorted(text.splitlines()):
        if line.startswith("singletask_") and "_total" in line:
            print(f"  {line}")


def _show(line: str) -> bool:
    return any(word in line for word in (" skipped: ", " raises TaskLocked", " retries in "))


if __name__ == "__main__":
    run_example(__file__, app, main, show_worker_log=_show)
