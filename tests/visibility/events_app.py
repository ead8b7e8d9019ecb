"""The Celery app of the events tests' worker (``celery -A tests.visibility.events_app worker``).

The worker subprocess builds it from environment variables, the test process from the same values
(:func:`make_app`). A body asked to ``hold`` blocks until the test opens its *gate* (a Redis list
in the probe database), calling ``self.lock.check()`` meanwhile, so that a holder stays exactly
as long as a test needs and a preempted one learns it.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery

from singletask import SingletonTask

PREFIX = "events."

#: Environment variables the worker reads its app from.
BROKER_ENV, RESULTS_ENV, LOCKS_ENV, GATES_ENV, QUEUE_ENV = (
    "SINGLETASK_VIS_BROKER", "SINGLETASK_VIS_RESULTS", "SINGLETASK_VIS_LOCKS",
    "SINGLETASK_VIS_GATES", "SINGLETASK_VIS_QUEUE",
)  # fmt: skip

#: How long a held body waits for its gate at most (a failed test forgot to open it).
GATE_TIMEOUT = 30.0


def make_app(*, broker: str, results: str, locks: str, queue: str) -> Celery:
    """The app, its tasks (:data:`TASKS`) on ``queue`` (a queue of the session's own). The tasks
    are the app's own, not shared tasks: other apps of the test process never see them."""
    app = Celery("vis", broker=broker, backend=results)
    app.conf.update(
        singletask_backend_url=locks,
        task_default_queue=queue,
        worker_prefetch_multiplier=1,
        result_expires=600,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=True,
        worker_redirect_stdouts=False,
    )
    for name, options in TASKS.items():
        app.task(base=SingletonTask, name=PREFIX + name, bind=True, **options)(_body)
    return app


def gate_key(label: str) -> str:
    return f"vis-gate:{label}"


def _hold(task: SingletonTask, label: str) -> None:
    """Wait for the gate of ``label``, checking the lock every 0.1 s (raises once it is lost)."""
    gates = redis.Redis.from_url(os.environ[GATES_ENV])
    try:
        deadline = time.monotonic() + GATE_TIMEOUT
        while gates.lpop(gate_key(label)) is None:
            assert task.lock is not None
            task.lock.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"gate {label!r} not opened within {GATE_TIMEOUT}s")
            time.sleep(0.1)
    finally:
        gates.close()


def _body(self: SingletonTask, label: str, hold: bool = False) -> str:
    """Every task's body (one function, so that apps built again register the same callable)."""
    if hold:
        _hold(self, label)
    return f"did the work of {label}"


KEY = {"lock_key": "{label}"}

#: The tasks, by name (``events.<name>``), with their singletask options.
TASKS: dict[str, dict[str, Any]] = {
    "skip": {"lock_policy": "skip", **KEY},
    "refuse": {"lock_policy": "raise", **KEY},
    "retry": {"lock_policy": "retry", "lock_retry_countdown": 0.5, "lock_retry_max": 100, **KEY},
    "debounce": {"lock_debounce": 1.0, **KEY},
    "replace": {"lock_policy": "replace", "lock_ttl": 1.5, **KEY},
    "rated": {"lock_rate": "1/m", **KEY},
    "dedupe": {"lock_scope": "queue", **KEY},
}


def _from_env() -> Celery | None:
    try:
        return make_app(
            broker=os.environ[BROKER_ENV],
            results=os.environ[RESULTS_ENV],
            locks=os.environ[LOCKS_ENV],
            queue=os.environ[QUEUE_ENV],
        )
    except KeyError:
        return None


#: Set in the worker and Flower subprocesses; None in the test process.
app = _from_env()
