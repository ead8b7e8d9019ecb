"""``python -m bench cache_stores`` (memcached and Django's cache beside Redis) runs in its tiny
configuration.

As for the main benchmark (test_bench.py), no timing is asserted: only what the run observed,
the round trips each store's server counted for one execution of a singleton task (within the
tolerance of :func:`~tests.servers.counted_on_the_server`). It runs in the ``-m bench`` step of
.ci/run.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ..servers import counted_on_the_server, redis_server_binary, unavailable

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.bench


def test_the_quick_run_counts_each_stores_round_trips(tmp_path: Path) -> None:
    """One execution of a fresh key: Redis 2 requests (two scripts); memcached 7 (acquire:
    ``gets`` finds no record, ``add`` of a free record, ``gets`` of it, ``add`` of the new fence
    counter, ``cas`` of the lock; release: ``gets``, ``cas``); ``django://`` over memcached is
    the same store, so the same 7."""
    if redis_server_binary() is None or shutil.which("memcached") is None:
        unavailable("the benchmark needs redis-server and memcached binaries")
    # When the quick configuration runs
    completed = subprocess.run(
        [sys.executable, "-m", "bench", "cache_stores", "--quick", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=170, check=False,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-4000:]

    # Then every measurement is there, with the round trips counted on the servers
    results = json.loads((tmp_path / "cache_stores.json").read_text())
    assert results["stores"] == ["redis", "memcached", "django-memcached"]
    trips = results["overhead"]["round_trips"]
    expected = {"redis": 2, "memcached": 7, "django-memcached": 7}
    assert trips.keys() == expected.keys()
    assert all(counted_on_the_server(trips[k], expected[k]) for k in expected), trips
    assert set(results["throughput"]) == {"redis", "memcached"}
    assert all(tp["all_complete"] for tp in results["throughput"].values())
    assert set(results["held"]) == {"redis", "memcached", "memcached_evictions"}
    assert results["held"]["memcached_evictions"] == 0
    assert "``memcached``" in (tmp_path / "cache_stores.rst").read_text()
