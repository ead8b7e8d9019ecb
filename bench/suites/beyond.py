"""What lock_limit, lock_rate, lock_debounce and named limits cost beside the singleton; a fleet
under a rate.

The lock stores are Redis (a private ``redis-server``) and PostgreSQL (the server of
``SINGLETASK_TEST_POSTGRES_URL``, default the test suite's, in a table of the benchmark's own,
dropped at the end). The broker is always the private Redis.

1. **Per execution**, in one process: eager executions (``task_always_eager``, Celery's tracer,
   with a worker's stack protection as the ``run`` suite installs it) of an empty task locked per
   argument value, for the singleton (no option), ``lock_limit=5``, ``lock_rate="1000/s"`` (a
   key per execution, so the rate is checked and never refuses), ``lock_debounce=1`` and named
   limits (``lock_limits``, one unit of limits that never refuse: one beside the key, one
   without a key of the task's own, and a concurrency and a rate with a ``charge`` of the
   rate in the body; bench/harness/app.py ``BEYOND`` and ``LIMITS``). Eager
   mode does not debounce a send, so a debounced execution is measured as a worker meets it:
   its key's window is first opened by a real send of the same task id (not timed), then the
   execution takes the window (``debounce_take``) and the lock. Added time is the median of
   the per-round differences with a plain task, all variants and stores in a shuffled order in
   each round. Round trips: Redis counts the requests its server read
   (``total_reads_processed``), PostgreSQL the requests the driver sent (one per
   ``cursor.execute``).
2. **Per debounced send**: ``apply_async`` of the debounced task to the real broker (its window
   written in the lock store, then the message published with its countdown), against a plain
   task's ``apply_async`` in the same round. Round trips to the lock store: on PostgreSQL the
   driver's requests; on Redis, whose one server is also the broker, the server's requests per
   send minus a plain send's.
3. **A fleet under a rate**: real ``celery worker -P prefork`` processes on one queue, working
   through a backlog of one key's task with ``lock_rate`` (policy ``retry``, a retry budget that
   never runs out). Each start records its fencing token, which on Redis is the store's clock
   in microseconds when the key was taken. Reported: starts per second over the middle of the
   run against the configured rate, the shortest gap between two starts against the interval,
   and the most starts seen in any window of one period (by the store's clock and by the
   workers' clocks).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import random
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from bench import RESULTS, ROOT
from bench.harness.app import make_app
from bench.harness.common import (
    BROKER_DB,
    LOCK_DB,
    PROBE_DB,
    RedisServer,
    ServerCounters,
    Worker,
    log,
    summary,
)
from bench.harness.store_runs import batch_us, request_counter
from tests.servers import SQL_URLS, drop_sql_table, sql_problem

CONFIGS: dict[str, dict[str, Any]] = {
    "full": {"executions": 1000, "rounds": 7, "rate": 20.0, "fleet_seconds": 90.0,
             "workers": 2, "concurrency": 2},
    "quick": {"executions": 100, "rounds": 2, "rate": 20.0, "fleet_seconds": 10.0,
              "workers": 2, "concurrency": 1},
}  # fmt: skip

#: Each measured variant and its task (bench/harness/app.py registers them).
TASKS = {
    "singleton": "bench.singletask.noop",
    "limit": "bench.singletask-limit.noop",
    "rate": "bench.singletask-rate.noop",
    "debounce": "bench.singletask-debounce.noop",
    "units": "bench.singletask-units.noop",
    "units-only": "bench.singletask-units-only.noop",
    "units-charge": "bench.singletask-units-charge.noop",
}
APP_VARIANTS = ["plain", "singletask", "singletask-limit", "singletask-rate",
                "singletask-debounce", "singletask-units", "singletask-units-only",
                "singletask-units-charge"]  # fmt: skip
LABELS = {
    "singleton": "singleton (no option)",
    "limit": "``lock_limit=5``",
    "rate": '``lock_rate="1000/s"``',
    "debounce": "``lock_debounce=1``: execution",
    "debounce-send": "``lock_debounce=1``: send",
    "units": "a key and 1 named limit",
    "units-only": "1 named limit, no key",
    "units-charge": "a key, 2 limits, a ``charge``",
}
#: The rows of the per-execution table, in order.
ROWS = [*(v for v in TASKS if not v.startswith("units")), "debounce-send",
        *(v for v in TASKS if v.startswith("units"))]  # fmt: skip


# -- 1 and 2: per execution, per send ----------------------------------------------------------


class Store:
    """One lock store: an eager app (executions), a sending app (real sends) and a way to
    count its round trips."""

    def __init__(self, kind: str, url: str, server: RedisServer) -> None:
        self.kind, self.url, self.server = kind, url, server
        urls = {"broker": server.url(BROKER_DB), "probe_url": server.url(PROBE_DB)}
        self.eager = make_app(broker=urls["broker"], lock_url=url, probe_url=urls["probe_url"],
                              variants=APP_VARIANTS, eager=True)  # fmt: skip
        queue = f"beyond-{uuid.uuid4().hex[:6]}"
        self.sender = make_app(broker=urls["broker"], lock_url=url, probe_url=urls["probe_url"],
                               variants=APP_VARIANTS, queue=queue)  # fmt: skip
        self.offset = random.randrange(10**9)

    def count(
        self, run: Callable[[int], Any], first: int, n: int
    ) -> tuple[float, dict[str, float]]:
        """Round trips per call of ``run`` (and, on Redis, commands per call)."""
        if self.kind == "redis":
            counters = ServerCounters(self.server.url(LOCK_DB))
            before = counters.snapshot()
            batch_us(run, first, n)
            delta = ServerCounters.delta(before, counters.snapshot())
            counters.client.close()
            commands = {name: calls / n for name, calls in sorted(delta["commands"].items())}
            return delta["round_trips"] / n, commands
        with request_counter() as counted:
            batch_us(run, first, n)
        return counted[0] / n, {}

    def runner(self, variant: str, first: int, n: int) -> Callable[[int], Any]:
        """What one execution of ``variant`` is; for the debounced task, its windows for
        ``first``..``first + n`` are opened by real sends first (not timed, not counted)."""
        task = self.eager.tasks[TASKS[variant]]
        if variant != "debounce":
            return lambda i: task.apply_async((self.offset + i,))
        sender = self.sender.tasks[TASKS[variant]]
        ids = {i: f"beyond-{self.offset + i}" for i in range(first, first + n)}
        for i, task_id in ids.items():
            sender.apply_async((self.offset + i,), task_id=task_id)
        purge(self.server)
        return lambda i: task.apply_async((self.offset + i,), task_id=ids[i])

    def send(self, name: str) -> Callable[[int], Any]:
        task = self.sender.tasks[name]
        return lambda i: task.apply_async((self.offset + i,))

    def close(self) -> None:
        self.eager.close()
        self.sender.close()


def purge(server: RedisServer) -> None:
    """Drop the messages the sends published (nothing consumes them)."""
    broker = redis.Redis.from_url(server.url(BROKER_DB))
    broker.flushdb()
    broker.close()


def per_execution(stores: dict[str, Store], cfg: dict[str, Any]) -> dict[str, Any]:
    n, rounds = cfg["executions"], cfg["rounds"]
    first = 0
    for store in stores.values():  # warm up: connect, create the table, load the scripts
        for variant in TASKS:
            batch_us(store.runner(variant, first, 20), first, 20)
        batch_us(store.send(TASKS["debounce"]), first, 20)
        purge(store.server)
    first += 20
    plain_send = next(iter(stores.values())).send("bench.plain.noop")
    trips: dict[str, dict[str, float]] = {}
    commands: dict[str, dict[str, dict[str, float]]] = {}
    for kind, store in stores.items():
        trips[kind], commands[kind] = {}, {}
        for variant in TASKS:
            trips[kind][variant], commands[kind][variant] = store.count(
                store.runner(variant, first, n), first, n
            )
            first += n
        sent, sent_commands = store.count(store.send(TASKS["debounce"]), first, n)
        if kind == "redis":  # the broker is on the same server: leave a plain send out
            plain, plain_commands = store.count(plain_send, first + n, n)
            sent -= plain
            sent_commands = {
                name: calls - plain_commands.get(name, 0.0)
                for name, calls in sent_commands.items()
                if abs(calls - plain_commands.get(name, 0.0)) > 1e-9
            }
        trips[kind]["debounce-send"], commands[kind]["debounce-send"] = sent, sent_commands
        purge(store.server)
        first += 2 * n
        log(f"beyond: {kind}: round trips " + ", ".join(f"{v} {t:.2f}" for v, t in
                                                          trips[kind].items()))  # fmt: skip

    plain_task = next(iter(stores.values())).eager.tasks["bench.plain.noop"]
    per: dict[str, list[float]] = {}
    added: dict[str, list[float]] = {}
    for number in range(rounds):
        jobs: list[tuple[str, str]] = [("-", "plain"), ("-", "plain-send")]
        jobs += [(kind, v) for kind in stores for v in [*TASKS, "debounce-send"]]
        random.shuffle(jobs)
        us: dict[str, float] = {}
        for kind, variant in jobs:
            if variant == "plain":
                run: Callable[[int], Any] = lambda i: plain_task.apply_async((i,))  # noqa: E731
            elif variant == "plain-send":
                run = plain_send
            elif variant == "debounce-send":
                run = stores[kind].send(TASKS["debounce"])
            else:
                run = stores[kind].runner(variant, first, n)
            us[f"{kind}:{variant}"] = batch_us(run, first, n)
            first += n
            if variant.endswith("send"):
                purge(next(iter(stores.values())).server)
        for name, value in us.items():
            per.setdefault(name, []).append(value)
            if name.startswith("-:"):
                continue
            base = us["-:plain-send"] if name.endswith("send") else us["-:plain"]
            added.setdefault(name, []).append(value - base)
        log(f"beyond: round {number + 1}/{rounds}: "
            + ", ".join(f"{k} {v:.0f}us" for k, v in sorted(us.items())))  # fmt: skip
    return {
        "round_trips": trips,
        "commands": commands,
        "us": {name: summary(values) for name, values in per.items()},
        "added_us": {name: summary(values) for name, values in added.items()},
    }


# -- 3: a fleet under a rate -------------------------------------------------------------------


def most_in_window(times: list[float], period: float) -> int:
    """The most of ``times`` (sorted) within any half-open window ``[t, t + period)``."""
    most, low = 0, 0
    for high, t in enumerate(times):
        while times[low] <= t - period:
            low += 1
        most = max(most, high - low + 1)
    return most


def fleet(server: RedisServer, cfg: dict[str, Any], workdir: Path) -> dict[str, Any]:
    rate, seconds = cfg["rate"], cfg["fleet_seconds"]
    messages = int(rate * seconds)
    probe = redis.Redis.from_url(server.url(PROBE_DB))
    probe.delete("fleet:starts")
    queue = f"fleet-{uuid.uuid4().hex[:6]}"
    env = {
        **os.environ, "PYTHONPATH": str(ROOT), "BENCH_BROKER_URL": server.url(BROKER_DB),
        "BENCH_LOCK_URL": server.url(LOCK_DB), "BENCH_PROBE_URL": server.url(PROBE_DB),
        "BENCH_VARIANTS": "singletask-fleet", "BENCH_FLEET_RATE": f"{rate:g}/s",
        "BENCH_TIMES_DIR": str(workdir / "fleet-times"),
    }  # fmt: skip
    (workdir / "fleet-times").mkdir(parents=True)
    producer = make_app(broker=server.url(BROKER_DB), lock_url=server.url(LOCK_DB),
                        probe_url=server.url(PROBE_DB), variants=[])  # fmt: skip
    for i in range(messages):
        producer.send_task("bench.singletask-fleet.start", (i,), queue=queue)
    producer.close()
    log(f"beyond: fleet: {messages} messages of one key at {rate:g}/s, "
        f"{cfg['workers']} workers x {cfg['concurrency']} processes")  # fmt: skip
    workers = [
        Worker(env, workdir / f"fleet-{n}.log", concurrency=cfg["concurrency"], queues=[queue])
        for n in range(cfg["workers"])
    ]
    began = time.monotonic()
    try:
        for worker in workers:
            worker.start(probe)
        deadline = time.monotonic() + seconds * 1.5 + 30
        while probe.llen("fleet:starts") < messages and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        for worker in workers:
            worker.kill()
    elapsed = time.monotonic() - began
    rows = [line.decode().split() for line in probe.lrange("fleet:starts", 0, -1)]
    probe.close()
    attempts = sum(
        path.read_bytes().count(b"\n") for path in (workdir / "fleet-times").glob("*.tsv")
    )
    store = sorted(int(fence) / 1e6 for fence, _, _ in rows)  # the store's clock, seconds
    wall = sorted(float(at) for _, at, _ in rows)
    interval = 1.0 / rate
    # The middle of the run: the pool's start and the backlog's last stragglers left out.
    low, high = int(len(store) * 0.1), int(len(store) * 0.9)
    observed = (high - low) / (store[high] - store[low]) if high > low else None
    gaps = [b - a for a, b in itertools.pairwise(store)]
    out = {
        "rate": rate,
        "interval_s": interval,
        "workers": cfg["workers"],
        "concurrency": cfg["concurrency"],
        "messages": messages,
        "starts": len(rows),
        "attempts": attempts,
        "processes": len({pid for _, _, pid in rows}),
        "seconds": elapsed,
        "observed_rate": observed,
        "ratio": observed / rate if observed else None,
        "min_gap_s": min(gaps) if gaps else None,
        "median_gap_s": sorted(gaps)[len(gaps) // 2] if gaps else None,
        "most_in_one_period_store_clock": most_in_window(store, 1.0),
        "most_in_one_period_worker_clocks": most_in_window(wall, 1.0),
        "allowed_in_one_period": int(rate),
    }
    log(f"beyond: fleet: {len(rows)} starts ({attempts} attempts) in {elapsed:.0f}s, "
        f"{observed or 0:.2f}/s against {rate:g}/s; shortest gap {out['min_gap_s']}")  # fmt: skip
    return out


# -- the report --------------------------------------------------------------------------------


def _table(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = "  ".join("=" * w for w in widths)
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    body = [fmt.format(*row).rstrip() for row in rows]
    return "\n".join([line, fmt.format(*head).rstrip(), line, *body, line])


def _us(stat: dict[str, Any]) -> str:
    if stat.get("median") is None:
        return "—"
    return f"{stat['median']:.0f} ({stat['p25']:.0f}\u2013{stat['p75']:.0f})"


def rst(results: dict[str, Any]) -> str:
    """The tables of docs/performance.rst ("Limits, rates and debounce")."""
    stores = results["stores"]
    over = results["per_execution"]
    head = ("variant", *(f"{k}: round trips" for k in stores), *(f"{k}: added µs" for k in stores))
    rows = []
    for variant in ROWS:
        rows.append((
            LABELS[variant],
            *(f"{over['round_trips'][k][variant]:.2f}" for k in stores),
            *(_us(over["added_us"][f"{k}:{variant}"]) for k in stores),
        ))  # fmt: skip
    text = _table(head, rows)
    tp = results.get("fleet")
    if tp:
        head2 = ("configured", "observed starts/s", "ratio", "shortest gap (interval)",
                 "most starts in 1 s: store / workers", "starts (attempts)")  # fmt: skip
        row = (
            f"{tp['rate']:g}/s",
            f"{tp['observed_rate']:.2f}",
            f"{tp['ratio']:.3f}",
            f"{tp['min_gap_s'] * 1000:.1f} ms ({tp['interval_s'] * 1000:.0f} ms)",
            f"{tp['most_in_one_period_store_clock']} / {tp['most_in_one_period_worker_clocks']}",
            f"{tp['starts']:,} ({tp['attempts']:,})",
        )
        text += "\n\n" + _table(head2, [row])
    notes = [f"``{kind}``: not measured ({why})" for kind, why in results["missing"].items()]
    return text + ("\n\n" + "\n".join(f"* {n}" for n in notes) if notes else "") + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench beyond", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="tiny configuration (a minute)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--publish-docs", action="store_true",
                        help="also write docs/_static/performance/beyond.rst.inc")  # fmt: skip
    args = parser.parse_args(argv)
    cfg = CONFIGS["quick" if args.quick else "full"]
    logging.getLogger("singletask").setLevel(logging.ERROR)
    from celery.app.trace import _install_stack_protection

    _install_stack_protection()  # as the run suite: execute as a worker's pool process does
    table = f"st_bench_beyond_{uuid.uuid4().hex[:8]}"
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="singletask-beyond-") as tmp:
        workdir = Path(tmp)
        server = RedisServer(workdir / "redis")
        server.start()
        urls = {"redis": server.url(LOCK_DB)}
        missing: dict[str, str] = {}
        problem = sql_problem("postgresql")
        if problem:
            missing["postgresql"] = problem
            log(f"beyond: leaving out postgresql: {problem}")
        else:
            urls["postgresql"] = f"{SQL_URLS['postgresql']}?table={table}"
        stores = {kind: Store(kind, url, server) for kind, url in urls.items()}
        try:
            results = {
                "config": cfg,
                "started": started,
                "stores": list(urls),
                "missing": missing,
                "machine": {"cpus": os.cpu_count(), "load": load},
                "redis_version": server.version(),
                "per_execution": per_execution(stores, cfg),
                "fleet": fleet(server, cfg, workdir),
            }
            results["machine"]["load_after"] = os.getloadavg()
        finally:
            for store in stores.values():
                with contextlib.suppress(Exception):
                    store.close()
            server.stop()
            if "postgresql" in urls:
                drop_sql_table("postgresql", table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "beyond.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "beyond.rst").write_text(rst(results))
    if args.publish_docs:
        (ROOT / "docs" / "_static" / "performance" / "beyond.rst.inc").write_text(rst(results))
    print(rst(results))
    return 0
