"""The lock stores side by side: Redis, PostgreSQL, MariaDB/MySQL and SQLite.

singletask's own task (``bench.singletask.noop``, locked per argument) with its lock in each
store, in the same run: Redis (a private ``redis-server``), PostgreSQL and MariaDB/MySQL (the
servers of ``SINGLETASK_TEST_POSTGRES_URL`` / ``SINGLETASK_TEST_MYSQL_URL``, default those of the
test suite, in a table of the benchmark's own, dropped at the end) and SQLite (a file). A store
whose server does not answer is left out, and the report says so. Four measurements:

1. **Round trips per execution**: Redis counts the read events of the server (the main
   benchmark's method); PostgreSQL and MySQL count the requests their driver sent (one per
   ``cursor.execute``: a statement, or a MySQL script sent as one request). SQLite has none.
2. **Added time per task**: eager executions (``task_always_eager``, Celery's tracer) of the
   singleton task minus those of a plain task, in the same round, stores in a shuffled order.
3. **Throughput**: a real ``celery worker -P prefork`` on the Redis broker works through a
   queue of distinct singleton tasks; tasks per second, and the ratio to a plain task's rate
   measured in the same round.
4. **Acquire at 100,000 held locks**: the backend's acquire+release of fresh keys, timed one
   by one on an empty store, then again while 100,000 other locks are held.

The broker is always the private Redis: only the lock store changes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import RESULTS, ROOT
from bench.harness.app import make_app
from bench.harness.common import (
    BROKER_DB,
    LOCK_DB,
    PROBE_DB,
    RedisServer,
    ServerCounters,
    log,
    summary,
)
from bench.harness.store_runs import (
    CONFIGS,
    batch_us,
    held_locks,
    request_counter,
    worker_throughput,
)
from singletask.backends import backend_from_url
from tests.servers import SQL_URLS, drop_sql_table, sql_problem

STORES = ("redis", "postgresql", "postgresql-async", "mysql", "sqlite")

#: The Redis database of the second (empty) Redis store of measurement 4.
OTHER_DB = 3

#: Stores whose backend takes no pool_size option.
SERVERLESS = ("redis", "sqlite")

#: PostgreSQL with ``synchronous_commit=off`` for the lock sessions (see docs/store-sql.rst,
#: "Durability").
ASYNC_COMMIT = "options=-c%20synchronous_commit%3Doff"


def store_urls(
    server: RedisServer, workdir: Path, table: str, suffix: str = ""
) -> tuple[dict[str, str], dict[str, str]]:
    """The URL of each store that answers, and why the others are left out.

    ``suffix`` names a second, separate set of stores (another table, database or file).
    """
    urls = {
        "redis": server.url(LOCK_DB if not suffix else OTHER_DB),
        "sqlite": f"sqlite:///{workdir}/locks{suffix}.db",
    }
    missing: dict[str, str] = {}
    for kind in ("postgresql", "mysql"):
        problem = sql_problem(kind)
        if problem:
            missing[kind] = problem
            log(f"stores: leaving out {kind}: {problem}")
        else:
            urls[kind] = f"{SQL_URLS[kind]}?table={table}{suffix}"
    if "postgresql" in urls:
        urls["postgresql-async"] = (
            f"{SQL_URLS['postgresql']}?table={table}_a{suffix}&{ASYNC_COMMIT}"
        )
    return {k: urls[k] for k in STORES if k in urls}, missing


def tables(table: str) -> list[tuple[str, str]]:
    """Every ``(server, table)`` store_urls() may have named, for the clean-up."""
    names = [f"{table}{suffix}" for suffix in ("", "_e", "_a", "_a_e")]
    return [("postgresql", name) for name in names] + [("mysql", table), ("mysql", f"{table}_e")]


def overhead(server: RedisServer, urls: dict[str, str], cfg: dict[str, Any]) -> dict[str, Any]:
    """Measurements 1 and 2, in one process, eager executions."""
    apps = {
        kind: make_app(broker=server.url(BROKER_DB), lock_url=url, probe_url=server.url(PROBE_DB),
                       variants=["plain", "singletask"], eager=True)
        for kind, url in urls.items()
    }  # fmt: skip
    runners = {kind: app.tasks["bench.singletask.noop"].apply_async for kind, app in apps.items()}
    plain = next(iter(apps.values())).tasks["bench.plain.noop"].apply_async
    offset = random.randrange(10**9)

    def run(kind: str) -> Callable[[int], Any]:
        return lambda i: runners[kind]((offset + i,))

    for kind in runners:  # warm up: connect, create tables, load scripts
        batch_us(run(kind), 0, 20)
    trips: dict[str, float | None] = {}
    for kind in runners:
        count = cfg["executions"]
        if kind == "redis":
            counters = ServerCounters(server.url(LOCK_DB))
            before = counters.snapshot()
            batch_us(run(kind), 10**6, count)
            trips[kind] = ServerCounters.delta(before, counters.snapshot())["round_trips"] / count
            counters.client.close()
        elif kind == "sqlite":  # no server: nothing goes over a network
            trips[kind] = None
        else:
            with request_counter() as counted:
                batch_us(run(kind), 10**6, count)
            trips[kind] = counted[0] / count
        log(f"stores: {kind}: {trips[kind]} round trips per execution")
    added: dict[str, list[float]] = {kind: [] for kind in runners}
    per: dict[str, list[float]] = {kind: [] for kind in [*runners, "plain"]}
    for number in range(cfg["rounds"]):
        first = 2 * 10**6 + number * cfg["executions"]
        order = ["plain", *runners]
        random.shuffle(order)
        us = {
            name: batch_us(
                (lambda i: plain((i,))) if name == "plain" else run(name), first, cfg["executions"]
            )
            for name in order
        }
        for name, value in us.items():
            per[name].append(value)
        for kind in runners:
            added[kind].append(us[kind] - us["plain"])
        log(f"stores: round {number + 1}: " + ", ".join(f"{n} {v:.0f}us" for n, v in us.items()))
    for app in apps.values():
        app.close()
    return {
        "round_trips": trips,
        "us_per_execution": {name: summary(values) for name, values in per.items()},
        "added_us": {kind: summary(values) for kind, values in added.items()},
    }


def _filler(kind: str, url: str) -> Any:
    """The backend measurement 4 writes the held locks with: 8 threads share it, so an SQL
    store gets 8 connections (each acquire commits: 8 at once share a flush)."""
    return backend_from_url(url, pool_size=8) if kind not in SERVERLESS else backend_from_url(url)


def rst(results: dict[str, Any]) -> str:
    """The table of docs/performance.rst ("Lock stores")."""
    held = results["config"]["held"]
    head = ("store", "round trips / execution", "added µs / task", "worker tasks/s (vs plain)",
            f"acquire µs, empty / {held:,} held")  # fmt: skip
    rows = []
    for kind in results["stores"]:
        trips = results["overhead"]["round_trips"][kind]
        added = results["overhead"]["added_us"][kind]["median"]
        tp = results["throughput"].get(kind, {})
        rate, ratio = tp.get("tasks_per_second", {}).get("median"), tp.get("vs_plain", {})
        scale = results["held"][kind]
        rows.append((
            kind,
            "— (in-process)" if trips is None else f"{trips:.2f}",
            f"{added:.0f}",
            f"{rate:.0f} ({ratio['median']:.2f})" if rate and ratio.get("median") else "—",
            f"{scale['acquire_us_empty']:.0f} / {scale['acquire_us_held']:.0f}",
        ))  # fmt: skip
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    line = "  ".join("=" * w for w in widths)
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    body = [fmt.format(*row).rstrip() for row in rows]
    text = "\n".join([line, fmt.format(*head).rstrip(), line, *body, line])
    notes = [f"``{kind}``: not measured ({why})" for kind, why in results["missing"].items()]
    return text + ("\n\n" + "\n".join(f"* {n}" for n in notes) if notes else "") + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench stores", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="tiny configuration (a minute)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--publish-docs", action="store_true",
                        help="also write docs/_static/performance/stores.rst.inc")  # fmt: skip
    args = parser.parse_args(argv)
    cfg = CONFIGS["quick" if args.quick else "full"]
    table = f"st_bench_{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="singletask-stores-") as tmp:
        workdir = Path(tmp)
        server = RedisServer(workdir / "redis")
        server.start()
        urls, missing = store_urls(server, workdir, table)
        empty = store_urls(server, workdir, table, "_e")[0]
        try:
            results = {
                "config": cfg,
                "stores": list(urls),
                "missing": missing,
                "machine": {"cpus": os.cpu_count(), "load": os.getloadavg()},
                "overhead": overhead(server, urls, cfg),
                "throughput": worker_throughput(server, urls, cfg, workdir),
                "held": held_locks(
                    {k: (u, empty[k]) for k, u in urls.items()}, cfg, label="stores", filler=_filler
                ),
            }
        finally:
            server.stop()
            for kind, name in tables(table):
                if kind in urls:
                    drop_sql_table(kind, name)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stores.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "stores.rst").write_text(rst(results))
    if args.publish_docs:
        (ROOT / "docs" / "_static" / "performance" / "stores.rst.inc").write_text(rst(results))
    print(rst(results))
    return 0
