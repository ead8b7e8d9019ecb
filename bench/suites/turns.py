"""Fair turns: a flood from one tenant on a shared limit, with fair turns on and off.

The experiment of docs/fair-turns.rst, on a real ``celery worker -P prefork`` of 4 processes
(more than the limit has room, so that executions meet it full and retry). The task
(bench/harness/app.py, ``bench.singletask-turns.sync``) takes one unit of ``bench-turns``, a
concurrency of 2, with the tenant as its lock key (``lock_key="{tenant}"``, a ``lock_limit``
far above any tenant's sends), ``lock_policy="retry"`` every 0.5 s, and a body of 0.25 s that
records its start and end (tenant, task id, the worker's clock) in the probe database.

One *run*: a fresh lock store and worker; tenant ``a`` sends 40 syncs at once, then ``b`` and
``c`` 5 each right after (``--quick``: 16, 3 and 3); the run ends when every sync has ended.
Each store runs fair turns on (the default) and off (``singletask_limit_turns = False``),
alternating, ``rounds`` times each. Reported per store and mode, the median over the rounds of:

* **position**: how many of ``a``'s starts came before ``b``'s last start, and before ``c``'s
  (each in the order the probe recorded the starts; the larger of the two is the table's);
* **Jain's index** over the *all-waiting window*: the window from when every tenant has a send
  waiting (the latest of the tenants' first sends) to when the first of them has none left (the
  earliest of the tenants' last starts), both included. ``x_t`` is tenant ``t``'s starts within
  the window divided by its weight (``--weights``; 1 by default); ``J = (sum x)^2 / (n * sum
  x^2)`` over the ``n = 3`` tenants: 1 when they started equally, 1/3 when one took all;
* **makespan**: from the first send to the last end (what holding room for a ticket's owner
  costs in throughput: an unused unit waits for its owner's retry);
* **attempts per start**: executions of the task (refused ones included) per body that ran;
* on Redis, **round trips per start** to the lock store (``total_reads_processed`` of a lock
  server of its own, the broker and probe being on another: every take, refused or not, every
  give), per attempt, and the commands per start (``INFO commandstats``, scripts' commands
  included). The difference on - off per start is the added cost per contended start.

Besides, **uncontended** on Redis: 20 syncs of one tenant sent one after another, each waited
for, so that every take finds room: round trips per start with turns on and off (the same, if
a take with room costs nothing more).

Stores: Redis (private servers) and SQLite (a file of the run's own) always; PostgreSQL and
MySQL (the servers of ``SINGLETASK_TEST_POSTGRES_URL`` / ``..._MYSQL_URL``, a table of the run's
own, dropped after) when they answer and their store keeps the limits' lines
(``supports_turns``). The SQL stores' round trips are sent by the worker's processes and not
counted. Nothing here is asserted: the figures are what the run saw.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
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
    Worker,
    log,
)
from singletask.backends import backend_class
from tests.e2e.turns_figures import figures
from tests.servers import SQL_URLS, drop_sql_table, sql_problem

CONFIGS: dict[str, dict[str, Any]] = {
    "full": {"flood": {"a": 40, "b": 5, "c": 5}, "rounds": 3, "processes": 4, "pause": 0.25,
             "countdown": 0.5, "uncontended": 20},
    "quick": {"flood": {"a": 16, "b": 3, "c": 3}, "rounds": 1, "processes": 4, "pause": 0.25,
              "countdown": 0.5, "uncontended": 20},
}  # fmt: skip

TASK = "bench.singletask-turns.sync"
MODES = {"on": True, "off": False}

#: The longest a run may take before it is reported as not finished.
RUN_BOUND = 300.0


class Run:
    """One store's servers for one run: the infra Redis (broker, probe), the lock store."""

    def __init__(self, infra: RedisServer, lock_url: str, lock_server: RedisServer | None) -> None:
        self.infra, self.lock_url, self.lock_server = infra, lock_url, lock_server
        self.probe = infra.client(PROBE_DB)

    def counters(self) -> ServerCounters | None:
        return None if self.lock_server is None else ServerCounters(self.lock_server.url(LOCK_DB))


def _worker(run: Run, turns: bool, cfg: dict[str, Any], workdir: Path, queue: str) -> Worker:
    env = {
        **os.environ, "PYTHONPATH": str(ROOT), "BENCH_BROKER_URL": run.infra.url(BROKER_DB),
        "BENCH_LOCK_URL": run.lock_url, "BENCH_PROBE_URL": run.infra.url(PROBE_DB),
        "BENCH_VARIANTS": "singletask-turns", "BENCH_LIMIT_TURNS": "1" if turns else "0",
        "BENCH_TURNS_COUNTDOWN": f"{cfg['countdown']:g}", "BENCH_TIMES_DIR": str(workdir),
    }  # fmt: skip
    workdir.mkdir(parents=True, exist_ok=True)
    return Worker(env, workdir / "worker.log", concurrency=cfg["processes"], queues=[queue])


