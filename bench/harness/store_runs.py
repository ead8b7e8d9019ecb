"""What the two lock store suites (``stores`` and ``cache_stores``) measure the same way.

Their configurations, a timed batch of calls, measurement 3 (a real prefork worker per store),
measurement 4 (acquire with ``held`` locks held, against an empty store), and the requests the
SQL drivers send.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from bench import ROOT
from bench.harness.app import make_app
from bench.harness.common import BROKER_DB, PROBE_DB, RedisServer, log, quantile, summary
from bench.suites import throughput
from singletask.backends import backend_from_url

CONFIGS: dict[str, dict[str, Any]] = {
    "full": {"executions": 1000, "rounds": 7, "messages": 1000, "tp_rounds": 3, "held": 100_000,
             "cycles": 2000},
    "quick": {"executions": 100, "rounds": 2, "messages": 100, "tp_rounds": 1, "held": 2000,
              "cycles": 100},
}  # fmt: skip


@contextmanager
def request_counter() -> Iterator[list[int]]:
    """Count the requests the PostgreSQL and MySQL drivers send (one per ``execute``)."""
    import psycopg
    import pymysql.cursors

    counted = [0]
    originals = (psycopg.Cursor.execute, pymysql.cursors.Cursor.execute)

    def counting(original: Callable[..., Any]) -> Callable[..., Any]:
        def execute(self: Any, *args: Any, **kwargs: Any) -> Any:
            counted[0] += 1
            return original(self, *args, **kwargs)

        return execute

    psycopg.Cursor.execute = counting(originals[0])  # type: ignore[method-assign]
    pymysql.cursors.Cursor.execute = counting(originals[1])  # type: ignore[method-assign]
    try:
        yield counted
    finally:
        psycopg.Cursor.execute, pymysql.cursors.Cursor.execute = originals  # type: ignore[method-assign]


def batch_us(run: Callable[[int], Any], first: int, count: int) -> float:
    """Microseconds per call of ``run(i)`` for ``count`` calls from ``i = first``."""
    start = time.perf_counter()
    for i in range(first, first + count):
        run(i)
    return (time.perf_counter() - start) / count * 1e6


def worker_throughput(
    server: RedisServer, urls: dict[str, str], cfg: dict[str, Any], workdir: Path
) -> dict[str, Any]:
    """Measurement 3: a real prefork worker per store (and a plain task in each round)."""
    out: dict[str, Any] = {}
    for kind, url in urls.items():
        producer = make_app(
            broker=server.url(BROKER_DB), lock_url=url, probe_url=server.url(PROBE_DB),
            variants=["plain", "singletask"],
        )  # fmt: skip
        env = {
            **os.environ, "PYTHONPATH": str(ROOT), "BENCH_BROKER_URL": server.url(BROKER_DB),
            "BENCH_LOCK_URL": url, "BENCH_PROBE_URL": server.url(PROBE_DB),
            "BENCH_VARIANTS": "plain,singletask",
        }  # fmt: skip
        result = throughput.run(
            server, env, producer, ["plain", "singletask"], messages=cfg["messages"],
            rounds=cfg["tp_rounds"], concurrency=2, cap=60.0, workdir=workdir / f"tp-{kind}",
        )  # fmt: skip
        producer.close()
        variants = result["variants"]
        out[kind] = {
            "tasks_per_second": variants["singletask"]["tasks_per_second"],
            "plain_tasks_per_second": variants["plain"]["tasks_per_second"],
            "vs_plain": variants["singletask"]["vs_plain"],
            "all_complete": variants["singletask"]["all_complete"],
        }
    return out


def _hold(backend: Any, prefix: str, meta: dict[str, str], i: int) -> None:
    backend.acquire(f"{prefix}{i}", "h", 3600.0, meta=meta)


def held_locks(
    stores: dict[str, tuple[str, str]],
    cfg: dict[str, Any],
    *,
    label: str,
    filler: Callable[[str, str], Any] | None = None,
) -> dict[str, Any]:
    """Measurement 4: acquire of fresh keys, in a store holding ``held`` locks and in an empty
    store of the same kind, alternately (so that both see the same moments of the machine).

    ``stores`` maps each kind to its (held, empty) URLs; ``filler(kind, url)``, if given, makes
    the backend the held locks are written with (closed afterwards), else the held store's own
    backend writes them. The held locks stay: the caller stops or drops the stores.
    """
    out: dict[str, Any] = {}
    run = uuid.uuid4().hex[:8]
    meta = {"task_id": "bench", "task": "bench.held", "hostname": "bench", "pid": "1"}
    for kind, (held_url, empty_url) in stores.items():
        held_store, empty_store = backend_from_url(held_url), backend_from_url(empty_url)
        writer = filler(kind, held_url) if filler is not None else None
        start = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            prefix = f"bench:{kind}:{run}:held:"
            list(pool.map(partial(_hold, writer or held_store, prefix, meta), range(cfg["held"])))
        fill_rate = cfg["held"] / (time.perf_counter() - start)
        if writer is not None:
            writer.close()
        timings: dict[str, list[float]] = {"empty": [], "held": []}
        for i in range(-1, cfg["cycles"]):
            for name, backend in (("empty", empty_store), ("held", held_store)):
                key, token = f"bench:{kind}:{run}:free:{i}", f"t{i}"
                begin = time.perf_counter()
                backend.acquire(key, token, 60.0, meta=meta)
                if i >= 0:  # the first cycle connects (and creates a table)
                    timings[name].append((time.perf_counter() - begin) * 1e6)
                backend.release(key, token)
        held_store.close()
        empty_store.close()
        empty, held = timings["empty"], timings["held"]
        out[kind] = {
            "acquire_us_empty": quantile(empty, 0.5),
            "acquire_us_held": quantile(held, 0.5),
            "acquire_us_held_p90": quantile(held, 0.9),
            "held_vs_empty": summary(h / e for h, e in zip(held, empty, strict=True)),
            "acquires_per_second_filling": fill_rate,
        }
        log(f"{label}: {kind}: acquire {out[kind]['acquire_us_empty']:.0f}us empty, "
            f"{out[kind]['acquire_us_held']:.0f}us with {cfg['held']} held")  # fmt: skip
    return out
