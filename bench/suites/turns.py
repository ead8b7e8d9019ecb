"""Fair turns (docs/fair-turns.rst), measured on a real prefork worker: one tenant floods a
shared limit, the others' syncs start in their turn or after the flood.

The experiment is tests/e2e/test_fair_turns.py's: tenant ``a`` sends 40 syncs at once, ``b``
and ``c`` 5 each right after; each sync takes one unit of a named limit of 1 on a worker of 2
pool processes, retries every 0.3 s (plus jitter) until it has room, and runs for 0.2 s. It
runs with ``singletask_limit_turns`` on, then off (today's first-come-back), in one run, on
the test session's private Redis (broker and lock store). Per run it reports:

* ``before_b``, ``before_c``: how many of a's syncs started before b's (c's) last one;
* ``jain``: Jain's fairness index (sum x)^2 / (n sum x^2) of the starts per tenant while all
  three have a sync waiting (from the first start after the last send to the start that
  leaves one tenant with none); 1 is an even share, 1/3 all turns to one tenant;
* ``takes_per_start``: the takes of the limit per start (refused takes are its retries; each
  take is one round trip to the lock store, a refused take with a ticket included);
* ``makespan``: seconds from the first start to the last end (50 syncs of 0.2 s: 10 s at best).

Writes ``bench/results/turns.json`` and ``turns.rst``. About a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
LINE = re.compile(r"FAIR-TURNS \S+=(?P<on>\d) (?P<fields>.*)")


def measure(turns: bool) -> dict[str, Any]:
    """One run of the e2e experiment, with fair turns on or off: its printed figures."""
    env = {**os.environ, "SINGLETASK_E2E_LIMIT_TURNS": "1" if turns else "0",
           "PYTHONPATH": str(ROOT)}  # fmt: skip
    command = [sys.executable, "-m", "pytest", "-q", "-s", "-n", "0", "-p", "no:cacheprovider",
               "tests/e2e/test_fair_turns.py"]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    match = LINE.search(done.stdout)
    if match is None:
        raise SystemExit(f"the experiment printed no figures:\n{done.stdout[-3000:]}")
    fields = dict(item.split("=", 1) for item in match["fields"].split())
    figures: dict[str, Any] = {"turns": turns, "order": fields.pop("order")}
    figures.update({k: float(v) for k, v in fields.items()})
    return figures


def table(runs: list[dict[str, Any]]) -> str:
    rows = [
        ("fair turns", "a's starts before b's / c's last", "Jain's index", "takes per start",
         "makespan (s)"),
    ]  # fmt: skip
    for run in runs:
        rows.append((
            "on" if run["turns"] else "off (first come back)",
            f"{run['before_b']:.0f} / {run['before_c']:.0f} of 40", f"{run['jain']:.3f}",
            f"{run['takes_per_start']:.1f}", f"{run['makespan']:.1f}",
        ))  # fmt: skip
    out = [".. list-table::", "   :header-rows: 1", ""]
    for row in rows:
        out.append(f"   * - {row[0]}")
        out += [f"     - {cell}" for cell in row[1:]]
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench turns", description=__doc__)
    parser.parse_args(argv)
    runs = [measure(True), measure(False)]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "turns.json").write_text(json.dumps(runs, indent=2) + "\n")
    (RESULTS / "turns.rst").write_text(table(runs))
    print(table(runs))
    for run in runs:
        print(f"{'on ' if run['turns'] else 'off'} {run['order']}")
    return 0