def _events(run: Run, label: str) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in run.probe.lrange(f"turns:{label}", 0, -1)]


def _attempts(workdir: Path) -> int:
    return sum(
        1
        for path in workdir.glob("*.tsv")
        for line in path.read_text().splitlines()
        if line.startswith(TASK + "\t")
    )


def _wait_ended(run: Run, label: str, total: int, worker: Worker) -> bool:
    deadline = time.monotonic() + RUN_BOUND
    while time.monotonic() < deadline:
        if sum(e["event"] == "end" for e in _events(run, label)) >= total:
            return True
        if worker.process is not None and worker.process.poll() is not None:
            raise RuntimeError(f"the worker exited:\n{worker.tail()}")
        time.sleep(0.1)
    return False


def _per_start(delta: dict[str, Any] | None, starts: int, attempts: int) -> dict[str, Any]:
    if delta is None or not starts:
        return {"round_trips_per_start": None, "round_trips_per_attempt": None, "commands": {}}
    return {
        "round_trips_per_start": delta["round_trips"] / starts,
        "round_trips_per_attempt": delta["round_trips"] / attempts if attempts else None,
        "commands": {n: c / starts for n, c in sorted(delta["commands"].items())},
    }


@contextmanager
def _session(
    run: Run, turns: bool, cfg: dict[str, Any], workdir: Path
) -> Iterator[tuple[str, Any, Worker, ServerCounters | None]]:
    """A fresh worker on a queue of its own, started: the run's label, the producer's sync
    task, the worker and the lock server's counters (Redis); all closed after."""
    queue, label = f"turns-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex[:10]
    producer = make_app(broker=run.infra.url(BROKER_DB), lock_url=run.lock_url,
                        probe_url=run.infra.url(PROBE_DB), variants=["singletask-turns"],
                        queue=queue)  # fmt: skip
    worker = _worker(run, turns, cfg, workdir, queue)
    counters = run.counters()
    try:
        worker.start(run.probe)
        yield label, producer.tasks[TASK], worker, counters
    finally:
        worker.kill()
        producer.close()
        if counters:
            counters.client.close()


def flood_run(
    run: Run, turns: bool, cfg: dict[str, Any], weights: dict[str, float], workdir: Path
) -> dict[str, Any]:
    """One flood on a fresh worker; its figures."""
    with _session(run, turns, cfg, workdir) as (label, sync, worker, counters):
        before = counters.snapshot() if counters else None
        sent: dict[str, float] = {}
        began = time.time()
        for tenant, count in cfg["flood"].items():
            sent[tenant] = time.time()
            kwargs = {"pause": cfg["pause"], "weight": weights.get(tenant, 1.0)}
            for _ in range(count):
                sync.apply_async((label, tenant), kwargs)
        total = sum(cfg["flood"].values())
        finished = _wait_ended(run, label, total, worker)
        delta = ServerCounters.delta(before, counters.snapshot()) if counters and before else None
    events = _events(run, label)
    starts = [e for e in events if e["event"] == "start"]
    refused: dict[str, float] = {}
    for event in events:
        if event["event"] == "refused":
            refused[event["tenant"]] = min(event["t"], refused.get(event["tenant"], event["t"]))
    attempts = _attempts(workdir)
    found = figures(starts, sent, flood="a", weights=weights, refused=refused)
    out = {
        "turns": turns,
        "finished": finished,
        "starts": len(starts),
        "distinct_starts": len({s["task_id"] for s in starts}),
        "sent": total,
        "most_at_once": _most_at_once(events),
        "makespan_s": max((e["t"] for e in events if e["event"] == "end"), default=began) - began,
        "attempts": attempts,
        "attempts_per_start": attempts / len(starts) if starts else None,
        **found.as_dict(),
        **_per_start(delta, len(starts), attempts),
    }
    log(f"turns: {'on' if turns else 'off'}: {found}; makespan {out['makespan_s']:.1f}s, "
        f"{out['attempts_per_start'] or 0:.1f} attempts per start"
        + (f", {out['round_trips_per_start']:.1f} round trips per start"
           if out["round_trips_per_start"] is not None else ""))  # fmt: skip
    return out


