"""singletask beside the alternatives on one private Redis, in five measurements.

Five measurements, each in its own module of this folder: the lock's overhead per execution
(``overhead``), a prefork worker's throughput (``throughput``), duplicates of one key
(``contention``), how long a key stays locked after its holder dies (``recovery``) and many
keys held at once (``scale``). One private ``redis-server`` on a free loopback port is broker,
lock store and probe for all of them. The output folder (``--out``, default ``bench/results``)
receives ``results.json``, ``results.md``, ``results.rst`` and ``plot.png`` (when matplotlib is
available). See ``docs/performance.rst`` for the method.

By default the command runs again inside the benchmark's own virtualenv, ``bench/.venv``,
creating it from ``bench/requirements.txt`` when it is missing or out of date: the alternatives
(celery-singleton, celery-once, celery-heimdall) and matplotlib are installed there only, never
as dependencies of singletask. ``--here`` runs in the current interpreter instead, with the
variants whose libraries it has (the test suite does this with ``--quick``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path
from typing import Any

from bench import RESULTS, ROOT

BENCH = ROOT / "bench"
VENV = BENCH / ".venv"
REQUIREMENTS = BENCH / "requirements.txt"
STAMP = VENV / "bench-requirements.sha256"

MEASUREMENTS = ("overhead", "scale", "throughput", "contention", "recovery")

#: Sizes of the two configurations. ``quick`` takes a minute or two; ``full`` about 20 minutes.
CONFIGS: dict[str, dict[str, Any]] = {
    "full": {
        "overhead_executions": 2000,
        "overhead_rounds": 9,
        "warmup": 300,
        "budget": 3.0,
        "reject_count": 1000,
        "reject_rounds": 5,
        "throughput_messages": 2000,
        "throughput_rounds": 5,
        "throughput_concurrency": 2,
        "throughput_cap": 15.0,
        "duplicates": 24,
        "body_seconds": 1.5,
        "contention_rounds": 3,
        "contention_concurrency": 4,
        "recovery_window": 40.0,
        "recovery_rounds": 3,
        "time_limit": 3.0,
        "interval": 0.25,
        "scale_holds": 100_000,
        "scale_cycles": 5000,
        "scale_rounds": 3,
    },
    "quick": {
        "overhead_executions": 200,
        "overhead_rounds": 3,
        "warmup": 30,
        "budget": 1.0,
        "reject_count": 100,
        "reject_rounds": 2,
        "throughput_messages": 150,
        "throughput_rounds": 1,
        "throughput_concurrency": 2,
        "throughput_cap": 10.0,
        "duplicates": 6,
        "body_seconds": 0.3,
        "contention_rounds": 1,
        "contention_concurrency": 2,
        "recovery_window": 6.0,
        "recovery_rounds": 1,
        "time_limit": 2.0,
        "interval": 0.25,
        "scale_holds": 1000,
        "scale_cycles": 200,
        "scale_rounds": 2,
    },
}


def _requirements_hash() -> str:
    return hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()


def ensure_venv() -> Path:
    """bench/.venv with bench/requirements.txt installed; returns its python."""
    python = VENV / "bin" / "python"
    if python.exists() and STAMP.exists() and STAMP.read_text().strip() == _requirements_hash():
        return python
    print(f"[bench] preparing {VENV} from {REQUIREMENTS.name}", file=sys.stderr, flush=True)
    if not python.exists():
        venv.EnvBuilder(with_pip=True).create(VENV)
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "-r", str(REQUIREMENTS)], check=True
    )
    STAMP.write_text(_requirements_hash() + "\n")
    return python


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench run", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny configuration (about 1.5 minutes; 10 s for plain,singletask)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="output folder")
    parser.add_argument(
        "--only", default="", help="comma-separated variants to run (default: all available)"
    )
    parser.add_argument(
        "--skip", default="", help=f"comma-separated measurements to leave out: {MEASUREMENTS}"
    )
    parser.add_argument(
        "--here",
        action="store_true",
        help="run in the current interpreter, not bench/.venv (variants it lacks are left out)",
    )
    parser.add_argument(
        "--scale-rounds",
        type=int,
        default=None,
        help="rounds of acquire+release cycles of the scale measurement, each while the locks "
        "are held and on an empty database (default: 3, quick 2); more rounds, a steadier ratio",
    )
    parser.add_argument(
        "--publish-docs",
        action="store_true",
        help="also copy the tables and the plot to docs/_static/performance/",
    )
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if not args.here and Path(sys.prefix).resolve() != VENV.resolve():
        python = ensure_venv()
        # The same command in the venv's interpreter, from the same folder (``--out`` may be
        # relative to it), with the repository on its path for ``bench`` and ``singletask``.
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        command = [str(python), "-m", "bench", "run", *argv]
        os.execve(str(python), command, {**os.environ, "PYTHONPATH": path})

    from bench.harness import app as bench_app
    from bench.harness.common import BROKER_DB, LOCK_DB, PROBE_DB, RedisServer, log, machine_load
    from bench.report import plot, publish, report
    from bench.suites import contention, overhead, recovery, scale, throughput

    # In this process the eager executions log every duplicate they turn away: keep it quiet.
    logging.getLogger("singletask").setLevel(logging.ERROR)
    # Run in-process executions the way a worker process does: ``celery worker`` installs this
    # stack protection, after which a task's own ``__call__`` calling ``super().__call__()``
    # goes straight to ``run`` (outside a worker, Celery's ``Task.__call__`` pushes a copy of
    # the request there, a cost no worker pays). Tasks without their own ``__call__`` pass
    # through it too, as in a worker.
    from celery.app.trace import _install_stack_protection

    _install_stack_protection()
    config = dict(CONFIGS["quick" if args.quick else "full"])
    if args.scale_rounds is not None:
        config["scale_rounds"] = max(1, args.scale_rounds)
    wanted = [v for v in args.only.split(",") if v] or list(bench_app.VARIANTS)
    unknown = sorted(set(wanted) - set(bench_app.VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants: {unknown}; known: {bench_app.VARIANTS}")
    variants = [v for v in bench_app.VARIANTS if v in wanted and bench_app.available(v)]
    missing = [v for v in wanted if v not in variants]
    if missing:
        log(f"left out (library not installed in this interpreter): {', '.join(missing)}")
    skip = {m for m in args.skip.split(",") if m}

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="singletask-bench-"))
    server = RedisServer(work / "redis")
    server.start()
    log(f"private redis-server {server.version()} on {server.base_url}; work files in {work}")

    import celery
    import kombu
    import redis

    results: dict[str, Any] = {
        "quick": args.quick,
        "config": config,
        "variants": variants,
        "left_out": missing,
        "environment": {
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "load_before": machine_load(),
            "cpus": os.cpu_count(),
            "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
            "python": platform.python_version(),
            "celery": celery.__version__,
            "kombu": kombu.__version__,
            "redis_py": redis.__version__,
            "redis_server": server.version(),
            "versions": {v: bench_app.package_version(v) for v in variants},
        },
    }
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "BENCH_BROKER_URL": server.url(BROKER_DB),
        "BENCH_LOCK_URL": server.url(LOCK_DB),
        "BENCH_PROBE_URL": server.url(PROBE_DB),
        "BENCH_VARIANTS": ",".join(variants),
    }
    common = {
        "lock_url": server.url(LOCK_DB),
        "probe_url": server.url(PROBE_DB),
        "variants": variants,
    }
    eager = bench_app.make_app(broker="memory://", eager=True, **common)
    # In eager mode singletask never deduplicates when sending (every message runs at once), so
    # lock_scope='queue' would only repeat the singletask rows of the in-process measurements.
    in_process = [v for v in variants if v != "singletask-queue"]
    producer = bench_app.make_app(broker=server.url(BROKER_DB), **common)
    try:
        if "overhead" not in skip:
            # Only the benchmark talks to the server here: the counters are ours alone.
            results["overhead"] = overhead.run(
                server,
                eager,
                in_process,
                executions=config["overhead_executions"],
                rounds=config["overhead_rounds"],
                warmup=config["warmup"],
                budget=config["budget"],
            )
        if "scale" not in skip:
            results["scale"] = scale.run(
                server,
                eager,
                [
                    *(v for v in variants if v not in ("singletask-queue", "celery-heimdall-nb")),
                    "singletask-acks-late",
                ],
                holds=config["scale_holds"],
                cycles=config["scale_cycles"],
                rounds=config["scale_rounds"],
            )
        if "throughput" not in skip:
            results["throughput"] = throughput.run(
                server,
                env,
                producer,
                variants,
                messages=config["throughput_messages"],
                rounds=config["throughput_rounds"],
                concurrency=config["throughput_concurrency"],
                cap=config["throughput_cap"],
                workdir=work,
            )
        if "contention" not in skip:
            results["contention"] = {
                "duplicates": config["duplicates"],
                "concurrency": config["contention_concurrency"],
                "reject": contention.reject_in_process(
                    server,
                    eager,
                    in_process,
                    count=config["reject_count"],
                    rounds=config["reject_rounds"],
                    budget=config["budget"],
                ),
                "overlap": contention.overlap_on_workers(
                    server,
                    env,
                    producer,
                    variants,
                    duplicates=config["duplicates"],
                    body_seconds=config["body_seconds"],
                    rounds=config["contention_rounds"],
                    concurrency=config["contention_concurrency"],
                    logdir=work,
                ),
            }
        if "recovery" not in skip:
            results["recovery"] = recovery.run(
                server,
                env,
                producer,
                variants,
                window=config["recovery_window"],
                rounds=config["recovery_rounds"],
                time_limit=config["time_limit"],
                interval=config["interval"],
                logdir=work,
            )
    finally:
        results["environment"]["load_after"] = machine_load()
        server.stop()
        (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (out / "results.md").write_text(report.markdown(results))
    (out / "results.rst").write_text(publish.rst(results))
    plotted = plot.draw(results, out / "plot.png")
    if not plotted:
        log("matplotlib is not installed here: no plot.png")
    if args.publish_docs:
        docs = ROOT / "docs" / "_static" / "performance"
        docs.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out / "results.rst", docs / "results.rst.inc")
        if plotted:
            shutil.copyfile(out / "plot.png", docs / "plot.png")
        log(f"copied the tables and the plot to {docs}")
    shutil.rmtree(work, ignore_errors=True)
    log(f"done: {out / 'results.md'}")
    print(report.markdown(results))
    return 0
