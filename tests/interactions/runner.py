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
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from singletask.backends.redis import RedisBackend
from singletask.exceptions import TaskLocked
from singletask.result import Skipped

from ..faultproxy import FaultProxy
from ..servers import free_port
from . import app as interactions_app
from .checker import Body, Fault, History, Outcome, Report, Residue, Send, check
from .sends import ENDING_WEIGHTS, FAULT_SHARE, SendPlan, perform, plan_round
from .space import Config, draw, find

__all__ = ["SCENARIOS", "Settings", "run", "run_seed"]

ROOT = Path(__file__).resolve().parents[2]
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
}


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
    quiet_bound: float = 25.0  # seconds after a burst for every send to resolve
    killed_producer: bool = False
    run_faults: bool = False
    store_faults_at_send: bool = True
    scenario: str | None = None
    concurrency: int = 3
    configs_per_round: int = 2


@dataclass
class Servers:
    redis_base_url: str
    broker_db: int = 8
    results_db: int = 9
    locks_db: int = 10
    probe_db: int = 11

    def url(self, db: int) -> str:
        return f"{self.redis_base_url}/{db}"


def _port(url: str) -> tuple[str, int]:
    rest = url.split("://", 1)[1].split("/", 1)[0]
    host, _, port = rest.rpartition(":")
    return host or "127.0.0.1", int(port)


class WorkerProcess:
    """``celery -A tests.interactions.app worker`` with the run's configurations."""

    def __init__(self, env: dict[str, str], log: Path, app: Celery, concurrency: int) -> None:
        self.env, self.log, self.app, self.concurrency = env, log, app, concurrency
        self.nodename = f"interactions-{uuid.uuid4().hex[:8]}@%h"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> None:
        command = [
            sys.executable, "-m", "celery", "-A", "tests.interactions.app", "worker",
            "-P", "prefork", "-c", str(self.concurrency), "-n", self.nodename, "-l", "INFO",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ]  # fmt: skip
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
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
        return draw(rng, settings.configs)
    options = find(SCENARIOS[settings.scenario]["options"])
    return [Config(0, options)]


@contextlib.contextmanager
def _cluster(
    servers: Servers, configs: Sequence[Config], workdir: Path, settings: Settings, prefix: str
) -> Iterator[dict[str, Any]]:
    locks = servers.url(servers.locks_db)
    queue = f"interactions-{uuid.uuid4().hex[:8]}"
    run_link = FaultProxy(_port(locks))
    send_link = FaultProxy(_port(locks))
    stack = contextlib.ExitStack()
    with stack:
        stack.enter_context(run_link)
        stack.enter_context(send_link)
        app_kwargs = {
            "broker": servers.url(servers.broker_db),
            "results": servers.url(servers.results_db),
            "locks": locks,
            "queue": queue,
            "prefix": prefix,
            "configs": configs,
        }
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            interactions_app.ENV_CONFIGS: json.dumps([c.to_json() for c in configs]),
            interactions_app.ENV_BROKER: app_kwargs["broker"],
            interactions_app.ENV_RESULTS: app_kwargs["results"],
            interactions_app.ENV_LOCKS: run_link.url_for(locks),
            interactions_app.ENV_QUEUE: queue,
            interactions_app.ENV_PREFIX: prefix,
            interactions_app.ENV_PROBE: servers.url(servers.probe_db),
        }
        os.environ[interactions_app.ENV_PROBE] = env[interactions_app.ENV_PROBE]
        apps = {
            "main": interactions_app.make_app(**app_kwargs),
            "dead-broker": _dead_broker(app_kwargs),
            "store-link": interactions_app.make_app(
                **{**app_kwargs, "locks": send_link.url_for(locks)}
            ),
        }
        for app in apps.values():
            # An AsyncResult collected after the result store has stopped (at the session's
            # end, from a failed test's kept frames) unsubscribes from it in its __del__:
            # without this, Celery's reconnection retries hold the process at exit.
            app.conf.result_backend_transport_options = {"retry_policy": {"max_retries": 0}}
            stack.callback(app.close)
        worker = WorkerProcess(env, workdir / "worker.log", apps["main"], settings.concurrency)
        stack.callback(worker.stop)
        worker.start()
        yield {
            "apps": apps, "worker": worker, "run_link": run_link, "send_link": send_link,
            "env": env, "locks": locks,
        }  # fmt: skip


def _producer_of(plan: SendPlan, apps: dict[str, Celery]) -> Celery:
    if plan.producer == "dead-broker":
        return apps["dead-broker"]
    if plan.producer == "store-link":
        return apps["store-link"]
    return apps["main"]


