"""One interaction run: a worker with a task per drawn configuration, rounds of seeded bursts
from several producers under faults at the hand-offs, a quiet period, then the ledger, the
probe, the result store and the lock store read back and judged (checker.py).

The producers: two threads of the test process; a producer whose broker is down (a closed
port, no retries: each publish fails at once); a producer whose lock store link goes through a
fault proxy that the schedule stops now and then (the store unreachable at send); and, when
``killed_producer`` is set, a producer subprocess (producer.py) killed with SIGKILL at a random
moment of its sends (a send in flight then has no reply). The worker's own link to the lock
store goes through another proxy, which the schedule cuts and stalls (the store unreachable at
run) when ``run_faults`` is set.

Each configuration carries its lock store (``Settings.stores``: Redis, and in the long run
PostgreSQL, MySQL/MariaDB and SQLite). The store is an app setting, so the configurations of
one store form a group with apps of their own (every producer role), a queue of their own and
one worker; the faults above meet every group at once, except that SQLite (a file on this
host) has no link to cut, stall or stop. A SQL server's group uses a table of the run's own
(``st_test_inter_*``, created by the store on first use, dropped after the run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import redis
from celery import Celery

from singletask.backends import backend_from_url
from singletask.backends.base import LockBackend
from singletask.backends.sql.lines import line_table
from singletask.backends.sql.sqlite.units import LINES as SQLITE_LINES
from singletask.backends.sql.sqlite.windows import CLOSED
from singletask.backends.turns import Line
from singletask.conf.runtime import app_state
from singletask.exceptions import TaskLocked
from singletask.protocol.limits import split_limit_key
from singletask.protocol.slots import split_companion
from singletask.result import Skipped

from ...faultproxy import FaultProxy, address_of
from ...servers import SQL_URLS, drop_sql_table, free_port
from . import app as interactions_app
from .checker import (
    Body,
    Charge,
    Fault,
    History,
    Outcome,
    Report,
    Residue,
    Send,
    check,
    unstored_endings,
)
from .sends import ENDING_WEIGHTS, FAULT_SHARE, SendPlan, perform, plan_round
from .space import STORES, Config, draw, find
from .turns_rules import Refusal, Ticket

__all__ = ["SCENARIOS", "Settings", "run", "run_seed"]

ROOT = Path(__file__).resolve().parents[3]
SEED_VARIABLE = "SINGLETASK_INTERACTIONS_SEED"

#: Named scenarios: a configuration the generator can draw (space.find checks it is in the
#: accepted space), and the endings and faults that make the interaction it targets likely.
SCENARIOS: dict[str, dict[str, Any]] = {
    # 1: a debounced send whose publish fails must not wipe out the burst.
    "debounce-publish-fails": {
        "options": {"lock_debounce": 1.0},
        "endings": {"return": 1},
        "fault_share": 0.35,
    },
    # 2: a coalescing follow-up whose publish fails must give its claim back.
    "coalesce-publish-fails": {
        "options": {"lock_scope": "coalesce"},
        "endings": {"return": 1},
        "fault_share": 0.35,
        "sleep": (0.3, 0.6),
    },
    # 3: queue scope, a rate and skip: a queued message refused by the rate.
    "queue-rate-skip": {
        "options": {"lock_scope": "queue", "lock_rate": "2/s"},
        "endings": {"return": 1},
        "fault_share": 0.0,
    },
    # 4: debounce, the body's own retry, a new send during the retry's countdown.
    "debounce-body-retry": {
        "options": {"lock_debounce": 0.5},
        "endings": {"retry": 3, "return": 1},
        "fault_share": 0.0,
    },
    # 5: a rate, skip, and a body retry sooner than the interval.
    "rate-body-retry": {
        "options": {"lock_rate": "2/s"},
        "endings": {"retry": 3, "return": 1},
        "fault_share": 0.0,
    },
    # Issue 30: "replace", bodies long enough to be preempted, retried and killed ones among them.
    "replace-preempts": {
        "options": {"lock_policy": "replace"},
        "endings": {"return": 4, "retry": 1, "raise": 1, "kill": 1},
        "fault_share": 0.1,
        "sleep": (0.3, 0.6),
    },
    # Issue 30: "replace" with two slots and lock_replace_terminate.
    "replace-terminate": {
        "options": {"lock_policy": "replace", "lock_limit": 2, "lock_replace_terminate": True},
        "endings": {"return": 3, "retry": 1},
        "fault_share": 0.0,
        "sleep": (0.3, 0.6),
    },
    # Issue 30: lock_coalesce "latest", failing publishes among the calls made during a run.
    "coalesce-latest": {
        "options": {"lock_scope": "coalesce", "lock_coalesce": "latest"},
        "endings": {"return": 3, "retry": 1},
        "fault_share": 0.3,
        "sleep": (0.3, 0.6),
    },
    # Named limits shared by three tasks of one store, each with its own policy, form of
    # lock_limits and key limit (one with lock_cost), bodies long enough to fill them.
    "limits-shared": {
        "configs": [
            {"lock_limits": "pool+budget"},
            {"lock_limits": "gate", "lock_policy": "retry", "lock_limit": 2},
            {"lock_limits": "budget", "lock_policy": "raise", "lock_limit": 3, "lock_cost": 2},
        ],
        "endings": {"return": 4, "retry": 1, "raise": 1, "kill": 1},
        "fault_share": 0.1,
        "sleep": (0.2, 0.5),
    },
    # lock_cost with a named limit's rate (lock_rate is refused with lock_cost: an execution
    # holds a key of its own).
    "cost-rate": {
        "options": {"lock_limit": 2, "lock_cost": 2, "lock_limits": "budget"},
        "endings": {"return": 1},
        "fault_share": 0.0,
    },
}

#: The share of rounds made of the configurations of one lock store that name one same limit
#: (when two or more do), rather than drawn from all: their executions compete for its units.
SHARED_ROUNDS = 0.5


def campaign_seed() -> int:
    value = os.environ.get(SEED_VARIABLE, "").strip()
    return int(value) if value else random.SystemRandom().randrange(1, 2**31)


@dataclass
class Settings:
    """What one run does."""

    configs: int = 2
    rounds: int = 1
    seconds: float | None = None  # run rounds until this much time has passed, if set
    burst: float = 2.5  # seconds of sends per round
    sends_per_key: int = 6
    keys: int = 2
    quiet_bound: float = 25.0  # seconds with no send resolving that end the wait (_wait_quiet)
    killed_producer: bool = False
    run_faults: bool = False
    store_faults_at_send: bool = True
    scenario: str | None = None
    concurrency: int = 3
    configs_per_round: int = 2
    stores: tuple[str, ...] = ("redis",)  # of space.STORES; the first carries the most


@dataclass
class Servers:
    redis_base_url: str
    broker_db: int = 8
    results_db: int = 9
    locks_db: int = 10
    probe_db: int = 11

    def url(self, db: int) -> str:
        return f"{self.redis_base_url}/{db}"


#: The stores that are a file on this host: no link for a fault proxy to cut, stall or stop.
UNLINKED: frozenset[str] = frozenset({"sqlite"})
#: Seconds a SQL store allows to connect, to run a statement and to wait for a pooled
#: connection: longer than the longest stall the schedule draws.
SQL_TIMEOUT = 2.0


def _store_url(servers: Servers, store: str, workdir: Path) -> tuple[str, str | None]:
    """The URL of ``store`` for one run, and the SQL table of the run's own (None: none)."""
    if store not in STORES:
        raise ValueError(f"not a store of the campaign: {store!r}")
    if store == "redis":
        return servers.url(servers.locks_db), None
    if store == "sqlite":
        return f"sqlite:///{workdir / f'interactions-{uuid.uuid4().hex[:8]}.db'}", None
    table = f"st_test_inter_{uuid.uuid4().hex[:10]}"
    base = SQL_URLS[store]
    return f"{base}{'&' if '?' in base else '?'}table={table}&timeout={SQL_TIMEOUT}", table


