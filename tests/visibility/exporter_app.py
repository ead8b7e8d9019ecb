"""The Celery app of tests/visibility/test_exporter.py: its worker (``celery -A
tests.visibility.exporter_app worker -E``) and its exporter (``celery -A
tests.visibility.exporter_app singletask exporter``) build it from environment variables; the
test process builds it with :func:`make_app` from the same values.
"""

from __future__ import annotations

import os
import time

from celery import Celery

from singletask import SingletonTask

#: The environment variables the subprocesses read: broker, lock store, key prefix, queue.
ENV = ("EXPORTER_TEST_BROKER", "EXPORTER_TEST_LOCKS", "EXPORTER_TEST_PREFIX", "EXPORTER_TEST_QUEUE")


def make_app(*, broker: str, locks: str, prefix: str, queue: str) -> Celery:
    app = Celery("exporter_app", broker=broker, set_as_current=False)
    app.conf.update(
        singletask_backend_url=locks,
        singletask_key_prefix=prefix,
        task_default_queue=queue,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=True,
        worker_redirect_stdouts=False,
        # as visibility.rst asks: the producer then stamps each send's time, for the wait
        worker_send_task_events=True,
    )

    @app.task(base=SingletonTask, name="exporter.hold", lock_key="{customer}", shared=False)
    def hold(customer: str, seconds: float) -> str:
        """One run per customer at a time; a duplicate is skipped. The customer is in the key."""
        time.sleep(seconds)
        return "done"

    @app.task(
        base=SingletonTask, name="exporter.queued", lock_key="{customer}", lock_scope="queue",
        shared=False,
    )  # fmt: skip
    def queued(customer: str) -> str:
        """Reserved from its send: a message waiting (countdown) shows as a reservation."""
        return "done"

    @app.task(
        base=SingletonTask, name="exporter.coalesced", lock_key="{customer}",
        lock_scope="coalesce", lock_retry_countdown=0.5, shared=False,
    )  # fmt: skip
    def coalesced(customer: str, seconds: float) -> str:
        """One run and one pending follow-up per customer: a call during a run claims it."""
        time.sleep(seconds)
        return "done"

    @app.task(
        base=SingletonTask, name="exporter.debounced", lock_key="{customer}", lock_debounce=3,
        shared=False,
    )  # fmt: skip
    def debounced(customer: str) -> str:
        """Runs 3 s after the last of a burst of sends: its window is open until then."""
        return "done"

    return app


def _from_env() -> Celery | None:
    values = [os.environ.get(name) for name in ENV]
    if not all(values):
        return None
    broker, locks, prefix, queue = (str(value) for value in values)
    return make_app(broker=broker, locks=locks, prefix=prefix, queue=queue)


#: Set in the subprocesses (which get the environment variables); None in the test process.
app = _from_env()
