"""Real ``celery worker`` subprocesses on a real broker, for the end-to-end tests.

One prefork worker per broker for the whole session (Redis always; RabbitMQ when
``SINGLETASK_TEST_AMQP_URL`` is set, as CI does: without it, the RabbitMQ runs are skipped
with that reason, and fail in CI). The ``cluster`` fixture is parametrized over
them, so every e2e test runs once per broker. The RabbitMQ runs carry the ``amqp`` marker: the
README's command leaves them out (the broker is not what most of them test), and the
``-m "e2e or pools"`` steps of .ci/run, on the oldest and the newest Python and Celery, run
them. :func:`start_cluster` starts a worker of another pool (test_pools.py). Databases of the
private Redis server: 0 broker, 1 results, 2 locks, 3 probe.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis
from celery import Celery

from singletask.backends.redis import RedisBackend

from ..backends.redis_lock import lock_fields, lock_token
from ..servers import SQL_URLS, amqp_url, sql_test_table, start_memcached, unavailable
from .app import LOCK_OPTIONS_ENV, TASK_MODULES, make_app
from .probe import PROBE_URL_ENV, Probe

ROOT = Path(__file__).resolve().parents[2]
#: Every broker is always collected: without SINGLETASK_TEST_AMQP_URL the RabbitMQ runs are
#: reported as skipped, with the reason (and fail in CI).
BROKERS = ["redis", "amqp"]

#: Lock stores besides the session's private Redis, from ``SINGLETASK_E2E_STORES`` (comma
#: separated): ``redis-cluster``, ``redis-sentinel`` (tests/deployments.py). When it is set, the
#: e2e tests run on the Redis broker with each of those lock stores instead (an extra step of
#: .ci/run), as ``redis@redis-cluster`` and ``redis@redis-sentinel``.
STORES = [s.strip() for s in os.environ.get("SINGLETASK_E2E_STORES", "").split(",") if s.strip()]
CLUSTER_PARAMS = [f"redis@{store}" for store in STORES] if STORES else BROKERS
CONCURRENCY = 2


@contextlib.contextmanager
def sql_lock_store(kind: str) -> Iterator[str]:
    """The URL of a table of its own on the machine's ``kind`` SQL server, dropped after."""
    with sql_test_table(kind) as table:
        yield f"{SQL_URLS[kind]}?table={table}"


@contextlib.contextmanager
def memcached_lock_store() -> Iterator[str]:
    """The URL of a memcached server of the test's own, stopped after."""
    try:
        server = start_memcached()
    except RuntimeError as exc:
        unavailable(f"cannot start a private memcached: {exc}")
        raise
    try:
        yield f"{server.url}?connect_timeout=2"
    finally:
        server.stop()


#: The lock stores besides Redis that test_stores.py runs its end-to-end scenarios on: name ->
#: a context manager that yields a store URL for one test and cleans up after it.
LOCK_STORES: dict[str, Callable[[], AbstractContextManager[str]]] = {
    "postgresql": lambda: sql_lock_store("postgresql"),
    "mysql": lambda: sql_lock_store("mysql"),
    "memcached": memcached_lock_store,
}

for _module in TASK_MODULES:  # register the shared tasks before any app is built
    importlib.import_module(_module)

#: Garbage of the producer's Celery client, not of singletask: broker and result-store sockets
#: that Celery's pools drop unclosed, and (Celery < 5.5) AsyncResult.__del__ complaining once
#: the result store is gone. Collected whenever the garbage collector runs, they would fail
#: whichever test happens to be running then (warnings are errors in this suite).
CLIENT_GARBAGE = [
    r"ignore:Exception ignored in. <socket\.socket:pytest.PytestUnraisableExceptionWarning",
    r"ignore:Exception ignored in. <function AsyncResult\.__del__:"
    r"pytest.PytestUnraisableExceptionWarning",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here):
            for spec in CLIENT_GARBAGE:
                item.add_marker(pytest.mark.filterwarnings(spec))


