"""``singletask locks`` on a large Redis database where KEYS is disabled: time and memory.

Starts a private ``redis-server`` on a free loopback port with ``KEYS`` renamed away (so any
use of it would fail), fills database 0 with ``--unrelated`` keys of another application
(strings and hashes) and ``--locks`` singletask locks (taken through the Redis store, so each
is laid out as a worker's), then runs ``singletask locks --url ... --json`` as a subprocess,
``--rounds`` times, and reports its wall time, its peak memory (maximum
resident set size of the child) and the number of locks it listed. A second fill with five times
as many locks shows whether the memory grows with the number of locks (it must not: the command
streams pages).

::

    python -m bench locks_scale                   # 100,000 unrelated keys, 10,000 locks
    python -m bench locks_scale --quick           # 2,000 and 200, for the test suite
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from bench import ROOT
from singletask.backends.redis import RedisBackend
from singletask.protocol.tokens import execution_token
from tests.servers import RedisServer, redis_server_binary

TASK = "bench.sync"


def fill(client: redis.Redis, unrelated: int, locks: int, start: int = 0) -> None:
    """Write ``unrelated`` foreign keys, then take ``locks`` singletask locks (numbered from
    ``start``) through the Redis store itself, so they are laid out as a worker's are."""
    with client.pipeline(transaction=False) as pipe:
        for i in range(unrelated):
            if i % 2:
                pipe.set(f"cache:{start + i}", "x" * 40)
            else:
                pipe.hset(f"session:{start + i}", mapping={"user": str(i), "data": "y" * 30})
            if i % 5000 == 4999:
                pipe.execute()
        pipe.execute()
    backend = RedisBackend(client=client)
    now = time.time()
    for i in range(locks):
        task_id = str(uuid.uuid4())
        meta = {
            "task": TASK if i % 2 else f"{TASK}.other", "scope": "execution",
            "hostname": f"celery@worker-{i % 8}", "pid": str(1000 + i % 50),
            "since": f"{now:.3f}", "task_id": task_id,
        }  # fmt: skip
        key = f"singletask:{TASK}:{start + i:064x}"
        taken = backend.acquire(key, execution_token(task_id, 0), 3600, meta=meta)
        if not taken.acquired:
            raise RuntimeError(f"could not take {key}: {taken}")


def run_locks(url: str, *extra: str) -> dict[str, Any]:
    """Run ``singletask locks --url URL --json`` once; wall time, peak RSS, locks listed."""
    code = (
        "import resource, subprocess, sys, time, json\n"
        "start = time.perf_counter()\n"
        "done = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "seconds = time.perf_counter() - start\n"
        "rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
        "listed = len(json.loads(done.stdout)) if done.returncode == 0 else None\n"
        "print(json.dumps({'seconds': seconds, 'rss_kib': rss, 'listed': listed,\n"
        "                  'returncode': done.returncode, 'stderr': done.stderr[-500:]}))\n"
    )
    command = [sys.executable, "-m", "singletask", "locks", "--url", url, "--json", *extra]
    # A fresh measuring process each time, so RUSAGE_CHILDREN sees this one command only.
    out = subprocess.run(
        [sys.executable, "-c", code, *command], capture_output=True, text=True, check=True,
        cwd=ROOT,
    )  # fmt: skip
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def measure(url: str, rounds: int, expected: int) -> dict[str, Any]:
    runs = [run_locks(url) for _ in range(rounds)]
    for run in runs:
        if run["returncode"] != 0 or run["listed"] != expected:
            raise RuntimeError(f"singletask locks listed {run['listed']}, not {expected}: {run}")
    filtered = run_locks(url, "--task", TASK)
    if filtered["listed"] != expected // 2:
        raise RuntimeError(f"--task listed {filtered['listed']}, not {expected // 2}")
    seconds = sorted(run["seconds"] for run in runs)
    return {
        "locks": expected,
        "seconds_median": seconds[len(seconds) // 2],
        "seconds_max": seconds[-1],
        "rss_mib_max": max(run["rss_kib"] for run in runs) / 1024,
        "task_filter_seconds": filtered["seconds"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench locks_scale", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--unrelated", type=int, default=100_000)
    parser.add_argument("--locks", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="2,000 / 200, one round")
    args = parser.parse_args(argv)
    if args.quick:
        args.unrelated, args.locks, args.rounds = 2_000, 200, 1
    binary = redis_server_binary()
    if binary is None:
        print("no redis-server binary", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as workdir:
        server = RedisServer(binary, Path(workdir), extra_args=["--rename-command", "KEYS", ""])
        server.start()
        try:
            url = f"{server.url}/0"
            client = redis.Redis.from_url(url)
            try:
                client.execute_command("KEYS", "*")
            except redis.ResponseError:
                pass
            else:
                raise RuntimeError("KEYS is still enabled on the benchmark's server")
            fill(client, args.unrelated, args.locks)
            dbsize = int(client.dbsize())
            first = measure(url, args.rounds, args.locks)
            more = args.locks * 4
            fill(client, 0, more, start=args.locks)
            second = measure(url, args.rounds, args.locks + more)
            dbsize_after = int(client.dbsize())
            client.close()
        finally:
            server.stop()
    report = {
        "unrelated_keys": args.unrelated,
        "keys_in_db": dbsize,
        "keys_in_db_second": dbsize_after,
        "keys_command": "disabled (rename-command KEYS '')",
        "cpus": os.cpu_count(),
        "load_1min": os.getloadavg()[0],
        "runs": [first, second],
    }
    print(json.dumps(report, indent=2))
    return 0
