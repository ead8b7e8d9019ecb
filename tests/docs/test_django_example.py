"""The Django example project (examples/django_project) runs as docs/django.rst says.

A real ``celery -A proj worker`` of the project, configured through Django settings in the
CELERY_ namespace, takes its locks in the project's ``locks`` cache (PyMemcacheCache on the
session's memcached) while ``send_orders.py`` sends duplicate syncs from a transaction's
``on_commit``. A worker pointed at the project's LocMemCache refuses to start.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ROOT / "examples" / "django_project"
BROKER_DB, RESULTS_DB = 14, 15  # databases no other test module uses


@pytest.fixture
def project_env(redis_base_url: str, memcached_url: str, tmp_path: Path) -> dict[str, str]:
    """The environment the project reads its servers from (see proj/settings.py)."""
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PYTHONDONTWRITEBYTECODE": "1",
        "SHOP_BROKER": f"{redis_base_url}/{BROKER_DB}",
        "SHOP_RESULTS": f"{redis_base_url}/{RESULTS_DB}",
        "SHOP_MEMCACHED": memcached_url.removeprefix("memcached://"),
        "SHOP_QUEUE": f"shop-{uuid.uuid4().hex[:8]}",
        "SHOP_DATABASE": str(tmp_path / "shop.sqlite3"),
    }


def worker_command() -> list[str]:
    return [
        sys.executable, "-m", "celery", "-A", "proj", "worker", "-P", "prefork", "-c", "2",
        "-l", "INFO", "-n", f"shop-{uuid.uuid4().hex[:8]}@%h",
        "--without-gossip", "--without-mingle", "--without-heartbeat",
    ]  # fmt: skip


@pytest.fixture
def worker(project_env: dict[str, str], tmp_path: Path) -> Iterator[Path]:
    """The project's worker, started and ready; yields its log file."""
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            worker_command(), cwd=PROJECT, env=project_env, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while "ready." not in log.read_text(errors="replace"):
            assert process.poll() is None, f"worker exited:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"worker not ready:\n{log.read_text()}"
            time.sleep(0.1)
        yield log
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def test_duplicate_syncs_sent_on_commit_run_once(worker: Path, project_env: dict[str, str]) -> None:
    """Ten syncs of one order sent from on_commit: one runs, the others are skipped naming it."""
    # When the project's script sends them (and checks each skip names a run that happened)
    done = subprocess.run(
        [sys.executable, "send_orders.py"], cwd=PROJECT, env=project_env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip

    # Then it succeeded, and the duplicates that met the running sync were skipped
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{worker.read_text()}"
    counts = re.search(r"sent 10 syncs of order 42: (\d+) ran, (\d+) skipped", done.stdout)
    assert counts is not None, done.stdout
    ran, skipped = int(counts[1]), int(counts[2])
    assert ran >= 1
    assert skipped >= 1
    assert ran + skipped == 10
    # And the worker took its locks through the Django cache (no lock store error logged)
    assert "BackendUnavailable" not in worker.read_text()


def test_a_worker_on_a_process_local_cache_refuses_to_start(project_env: dict[str, str]) -> None:
    """CELERY_SINGLETASK_BACKEND_URL = "django://default" (a LocMemCache): the worker stops at
    start with a ConfigurationError that says why, before it takes any task."""
    done = subprocess.run(
        worker_command(), cwd=PROJECT, env={**project_env, "SHOP_LOCKS": "django://default"},
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "ConfigurationError" in output
    assert "refuses the cache django.core.cache.backends.locmem.LocMemCache" in output
    assert "memory of one process" in output
    assert "ready." not in output