class Worker:
    """A ``celery worker`` subprocess (its own process group) and its log file."""

    def __init__(
        self,
        env: dict[str, str],
        log: Path,
        app: Celery,
        extra: list[str],
        *,
        pool: str = "prefork",
        concurrency: int = CONCURRENCY,
    ) -> None:
        self.env = env
        self.log = log
        self.app = app
        self.extra = extra
        self.pool = pool
        self.concurrency = concurrency
        self.nodename = f"e2e-{uuid.uuid4().hex[:8]}@%h"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> None:
        command = [
            sys.executable, "-m", "celery", "-A", "tests.e2e.app", "worker",
            "-P", self.pool, "-c", str(self.concurrency), "-n", self.nodename, "-l", "INFO",
            "--without-gossip", "--without-mingle", "--without-heartbeat", *self.extra,
        ]  # fmt: skip
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        hostname = self.nodename.replace("%h", os.uname().nodename)
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"worker exited with {self.process.returncode}:\n{self.tail()}")
            try:
                replies = self.app.control.ping(destination=[hostname], timeout=0.5)
            except (OSError, redis.ConnectionError) as exc:
                # The broker reset a connection under load, or closed one an earlier test's
                # restart of it left in the pool: the next ping takes a new one.
                last_error = exc
                time.sleep(0.5)
                continue
            if replies:
                return
        raise RuntimeError(
            f"worker did not answer ping within {timeout}s (last error: {last_error!r}):\n"
            f"{self.tail()}"
        )

    def children(self) -> list[int]:
        """PIDs of the pool processes."""
        assert self.process is not None
        return [child.pid for child in psutil.Process(self.process.pid).children()]

    def tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL the whole worker (its process group: the main process and any pool
        processes), and reap it."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)  # warm shutdown
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@dataclass
class Cluster:
    """What an e2e test talks to: a producer app, the worker, the lock store and the probe."""

    broker: str
    app: Celery
    worker: Worker
    locks: redis.Redis
    probe: Probe
    _labels: list[str] = field(default_factory=list)

    def task(self, name: str) -> Any:
        return self.app.tasks[name]

    def label(self) -> str:
        """A probe label no other test uses."""
        label = f"{self.broker}-{uuid.uuid4().hex[:10]}"
        self._labels.append(label)
        return label

    def lock_keys(self, pattern: str = "singletask:*") -> list[str]:
        return sorted(k.decode() for k in self.locks.scan_iter(match=pattern))

    def held_by(self, key: str) -> str | None:
        """The task id the lock at ``key`` is held or reserved for, as the store reads it."""
        holder = RedisBackend(client=self.locks).holder(key)
        return holder.task_id if holder is not None else None

    def wait_free(self, key: str, timeout: float = 15.0) -> float:
        """Wait until no lock is held at ``key`` (a released record may stay: it holds no
        owner token); return how long that took (fails on timeout)."""
        start = time.monotonic()
        while lock_token(self.locks, key) is not None:
            if time.monotonic() - start > timeout:
                raise AssertionError(
                    f"lock {key!r} still held after {timeout}s: {lock_fields(self.locks, key)}\n"
                    f"worker log:\n{self.worker.tail()}"
                )
            time.sleep(0.05)
        return time.monotonic() - start


def _broker_url(name: str, redis_base_url: str) -> str:
    if name == "redis":
        return f"{redis_base_url}/0"
    url = amqp_url()
    if url is None:
        unavailable(
            "the RabbitMQ end-to-end tests need SINGLETASK_TEST_AMQP_URL "
            "(e.g. amqp://guest:guest@127.0.0.1:5672//)"
        )
    assert url is not None
    return url