@dataclass
class Group:
    """The configurations of one lock store: their producers' apps, queue, worker and links
    (the worker's, ``run_link``, and the store-link producer's, ``send_link``; None for a
    store with no link)."""

    store: str
    configs: list[Config]
    url: str
    queue: str
    table: str | None = None
    run_link: FaultProxy | None = None
    send_link: FaultProxy | None = None
    apps: dict[str, Celery] = field(default_factory=dict)
    worker: WorkerProcess | None = None

    @property
    def worker_url(self) -> str:
        return self.url if self.run_link is None else self.run_link.url_for(self.url)

    def app_kwargs(self, servers: Servers, prefix: str, locks: str | None = None) -> dict[str, Any]:
        return {
            "broker": servers.url(servers.broker_db),
            "results": servers.url(servers.results_db),
            "locks": locks or self.url,
            "queue": self.queue,
            "prefix": prefix,
            "configs": self.configs,
        }

    def to_json(self) -> dict[str, Any]:
        """What a producer subprocess needs to send this group's tasks (through the worker's
        link, as the worker reaches the store)."""
        return {
            "configs": [c.to_json() for c in self.configs],
            "locks": self.worker_url,
            "queue": self.queue,
        }


class WorkerProcess:
    """``celery -A tests.campaigns.interactions.app worker`` with the run's configurations."""

    def __init__(self, env: dict[str, str], log: Path, app: Celery, concurrency: int) -> None:
        self.env, self.log, self.app, self.concurrency = env, log, app, concurrency
        self.nodename = f"interactions-{uuid.uuid4().hex[:8]}@%h"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> None:
        self.launch()
        self.wait_ready(timeout)

    def launch(self) -> None:
        command = [
            sys.executable, "-m", "celery", "-A", "tests.campaigns.interactions.app", "worker",
            "-P", "prefork", "-c", str(self.concurrency), "-n", self.nodename, "-l", "INFO",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
            # Task events on: every configuration, ending and fault also runs singletask's event
            # sending (singletask_send_events follows -E), which must never change an outcome.
            "-E",
        ]  # fmt: skip
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def wait_ready(self, timeout: float = 60.0) -> None:
        assert self.process is not None
        hostname = self.nodename.replace("%h", os.uname().nodename)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"worker exited with {self.process.returncode}: {self.tail()}")
            with contextlib.suppress(OSError):
                if self.app.control.ping(destination=[hostname], timeout=0.5):
                    return
            time.sleep(0.2)
        raise RuntimeError(f"worker did not answer within {timeout}s: {self.tail()}")

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        # Every process of the worker writes its threads' stacks into the log first (app.py):
        # an execution still running at the end of the run shows where it stands.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGUSR2)
        time.sleep(0.5)
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def _dead_broker(app_kwargs: dict[str, Any]) -> Celery:
    """A producer whose broker is down: a closed port, no retries, so a publish raises
    OperationalError at once."""
    dead = interactions_app.make_app(
        **{**app_kwargs, "broker": f"redis://127.0.0.1:{free_port()}/0"}
    )
    dead.conf.update(
        broker_connection_timeout=0.5,
        broker_connection_retry=False,
        broker_connection_max_retries=1,
        task_publish_retry=False,
        broker_transport_options={**dead.conf.broker_transport_options, "max_retries": 0},
    )
    return dead


