"""`singletask demo` end to end: a real prefork worker, every scenario, its summary, its cleanup.

The demo checks itself (exit status 0 only when no lock key had more runs at once than its
lock_limit, rated starts kept their interval, and every duplicate ended as its policy says);
these tests run it as a user would (``--quick``, output to a pipe, so in plain mode) and check
its summary table and what it leaves behind. The run on the embedded parts and the run on Redis
go at the same time, to keep the suite short.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import redis

from ..servers import unavailable

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
COMMAND = [sys.executable, "-m", "singletask", "demo", "--quick"]
SCENARIOS = ["burst", "customers", "retry", "raise", "periodic", "replace", "limit", "rate"]
#: The lock_limit of each scenario's task (1: a singleton); for "replace", one more while a
#: replaced run stops.
LIMITS = {"limit": 2, "rate": 3, "replace": 2}
REDIS_DB = 12  # a database no other test module uses

#: A row of the summary table: scenario, task, then submitted, ran, skipped, retried, raised,
#: max overlap per key, parallel.
ROW = re.compile(r"^  (?:\d (\w+)|(total))\s+(\w*)\s+" + r"\s+".join([r"(\d+)"] * 7) + "$", re.M)


@dataclass
class Summary:
    submitted: int
    ran: int
    skipped: int
    retried: int
    raised: int
    overlap_per_key: int
    parallel: int


@dataclass
class DemoRun:
    returncode: int
    stdout: str
    stderr: str
    tmpdir: Path

    def __str__(self) -> str:
        return f"exit status {self.returncode}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}"

    def summary(self, scenarios: list[str] = SCENARIOS) -> dict[str, Summary]:
        rows = {
            (m[1] or m[2]): Summary(*(int(n) for n in m.groups()[3:]))
            for m in ROW.finditer(self.stdout)
        }
        assert list(rows) == [*scenarios, "total"], f"no summary table in the output:\n{self}"
        return rows

    def worker_pids(self) -> list[int]:
        found = re.search(r"pid (\d+), pool processes ([\d, ]+)$", self.stdout, re.M)
        assert found, f"the output does not name the worker's processes:\n{self}"
        return [int(found[1]), *(int(pid) for pid in found[2].split(", "))]


def environment(tmpdir: Path) -> dict[str, str]:
    """The user's environment, with a temporary folder of the test's own."""
    tmpdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    env.pop("NO_COLOR", None)
    return env


def finish(process: subprocess.Popen[str], tmpdir: Path, timeout: float = 150) -> DemoRun:
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
    return DemoRun(process.returncode, stdout, stderr, tmpdir)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def assert_as_documented(run: DemoRun, scenarios: list[str] = SCENARIOS) -> None:
    """Exit status 0, and a summary whose numbers add up, with never more runs of one key at
    once than its limit."""
    assert run.returncode == 0, str(run)
    assert "OK: no lock key ever had more runs at once than its lock_limit" in run.stdout, str(run)
    assert "FAILED" not in run.stdout
    assert "PROBLEM" not in run.stdout
    rows = run.summary(scenarios)
    for name, row in rows.items():
        limit = max(LIMITS.values()) if name == "total" else LIMITS.get(name, 1)
        assert 1 <= row.overlap_per_key <= limit, f"{name}: {row}\n{run}"
        assert row.submitted == row.ran + row.skipped + row.raised, f"{name}: {row}\n{run}"
    # Each policy did its own thing: skip skips, retry waits and runs them all, raise raises.
    burst, customers, retry, raised = (rows[n] for n in ["burst", "customers", "retry", "raise"])
    assert (burst.submitted, retry.submitted, raised.submitted) == (8, 3, 3)
    assert burst.ran >= 1
    assert burst.skipped >= 1
    assert burst.raised == burst.retried == 0
    assert customers.ran >= 3  # one per customer at least
    assert retry.ran == 3
    assert retry.retried >= 1
    assert retry.skipped == retry.raised == 0
    assert raised.skipped == raised.retried == 0
    # The limit: two exports of customer 1 at once (never three), all six run, none lost
    limit = rows["limit"]
    assert (limit.submitted, limit.ran, limit.overlap_per_key) == (6, 6, 2), f"{limit}\n{run}"
    assert limit.retried >= 1
    assert limit.parallel >= 3  # customer 2 alongside
    if "replace" in rows:
        # Replace: each newer rebuild took over; the two it replaced were skipped as replaced
        replace = rows["replace"]
        assert (replace.submitted, replace.ran, replace.skipped) == (3, 1, 2), f"{replace}\n{run}"
        assert "2 runs were replaced by a newer one" in run.stdout, str(run)
    if "rate" in rows:
        # The rate: every call ran, the ones over the rate after being sent again
        rate = rows["rate"]
        assert (rate.submitted, rate.ran, rate.skipped) == (6, 6, 0), f"{rate}\n{run}"
        assert rate.retried >= 5
        spacing = re.search(r"Starts of one lock key: at least ([\d.]+)s apart", run.stdout)
        assert spacing, str(run)
        assert float(spacing[1]) >= 0.25 - 0.02
    total = rows["total"]
    assert total.submitted == sum(r.submitted for n, r in rows.items() if n != "total")


def assert_cleaned_up(run: DemoRun) -> None:
    """No process of the worker is left, and the demo's temporary folder is gone."""
    for pid in run.worker_pids():
        assert gone(pid), f"worker process {pid} is still running"
    assert list(run.tmpdir.iterdir()) == [], (
        f"left in the temporary folder: {list(run.tmpdir.iterdir())}"
    )