def _run_plans(
    plans: Sequence[SendPlan], apps: dict[str, Celery], run: str, start: float
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
    rng: random.Random, link: FaultProxy, until: float, side: str, faults: list[Fault]
) -> threading.Thread:
    """Stop, stall or cut ``link`` at random moments until ``until`` (time.time())."""

    def loop() -> None:
        while time.time() < until:
            time.sleep(rng.uniform(0.3, 1.2))
            kind = rng.choice(("cut", "stall", "stop"))
            lasting = rng.uniform(0.2, 0.8)
            began = time.time()
            if kind == "cut":
                link.cut()
            elif kind == "stall":
                link.stall()
                time.sleep(lasting)
                link.resume()
            else:
                link.stop()
                time.sleep(lasting)
                link.start()
            faults.append(Fault(f"store-{kind}-at-{side}", began, time.time(), side))

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
        [sys.executable, "-m", "tests.interactions.producer", str(plan_file), str(ledger_file)],
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
    elif isinstance(result, BaseException):
        outcome.kind, outcome.exception = "exception", type(result).__name__
        if isinstance(result, TaskLocked):
            outcome.holder = result.holder
            outcome.holders = tuple(h for h in getattr(result, "holders", ()) or () if h)
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
            )  # fmt: skip
            open_[ident] = body
            bodies.append(body)
        elif ident in open_:
            body = open_.pop(ident)
            body.end, body.how = e["t"], e["how"]
    return bodies


def _residues(locks: redis.Redis, prefix: str) -> list[Residue]:
    found: list[Residue] = []
    for key, holder in RedisBackend(client=locks).iter_locks(prefix):
        kind = "reservation" if holder.token.endswith(":reserved") else "lock"
        found.append(Residue(key, kind, holder.task_id, f"token {holder.token}, ttl {holder.ttl}"))
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
                found.append(Residue(name, "follow-up claim", fields["next"], f"claim {fields}"))
        elif name.endswith("}:rate"):
            found.append(Residue(name, "rate record", None, f"pttl {locks.pttl(raw)} ms"))
    return found


def _wait_quiet(app: Celery, ledger: Sequence[Send], probe: redis.Redis, run: str,
                bound: float) -> None:  # fmt: skip
    """Wait until every AsyncResult a caller got resolves (or the bound passes)."""
    deadline = time.time() + bound
    pending = {s.returned for s in ledger if s.returned}
    while pending and time.time() < deadline:
        bodies = _bodies(probe, run)
        ignored = {b.task_id for b in bodies if b.how == "ignore"}
        pending = {
            tid for tid in pending
            if tid not in ignored and app.backend.get_task_meta(tid).get("status") not in
            ("SUCCESS", "FAILURE", "REVOKED")
        }  # fmt: skip
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
    locks = redis.Redis.from_url(servers.url(servers.locks_db))
    with _cluster(servers, configs, workdir, settings, prefix) as cluster:
        apps = cluster["apps"]
        round_no, seq = 0, 0
        while True:
            chosen = rng.sample(configs, min(settings.configs_per_round, len(configs)))
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
            if settings.store_faults_at_send:
                fault_threads.append(
                    _store_faults(rng, cluster["send_link"], until, "send", faults)
                )
            if settings.run_faults:
                fault_threads.append(_store_faults(rng, cluster["run_link"], until, "run", faults))
            killed = None
            if settings.killed_producer:
                mine = [p for p in plans if p.producer == "killed"]
                kill_at = start + rng.uniform(0.2, settings.burst)
                killed = _killed_producer(mine, cluster["env"], workdir, run_id, start, kill_at)
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
        _mark_store_faults(ledger, faults)
        _wait_quiet(apps["main"], ledger, probe, run_id, settings.quiet_bound)
        time.sleep(1.0)  # releases after the results, rate records' last interval
        ids = set()
        for send in ledger:
            ids.update(i for i in (send.task_id, send.returned) if i)
        outcomes = {tid: _outcome(apps["main"], tid) for tid in ids}
        for outcome in list(outcomes.values()):
            for holder in (outcome.holder, *outcome.holders):
                if holder and holder not in outcomes:
                    outcomes[holder] = _outcome(apps["main"], holder)
        history = History(
            seed, {c.name: c for c in configs}, ledger, _bodies(probe, run_id), outcomes,
            _residues(locks, prefix), faults,
        )  # fmt: skip
        # Collect the run's AsyncResults while the result store still answers: their __del__
        # unsubscribes from it, and against a stopped server Celery's reconnection retries
        # would hold the process at exit.
        gc.collect()
    probe.close()
    locks.close()
    return check(history), history


def _mark_store_faults(ledger: Sequence[Send], faults: Sequence[Fault]) -> None:
    """A send of the store-link producer made while its link was down met the store
    unreachable at send (it is published without deduplication or debounce)."""
    for send in ledger:
        if send.producer != "store-link" or send.fault not in (None, "encode"):
            continue
        end = send.t_after or send.t_before
        for fault in faults:
            if fault.side == "send" and fault.start <= end and send.t_before <= fault.end:
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