def _configs(rng: random.Random, settings: Settings) -> list[Config]:
    if settings.scenario is None:
        return draw(rng, settings.configs, settings.stores)
    scenario = SCENARIOS[settings.scenario]
    chosen = scenario.get("configs") or [scenario["options"]]
    return [Config(n, find(options), settings.stores[0]) for n, options in enumerate(chosen)]


def _round_configs(rng: random.Random, configs: Sequence[Config], count: int) -> list[Config]:
    """The configurations of a round: ``count`` of ``configs``; or, in a share of the rounds
    (SHARED_ROUNDS), those of one store that name one same limit, when two or more do."""
    chosen = rng.sample(list(configs), min(count, len(configs)))
    sharing: dict[tuple[str, str], list[Config]] = {}
    for config in configs:
        for name in config.costs(1):
            sharing.setdefault((config.store, name), []).append(config)
    groups = [group for _, group in sorted(sharing.items()) if len(group) > 1]
    if groups and rng.random() < SHARED_ROUNDS:
        group = rng.choice(groups)
        chosen = rng.sample(group, min(count, len(group)))
    return chosen


@contextlib.contextmanager
def _cluster(
    servers: Servers, configs: Sequence[Config], workdir: Path, settings: Settings, prefix: str
) -> Iterator[list[Group]]:
    """One :class:`Group` per store the configurations name, each with its worker started."""
    queue = f"interactions-{uuid.uuid4().hex[:8]}"
    probe = servers.url(servers.probe_db)
    os.environ[interactions_app.ENV_PROBE] = probe
    stack = contextlib.ExitStack()
    with stack:
        groups: list[Group] = []
        for store in dict.fromkeys(c.store for c in configs):
            url, table = _store_url(servers, store, workdir)
            group = Group(store, [c for c in configs if c.store == store], url,
                          f"{queue}-{store}", table)  # fmt: skip
            if table is not None:  # dropped last, once every client of it has ended
                stack.callback(drop_sql_table, store, table)
                stack.callback(_close_stores, group)
            if store not in UNLINKED:
                group.run_link = stack.enter_context(FaultProxy(address_of(url)))
                group.send_link = stack.enter_context(FaultProxy(address_of(url)))
            app_kwargs = group.app_kwargs(servers, prefix)
            group.apps = {"main": interactions_app.make_app(**app_kwargs),
                          "dead-broker": _dead_broker(app_kwargs)}  # fmt: skip
            if group.send_link is not None:
                linked = group.send_link.url_for(url)
                group.apps["store-link"] = interactions_app.make_app(
                    **{**app_kwargs, "locks": linked}
                )
            for app in group.apps.values():
                # An AsyncResult collected after the result store has stopped (at the
                # session's end, from a failed test's kept frames) unsubscribes from it in its
                # __del__: without this, Celery's reconnection retries hold the process at exit.
                app.conf.result_backend_transport_options = {"retry_policy": {"max_retries": 0}}
                stack.callback(app.close)
            env = {
                **os.environ,
                "PYTHONPATH": str(ROOT),
                interactions_app.ENV_CONFIGS: json.dumps([c.to_json() for c in group.configs]),
                interactions_app.ENV_BROKER: app_kwargs["broker"],
                interactions_app.ENV_RESULTS: app_kwargs["results"],
                interactions_app.ENV_LOCKS: group.worker_url,
                interactions_app.ENV_QUEUE: group.queue,
                interactions_app.ENV_PREFIX: prefix,
                interactions_app.ENV_PROBE: probe,
            }
            log = workdir / f"worker-{store}.log"
            group.worker = WorkerProcess(env, log, group.apps["main"], settings.concurrency)
            stack.callback(group.worker.stop)
            groups.append(group)
        for group in groups:  # the workers start side by side
            assert group.worker is not None
            group.worker.launch()
        for group in groups:
            assert group.worker is not None
            group.worker.wait_ready()
        yield groups


