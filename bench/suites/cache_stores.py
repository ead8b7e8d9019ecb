"""memcached and Django's cache beside Redis, as the lock store of singletask's own task.

Options: ``--out DIR`` (default ``bench/results``), ``--publish-docs``.

singletask's own task (``bench.singletask.noop``, locked per argument) with its lock in each
store, in the same run: Redis (a private ``redis-server``), memcached (a private ``memcached``)
and ``django://`` over a ``PyMemcacheCache`` of that memcached. Four measurements:

1. **Round trips per execution**, counted on the server: Redis's read events (as in the main
   benchmark), memcached's command counters (``get``/``gets`` keys, stores including ``add`` and
   ``cas``, ``incr``, ``touch``, ``delete``); each of the store's commands is one request.
2. **Added time per task**: eager executions (``task_always_eager``, Celery's tracer) of the
   singleton task minus those of a plain task, in the same round, stores in a shuffled order.
3. **Throughput**: a real ``celery worker -P prefork`` on the Redis broker works through a queue
   of distinct singleton tasks; tasks per second, and the ratio to a plain task's rate measured
   in the same round. ``django://`` is not run in a worker (it would need a Django project); it
   is the memcached store, so its worker rate is memcached's.
4. **Acquire at 100,000 held locks**: the backend's acquire+release of fresh keys, timed one by
   one on an empty store and on one holding 100,000 locks, alternately. memcached gets 256 MB so
   that nothing is evicted; the evictions counted are reported.

The broker is always the private Redis: only the lock store changes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pymemcache.client.base import Client

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
    worker_throughput,
)
from tests.servers import MemcachedServer, start_memcached

#: The second (empty) Redis store of measurement 4.
EMPTY_DB = 3

#: memcached's counters of the commands a lock store sends (each is one request and answer).
MEMCACHED_COMMANDS = (
    "cmd_get", "cmd_set", "cmd_touch", "incr_hits", "incr_misses", "decr_hits", "decr_misses",
    "delete_hits", "delete_misses",
)  # fmt: skip


def memcached_requests(server: MemcachedServer) -> int:
    client = Client(("127.0.0.1", server.port), default_noreply=False)
    try:
        stats = client.stats()
        return sum(int(stats[name.encode()]) for name in MEMCACHED_COMMANDS)
    finally:
        client.close()


def configure_django(memcached: MemcachedServer) -> None:
    """Django settings for this process: the ``locks`` cache on the benchmark's memcached."""
    from django.conf import settings

    settings.configure(
        CACHES={
            "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
            "locks": {
                "BACKEND": "django.core.cache.backends.memcached.PyMemcacheCache",
                "LOCATION": f"127.0.0.1:{memcached.port}",
            },
        }
    )


def overhead(
    server: RedisServer, memcached: MemcachedServer, urls: dict[str, str], cfg: dict[str, Any]
) -> dict[str, Any]:
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

    for kind in runners:  # warm up: connect, load scripts
        batch_us(run(kind), 0, 20)
    trips: dict[str, float] = {}
    for kind in runners:
        count = cfg["executions"]
        if kind == "redis":
            counters = ServerCounters(server.url(LOCK_DB))
            before = counters.snapshot()
            batch_us(run(kind), 10**6 + 10**5 * len(trips), count)
            trips[kind] = ServerCounters.delta(before, counters.snapshot())["round_trips"] / count
            counters.client.close()
        else:
            before_requests = memcached_requests(memcached)
            batch_us(run(kind), 10**6 + 10**5 * len(trips), count)
            trips[kind] = (memcached_requests(memcached) - before_requests) / count
        log(f"cache stores: {kind}: {trips[kind]:.2f} round trips per execution")
    added: dict[str, list[float]] = {kind: [] for kind in runners}
    per: dict[str, list[float]] = {kind: [] for kind in [*runners, "plain"]}
    for number in range(cfg["rounds"]):
        first = 3 * 10**6 + number * cfg["executions"]
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
        log(
            f"cache stores: round {number + 1}: "
            + ", ".join(f"{n} {v:.0f}us" for n, v in us.items())
        )
    for app in apps.values():
        app.close()
    return {
        "round_trips": trips,
        "us_per_execution": {name: summary(values) for name, values in per.items()},
        "added_us": {kind: summary(values) for kind, values in added.items()},
    }


def rst(results: dict[str, Any]) -> str:
    """The table of docs/performance.rst ("memcached and Django's cache")."""
    held = results["config"]["held"]
    head = ("store", "round trips / execution", "added µs / task", "worker tasks/s (vs plain)",
            f"acquire µs, empty / {held:,} held")  # fmt: skip
    rows = []
    for kind in results["stores"]:
        trips = results["overhead"]["round_trips"][kind]
        added = results["overhead"]["added_us"][kind]["median"]
        tp = results["throughput"].get(kind, {})
        rate, ratio = tp.get("tasks_per_second", {}).get("median"), tp.get("vs_plain", {})
        scale = results["held"].get(kind)
        rows.append((
            f"``{kind}``",
            f"{trips:.2f}",
            f"{added:.0f}",
            f"{rate:.0f} ({ratio['median']:.2f})" if rate and ratio.get("median") else "—",
            f"{scale['acquire_us_empty']:.0f} / {scale['acquire_us_held']:.0f}" if scale else "—",
        ))  # fmt: skip
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    line = "  ".join("=" * w for w in widths)
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    body = [fmt.format(*row).rstrip() for row in rows]
    return "\n".join([line, fmt.format(*head).rstrip(), line, *body, line]) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench cache_stores", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="tiny configuration (a minute)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--publish-docs", action="store_true",
        help="also write docs/_static/performance/cache_stores.rst.inc",
    )  # fmt: skip
    args = parser.parse_args(argv)
    cfg = CONFIGS["quick" if args.quick else "full"]
    with tempfile.TemporaryDirectory(prefix="singletask-cache-stores-") as tmp:
        workdir = Path(tmp)
        server = RedisServer(workdir / "redis")
        server.start()
        memcached = start_memcached(memory_mb=256)
        empty_memcached = start_memcached(memory_mb=256)
        configure_django(memcached)
        urls = {
            "redis": server.url(LOCK_DB),
            "memcached": memcached.url,
            "django-memcached": "django://locks",
        }
        try:
            results = {
                "config": cfg,
                "stores": list(urls),
                "machine": {"cpus": os.cpu_count(), "load": os.getloadavg()},
                "versions": {"memcached": Client(("127.0.0.1", memcached.port)).version().decode()},
                "overhead": overhead(server, memcached, urls, cfg),
                # Django's cache needs a Django project in the worker; it is the memcached store
                "throughput": worker_throughput(
                    server,
                    {k: u for k, u in urls.items() if not k.startswith("django")},
                    cfg,
                    workdir,
                ),
                "held": held_locks(
                    {
                        "redis": (server.url(LOCK_DB), server.url(EMPTY_DB)),
                        "memcached": (memcached.url, empty_memcached.url),
                    },
                    cfg,
                    label="cache stores",
                ),
            }
            evictions = Client(("127.0.0.1", memcached.port), default_noreply=False)
            results["held"]["memcached_evictions"] = int(evictions.stats()[b"evictions"])
            evictions.close()
        finally:
            server.stop()
            memcached.stop()
            empty_memcached.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cache_stores.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "cache_stores.rst").write_text(rst(results))
    if args.publish_docs:
        target = ROOT / "docs" / "_static" / "performance" / "cache_stores.rst.inc"
        target.write_text(rst(results))
    print(rst(results))
    return 0
