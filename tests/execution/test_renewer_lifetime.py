"""How long the lease renewer's thread lives (issue 37, item 6).

Outside a worker (an eager execution, a direct call) the thread ends with the last lease it
renews, before the execution returns: a test suite that checks for leftover threads after each
test (Celery's own does) finds none. In a worker, back-to-back executions share one thread (no
thread start per execution), and the thread ends once the worker shuts down. Real runs, with the
session's private Redis as the lock store; an in-process worker (solo pool) for the worker.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import celery
import pytest
import redis
from celery.contrib.testing.worker import start_worker

from singletask import SingletonTask
from singletask.lease import STOP_WAIT

RENEWER = "singletask-renewer"
EXECUTIONS = 20


def renewers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == RENEWER and t.is_alive()]


class Starts:
    """Counts the renewer threads started (``threading.Thread.start`` calls)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        start = threading.Thread.start

        def counting_start(thread: threading.Thread) -> None:
            if thread.name == RENEWER:
                self.count += 1
            start(thread)

        monkeypatch.setattr(threading.Thread, "start", counting_start)


@pytest.fixture
def app(redis_url: str, redis_client: redis.Redis, key_prefix: str) -> Iterator[celery.Celery]:
    app = celery.Celery("renewer-lifetime", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        result_backend="cache+memory://",
        task_default_queue=f"renewer-lifetime-{uuid.uuid4().hex}",  # memory queues are global
        singletask_backend_url=redis_url,
        singletask_key_prefix=key_prefix,
    )

    @app.task(base=SingletonTask, bind=True, shared=False, name="lifetime.work", lock_args=["n"])
    def work(self: Any, n: int) -> bool:
        return self.lock is not None and not self.lock.lost

    yield app
    app.close()


def test_an_eager_execution_leaves_no_renewer_thread(
    app: celery.Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given no renewer thread of this app yet
    starts = Starts(monkeypatch)
    task = app.tasks["lifetime.work"]
    before = set(renewers())

    # When a singleton task runs eagerly, and is called directly, holding its lock each time
    assert task.apply(args=(1,)).get() is True
    after_apply = set(renewers()) - before
    assert task(2) is True
    after_call = set(renewers()) - before

    # Then its renewer thread had started, and was gone by the time each returned
    assert starts.count == 2
    assert after_apply == set()
    assert after_call == set()


def test_a_busy_worker_starts_one_renewer_thread_and_it_ends_with_the_worker(
    app: celery.Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a worker of the app, and the renewer threads started so far counted
    starts = Starts(monkeypatch)
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        # When it runs executions back to back, each holding its own lock
        results = [app.tasks["lifetime.work"].delay(n) for n in range(EXECUTIONS)]
        assert [result.get(timeout=30) for result in results] == [True] * EXECUTIONS
        # Then they shared one renewer thread
        assert starts.count == 1
        assert len(renewers()) == 1
        thread = renewers()[0]

    # And once the worker has shut down, that thread ends (at once: it has nothing to renew)
    thread.join(STOP_WAIT + 1)
    assert not thread.is_alive()
    time.sleep(0)  # nothing else started one meanwhile
    assert starts.count == 1
