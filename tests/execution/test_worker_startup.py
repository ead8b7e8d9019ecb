"""What a worker says when it starts and cannot run its singleton tasks as documented.

``memory://`` on a pool of several processes excludes nothing between them, and a missing or
invalid lock store fails every execution of a singleton task: the worker says so, at ERROR,
when it starts (see docs/configuration.rst).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import celery
import pytest
from celery.concurrency import get_implementation

from singletask import SingletonTask
from singletask.execution.startup import check_worker

APP_MODULE = """
import os

from celery import Celery

from singletask import SingletonTask

app = Celery("startup_app", broker=os.environ["STARTUP_BROKER"])
app.conf.update(
    singletask_backend_url=os.environ["STARTUP_LOCKS"],
    task_default_queue=os.environ["STARTUP_QUEUE"],
    broker_connection_retry_on_startup=True,
)


@app.task(base=SingletonTask, name="startup.sync")
def sync():
    return "done"
"""


@pytest.fixture
def app() -> Iterator[SimpleNamespace]:
    """A worker's app with one singleton task, and only that task: a real app would also hold
    the shared tasks that other test modules registered in this process."""
    real = celery.Celery("startup", set_as_current=False)

    @real.task(base=SingletonTask, shared=False, lazy=False, name="startup.one")
    def one() -> None: ...

    yield SimpleNamespace(tasks={"startup.one": one}, conf=real.conf)
    real.close()


@pytest.mark.parametrize(
    ("pool", "concurrency", "level"),
    [
        ("prefork", 2, logging.ERROR),
        ("processes", 4, logging.ERROR),
        ("prefork", 1, logging.WARNING),
        ("solo", 1, logging.WARNING),
        ("threads", 8, logging.WARNING),
    ],
)
def test_memory_locks_on_a_worker_are_reported_by_pool(
    app: SimpleNamespace,
    caplog: pytest.LogCaptureFixture,
    pool: str,
    concurrency: int,
    level: int,
) -> None:
    """memory:// on a pool of several processes (``processes`` is prefork's alias): ERROR naming
    memory:// and the pool; on one process: a WARNING (another worker with the same setting
    would not be excluded)."""
    # Given an app with a singleton task and memory:// locks
    app.conf.singletask_backend_url = "memory://"

    # When a worker with that pool starts
    with caplog.at_level(logging.INFO, logger="singletask"):
        said = check_worker(app, get_implementation(pool), concurrency)

    # Then it says so, at the level for that pool
    assert len(said) == 1
    records = [r for r in caplog.records if r.name == "singletask"]
    assert [r.levelno for r in records] == [level]
    assert "memory://" in said[0]
    assert "startup.one" in said[0]
    if level == logging.ERROR:
        assert f"prefork pool runs tasks in {concurrency} processes" in said[0]


def test_a_worker_without_a_usable_lock_store_says_so_at_error(
    app: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    """An invalid lock store URL: ERROR at start-up, with the error every execution will get."""
    app.conf.singletask_backend_url = "redis://:hunter2@localhost:99999/0"

    with caplog.at_level(logging.INFO, logger="singletask"):
        said = check_worker(app, get_implementation("prefork"), 2)

    assert len(said) == 1
    expected = "no usable lock store, so every execution of its singleton tasks (startup.one) will"
    assert expected in said[0]
    assert "setting singletask_backend_url" in said[0]
    assert "hunter2" not in caplog.text


def test_a_worker_with_an_invalid_setting_says_so_at_error(
    app: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    app.conf.update(singletask_backend_url="memory://", singletask_lock_ttl=1e16)

    with caplog.at_level(logging.INFO, logger="singletask"):
        said = check_worker(app, get_implementation("solo"), 1)

    assert len(said) == 1
    assert "an invalid setting" in said[0]
    assert "singletask_lock_ttl" in said[0]
    assert [r.levelno for r in caplog.records if r.name == "singletask"] == [logging.ERROR]


def test_a_worker_with_a_shared_lock_store_says_nothing(
    app: SimpleNamespace, caplog: pytest.LogCaptureFixture, redis_url: str
) -> None:
    app.conf.singletask_backend_url = redis_url
    assert check_worker(app, get_implementation("prefork"), 4) == []


def test_an_app_without_singleton_tasks_is_not_checked(app: SimpleNamespace) -> None:
    app.conf.singletask_backend_url = "memory://"
    app.tasks = {"plain.add": object()}  # any task that is not a SingletonTask
    assert check_worker(app, get_implementation("prefork"), 4) == []


@pytest.mark.e2e
def test_a_real_prefork_worker_on_memory_locks_logs_an_error_at_start(
    tmp_path: Path, redis_base_url: str
) -> None:
    """The reported case: singletask_backend_url="memory://" and a prefork worker with
    concurrency 2 ran two duplicates at once with no warning. Now the worker's log says, at
    ERROR, as it starts, that memory:// excludes nothing between its 2 pool processes."""
    # Given an app module with memory:// locks and a singleton task
    (tmp_path / "startup_app.py").write_text(textwrap.dedent(APP_MODULE))
    env = {
        **os.environ,
        "PYTHONPATH": str(tmp_path),
        "STARTUP_BROKER": f"{redis_base_url}/6",
        "STARTUP_LOCKS": "memory://",
        "STARTUP_QUEUE": f"startup-{uuid.uuid4().hex[:8]}",
    }
    log = tmp_path / "worker.log"

    # When a prefork worker with concurrency 2 starts
    with log.open("wb") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "startup_app", "worker", "-P", "prefork",
             "-c", "2", "-l", "INFO", "-n", f"startup-{uuid.uuid4().hex[:6]}@%h",
             "--without-gossip", "--without-mingle", "--without-heartbeat"],
            cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while " ready." not in log.read_text(errors="replace"):
            assert worker.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.2)
        time.sleep(0.5)  # the check runs right after "ready"
        text = log.read_text(errors="replace")
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()

    # Then its log has the ERROR, naming memory:// and the pool
    lines = [line for line in text.splitlines() if "memory://" in line]
    assert lines, text
    assert "ERROR" in lines[0], text
    assert "prefork pool runs tasks in 2 processes" in lines[0], text
    assert "startup.sync" in lines[0], text
