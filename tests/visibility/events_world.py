"""What test_flower.py runs against: a real worker started with ``-E``, a real ``celery flower``
process, and a recorder of the events singletask sends, all on the session's private Redis
server (:func:`start`, the body of its session fixture)."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from tests.servers import free_port, unavailable
from tests.visibility.events_app import (
    BROKER_ENV,
    GATES_ENV,
    LOCKS_ENV,
    QUEUE_ENV,
    RESULTS_ENV,
    gate_key,
    make_app,
)

ROOT = Path(__file__).resolve().parents[2]

#: Flower's configuration file: singletask's formatter for its task list and task page.
FLOWER_CONFIG = "from singletask.observe.flower import format_task  # noqa: F401\n"


class Process:
    """A subprocess in its own process group, its output in a log file."""

    def __init__(self, command: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        with log.open("ab") as out:
            self.popen = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def stop(self) -> None:
        if self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()


class Recorder:
    """Every ``task-singletask-*`` event on the broker, as a Celery event receiver gets it."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._receiver: Any = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(20):
            raise RuntimeError("the event recorder did not start")

    def _run(self) -> None:
        with self.app.connection_for_read() as connection:
            self._receiver = self.app.events.Receiver(connection, handlers={"*": self._on_event})
            self._ready.set()
            self._receiver.capture(limit=None, timeout=None, wakeup=False)

    def _on_event(self, event: dict[str, Any]) -> None:
        if str(event.get("type", "")).startswith("task-singletask-"):
            with self._lock:
                self.events.append(event)

    def of(self, task_id: str, outcome: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return [
                e for e in self.events
                if e["uuid"] == task_id and outcome in (None, e["singletask_outcome"])
            ]  # fmt: skip

    def wait(self, task_id: str, outcome: str, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.of(task_id, outcome)
            if found:
                return found[-1]
            time.sleep(0.05)
        raise AssertionError(f"no {outcome!r} event for {task_id} within {timeout}s")

    def stop(self) -> None:
        if self._receiver is not None:
            self._receiver.should_stop = True
        self._thread.join(10)


@dataclass
class Visibility:
    """What a visibility test talks to."""

    app: Celery
    flower_url: str
    worker: Process
    flower: Process
    recorder: Recorder
    gates: redis.Redis
    hostname: str
    labels: list[str] = field(default_factory=list)

    def label(self) -> str:
        label = uuid.uuid4().hex[:12]
        self.labels.append(label)
        return label

    def open_gate(self, label: str) -> None:
        self.gates.rpush(gate_key(label), 1)
        self.gates.expire(gate_key(label), 300)

    def get(self, path: str, **params: Any) -> tuple[int, str]:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        try:
            with urllib.request.urlopen(self.flower_url + path + query, timeout=10) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")

    def flower_task(
        self, task_id: str, until: Callable[[dict[str, Any]], bool], timeout: float = 30.0
    ) -> dict[str, Any]:
        """Flower's ``/api/task/info`` of ``task_id`` once ``until`` holds for it."""
        deadline = time.monotonic() + timeout
        info: dict[str, Any] = {}
        while time.monotonic() < deadline:
            status, body = self.get(f"/api/task/info/{task_id}")
            if status == 200:
                info = json.loads(body)
                if until(info):
                    return info
            time.sleep(0.2)
        raise AssertionError(
            f"Flower's view of {task_id} within {timeout}s: {info}\n"
            f"flower log:\n{self.flower.tail()}\nworker log:\n{self.worker.tail()}"
        )

    def listed(self, task_id: str) -> dict[str, Any]:
        """The row of ``task_id`` in Flower's task list (the data its table is drawn from)."""
        status, body = self.get(
            "/tasks/datatable", **{
                "draw": 1, "start": 0, "length": 500, "search[value]": "",
                "order[0][column]": 0, "order[0][dir]": "desc", "columns[0][data]": "received",
            },
        )  # fmt: skip
        assert status == 200, body
        rows = {row["uuid"]: row for row in json.loads(body)["data"]}
        assert task_id in rows, f"{task_id} not in Flower's task list"
        return rows[task_id]


def _wait_http(url: str, process: Process, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.popen.poll() is not None:
            raise RuntimeError(f"exited with {process.popen.returncode}:\n{process.tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer within {timeout}s:\n{process.tail()}")


def start(redis_base_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Visibility]:
    """Start the worker, Flower and the recorder; yield them; stop them."""
    workdir = Path(tmp_path_factory.mktemp("visibility"))
    settings = {
        BROKER_ENV: f"{redis_base_url}/5",
        RESULTS_ENV: f"{redis_base_url}/6",
        LOCKS_ENV: f"{redis_base_url}/7",
        GATES_ENV: f"{redis_base_url}/8",
        QUEUE_ENV: f"vis-{uuid.uuid4().hex[:8]}",
    }
    env = {
        **os.environ, **settings, "PYTHONPATH": str(ROOT), "FLOWER_UNAUTHENTICATED_API": "true",
    }  # fmt: skip
    app = make_app(
        broker=settings[BROKER_ENV],
        results=settings[RESULTS_ENV],
        locks=settings[LOCKS_ENV],
        queue=settings[QUEUE_ENV],
    )
    hostname = f"vis-{uuid.uuid4().hex[:8]}@{os.uname().nodename}"
    celery = [sys.executable, "-m", "celery", "-A", "tests.visibility.events_app"]
    (workdir / "flowerconfig.py").write_text(FLOWER_CONFIG)
    port = free_port()
    recorder = Recorder(app)
    processes: list[Process] = []
    try:
        flower = Process(
            [*celery, "flower", "--address=127.0.0.1", f"--port={port}",
             f"--conf={workdir / 'flowerconfig.py'}"],
            env, workdir / "flower.log",
        )  # fmt: skip
        processes.append(flower)
        worker = Process(
            [*celery, "worker", "-E", "-P", "prefork", "-c", "2", "-n", hostname, "-l", "INFO",
             "-Q", settings[QUEUE_ENV], "--without-gossip", "--without-mingle",
             # A pool process ends after each task: the events it queued are sent all the same.
             "--max-tasks-per-child=1"],
            env, workdir / "worker.log",
        )  # fmt: skip
        processes.append(worker)
        url = f"http://127.0.0.1:{port}"
        _wait_http(url + "/healthcheck", flower)
    except (OSError, RuntimeError) as exc:
        for process in processes:
            process.stop()
        recorder.stop()
        unavailable(f"cannot start a celery worker -E and celery flower: {exc}")
        raise
    gates = redis.Redis.from_url(settings[GATES_ENV])
    vis = Visibility(app, url, worker, flower, recorder, gates, hostname)
    try:
        # Ready once a run has gone from the worker through the broker to Flower and to the
        # recorder (which misses what is published before it has subscribed).
        deadline = time.monotonic() + 60
        while True:
            probe = app.tasks["events.skip"].delay(vis.label())
            probe.get(timeout=60)
            vis.flower_task(probe.id, lambda info: info.get("state") == "SUCCESS", timeout=60)
            if recorder.of(probe.id, "released") or time.monotonic() > deadline:
                break
        yield vis
    finally:
        for process in (worker, flower):
            process.stop()
        recorder.stop()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()
        gates.close()
        app.close()
