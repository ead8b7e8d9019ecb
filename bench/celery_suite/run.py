"""Run Celery's unit suite (t/unit/tasks, t/unit/app) twice, with Celery's Task and with
SingletonTask as every task's base (:mod:`bench.celery_suite.plugin`), and diff the outcomes.

Usage: ``python -m bench.celery_suite.run CELERY_SOURCE_DIR`` with the Python of a virtualenv
that has Celery's test requirements, and singletask, installed. Exits 1 unless the tests whose
outcome differs are exactly :data:`EXPECTED`.
"""

from __future__ import annotations

import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

#: The tests that differ, and why: each checks that ``apply()`` pushes one request. A task class
#: with its own ``__call__`` (SingletonTask's takes the lock there) is called through
#: ``Task.__call__``, which pushes a copy of the tracer's request a second time; Celery's fast
#: path calls ``run`` directly only for a task with no ``__call__`` of its own.
EXPECTED = frozenset(
    {
        "t.unit.tasks.test_tasks.test_apply_task::test_apply_eager_populates_request_task",
        "t.unit.tasks.test_tasks.test_apply_task::test_apply_simulates_delivery_info",
    }
)

PLUGIN = "bench.celery_suite.plugin"
PATHS = ("t/unit/tasks", "t/unit/app")


def outcomes(report: Path) -> dict[str, str]:
    """Test id -> passed, failed, error or skipped, from a JUnit XML report."""
    found: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
        test_id = f"{case.get('classname')}::{case.get('name')}"
        if outcome == "error" or found.get(test_id) in (None, "passed"):
            found[test_id] = outcome  # an error in teardown is a second entry
    return found


def run(source: Path, report: Path, *plugins: str) -> dict[str, str]:
    args = [sys.executable, "-m", "pytest", *PATHS, "-q", "-p", "no:cacheprovider"]
    args += ["-o", "addopts=", f"--junitxml={report}"]
    for plugin in plugins:
        args += ["-p", plugin]
    started = time.monotonic()
    subprocess.run(args, cwd=source, check=False, stdout=subprocess.DEVNULL)
    print(f"  {' '.join(plugins) or 'celery.Task'}: {time.monotonic() - started:.0f}s")
    return outcomes(report)


def main(argv: list[str]) -> int:
    source = Path(argv[0]).resolve()
    plain = run(source, source / "plain.xml")
    singleton = run(source, source / "singleton.xml", PLUGIN)
    differ = {t for t in plain.keys() | singleton.keys() if plain.get(t) != singleton.get(t)}
    for test_id in sorted(differ):
        print(f"  {test_id}: {plain.get(test_id)} -> {singleton.get(test_id)}")
    print(f"{len(plain)} tests; {len(differ)} differ, {len(EXPECTED)} expected to")
    if not plain or differ != EXPECTED:
        print(f"unexpected: {sorted(differ ^ EXPECTED)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