def _close_stores(group: Group) -> None:
    """Close the test process's clients of ``group``'s store (its SQL table is dropped next)."""
    for app in group.apps.values():
        with contextlib.suppress(Exception):
            app_state(app).backend.close()


def _producer_env(groups: Sequence[Group], prefix: str, servers: Servers) -> dict[str, str]:
    """The environment of a producer subprocess: every group's tasks, store and queue."""
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        interactions_app.ENV_GROUPS: json.dumps([g.to_json() for g in groups]),
        interactions_app.ENV_BROKER: servers.url(servers.broker_db),
        interactions_app.ENV_RESULTS: servers.url(servers.results_db),
        interactions_app.ENV_PREFIX: prefix,
        interactions_app.ENV_PROBE: servers.url(servers.probe_db),
    }


def _producer_of(plan: SendPlan, apps: Mapping[str, dict[str, Celery]]) -> Celery:
    """The app that makes ``plan``'s send: its configuration's store's, in the plan's role (a
    store with no link makes the store-link producer's sends with its main app)."""
    mine = apps[plan.config]
    return mine.get(plan.producer, mine["main"])


def _run_plans(
    plans: Sequence[SendPlan], apps: Mapping[str, dict[str, Celery]], run: str, start: float
) -> list[Send]:
    """Make every send at its time, one thread per producer; return the ledger."""
    ledger: list[Send] = []
    mutex = threading.Lock()
    by_seq = {p.seq: p for p in plans}
    producers = sorted({p.producer for p in plans})

    def produce(name: str) -> None:
        for plan in plans:
            if plan.producer != name or (plan.partner is not None and plan.partner < plan.seq):
                continue
            delay = start + plan.at - time.time()
            if delay > 0:
                time.sleep(delay)
            partner = by_seq.get(plan.partner) if plan.partner is not None else None
            sends = perform(_producer_of(plan, apps), plan, run, partner)
            with mutex:
                ledger.extend(sends)

    threads = [threading.Thread(target=produce, args=(n,), daemon=True) for n in producers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return ledger


def _store_faults(
    rng: random.Random, links: Sequence[tuple[str, FaultProxy]], until: float, side: str,
    faults: list[Fault],
) -> threading.Thread:  # fmt: skip
    """Stop, stall or cut ``links`` (each store's) at random moments until ``until``
    (time.time()), every store's at once."""
    stores = tuple(store for store, _ in links)
    proxies = [link for _, link in links]

    def loop() -> None:
        while time.time() < until:
            time.sleep(rng.uniform(0.3, 1.2))
            kind = rng.choice(("cut", "stall", "stop"))
            lasting = rng.uniform(0.2, 0.8)
            began = time.time()
            for link in proxies:
                {"cut": link.cut, "stall": link.stall, "stop": link.stop}[kind]()
            if kind != "cut":
                time.sleep(lasting)
                for link in proxies:
                    (link.resume if kind == "stall" else link.start)()
            faults.append(Fault(f"store-{kind}-at-{side}", began, time.time(), side, stores))

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def _killed_producer(
    plans: Sequence[SendPlan], env: dict[str, str], workdir: Path, run: str, start: float,
    kill_at: float,
) -> tuple[subprocess.Popen[bytes], Path]:  # fmt: skip
    plan_file = workdir / f"plans-{run}-{start:.0f}.json"
    ledger_file = workdir / f"ledger-{run}-{start:.0f}.jsonl"
    plan_file.write_text(json.dumps({"plans": [p.to_json() for p in plans], "start": start,
                                     "run": run}))  # fmt: skip
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.campaigns.interactions.producer", str(plan_file),
         str(ledger_file)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip

    def killer() -> None:
        time.sleep(max(0.0, kill_at - time.time()))
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)

    threading.Thread(target=killer, daemon=True).start()
    return process, ledger_file


