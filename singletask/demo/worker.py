"""A real ``celery worker -P prefork`` for a :class:`~singletask.demo.local.Setup`, as a
subprocess: started, known to be ready, stopped, and what it leaves on servers tidied up.

:class:`WorkerProcess` knows the worker is ready from the folder's event log: the worker's
``worker_ready`` and ``worker_process_init`` signals append to it (see
:func:`singletask.demo.local.configure`).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import TYPE_CHECKING

from .events import EventLog
from .local import DemoError, Setup

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["WorkerProcess", "interrupt_on_sigterm", "tidy_up_servers"]


class WorkerProcess:
    """``celery -A <module> worker -P prefork -c N`` as a subprocess, for one :class:`Setup`.

    It runs in a session of its own, so a Ctrl-C in the terminal reaches only the program that
    started it, which then stops it (warm shutdown, then SIGKILL after a grace period).
    """

    def __init__(
        self,
        module: str,
        setup: Setup,
        *,
        concurrency: int = 4,
        cwd: Path | None = None,
        extra_args: Sequence[str] = (),
        loglevel: str = "INFO",
    ) -> None:
        self.module = module
        self.setup = setup
        self.concurrency = concurrency
        self.cwd = cwd
        self.log = setup.folder / "worker.log"
        self.nodename = f"{module.rsplit('.', 1)[-1]}-{uuid.uuid4().hex[:8]}@%h"
        self.command = [
            sys.executable, "-m", "celery", "-A", module, "worker",
            "-P", "prefork", "-c", str(concurrency), "-l", loglevel, "-n", self.nodename,
            "-Q", setup.queue,
            # No other worker to talk to: start faster, send less.
            "--without-gossip", "--without-mingle", "--without-heartbeat",
            *extra_args,
        ]  # fmt: skip
        self.process: subprocess.Popen[bytes] | None = None
        self.pool: list[int] = []
        self.startup_seconds = 0.0

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self, timeout: float = 60.0) -> None:
        """Start the worker; return once it consumes and its pool processes are up.

        Raises:
            DemoError: It exited, or was not ready within ``timeout`` seconds.
        """
        started = time.monotonic()
        events = EventLog(self.setup.events)
        events.read_new()  # only this start's events count
        env = {**os.environ, **self.setup.environ(), "PYTHONDONTWRITEBYTECODE": "1"}
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                self.command, cwd=self.cwd, env=env, stdin=subprocess.DEVNULL,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        ready_at: float | None = None
        pool: list[int] = []
        while True:
            for event in events.read_new():
                if event.kind == "ready":
                    ready_at = time.monotonic()
                elif event.kind == "process":
                    pool.append(event.pid)
            now = time.monotonic()
            # Ready when it consumes and every pool process is up (or, should a process be
            # slow to report, a few seconds after it consumes).
            if ready_at is not None and (len(pool) >= self.concurrency or now - ready_at > 5):
                break
            if self.process.poll() is not None:
                raise DemoError(
                    f"the worker exited with status {self.process.returncode}:\n{self.tail()}"
                )
            if now - started > timeout:
                raise DemoError(f"the worker was not ready within {timeout:.0f} s:\n{self.tail()}")
            time.sleep(0.05)
        self.pool = sorted(pool)
        self.startup_seconds = time.monotonic() - started

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def tail(self, lines: int = 30) -> str:
        """The end of the worker's log, indented."""
        try:
            text = self.log.read_text(errors="replace")
        except FileNotFoundError:
            return "    (no log)"
        return "\n".join("    " + line for line in text.splitlines()[-lines:])

    def stop(self, grace: float = 10.0) -> None:
        """Warm shutdown (SIGTERM); SIGKILL for the whole group after ``grace`` s or a Ctrl-C."""
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired, KeyboardInterrupt):
                process.wait(grace)
        if process.poll() is None:
            # Not yet reaped, so the group is still ours: the worker and its pool processes.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        while True:
            with contextlib.suppress(KeyboardInterrupt):
                process.wait()
                break
        # A pool process that outlived its parent would still be in the worker's group.
        for pid in self.pool:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if os.getpgid(pid) == process.pid:
                    os.kill(pid, signal.SIGKILL)

    def __enter__(self) -> WorkerProcess:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


@contextlib.contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    """Within the block, SIGINT (Ctrl-C), SIGTERM and SIGHUP raise KeyboardInterrupt, so cleanup
    runs.

    SIGINT is set explicitly: a process started with SIGINT ignored (by ``nohup``, or from a
    shell that backgrounds it) inherits that disposition, and Python then leaves it ignored, so
    Ctrl-C would not stop the run.
    """

    def interrupted(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = {
        sig: signal.signal(sig, interrupted)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def tidy_up_servers(app: Celery, setup: Setup, task_ids: Iterable[str]) -> None:
    """Delete what a run left on servers it was pointed at: its results, its queue, and every
    key it wrote to a lock store of the user's (locks, fence records, follow-up slots)."""
    with contextlib.suppress(Exception):
        if setup.locks is not None and setup.key_prefix is not None:
            delete_lock_keys(setup.locks, setup.key_prefix)
    with contextlib.suppress(Exception):
        if setup.backend is not None:
            for task_id in task_ids:
                app.AsyncResult(task_id).forget()
    with contextlib.suppress(Exception):
        if setup.broker is not None:
            with app.connection_for_write() as connection:
                queue = app.amqp.queues[setup.queue](connection.default_channel)
                queue.declare()  # makes the binding known to this channel, so delete() drops it
                queue.delete()


#: The SQLite store's tables, whose rows the demo deletes by key prefix.
SQLITE_TABLES = ("singletask_locks", "singletask_fences", "singletask_rates", "singletask_debounce")


def delete_lock_keys(url: str, prefix: str) -> int:
    """Delete every record whose key contains ``prefix`` from the lock store at ``url`` (Redis:
    the locks, released records and ``{...}:fence`` companion hashes; SQLite: rows of the
    locks, fences, rates and debounce tables). Returns how many.

    Only for a prefix that is the run's own (it must not match anyone else's keys).
    """
    scheme = url.split("://", 1)[0].lower()
    if scheme in ("redis", "rediss", "unix"):
        import redis

        client = redis.Redis.from_url(url)
        try:
            keys = list(client.scan_iter(match=f"*{_glob_escape(prefix)}*", count=1000))
            return int(client.delete(*keys)) if keys else 0
        finally:
            client.close()
    if scheme == "sqlite":
        import sqlite3

        from ..backends import backend_from_url

        # The store's own reading of its URL (the database file), through the registry.
        path: Path = backend_from_url(url).path  # type: ignore[attr-defined]
        conn = sqlite3.connect(path, timeout=10)
        try:
            like = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            deleted = 0
            # A database of an older version may lack the newer tables: only those it has.
            tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
            with conn:
                for table in [t for t in SQLITE_TABLES if t in tables]:
                    deleted += conn.execute(
                        f"DELETE FROM {table} WHERE key LIKE ? ESCAPE '\\'", (f"%{like}%",)
                    ).rowcount
            return deleted
        finally:
            conn.close()
    return 0


def _glob_escape(text: str) -> str:
    """``text`` with Redis glob characters escaped, to match it literally in SCAN MATCH."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)
