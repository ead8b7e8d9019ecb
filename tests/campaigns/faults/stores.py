"""Each lock store set up for a campaign (context managers yielding an
:class:`~.runner.Environment`), on real servers only.

* ``memory``: one in-process store shared by threads; replies delayed or held back in-process.
* ``sqlite``: worker processes on one database file; workers paused (SIGSTOP), the file held
  by another writer.
* ``redis``: a primary with AOF (``appendfsync always``) and its replica, of the campaign's own;
  every worker through a fault proxy of its own; restarts of the primary (lossless: the AOF), and
  failovers by ``FAILOVER`` (the primary waits for its replica, then swaps roles) after which
  every proxy is re-pointed to the new primary, as a managed endpoint or a VIP moves.
* ``sentinel``: the session's Sentinel deployment, failed over with ``SENTINEL FAILOVER``;
  acquisitions wait for one replica (``wait_replicas``).
* ``cluster``: the session's Redis Cluster (3 masters, 3 replicas), a random master failed over
  to its replica with ``CLUSTER FAILOVER``; acquisitions wait for one replica.
* ``postgresql``, ``mysql``: the machine's shared servers (a table of the campaign's own), each
  worker through its own proxy; an outage is every proxy stopped, then started (the campaign
  never restarts a shared server).
* ``memcached``: a server of the campaign's own, each worker through its own proxy, restarted
  (lossy: memcached keeps nothing, as docs/guarantees.rst says, so a restart is an amnesty).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import redis

from singletask.backends.memory import MemoryBackend

from ...servers import (
    SQL_URLS,
    RedisServer,
    redis_server_binary,
    sql_test_table,
    start_memcached,
    unavailable,
)
from .faults import Injector, InProcessLink, link_faults, pause_fault, sqlite_lock_fault
from .history import Fault
from .runner import Environment

__all__ = ["STORES", "cluster_env", "sentinel_env"]

#: The stores' client-side timeouts in the campaign (connect, read, statement, pool wait).
TIMEOUT = 1.0

#: The longest a call to a store behind a proxy may block: a few timeouts (a pool wait, a
#: connect, a reply; Redis retries a dropped connection twice). Stalls last up to 2 s longer.
BLOCK_BOUND = 3 * TIMEOUT + 2.0


def _proxies(url: str, count: int) -> tuple[list[Any], list[str]]:
    """``count`` started fault proxies to the server of ``url``, and ``url`` through each."""
    from ...faultproxy import FaultProxy

    proxies, urls = [], []
    for _ in range(count):
        proxy, proxied = FaultProxy.for_url(url)
        proxy.start()
        proxies.append(proxy)
        urls.append(proxied)
    return proxies, urls


@contextlib.contextmanager
def _stopping(proxies: list[Any]) -> Iterator[None]:
    try:
        yield
    finally:
        for proxy in proxies:
            proxy.close()


def _links(proxies: list[Any]) -> dict[str, Any]:
    return {f"link-{n}": proxy for n, proxy in enumerate(proxies)}


@contextlib.contextmanager
def memory_env(workdir: Path, scale: int) -> Iterator[Environment]:
    store = MemoryBackend()
    threads = 4 * scale
    links = [InProcessLink() for _ in range(threads)]
    ttls = (0.5, 1.0, 2.0)
    kinds = {"delay", "stall"}  # no socket to cut, no server to stop
    yield Environment(
        store="memory",
        urls=[],
        options={},
        threads=threads,
        processes=0,
        ttls=ttls,
        block_bound=2 * max(ttls) + 1.0,  # the longest stall the schedule draws, and then some
        injectors=lambda pids: {
            kind: injector
            for kind, injector in link_faults(_links(links), 2 * max(ttls)).items()
            if kind in kinds
        },
        backend=lambda n: links[n].wrap(store),
    )


@contextlib.contextmanager
def sqlite_env(workdir: Path, scale: int) -> Iterator[Environment]:
    path = workdir / "campaign.db"
    ttls = (0.5, 1.0, 2.0)

    def injectors(pids: Callable[[], list[int]]) -> Mapping[str, Injector]:
        return {
            "pause": pause_fault(pids, 2 * max(ttls)),
            "db-lock": sqlite_lock_fault(str(path), 2 * TIMEOUT),
        }

    yield Environment(
        store="sqlite",
        urls=[f"sqlite:///{path}?timeout={TIMEOUT}"],
        options={},
        threads=0,
        processes=3 * scale,
        ttls=ttls,
        # SQLite's busy timeout, and a margin (calls of a paused process are not judged).
        block_bound=TIMEOUT + 1.5,
        injectors=injectors,
    )


class _RedisPair:
    """A primary and its replica of the campaign's own, with AOF, which trade places."""

    def __init__(self, workdir: Path) -> None:
        binary = redis_server_binary()
        if binary is None:
            unavailable("no redis-server for the campaign")
        assert binary is not None
        aof = ("--appendonly", "yes", "--appendfsync", "always")
        self.servers = [RedisServer(binary, workdir / f"redis-{n}", extra_args=aof) for n in (0, 1)]
        self.aof = aof
        self.primary = 0

    def start(self) -> None:
        first, second = self.servers
        first.start()
        second.extra_args = (*self.aof, "--replicaof", "127.0.0.1", str(first.port))
        second.start()
        self._wait_synced()

    def _client(self, n: int) -> redis.Redis:
        return redis.Redis(port=self.servers[n].port, socket_timeout=5, decode_responses=True)

    def _wait_synced(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        replica = self._client(1 - self.primary)
        try:
            while time.monotonic() < deadline:
                with contextlib.suppress(redis.RedisError):
                    info = replica.info("replication")
                    if info.get("role") == "slave" and info.get("master_link_status") == "up":
                        return
                time.sleep(0.05)
            raise RuntimeError("the campaign's Redis replica did not sync")
        finally:
            replica.close()

    def target(self) -> tuple[str, int]:
        return ("127.0.0.1", self.servers[self.primary].port)

    def failover(self) -> None:
        """``FAILOVER`` on the primary: writes paused until the replica has caught up, then the
        roles swap; wait until the new primary takes writes."""
        old = self._client(self.primary)
        try:
            old.execute_command("FAILOVER", "TIMEOUT", "5000")  # type: ignore[no-untyped-call]
        finally:
            old.close()
        self.primary = 1 - self.primary
        new = self._client(self.primary)
        deadline = time.monotonic() + 20
        try:
            while new.info("replication").get("role") != "master":
                if time.monotonic() > deadline:
                    raise RuntimeError("FAILOVER did not promote the replica")
                time.sleep(0.02)
        finally:
            new.close()
        self._wait_synced()

    def restart_primary(self, down: float) -> None:
        """Stop the primary (its AOF has every write), wait ``down`` s, start it again as the
        primary; the replica follows it again."""
        server = self.servers[self.primary]
        server.stop()
        time.sleep(down)
        server.extra_args = self.aof
        server.start()
        replica = self._client(1 - self.primary)
        try:
            replica.execute_command(  # type: ignore[no-untyped-call]
                "REPLICAOF", "127.0.0.1", str(server.port)
            )
        finally:
            replica.close()
        self._wait_synced()

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


@contextlib.contextmanager
def redis_env(workdir: Path, scale: int) -> Iterator[Environment]:
    pair = _RedisPair(workdir)
    try:
        pair.start()
    except RuntimeError as exc:
        pair.stop()
        unavailable(f"cannot start the campaign's Redis servers: {exc}")
    threads, processes = 3 * scale, 2 * scale
    ttls = (0.5, 1.0, 2.0)
    host, port = pair.target()
    proxies, urls = _proxies(f"redis://{host}:{port}/0", threads + processes)

    def failover(rng: Any) -> Fault:
        start = time.monotonic()
        pair.failover()
        for proxy in proxies:
            proxy.repoint(pair.target())
        return Fault("failover", "primary", start, time.monotonic())

    def restart(rng: Any) -> Fault:
        start = time.monotonic()
        pair.restart_primary(rng.uniform(0.1, 1.0))
        return Fault("restart", "primary", start, time.monotonic())

    def injectors(pids: Callable[[], list[int]]) -> Mapping[str, Injector]:
        return {
            **link_faults(_links(proxies), 2 * max(ttls), stall_longest=BLOCK_BOUND + 2.0),
            "pause": pause_fault(pids, 2 * max(ttls)),
            "failover": failover,
            "restart": restart,
        }

    options = {"transport_options": {"socket_timeout": TIMEOUT, "socket_connect_timeout": TIMEOUT}}
    try:
        with _stopping(proxies):
            yield Environment(
                store="redis",
                urls=urls,
                options=options,
                threads=threads,
                processes=processes,
                ttls=ttls,
                # One try and two retries of a dropped connection, each bounded by the timeout.
                block_bound=BLOCK_BOUND,
                injectors=injectors,
            )
    finally:
        pair.stop()


def _replicated_env(
    store: str,
    url: str,
    scale: int,
    transport_options: Mapping[str, Any],
    promote: Callable[[Any], str],
) -> Environment:
    """A Redis deployment with replicas (Sentinel, Cluster): workers pause, ``promote(rng)``
    fails a master over (and names it), acquisitions wait for one replica."""
    ttls = (1.0, 2.0, 3.0)

    def failover(rng: Any) -> Fault:
        start = time.monotonic()
        which = promote(rng)
        return Fault("failover", which, start, time.monotonic())

    def injectors(pids: Callable[[], list[int]]) -> Mapping[str, Injector]:
        return {"pause": pause_fault(pids, 2 * max(ttls)), "failover": failover}

    options = {
        "transport_options": {
            **transport_options,
            "socket_timeout": TIMEOUT,
            "socket_connect_timeout": TIMEOUT,
            "wait_replicas": 1,
        }
    }
    return Environment(
        store=store,
        urls=[url],
        options=options,
        threads=3 * scale,
        processes=2 * scale,
        ttls=ttls,
        block_bound=3 * TIMEOUT + 3.0,
        injectors=injectors,
    )


@contextlib.contextmanager
def sentinel_env(workdir: Path, scale: int, deployment: Any) -> Iterator[Environment]:
    def promote(rng: Any) -> str:
        deployment.failover()
        return "master"

    yield _replicated_env("sentinel", deployment.url, scale, deployment.transport_options, promote)


@contextlib.contextmanager
def cluster_env(workdir: Path, scale: int, deployment: Any) -> Iterator[Environment]:
    def promote(rng: Any) -> str:
        deployment.failover(deployment.replica_of(rng.choice(deployment.masters())))
        return "a master"

    yield _replicated_env("cluster", deployment.url, scale, {"wait_timeout": TIMEOUT / 2}, promote)


@contextlib.contextmanager
def sql_env(kind: str, workdir: Path, scale: int) -> Iterator[Environment]:
    ttls = (1.0, 2.0, 3.0)
    with sql_test_table(kind) as table:
        count = 4 * scale
        proxies, urls = _proxies(SQL_URLS[kind], count)
        with _stopping(proxies):
            yield Environment(
                store=kind,
                urls=urls,
                options={"table": table, "timeout": TIMEOUT},
                threads=count,
                processes=0,
                ttls=ttls,
                # connect, statement and pool wait are each bounded by the timeout
                block_bound=BLOCK_BOUND,
                injectors=lambda pids: link_faults(
                    _links(proxies), 2 * max(ttls), stall_longest=BLOCK_BOUND + 2.0
                ),
            )


@contextlib.contextmanager
def memcached_env(workdir: Path, scale: int) -> Iterator[Environment]:
    try:
        server = start_memcached()
    except RuntimeError as exc:
        unavailable(f"cannot start the campaign's memcached: {exc}")
        raise
    ttls = (1.0, 2.0, 3.0)
    threads, processes = 3 * scale, 1 * scale
    try:
        proxies, urls = _proxies(server.url, threads + processes)
        urls = [f"{url}?timeout={TIMEOUT}&connect_timeout={TIMEOUT}" for url in urls]

        def restart(rng: Any) -> Fault:
            start = time.monotonic()
            server.stop()
            time.sleep(rng.uniform(0.1, 1.0))
            server.start()
            return Fault("restart", "memcached", start, time.monotonic(), lossy=True)

        def injectors(pids: Callable[[], list[int]]) -> Mapping[str, Injector]:
            return {
                **link_faults(_links(proxies), 2 * max(ttls), stall_longest=BLOCK_BOUND + 2.0),
                "pause": pause_fault(pids, 2 * max(ttls)),
                "restart": restart,
            }

        with _stopping(proxies):
            yield Environment(
                store="memcached",
                urls=urls,
                options={},
                threads=threads,
                processes=processes,
                ttls=ttls,
                block_bound=BLOCK_BOUND,
                injectors=injectors,
            )
    finally:
        server.stop()


#: The stores a campaign runs on, and how each is set up (sentinel needs the session's
#: deployment: see test_campaign.py).
STORES: dict[str, Callable[[Path, int], contextlib.AbstractContextManager[Environment]]] = {
    "memory": memory_env,
    "sqlite": sqlite_env,
    "redis": redis_env,
    "postgresql": functools.partial(sql_env, "postgresql"),
    "mysql": functools.partial(sql_env, "mysql"),
    "memcached": memcached_env,
}