def _most_at_once(events: list[dict[str, Any]]) -> int:
    running = most = 0
    for event in events:
        if event["event"] in ("start", "end"):
            running += 1 if event["event"] == "start" else -1
        most = max(most, running)
    return most


def uncontended(run: Run, turns: bool, cfg: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Syncs of one tenant, one at a time: every take finds room."""
    n = cfg["uncontended"]
    with _session(run, turns, cfg, workdir) as (label, sync, worker, counters):
        sync.apply_async((label, "warm-up"), {"pause": 0})  # connections, scripts
        _wait_ended(run, label, 1, worker)
        before = counters.snapshot() if counters else None
        for i in range(n):
            sync.apply_async((label, "solo"), {"pause": 0})
            _wait_ended(run, label, i + 2, worker)
        delta = ServerCounters.delta(before, counters.snapshot()) if counters and before else None
    return _per_start(delta, n, n)


# -- stores ------------------------------------------------------------------------------------


def _redis(workdir: Path) -> AbstractContextManager[tuple[str, RedisServer | None]]:
    @contextmanager
    def store() -> Iterator[tuple[str, RedisServer | None]]:
        server = RedisServer(workdir / f"locks-{uuid.uuid4().hex[:6]}")
        server.start()
        try:
            yield server.url(LOCK_DB), server
        finally:
            server.stop()

    return store()


def _sqlite(workdir: Path) -> AbstractContextManager[tuple[str, RedisServer | None]]:
    @contextmanager
    def store() -> Iterator[tuple[str, RedisServer | None]]:
        yield f"sqlite:///{workdir / f'locks-{uuid.uuid4().hex[:6]}.db'}", None

    return store()


def _sql(kind: str) -> Callable[[Path], AbstractContextManager[tuple[str, RedisServer | None]]]:
    def opener(_: Path) -> AbstractContextManager[tuple[str, RedisServer | None]]:
        @contextmanager
        def store() -> Iterator[tuple[str, RedisServer | None]]:
            table = f"st_bench_turns_{uuid.uuid4().hex[:8]}"
            try:
                yield f"{SQL_URLS[kind]}?table={table}", None
            finally:
                drop_sql_table(kind, table)

        return store()

    return opener


STORES: dict[str, Callable[[Path], AbstractContextManager[tuple[str, RedisServer | None]]]] = {
    "redis": _redis,
    "sqlite": _sqlite,
    "postgresql": _sql("postgresql"),
    "mysql": _sql("mysql"),
}


def _missing(kind: str) -> str | None:
    """Why a store is left out, or None."""
    if kind in ("postgresql", "mysql"):
        problem = sql_problem(kind)
        if problem:
            return problem
        url = SQL_URLS[kind]
    else:
        url = "redis://localhost" if kind == "redis" else "sqlite:///x.db"
    if not backend_class(url).supports_turns:
        return "its store keeps no limits' lines (supports_turns is False)"
    return None


# -- the report --------------------------------------------------------------------------------


def _median(rows: list[dict[str, Any]], get: Callable[[dict[str, Any]], Any]) -> float | None:
    values = [v for v in (get(r) for r in rows) if v is not None]
    return statistics.median(values) if values else None


def medians(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "position": _median(rows, lambda r: max(r["flood_before_last"].values(), default=None)),
        "position_b": _median(rows, lambda r: r["flood_before_last"].get("b")),
        "position_c": _median(rows, lambda r: r["flood_before_last"].get("c")),
        "jain": _median(rows, lambda r: r["jain"]),
        "jain_min": min((r["jain"] for r in rows if r["jain"] is not None), default=None),
        "jain_in_line": _median(rows, lambda r: r.get("jain_in_line")),
        "makespan_s": _median(rows, lambda r: r["makespan_s"]),
        "attempts_per_start": _median(rows, lambda r: r["attempts_per_start"]),
        "round_trips_per_start": _median(rows, lambda r: r["round_trips_per_start"]),
        "round_trips_per_attempt": _median(rows, lambda r: r["round_trips_per_attempt"]),
        "lost": sum(r["sent"] - r["distinct_starts"] for r in rows),
        "started_twice": sum(r["starts"] - r["distinct_starts"] for r in rows),
        "most_at_once": max(r["most_at_once"] for r in rows),
    }


def _table(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = "  ".join("=" * w for w in widths)
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    body = [fmt.format(*row).rstrip() for row in rows]
    return "\n".join([line, fmt.format(*head).rstrip(), line, *body, line])


def _f(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def rst(results: dict[str, Any]) -> str:
    """The table of docs/performance.rst ("Fair turns")."""
    flood = results["config"]["flood"]
    head = ("store", "fair turns", f"a's starts before b's / c's last (of {flood['a']})",
            "Jain's index (lowest)", "from all in line", "makespan", "attempts per start",
            "lock round trips per start", "lost / twice / most at once")  # fmt: skip
    rows = []
    for kind, modes in results["floods"].items():
        for mode in MODES:
            m = modes[mode]["median"]
            rows.append((
                kind, mode, f"{_f(m['position_b'], '.0f')} / {_f(m['position_c'], '.0f')}",
                f"{_f(m['jain'], '.2f')} ({_f(m['jain_min'], '.2f')})",
                _f(m["jain_in_line"], ".2f"),
                f"{_f(m['makespan_s'], '.1f')} s", _f(m["attempts_per_start"], ".1f"),
                _f(m["round_trips_per_start"], ".1f"),
                f"{m['lost']} / {m['started_twice']} / {m['most_at_once']}",
            ))  # fmt: skip
    text = _table(head, rows)
    solo = results.get("uncontended") or {}
    if solo:
        head2 = ("uncontended (room free), Redis", "round trips per start", "commands per start")
        rows2 = [
            (f"fair turns {mode}", _f(solo[mode]["round_trips_per_start"], ".2f"),
             ", ".join(f"{n} {c:.2f}" for n, c in solo[mode]["commands"].items()) or "—")
            for mode in MODES if mode in solo
        ]  # fmt: skip
        text += "\n\n" + _table(head2, rows2)
    notes = [f"``{kind}``: not measured ({why})" for kind, why in results["missing"].items()]
    return text + ("\n\n" + "\n".join(f"* {n}" for n in notes) if notes else "") + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench turns", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="tiny configuration (2 minutes)")
    parser.add_argument("--stores", default=",".join(STORES),
                        help=f"comma separated, of {', '.join(STORES)}")  # fmt: skip
    parser.add_argument("--rounds", type=int, help="runs per store and mode")
    parser.add_argument("--flood", default="", help='sends per tenant, e.g. "a=40,b=10,c=10"')
    parser.add_argument("--weights", default="",
                        help='tenants\' weights, e.g. "b=2" (default: all 1)')  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--publish-docs", action="store_true",
                        help="also write docs/_static/performance/turns.rst.inc")  # fmt: skip
    args = parser.parse_args(argv)
    cfg = dict(CONFIGS["quick" if args.quick else "full"])
    if args.rounds:
        cfg["rounds"] = args.rounds
    if args.flood:
        cfg["flood"] = {t: int(n) for t, _, n in (p.partition("=") for p in args.flood.split(","))}
    weights = {t: float(w) for t, _, w in (p.partition("=") for p in args.weights.split(",") if p)}
    logging.getLogger("singletask").setLevel(logging.ERROR)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load = os.getloadavg()
    floods: dict[str, dict[str, Any]] = {}
    solo: dict[str, Any] = {}
    missing: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="singletask-turns-") as tmp:
        workdir = Path(tmp)
        infra = RedisServer(workdir / "infra")
        infra.start()
        try:
            for kind in [s.strip() for s in args.stores.split(",") if s.strip()]:
                why = _missing(kind)
                if why:
                    missing[kind] = why
                    log(f"turns: leaving out {kind}: {why}")
                    continue
                runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
                for number in range(cfg["rounds"]):
                    for mode, turns in MODES.items():
                        where = workdir / f"{kind}-{mode}-{number}"
                        with STORES[kind](workdir) as (url, server):
                            log(f"turns: {kind}, turns {mode}, round {number + 1}/{cfg['rounds']}")
                            runs[mode].append(flood_run(Run(infra, url, server), turns, cfg,
                                                        weights, where))  # fmt: skip
                floods[kind] = {m: {"median": medians(r), "runs": r} for m, r in runs.items()}
                if kind == "redis":
                    for mode, turns in MODES.items():
                        with STORES[kind](workdir) as (url, server):
                            solo[mode] = uncontended(Run(infra, url, server), turns, cfg,
                                                     workdir / f"solo-{mode}")  # fmt: skip
        finally:
            infra.stop()
    results = {
        "config": cfg,
        "weights": weights,
        "started": started,
        "machine": {"cpus": os.cpu_count(), "load": load, "load_after": os.getloadavg()},
        "missing": missing,
        "floods": floods,
        "uncontended": solo,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "turns.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "turns.rst").write_text(rst(results))
    if args.publish_docs:
        (ROOT / "docs" / "_static" / "performance" / "turns.rst.inc").write_text(rst(results))
    print(rst(results))
    return 0
