"""Run a Celery app and a real prefork worker on this machine, with no server to install.

:class:`Setup` says where the app keeps its messages, results and locks. Each defaults to an
embedded part in one folder: kombu's filesystem transport as the broker, Celery's file result
backend, and singletask's SQLite lock store. Any of them can be a server instead (Redis,
RabbitMQ). :func:`configure` applies a setup to an app, in the process that sends tasks and, via
environment variables, in the worker. :class:`WorkerProcess` runs ``celery worker -P prefork``
as a subprocess and knows when it is ready: the worker's ``worker_ready`` and
``worker_process_init`` signals append to the folder's event log (see
:mod:`singletask.demo.events`), which works on every broker, including the filesystem one where
remote control is not dependable.

``singletask demo`` and the programs in ``examples/`` are built on this module;
:func:`run_example` is the whole of an example's ``if __name__ == "__main__":`` block.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any

from celery import signals as celery_signals
from kombu import Exchange, Queue
from kombu.utils.url import maybe_sanitize_url

from ..signals import lock_conflict
from .events import EventLog

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "DemoError",
    "Setup",
    "WorkerProcess",
    "configure",
    "interrupt_on_sigterm",
    "run_example",
]

#: Prefix of the environment variables that carry a :class:`Setup` to the worker.
ENV_PREFIX = "SINGLETASK_LOCAL_"

#: The app setting that holds the setup's folder (the event log lives there).
FOLDER_SETTING = "singletask_local_folder"


class DemoError(Exception):
    """The demo or an example cannot go on; the message says why."""


@dataclass(frozen=True)
class Setup:
    """Where an app keeps its messages, results and locks. ``None`` means "embedded".

    Attributes:
        folder: A folder of this run: the event log, the worker's log, and the embedded parts.
        broker: A broker URL, or None for kombu's filesystem transport in ``folder``.
        backend: A result backend URL, or None for Celery's file backend in ``folder``.
        locks: A lock store URL, or None for a SQLite file in ``folder``.
        queue: The queue the tasks go to (a run of its own, so nothing else is consumed).
        key_prefix: The lock key prefix, or None for singletask's default.
    """

    folder: Path
    broker: str | None = None
    backend: str | None = None
    locks: str | None = None
    queue: str = "celery"
    key_prefix: str | None = None

    @property
    def broker_url(self) -> str:
        return self.broker or "filesystem://"

    @property
    def result_backend(self) -> str:
        return self.backend or f"file://{self.folder / 'results'}"

    @property
    def lock_url(self) -> str:
        return self.locks or f"sqlite:///{self.folder / 'locks.db'}"

    @property
    def events(self) -> Path:
        return self.folder / "events.jsonl"

    def describe(self) -> list[tuple[str, str]]:
        """What is used for what, for people: ``[("broker", "..."), ...]``."""
        here = "in the run's temporary folder"
        return [
            (
                "broker",
                maybe_sanitize_url(self.broker)
                if self.broker
                else f"kombu's filesystem transport, {here}",
            ),
            (
                "results",
                maybe_sanitize_url(self.backend)
                if self.backend
                else f"Celery's file result backend, {here}",
            ),
            (
                "locks",
                maybe_sanitize_url(self.locks) if self.locks else f"SQLite (sqlite:///...), {here}",
            ),
        ]

    def prepare(self) -> None:
        """Create the folders the embedded parts need."""
        for sub in ("broker/queue", "broker/control", "broker/processed", "results"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)

    def celery_settings(self) -> dict[str, Any]:
        exchange = Exchange(self.queue, type="direct", durable=False, auto_delete=True)
        settings: dict[str, Any] = {
            "broker_url": self.broker_url,
            "result_backend": self.result_backend,
            "singletask_backend_url": self.lock_url,
            "task_queues": [
                Queue(self.queue, exchange, routing_key=self.queue, durable=False, auto_delete=True)
            ],
            "task_default_queue": self.queue,
            "task_default_exchange": self.queue,
            "task_default_routing_key": self.queue,
            "worker_prefetch_multiplier": 1,
            "broker_connection_retry_on_startup": True,
            FOLDER_SETTING: str(self.folder),
        }
        if self.key_prefix is not None:
            settings["singletask_key_prefix"] = self.key_prefix
        if self.broker is None:
            broker = self.folder / "broker"
            # kombu's filesystem transport, with whole messages (see singletask.demo.transport).
            settings["broker_transport"] = "singletask.demo.transport:Transport"
            settings["broker_transport_options"] = {
                "data_folder_in": str(broker / "queue"),
                "data_folder_out": str(broker / "queue"),
                "control_folder": str(broker / "control"),
                # Keep consumed messages in the folder too (the default moves them to /tmp).
                "store_processed": True,
                "processed_folder": str(broker / "processed"),
                "polling_interval": 0.05,
            }
        return settings

    def environ(self) -> dict[str, str]:
        """This setup as environment variables, for the worker subprocess."""
        values = {
            "FOLDER": str(self.folder),
            "BROKER": self.broker,
            "BACKEND": self.backend,
            "LOCKS": self.locks,
            "QUEUE": self.queue,
            "KEY_PREFIX": self.key_prefix,
        }
        return {ENV_PREFIX + name: value for name, value in values.items() if value is not None}

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Setup | None:
        """The setup that :meth:`environ` exported, or None if there is none."""
        env = os.environ if environ is None else environ
        folder = env.get(ENV_PREFIX + "FOLDER")
        if not folder:
            return None
        return cls(
            folder=Path(folder),
            broker=env.get(ENV_PREFIX + "BROKER"),
            backend=env.get(ENV_PREFIX + "BACKEND"),
            locks=env.get(ENV_PREFIX + "LOCKS"),
            queue=env.get(ENV_PREFIX + "QUEUE", "celery"),
            key_prefix=env.get(ENV_PREFIX + "KEY_PREFIX"),
        )


def configure(app: Celery, setup: Setup | None = None) -> Setup | None:
    """Apply ``setup`` to ``app`` (by default the one in the environment, if any).

    Also connects the signal receivers that write the event log: worker start-up and every
    lock conflict of the app's singleton tasks.
    """
    setup = setup if setup is not None else Setup.from_environ()
    if setup is None:
        return None
    app.conf.update(setup.celery_settings())
    celery_signals.worker_process_init.connect(
        _process_started, weak=False, dispatch_uid="singletask.demo.process"
    )
    celery_signals.worker_ready.connect(
        _worker_ready, weak=False, dispatch_uid="singletask.demo.ready"
    )
    lock_conflict.connect(_conflict, weak=False, dispatch_uid="singletask.demo.conflict")
    return setup


def _environ_log() -> EventLog | None:
    setup = Setup.from_environ()
    return EventLog(setup.events) if setup is not None else None


def _process_started(**_: Any) -> None:
    log = _environ_log()
    if log is not None:
        log.record("process")


def _worker_ready(**_: Any) -> None:
    log = _environ_log()
    if log is not None:
        log.record("ready")


def _conflict(
    sender: Any = None,
    key: str | None = None,
    holder: str | None = None,
    task_id: str | None = None,
    action: str | None = None,
    **_: Any,
) -> None:
    folder = sender.app.conf.get(FOLDER_SETTING) if sender is not None else None
    if folder and action:
        EventLog(Path(folder) / "events.jsonl").record(
            action, task_id=task_id, task=sender.name, key=key, holder=holder
        )


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
    """Within the block, SIGTERM and SIGHUP raise KeyboardInterrupt, so cleanup runs."""

    def interrupted(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def tidy_up_servers(app: Celery, setup: Setup, task_ids: Iterable[str]) -> None:
    """Delete what a run left on servers it was pointed at: its results and its queue."""
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


def _redis_url(value: str) -> str:
    if not re.match(r"(redis|rediss|unix)://", value):
        raise argparse.ArgumentTypeError(
            f"expected a redis://, rediss:// or unix:// URL, got {value!r}"
        )
    return value


def run_example(
    file: str,
    app: Celery,
    main: Callable[[], None],
    *,
    argv: Sequence[str] | None = None,
    concurrency: int = 3,
    beat: bool = False,
    show_worker_log: Callable[[str], bool] | None = None,
) -> None:
    """Run an example: a worker for the module ``file`` defines ``app`` in, then ``main()``.

    Command line: ``--redis-url URL`` puts the broker, the results and the locks in that Redis
    database instead of the embedded parts. ``beat`` runs Celery beat inside the worker (``-B``).
    ``show_worker_log`` selects worker log lines to print while ``main()`` runs.
    Exits with status 130 on Ctrl-C, after stopping the worker and deleting its folder.
    """
    path = Path(file).resolve()
    parser = argparse.ArgumentParser(
        prog=path.name, description=(sys.modules["__main__"].__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument(
        "--redis-url",
        type=_redis_url,
        metavar="URL",
        help="use this Redis database (e.g. redis://localhost:6379/0) for the broker, the "
        "results and the locks, instead of the embedded parts",
    )
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix=f"singletask-{path.stem}-"))
    sent: list[str] = []
    setup = Setup(
        folder,
        broker=args.redis_url,
        backend=args.redis_url,
        locks=args.redis_url,
        queue=f"{path.stem}-{uuid.uuid4().hex[:8]}",
    )
    try:
        with interrupt_on_sigterm():
            setup.prepare()
            configure(app, setup)
            celery_signals.after_task_publish.connect(
                lambda headers=None, **_: sent.append((headers or {}).get("id", "")), weak=False
            )
            for what, where in setup.describe():
                print(f"{what:>8}: {where}")
            extra = ["-B", "-s", str(folder / "beat-schedule")] if beat else []
            worker = WorkerProcess(
                path.stem, setup, concurrency=concurrency, cwd=path.parent, extra_args=extra
            )
            print(f"{'worker':>8}: {' '.join(worker.command[2:8])} ...", flush=True)
            follower = None
            try:
                with worker:
                    print(f"{'':>8}  ready after {worker.startup_seconds:.1f} s\n", flush=True)
                    if show_worker_log is not None:
                        follower = _LogFollower(worker.log, show_worker_log)
                    main()
                    print("\nStopping the worker (warm shutdown) ...", flush=True)
            finally:
                if follower is not None:
                    follower.stop()  # after the worker stopped: its last lines are shown too
            tidy_up_servers(app, setup, [s for s in sent if s])
    except KeyboardInterrupt:
        print("\nInterrupted: the worker is stopped and its folder deleted.", file=sys.stderr)
        raise SystemExit(130) from None
    except DemoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


#: A task id: log lines show its first 8 characters.
TASK_ID = re.compile(r"\b([0-9a-f]{8})-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b")


class _LogFollower:
    """Print the worker log lines ``select`` accepts, as they are written (like ``tail -f``)."""

    PREFIX = re.compile(r"^\[[^\]]*?: \w+/(?P<process>[^\]]+)\] ")

    def __init__(self, log: Path, select: Callable[[str], bool]) -> None:
        self.log = log
        self.select = select
        self.offset = log.stat().st_size if log.exists() else 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        partial = ""
        while True:
            stopping = self._stop.wait(0.1)
            with self.log.open("r", errors="replace") as file:
                file.seek(self.offset)
                chunk = file.read()
                self.offset = file.tell()
            *lines, partial = (partial + chunk).split("\n")
            for line in lines:
                if self.select(line):
                    line = TASK_ID.sub(r"\1", self.PREFIX.sub(r"\g<process>: ", line))
                    print(f"  worker| {line}", flush=True)
            if stopping:
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
