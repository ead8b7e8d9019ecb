"""The benchmarks' one entry point: ``python -m bench SUITE [options]``, from the repository's root.

``python -m bench`` (or ``--help``) lists the suites; ``python -m bench SUITE --help`` shows a
suite's options. Each suite is a module of ``bench/suites/`` with ``main(argv) -> int``,
imported only when it runs (some need packages that only ``bench/.venv`` or the test extras
have).
"""

from __future__ import annotations

import importlib
import sys

#: Each suite: its module in ``bench/suites/`` and what it measures, in one line.
SUITES: dict[str, str] = {
    "run": "singletask beside the alternatives: overhead, throughput, duplicates, recovery, scale",
    "stores": "the lock stores side by side: Redis, PostgreSQL, MariaDB/MySQL, SQLite",
    "cache_stores": "memcached and Django's cache beside Redis",
    "beyond": "lock_limit, lock_rate, lock_debounce beside the singleton; a fleet under a rate",
    "deployments": "one Redis, a Cluster, Sentinel: cost per execution, locks lost in failovers",
    "layouts": "Redis memory per lock record, for candidate record layouts",
    "locks_scale": "`singletask locks` on a large database with KEYS disabled: time, memory",
    "cost": "instructions per execution and per refusal, counted by callgrind, beside the recipes",
    "turns": "fair turns on a flooded limit, on and off: who starts when, Jain's index, cost",
}


def usage() -> str:
    width = max(map(len, SUITES))
    lines = [
        "usage: python -m bench SUITE [options]",
        "",
        "singletask's benchmarks; `python -m bench SUITE --help` shows a suite's options.",
        "",
        "suites:",
    ]
    for name, what in SUITES.items():
        lines.append(f"  {name:<{width}}  {what}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, *rest = argv
    if name not in SUITES:
        print(f"unknown suite {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    suite = importlib.import_module(f"bench.suites.{name}")
    return int(suite.main(rest))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