def _read_killed_ledger(path: Path) -> list[Send]:
    sends: dict[int, Send] = {}
    if not path.exists():
        return []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue  # the line the kill cut short
        sends[entry["seq"]] = Send(**entry)
    return list(sends.values())


def _date(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = datetime.datetime.fromisoformat(value)
    if value.tzinfo is None:
        value = value.replace(tzinfo=datetime.timezone.utc)
    return float(value.timestamp())


def _outcome(app: Celery, task_id: str) -> Outcome:
    meta = app.backend.get_task_meta(task_id)
    state = meta.get("status", "PENDING")
    result = meta.get("result")
    outcome = Outcome(state, date_done=_date(meta.get("date_done")))
    if isinstance(result, Skipped):
        outcome.kind, outcome.reason = "skipped", result.reason
        outcome.holder = result.holder
        outcome.holders = tuple(h for h in result.holders if h)
        outcome.limit = result.limit
    elif isinstance(result, BaseException):
        outcome.kind, outcome.exception = "exception", type(result).__name__
        if isinstance(result, TaskLocked):
            outcome.holder = result.holder
            outcome.holders = tuple(h for h in getattr(result, "holders", ()) or () if h)
            outcome.limit = getattr(result, "limit", None)
    elif state in ("SUCCESS",):
        outcome.kind = "value"
    return outcome


def _bodies(probe: redis.Redis, run: str) -> list[Body]:
    raw = probe.lrange(interactions_app.events_key(run), 0, -1)
    open_: dict[tuple[str, int, int], Body] = {}
    bodies: list[Body] = []
    for item in raw:
        e = json.loads(item)
        ident = (e["task_id"], e["retries"], e["pid"])
        if e["event"] == "start":
            body = Body(
                e["task_id"], e["retries"], e["seq"], e["key"], e["task"], e["pid"], e["fence"],
                e["t"], ending=e["ending"], redelivered=e["redelivered"],
                acquired=e.get("acquired"), units=dict(e.get("units") or {}),
            )  # fmt: skip
            open_[ident] = body
            bodies.append(body)
        elif e["event"] == "charge" and ident in open_:
            open_[ident].charges.append(
                Charge(e["name"], e["units"], e["before"], e["after"], e.get("error"))
            )
        elif e["event"] == "end" and ident in open_:
            body = open_.pop(ident)
            body.end, body.how, body.lost = e["t"], e["how"], bool(e.get("lost"))
    return bodies


def _residues(group: Group, prefix: str) -> list[Residue]:
    """What ``group``'s store still holds of the run's keys: every lock and reservation (the
    store's own listing) and hold of a named limit's concurrency (its listing of limits), then
    the records it keeps beside them that still act: open debounce windows, pending follow-up
    claims, rate records. Kept by design, and so not listed: closed
    windows, fencing tokens, completion markers (docs/guarantees.rst)."""
    found: list[Residue] = []
    backend: LockBackend = backend_from_url(group.url)
    try:
        for key, holder in backend.iter_locks(prefix):
            kind = "reservation" if holder.token.endswith(":reserved") else "lock"
            detail = f"{group.store}: token {holder.token}, ttl {holder.ttl}"
            found.append(Residue(key, kind, holder.task_id, detail))
        for state in backend.iter_state(prefix):
            if state.kind != "limit" or state.detail.get("period") is not None:
                continue  # a rate's starts count for their period, whatever the executions did
            for hold in state.detail.get("holds") or ():
                detail = (
                    f"{group.store}: {hold.get('units')} units, token {hold.get('token')}, "
                    f"ttl {hold.get('ttl')}"
                )
                found.append(Residue(state.key, "limit hold", hold.get("task_id"), detail,
                                     group.store))  # fmt: skip
    finally:
        backend.close()
    records = {"redis": _redis_records, "sqlite": _sqlite_records}.get(group.store, _sql_records)
    return found + records(group, prefix)


def _refusals(probe: redis.Redis, run: str) -> list[Refusal]:
    """The refusals the workers recorded (``lock_conflict``), in the order recorded."""
    found = []
    for item in probe.lrange(interactions_app.events_key(run), 0, -1):
        e = json.loads(item)
        if e["event"] == "refused":
            found.append(Refusal(e["task"], e["task_id"], int(e["retries"]), e.get("key"),
                                 e.get("holder"), e["action"], float(e["t"])))  # fmt: skip
    return found


def _tickets(group: Group, prefix: str) -> list[Ticket]:
    """The tickets the limits' lines of ``group``'s store still hold (fair turns): the line of
    each limit under ``prefix``, as the store keeps it (singletask.backends.turns.Line)."""
    lines: list[tuple[str, str | bytes, float]] = []  # (limit key, line JSON, seconds per unit)
    if group.store == "redis":
        client = redis.Redis.from_url(group.url)
        try:
            for raw in client.scan_iter(match="*}:turns", count=1000):
                companion = split_companion(raw.decode())
                text = client.get(raw)
                if companion is not None and companion[0].startswith(prefix) and text:
                    lines.append((companion[0], text, 1e-6))
        finally:
            client.close()
    elif group.store == "sqlite":
        conn = sqlite3.connect(group.url.removeprefix("sqlite:///"), timeout=10)
        try:
            query = f"SELECT key, line FROM {SQLITE_LINES}"
            rows = conn.execute(query).fetchall()
            lines += [(k, t, 1.0) for k, t in rows if k.startswith(prefix)]
        except sqlite3.OperationalError:
            pass  # no line was ever kept: the table was never made
        finally:
            conn.close()
    else:
        key = "`key`" if group.store == "mysql" else "key"
        query = f"SELECT {key}, line FROM {line_table(str(group.table))}"
        try:
            rows = _sql_rows(group.store, query)
        except Exception as exc:  # no named limit was ever taken there: the table was never made
            if "exist" not in str(exc):
                raise
            rows = []
        lines += [(_text(k), t, 1.0) for k, t in rows if _text(k).startswith(prefix)]
    found = []
    for limit_key_, text, scale in lines:
        split = split_limit_key(limit_key_)
        line = Line.from_json(json.loads(text))
        for name, ticket in line.tickets.items():
            found.append(Ticket(split[1] if split else limit_key_, bool(split and split[2]),
                                name, ticket.expires * scale, group.store))  # fmt: skip
    return found


def _redis_records(group: Group, prefix: str) -> list[Residue]:
    found: list[Residue] = []
    locks = redis.Redis.from_url(group.url)
    try:
        now_ms = time.time() * 1000
        for raw in locks.scan_iter(match="{" + prefix + "*", count=1000):
            name = raw.decode()
            if name.endswith("}:debounce"):
                fields = {k.decode(): v.decode() for k, v in locks.hgetall(raw).items()}
                if "o" in fields:
                    found.append(Residue(name, "open window", fields.get("l"), f"window {fields}"))
            elif name.endswith("}:fence"):
                fields = {k.decode(): v.decode() for k, v in locks.hgetall(raw).items()}
                if "next" in fields and float(fields.get("next_until", "0")) > now_ms:
                    found.append(
                        Residue(name, "follow-up claim", fields["next"], f"claim {fields}")
                    )
            elif name.endswith("}:rate"):
                found.append(Residue(name, "rate record", None, f"pttl {locks.pttl(raw)} ms"))
    finally:
        locks.close()
    return found


#: The SQL servers' clock, as their stores read it.
_SQL_NOW = {"postgresql": "clock_timestamp()", "mysql": "UTC_TIMESTAMP(6)"}


def _sql_records(group: Group, prefix: str) -> list[Residue]:
    """The rows of the run's table whose follow-up claim, debounce window or rate record is
    still live (singletask/backends/sql/core.py: the table's layout)."""
    now = _SQL_NOW[group.store]
    key = "`key`" if group.store == "mysql" else "key"
    query = (
        f"SELECT coalesce(full_key, {key}), next_task, next_expires, debounce_latest, "
        "debounce_until, rate_next, "
        f"coalesce(next_task IS NOT NULL AND next_expires > {now}, false), "
        f"coalesce(debounce_opened IS NOT NULL AND debounce_until > {now}, false), "
        f"coalesce(rate_next > {now}, false) FROM {group.table}"
    )
    found: list[Residue] = []
    for row in _sql_rows(group.store, query):
        name, claim, claim_until, latest, until, rate_next = (_text(v) for v in row[:6])
        if not name.lstrip("{").startswith(prefix):
            continue
        if row[6]:
            found.append(Residue(name, "follow-up claim", claim, f"next_expires {claim_until}"))
        if row[7]:
            found.append(Residue(name, "open window", latest, f"debounce_until {until}"))
        if row[8]:
            found.append(Residue(name, "rate record", None, f"rate_next {rate_next}"))
    return found


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _sql_rows(kind: str, query: str) -> list[tuple[Any, ...]]:
    if kind == "postgresql":
        import psycopg

        with psycopg.connect(SQL_URLS[kind], autocommit=True) as conn:
            return list(conn.execute(query).fetchall())  # type: ignore[arg-type]
    import pymysql

    from singletask.backends.sql.mysql import MySQLBackend

    args = MySQLBackend.from_url(SQL_URLS[kind])._connect_args
    conn = pymysql.connect(**{k: v for k, v in args.items() if k != "client_flag"})
    try:
        with conn.cursor() as cursor:
            cursor.execute(query)
            return list(cursor.fetchall())
    finally:
        conn.close()


def _sqlite_records(group: Group, prefix: str) -> list[Residue]:
    """The live rows of the SQLite store's follow-up claims (``singletask_fences``), debounce
    windows and rate records (singletask/backends/sql/sqlite/windows.py)."""
    queries = (
        ("follow-up claim", "SELECT key, next, next_until FROM singletask_fences "
         "WHERE next IS NOT NULL AND next_until > ?"),
        ("open window", "SELECT key, latest, until FROM singletask_debounce "
         f"WHERE opened != {CLOSED} AND until > ?"),
        ("rate record", "SELECT key, NULL, allowed FROM singletask_rates WHERE allowed > ?"),
    )  # fmt: skip
    found: list[Residue] = []
    conn = sqlite3.connect(group.url.removeprefix("sqlite:///"), timeout=10)
    try:
        now = time.time()
        for kind, query in queries:
            for key, task_id, until in conn.execute(query, (now,)).fetchall():
                if key.lstrip("{").startswith(prefix):
                    found.append(Residue(key, kind, task_id, f"sqlite: until {until}"))
    finally:
        conn.close()
    return found


#: The quiet wait after the last burst ends after ``quiet_bound`` seconds with no send resolving,
#: and after this many times ``quiet_bound`` whatever happens.
QUIET_ROUNDS: Final = 4


def _wait_quiet(app: Celery, ledger: Sequence[Send], probe: redis.Redis, run: str,
                bound: float) -> None:  # fmt: skip
    """Wait until every AsyncResult a caller got resolves: until ``bound`` seconds pass with
    none resolving, and at most ``QUIET_ROUNDS`` times ``bound`` in all. A backlog still
    draining (sends of a key kept full by its rate and limits, retrying on a loaded machine)
    is waited for; a send that never resolves is left for the checker to name."""
    started = time.time()
    stalled_at = started + bound
    pending = {s.returned for s in ledger if s.returned}
    while pending and time.time() < min(stalled_at, started + QUIET_ROUNDS * bound):
        bodies = _bodies(probe, run)
        unstored = unstored_endings()  # Ignore (and Reject before Celery 5.7) store nothing
        ignored = {b.task_id for b in bodies if b.how in unstored}
        still = {
            tid for tid in pending
            if tid not in ignored and app.backend.get_task_meta(tid).get("status") not in
            ("SUCCESS", "FAILURE", "REVOKED")
        }  # fmt: skip
        if still != pending:
            stalled_at = time.time() + bound
        pending = still
        time.sleep(0.5)


def run(servers: Servers, seed: int, settings: Settings, workdir: Path) -> tuple[Report, History]:
    """One run of the campaign; returns its report and the history it judged."""
    rng = random.Random(seed)
    configs = _configs(rng, settings)
    scenario = SCENARIOS.get(settings.scenario or "", {})
    endings = scenario.get("endings", ENDING_WEIGHTS)
    fault_share = scenario.get("fault_share", FAULT_SHARE)
    run_id = f"{seed}-{uuid.uuid4().hex[:6]}"
    salt = uuid.uuid4().int
    prefix = f"test:{uuid.uuid4().hex[:12]}:"
    faults: list[Fault] = []
    ledger: list[Send] = []
    started = time.time()
    probe = interactions_app.probe_client(servers.url(servers.probe_db))
    with _cluster(servers, configs, workdir, settings, prefix) as groups:
        apps = {c.name: g.apps for g in groups for c in g.configs}
        main = groups[0].apps["main"]  # every group's results are in the one result store
        links = {  # the stores with a link to cut, stall, stop (SQLite has none)
            "send": [(g.store, g.send_link) for g in groups if g.send_link is not None],
            "run": [(g.store, g.run_link) for g in groups if g.run_link is not None],
        }
        round_no, seq = 0, 0
        while True:
            chosen = _round_configs(rng, configs, settings.configs_per_round)
            producers = ["p0", "p1"] + (["store-link"] if settings.store_faults_at_send else [])
            if settings.killed_producer:
                producers.append("killed")
            plans = plan_round(
                rng, chosen, round_no, seconds=settings.burst,
                sends_per_key=settings.sends_per_key, keys=settings.keys, producers=producers,
                first_seq=seq, endings=endings, fault_share=fault_share, salt=salt,
            )  # fmt: skip
            if "sleep" in scenario:
                low, high = scenario["sleep"]
                for plan in plans:
                    plan.sleep = round(rng.uniform(low, high), 3)
            seq = max((p.seq for p in plans), default=seq) + 1
            start = time.time() + (2.0 if settings.killed_producer else 0.3)
            until = start + settings.burst
            fault_threads = []
            if settings.store_faults_at_send and links["send"]:
                fault_threads.append(_store_faults(rng, links["send"], until, "send", faults))
            if settings.run_faults and links["run"]:
                fault_threads.append(_store_faults(rng, links["run"], until, "run", faults))
            killed = None
            if settings.killed_producer:
                mine = [p for p in plans if p.producer == "killed"]
                kill_at = start + rng.uniform(0.2, settings.burst)
                env = _producer_env(groups, prefix, servers)
                killed = _killed_producer(mine, env, workdir, run_id, start, kill_at)
                faults.append(Fault("producer-killed", kill_at, kill_at, "send"))
            ours = [p for p in plans if p.producer != "killed"]
            ledger += _run_plans(ours, apps, run_id, start)
            for thread in fault_threads:
                thread.join(10)
            if killed is not None:
                killed[0].wait(30)
                ledger += _read_killed_ledger(killed[1])
            round_no += 1
            out_of_time = settings.seconds is not None and (
                time.time() - started > settings.seconds
            )
            if (settings.seconds is None and round_no >= settings.rounds) or out_of_time:
                break
        _mark_store_faults(ledger, faults, {c.name: c.store for c in configs})
        _wait_quiet(main, ledger, probe, run_id, settings.quiet_bound)
        time.sleep(1.0)  # releases after the results, rate records' last interval
        observed = time.time()
        ids = set()
        for send in ledger:
            ids.update(i for i in (send.task_id, send.returned) if i)
        outcomes = {tid: _outcome(main, tid) for tid in ids}
        for outcome in list(outcomes.values()):
            for holder in (outcome.holder, *outcome.holders):
                if holder and holder not in outcomes:
                    outcomes[holder] = _outcome(main, holder)
        residues = [r for g in groups for r in _residues(g, prefix)]
        tickets = [t for g in groups for t in _tickets(g, prefix)]
        history = History(
            seed, {c.name: c for c in configs}, ledger, _bodies(probe, run_id), outcomes,
            residues, faults, observed, refusals=_refusals(probe, run_id), tickets=tickets,
        )  # fmt: skip
        # Collect the run's AsyncResults while the result store still answers: their __del__
        # unsubscribes from it, and against a stopped server Celery's reconnection retries
        # would hold the process at exit.
        gc.collect()
    probe.close()
    # The whole history beside the workers' logs: a violation's evidence, to read afterwards.
    (workdir / "history.json").write_text(json.dumps(dataclasses.asdict(history), default=str))
    return check(history), history


def _mark_store_faults(
    ledger: Sequence[Send], faults: Sequence[Fault], stores: Mapping[str, str]
) -> None:
    """A send of the store-link producer made while its link was down met the store
    unreachable at send (it is published without deduplication or debounce); a store with no
    link (``stores``: configuration -> store) met no such fault."""
    for send in ledger:
        if send.producer != "store-link" or send.fault not in (None, "encode"):
            continue
        end = send.t_after or send.t_before
        for fault in faults:
            hit = fault.side == "send" and fault.hits(stores.get(send.config))
            if hit and fault.start <= end and send.t_before <= fault.end:
                send.fault = "store-down-at-send" + ("+encode" if send.fault else "")
                break


def run_seed(servers: Servers, settings: Settings, workdir: Path, seed: int | None = None
             ) -> tuple[int, Report, History]:  # fmt: skip
    seed = campaign_seed() if seed is None else seed
    report, history = run(servers, seed, settings, workdir)
    return seed, report, history


@dataclass
class Figures:
    """Totals over several runs."""

    reports: list[Report] = field(default_factory=list)