@pytest.fixture(scope="module")
def demo_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, DemoRun | str]:
    """The quick demo, on the embedded parts and (when the session has Redis) on Redis, at once.

    Returns ``{"embedded": DemoRun, "redis": DemoRun or why there is none}``.
    """
    started: dict[str, tuple[subprocess.Popen[str], Path]] = {}
    runs: dict[str, DemoRun | str] = {}
    tmp = tmp_path_factory.mktemp("demo")
    try:
        redis_url = f"{request.getfixturevalue('redis_base_url')}/{REDIS_DB}"
        with redis.Redis.from_url(redis_url) as client:
            client.ping()
    except (pytest.skip.Exception, redis.RedisError) as exc:
        runs["redis"] = f"no Redis server for the test session: {exc}"
    else:
        args = ["--broker", redis_url, "--backend", redis_url, "--locks", redis_url]
        started["redis"] = (spawn([*COMMAND, *args], tmp / "redis"), tmp / "redis")
    started["embedded"] = (spawn(COMMAND, tmp / "embedded"), tmp / "embedded")
    for name, (process, tmpdir) in started.items():
        runs[name] = finish(process, tmpdir)
    runs["redis_url"] = redis_url if "redis" in started else ""
    return runs


def spawn(
    command: list[str], tmpdir: Path, *, ignore_sigint: bool = False
) -> subprocess.Popen[str]:
    """Start the demo. With ``ignore_sigint``, it starts with SIGINT ignored, as ``nohup`` or a
    backgrounded shell starts processes (an ignored signal stays ignored across ``exec``); else
    with SIGINT's default disposition, whatever this process has (``restore_signals`` does not
    cover SIGINT), so the test never depends on the disposition it inherits."""
    disposition = "SIG_IGN" if ignore_sigint else "SIG_DFL"
    launcher = [
        sys.executable,
        "-c",
        f"import os, signal, sys; signal.signal(signal.SIGINT, signal.{disposition}); "
        "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])",
    ]
    return subprocess.Popen(
        [*launcher, *command[1:]],
        cwd=ROOT,
        env=environment(tmpdir),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_the_demo_needs_no_server_and_never_runs_one_lock_key_twice_at_once(
    demo_runs: dict[str, DemoRun | str],
) -> None:
    """Embedded broker, results and locks: the scenarios behave as documented, then it cleans up."""
    # Given no option (and so no server)
    run = demo_runs["embedded"]
    assert isinstance(run, DemoRun)

    # When it ran (see the fixture)

    # Then it used only the embedded parts, in its temporary folder
    assert "kombu's filesystem transport, in the run's temporary folder" in run.stdout, str(run)
    assert "SQLite (sqlite:///...), in the run's temporary folder" in run.stdout
    # And it drew a timeline row for each pool process, in plain characters (output to a pipe)
    for pid in run.worker_pids()[1:]:
        assert re.search(rf"^    pid {pid}\s+\|", run.stdout, re.M), str(run)
    assert "\x1b[" not in run.stdout
    # And its summary says every lock key ran alone, and the numbers add up
    assert_as_documented(run)
    # And it left nothing behind
    assert_cleaned_up(run)


def test_the_demo_on_redis_uses_only_the_database_given_and_leaves_no_lock_or_result(
    demo_runs: dict[str, DemoRun | str],
) -> None:
    """--broker, --backend and --locks on Redis: same behaviour; its queue, results, locks gone."""
    # Given the session's Redis server for the broker, the results and the locks
    run = demo_runs["redis"]
    if not isinstance(run, DemoRun):
        unavailable(str(run))
        return
    url = str(demo_runs["redis_url"])

    # When it ran (see the fixture)

    # Then it behaved as documented (a store that keeps no rate records, as redis:// does for
    # now, leaves the rate scenario out, and says so)
    assert f"  broker   {url}" in run.stdout, str(run)
    left_out = "Left out: a rate spaces the starts" in run.stdout
    assert_as_documented(run, [s for s in SCENARIOS if not (left_out and s == "rate")])
    assert_cleaned_up(run)
    # And in that database it left no key of its own (no lock, no released record, no companion
    # hash "{<lock key>}:fence"), no result and not its queue's binding
    prefix = re.search(r"\(lock keys of this run: (\S+)\*\)", run.stdout)
    assert prefix, str(run)
    with redis.Redis.from_url(url) as client:
        left = sorted(key.decode() for key in client.scan_iter())
    assert not [k for k in left if prefix[1] in k], left
    assert not [k for k in left if k.startswith("celery-task-meta-")], left
    assert not [k for k in left if "singletask-demo-" in k and k.startswith("_kombu")], left


def test_ctrl_c_stops_the_worker_and_deletes_the_temporary_folder(tmp_path: Path) -> None:
    """SIGINT while a scenario runs: exit status 130, no worker process left, no folder left.

    The demo is started with SIGINT ignored, as ``nohup`` or a backgrounded shell starts it: it
    must still stop on Ctrl-C (it sets its own handler, whatever it inherits).
    """
    # Given a demo, started with SIGINT ignored, that is running its first scenario
    process = spawn(COMMAND, tmp_path, ignore_sigint=True)
    lines: queue.Queue[str] = queue.Queue()
    seen: list[str] = []

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while not any(line.startswith("1. ") for line in seen):
        assert time.monotonic() < deadline, (
            "the demo did not start its first scenario:\n" + "".join(seen)
        )
        try:
            seen.append(lines.get(timeout=1))
        except queue.Empty:
            assert process.poll() is None, "".join(seen)
    time.sleep(0.3)

    # When it gets a Ctrl-C
    process.send_signal(signal.SIGINT)
    process.wait(timeout=60)
    reader.join(10)
    while not lines.empty():
        seen.append(lines.get())
    assert process.stdout is not None
    assert process.stderr is not None
    stderr = process.stderr.read()
    process.stdout.close()
    process.stderr.close()
    run = DemoRun(process.returncode, "".join(seen), stderr, tmp_path)

    # Then it says so and exits with status 130
    assert run.returncode == 130, str(run)
    assert "Interrupted." in run.stdout, str(run)
    assert "Cleaned up: no worker left running" in run.stdout, str(run)
    # And neither its worker nor a pool process is left, nor its temporary folder
    assert_cleaned_up(run)