def _lock_store(
    store: str, redis_base_url: str, request: pytest.FixtureRequest
) -> tuple[str, dict[str, Any], Any]:
    """The lock store's URL, transport options and a client to inspect it with."""
    if store == "redis-cluster":
        deployment = request.getfixturevalue("redis_cluster")
        return deployment.url, {}, deployment.client()
    if store == "redis-sentinel":
        deployment = request.getfixturevalue("redis_sentinel")
        options = deployment.transport_options
        sentinel = redis.Sentinel([("127.0.0.1", s.port) for s in deployment.sentinels])
        return deployment.url, options, sentinel.master_for(options["master_name"], db=2)
    url = f"{redis_base_url}/2"
    return url, {}, redis.Redis.from_url(url)


@contextlib.contextmanager
def start_cluster(
    param: str,
    redis_base_url: str,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
    *,
    pool: str = "prefork",
    concurrency: int = CONCURRENCY,
) -> Iterator[Cluster]:
    """A worker of ``pool`` on a queue of its own, and the producer side that talks to it.

    ``param`` names the broker, optionally with the lock store: ``"redis"``,
    ``"redis@redis-cluster"``.
    """
    broker_name, _, store = param.partition("@")
    broker = _broker_url(broker_name, redis_base_url)
    locks, lock_options, lock_client = _lock_store(store, redis_base_url, request)
    queue = f"singletask-e2e-{uuid.uuid4().hex[:8]}"
    settings = {
        "SINGLETASK_E2E_BROKER": broker,
        "SINGLETASK_E2E_RESULTS": f"{redis_base_url}/1",
        "SINGLETASK_E2E_LOCKS": locks,
        LOCK_OPTIONS_ENV: json.dumps(lock_options),
        "SINGLETASK_E2E_QUEUE": queue,
        PROBE_URL_ENV: f"{redis_base_url}/3",
    }
    os.environ[PROBE_URL_ENV] = settings[PROBE_URL_ENV]
    env = {**os.environ, **settings, "PYTHONPATH": str(ROOT)}
    app = make_app(
        broker=broker,
        results=settings["SINGLETASK_E2E_RESULTS"],
        locks=locks,
        queue=queue,
        lock_options=lock_options,
    )
    log = Path(tmp_path_factory.mktemp(f"worker-{param.replace('@', '-')}-{pool}")) / "worker.log"
    worker = Worker(env, log, app, [], pool=pool, concurrency=concurrency)
    try:
        worker.start()
    except Exception as exc:  # reported as unavailable (a failure in CI) below
        worker.stop()
        unavailable(f"cannot start a celery worker -P {pool} on the {param} broker: {exc}")
    cluster = Cluster(param, app, worker, lock_client, Probe(settings[PROBE_URL_ENV]))
    try:
        yield cluster
    finally:
        worker.stop()
        # Collect the tests' AsyncResults while the result store still answers: on Celery < 5.5
        # their __del__ unsubscribes from it and complains once the server is gone. What this
        # collects is the producer's client garbage (CLIENT_GARBAGE): a session fixture ends in
        # the teardown of whichever test a process ran last, e2e or not, so its sockets are
        # dropped here without a ResourceWarning.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()
        cluster.locks.close()
        app.close()


def broker_params(params: list[str]) -> list[Any]:
    """``params`` for a fixture or a parametrize, the RabbitMQ ones marked ``amqp``."""
    return [
        pytest.param(p, marks=pytest.mark.amqp) if p.partition("@")[0] == "amqp" else p
        for p in params
    ]


#: For a module whose subject lives in the lock store (rates, debounce, hand-offs): its tests
#: run on the Redis broker only, as ``pytestmark``; the other e2e modules cover RabbitMQ.
ON_REDIS_BROKER = pytest.mark.parametrize(
    "cluster", [p for p in CLUSTER_PARAMS if p.partition("@")[0] == "redis"], indirect=True
)


@pytest.fixture(scope="session", params=broker_params(CLUSTER_PARAMS))
def cluster(
    request: pytest.FixtureRequest,
    redis_base_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Cluster]:
    with start_cluster(request.param, redis_base_url, tmp_path_factory, request) as cluster:
        yield cluster
