"""Lock stores beyond one Redis: a Redis Cluster and Sentinel, beside a single server.

In one run, on loopback, from the ``redis-server`` on PATH (tests/deployments.py starts them):
a single Redis, a 6-node Redis Cluster (3 masters, 3 replicas) and a Sentinel deployment
(1 master, 1 replica, 3 sentinels). For each lock store, and with the opt-in replica wait
(``wait_replicas=1``) on Cluster and Sentinel:

* **per execution**: an uncontended singleton execution in process (``task.apply()``, the
  tracer and hooks as in eager mode) against a plain task, median of rounds: the time the lock
  adds, and the commands the store's servers counted per execution (INFO commandstats of every
  node), with the round trips they took (the WAIT is pipelined with the acquire: it shares
  its round trip);
* **Sentinel failover** (``--failovers`` rounds): acquisitions of fresh keys in a loop, then
  the master is killed (SIGKILL): how long until the first acquisition succeeds on the new
  master, and how many acquisitions that had succeeded are gone after it, without and with the
  replica wait. With the wait, the new master has no replica until the old one is restarted
  (as soon as the sentinels have promoted the replica): no lock can be taken before.

Writes ``deployments.json`` and ``deployments.rst`` (the tables of docs/performance.rst) to the
output folder (default ``bench/results``). Numbers never decide a test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from bench import RESULTS
from singletask import SingletonTask
from singletask.backends import backend_from_url
from singletask.exceptions import BackendError
from tests.deployments import (
    ClusterDeployment,
    SentinelDeployment,
    default_binary,
    wait_until,
)
from tests.servers import RedisServer


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def make_app(url: str, options: dict[str, Any]) -> tuple[Celery, Any, Any]:
    app = Celery("bench-deploy", broker="memory://", backend="cache+memory://")
    app.conf.update(
        singletask_backend_url=url,
        singletask_backend_transport_options=options,
        task_always_eager=False,
    )

    @app.task(name="bench.deploy.plain")
    def plain(i: int) -> int:
        return i

    @app.task(name="bench.deploy.locked", base=SingletonTask, lock_args=["i"])
    def locked(i: int) -> int:
        return i

    return app, plain, locked


#: The commands a client sends to run the lock: scripts, and on Redis 7 and later the plain
#: lock's functions (the commands the scripts run inside are counted by Redis too, and
#: replication and the sentinels send their own: left out).
CLIENT_COMMANDS = ("evalsha", "eval", "fcall", "function|load", "wait", "script|load")


def commands(ports: list[int]) -> dict[str, int]:
    """Calls of the lock's client commands on the masters at ``ports``, summed."""
    total: dict[str, int] = {}
    for port in ports:
        with contextlib.closing(redis.Redis(port=port)) as client:
            for name, stats in client.info("commandstats").items():
                command = name.removeprefix("cmdstat_")
                if command in CLIENT_COMMANDS:
                    total[command] = total.get(command, 0) + int(stats["calls"])
    return total


def per_execution(
    url: str, options: dict[str, Any], ports: list[int], executions: int, rounds: int
) -> dict[str, Any]:
    """Median time per execution, plain and locked, and the store's commands per execution."""
    app, plain, locked = make_app(url, options)
    for i in range(50):  # warm up: client, scripts, topology
        locked.apply(args=(i,))
        plain.apply(args=(i,))
    times: dict[str, list[float]] = {"plain": [], "locked": []}
    counted: dict[str, int] = {}
    for _ in range(rounds):
        for name, task in (("plain", plain), ("locked", locked)):
            before = commands(ports) if name == "locked" else {}
            start = time.perf_counter()
            for i in range(executions):
                task.apply(args=(i,))
            times[name].append((time.perf_counter() - start) / executions)
            if name == "locked":
                after = commands(ports)
                for command, calls in after.items():
                    counted[command] = counted.get(command, 0) + calls - before.get(command, 0)
    app.close()
    per = {c: n / (executions * rounds) for c, n in counted.items() if n}
    waits = per.get("wait", 0.0)
    return {
        "plain_us": statistics.median(times["plain"]) * 1e6,
        "locked_us": statistics.median(times["locked"]) * 1e6,
        "added_us": (statistics.median(times["locked"]) - statistics.median(times["plain"])) * 1e6,
        "commands": per,
        "round_trips": sum(per.values()) - waits,  # WAIT shares the acquire's round trip
    }


