"""The Celery app the end-to-end workers run (``celery -A tests.e2e.app worker``).

Both sides build it with :func:`make_app`: the worker subprocess from environment variables, the
test process from the same values. Task modules use ``@shared_task`` so that every app built here
has them; tests look tasks up by name (``app.tasks["e2e.basic.sleep"]``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from celery import Celery
from kombu import Exchange, Queue

#: The task modules every e2e worker imports. Each test module's tasks live in its own module.
TASK_MODULES = [
    "tests.e2e.tasks_basic",
    "tests.e2e.tasks_endings",
    "tests.e2e.tasks_policies",
    "tests.e2e.tasks_faults",
    "tests.e2e.tasks_scopes",
    "tests.e2e.tasks_ops",
    "tests.e2e.tasks_pools",
    "tests.e2e.tasks_limits",
    "tests.e2e.tasks_handoffs",
    "tests.e2e.tasks_replace",
    "tests.e2e.tasks_shared",
    "tests.e2e.tasks_turns",
]


def e2e_limits(name: str) -> dict[str, Any] | None:
    """The app's named limits (``singletask_limits``): per test label, by the name's kind
    (tests/e2e/tasks_shared.py)."""
    if name.startswith("{e2e}-db:"):
        return {"concurrency": 3}
    if name.startswith("{e2e}-tokens:"):
        return {"rate": "10/2s"}
    if name.startswith("{e2e}-turns:"):  # tests/e2e/tasks_turns.py
        return {"concurrency": 2}
    return None


#: Optional: a JSON object merged into ``broker_transport_options`` (e.g. a short
#: ``visibility_timeout`` for the redelivery tests of test_faults.py).
TRANSPORT_ENV = "SINGLETASK_E2E_TRANSPORT"

#: Optional: a JSON object, the lock store's ``singletask_backend_transport_options``.
LOCK_OPTIONS_ENV = "SINGLETASK_E2E_LOCK_OPTIONS"

#: Optional: ``"0"`` turns fair turns off (``singletask_limit_turns = False``), as
#: test_fair_turns.py compares.
TURNS_ENV = "SINGLETASK_E2E_LIMIT_TURNS"


def make_app(
    *,
    broker: str,
    results: str,
    locks: str,
    queue: str,
    transport_options: Mapping[str, Any] | None = None,
    lock_options: Mapping[str, Any] | None = None,
    limit_turns: bool = True,
) -> Celery:
    app = Celery("e2e", broker=broker, backend=results, include=TASK_MODULES)
    exchange = Exchange(queue, type="direct", durable=False, auto_delete=True)
    app.conf.update(
        singletask_backend_url=locks,
        singletask_backend_transport_options=dict(lock_options or {}),
        singletask_limits=e2e_limits,
        singletask_limit_turns=limit_turns,
        task_queues=[Queue(queue, exchange, routing_key=queue, durable=False, auto_delete=True)],
        task_default_queue=queue,
        task_default_exchange=queue,
        task_default_routing_key=queue,
        worker_prefetch_multiplier=1,
        result_expires=600,
        broker_connection_retry_on_startup=True,
        # Room for the green pools' 20 greenlets publishing at once (kombu's Redis transport
        # allows 10 connections by default; docs/pools.rst, "Broker connections").
        broker_transport_options={
            "visibility_timeout": 60,
            "max_connections": 64,
            **(transport_options or {}),
        },
        worker_hijack_root_logger=True,
        worker_redirect_stdouts=False,
    )
    return app


def _from_env() -> Celery | None:
    try:
        return make_app(
            broker=os.environ["SINGLETASK_E2E_BROKER"],
            results=os.environ["SINGLETASK_E2E_RESULTS"],
            locks=os.environ["SINGLETASK_E2E_LOCKS"],
            queue=os.environ["SINGLETASK_E2E_QUEUE"],
            transport_options=json.loads(os.environ.get(TRANSPORT_ENV) or "{}"),
            lock_options=json.loads(os.environ.get(LOCK_OPTIONS_ENV) or "{}"),
            limit_turns=os.environ.get(TURNS_ENV, "1") != "0",
        )
    except KeyError:
        return None


#: Set in worker subprocesses (which get the environment variables); None in the test process.
app = _from_env()