def failover_round(deployment: SentinelDeployment, wait: bool) -> dict[str, Any]:
    """Acquire fresh keys in a loop, kill the master; measure the outage and the locks lost."""
    options = dict(deployment.transport_options)
    if wait:
        options.update(wait_replicas=1, wait_timeout=0.5)
    backend = backend_from_url(deployment.url, transport_options=options)
    acquired: list[str] = []
    errors: list[float] = []
    stop = threading.Event()
    killed_at: list[float] = []
    first_after: list[float] = []
    prefix = f"failover:{uuid.uuid4().hex[:8]}:"

    def loop() -> None:
        i = 0
        while not stop.is_set():
            key = f"{prefix}{i}"
            i += 1
            try:
                if backend.acquire(key, "t", 300.0).acquired:
                    acquired.append(key)
                    # the first success after a failure since the kill: on the new master
                    if killed_at and errors and errors[-1] > killed_at[0] and not first_after:
                        first_after.append(time.monotonic())
            except BackendError:
                errors.append(time.monotonic())
                time.sleep(0.01)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    time.sleep(1.0)
    server = deployment.master  # a fresh deployment: its master is the first server
    assert server.process is not None
    old = server.port
    killed_at.append(time.monotonic())
    server.process.send_signal(signal.SIGKILL)
    server.process.wait()
    if wait:
        # The promoted replica has no replica of its own: no WAIT can succeed, so no lock can
        # be taken, until one is back. Restart the old master (the sentinels make it one).
        wait_until(lambda: deployment.master_port() != old, "the failover", 60)
        server.start()
    wait_until(lambda: bool(first_after), "an acquisition on the new master", 60)
    wait_until(
        lambda: all(deployment.master_port(i) != old for i in range(3)),
        "every sentinel to name the new master",
    )
    time.sleep(0.5)
    stop.set()
    thread.join(10)
    new = deployment.master_port()
    with contextlib.closing(redis.Redis(port=new, db=2)) as client:
        lost = [key for key in acquired if not client.exists(key)]
    backend.close()
    return {
        "old_master": old,
        "new_master": new,
        "acquired": len(acquired),
        "lost": len(lost),
        "failed_calls": len([t for t in errors if t > killed_at[0]]),
        "outage_s": first_after[0] - killed_at[0],
    }


@contextlib.contextmanager
def started(make: Callable[[int], Any]) -> Iterator[Any]:
    """A deployment made by ``make(attempt)`` and started; one that cannot start (a port found
    free was taken meanwhile by another process) is stopped and made again, in a folder of its
    own and on other ports, twice."""
    for attempt in range(3):
        deployment = make(attempt)
        try:
            deployment.start()
            break
        except (RuntimeError, OSError):
            deployment.stop()
            if attempt == 2:
                raise
    try:
        yield deployment
    finally:
        deployment.stop()


def run(quick: bool, failovers: int, workdir: Path) -> dict[str, Any]:
    executions, rounds = (200, 3) if quick else (2000, 7)
    binary = default_binary()
    results: dict[str, Any] = {"executions": executions, "rounds": rounds, "rows": []}
    with (
        started(lambda n: RedisServer(binary, workdir / f"single-{n}")) as single,
        started(lambda n: ClusterDeployment(binary, workdir / f"cluster-{n}")) as cluster,
        started(lambda n: SentinelDeployment(binary, workdir / f"sentinel-{n}")) as sentinel,
    ):
        stores: list[tuple[str, str, dict[str, Any], list[int]]] = [
            ("Redis, one server", f"{single.url}/2", {}, [single.port]),
            ("Redis Cluster (3 masters)", cluster.url, {}, cluster.masters()),
            (
                "Redis Cluster, wait_replicas=1",
                cluster.url,
                {"wait_replicas": 1},
                cluster.masters(),
            ),
            ("Sentinel", sentinel.url, sentinel.transport_options, [sentinel.master.port]),
            (
                "Sentinel, wait_replicas=1",
                sentinel.url,
                {**sentinel.transport_options, "wait_replicas": 1},
                [sentinel.master.port],
            ),
        ]
        for name, url, options, ports in stores:
            log(f"per execution: {name}")
            row = per_execution(url, options, ports, executions, rounds)
            results["rows"].append({"store": name, **row})
    failover_rows = []
    for wait in (False, True):
        for index in range(failovers):
            log(f"sentinel failover {index + 1}/{failovers}, wait_replicas={int(wait)}")
            deployment = SentinelDeployment(binary, workdir / f"failover-{wait}-{index}")
            with started(deployment):
                failover_rows.append(
                    {"wait_replicas": int(wait), **failover_round(deployment, wait)}
                )
    results["failovers"] = failover_rows
    return results


def rst(results: dict[str, Any]) -> str:
    lines = [
        ".. list-table:: Uncontended execution, in process "
        f"({results['executions']} executions x {results['rounds']} rounds, median)",
        "   :header-rows: 1",
        "",
        "   * - lock store",
        "     - plain task (µs)",
        "     - singleton task (µs)",
        "     - added (µs)",
        "     - round trips",
        "     - commands per execution",
    ]
    for row in results["rows"]:
        spelled = ", ".join(f"{c.upper()} {n:g}" for c, n in sorted(row["commands"].items()))
        lines += [
            f"   * - {row['store']}",
            f"     - {row['plain_us']:.0f}",
            f"     - {row['locked_us']:.0f}",
            f"     - {row['added_us']:.0f}",
            f"     - {row['round_trips']:g}",
            f"     - {spelled}",
        ]
    lines += [
        "",
        ".. list-table:: Sentinel: the master killed while acquisitions run",
        "   :header-rows: 1",
        "",
        "   * - wait_replicas",
        "     - acquired before and after",
        "     - acquired, then lost",
        "     - failed calls",
        "     - kill to first new lock (s)",
    ]
    for row in results["failovers"]:
        lines += [
            f"   * - {row['wait_replicas']}",
            f"     - {row['acquired']}",
            f"     - {row['lost']}",
            f"     - {row['failed_calls']}",
            f"     - {row['outage_s']:.1f}",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench deployments", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="a small configuration")
    parser.add_argument("--failovers", type=int, default=3, help="failover rounds per mode")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="singletask-deploy-") as tmp:
        results = run(args.quick, args.failovers, Path(tmp))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "deployments.json").write_text(json.dumps(results, indent=2))
    (args.out / "deployments.rst").write_text(rst(results))
    print(rst(results))
    return 0
