"""The callgrind cost benchmark (``python -m bench cost``) runs end to end in its quick mode.

It checks what the run observed, never how it compares: a figure for every contender and mode,
the plain task costing the server nothing, each lock costing the server and the client
something, and a refusal costing the server less than an execution (one round trip, not two).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ..servers import redis_server_binary, unavailable

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.bench


@pytest.mark.timeout(600)  # contenders, references and floors under Valgrind
def test_the_cost_benchmark_counts_every_contender_per_execution_and_per_refusal(
    tmp_path: Path,
) -> None:
    """``python -m bench cost --quick`` writes a row per contender and mode, with sane counts."""
    if shutil.which("valgrind") is None or shutil.which("redis-server") is None:
        unavailable("the cost benchmark needs valgrind and redis-server on PATH")
    assert redis_server_binary() is not None
    # When the benchmark runs in its small configuration
    command = [sys.executable, "-m", "bench", "cost", "--quick", "--out", str(tmp_path)]
    completed = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    assert completed.returncode == 0, f"failed:\n{completed.stderr[-4000:]}"
    # Then every contender has its figures, and what they say is sane
    results = json.loads((tmp_path / "cost.json").read_text())
    rows = results["rows"]
    assert results["raw"]["server"]["plain/execution"]["instructions"] < 1000
    for variant in ("singletask", "only-one", "cookbook"):
        execution, refusal = rows[f"{variant}/execution"], rows[f"{variant}/refusal"]
        assert execution["server_instructions"] > refusal["server_instructions"] > 1000
        assert execution["client_instructions"] > 0
        assert refusal["client_instructions"] > 0
        assert execution["client_syscalls"] > 0
    assert rows["celery-once/refusal"]["server_instructions"] > 1000
    for reference in ("EVALSHA return 0", "EVALSHA return 0, 8 arguments"):
        assert rows[reference]["server_instructions"] > 1000
    assert rows["floor: hash lock, two scripts"]["server_instructions"] > 2000
    assert rows["floor: string lock, two scripts"]["server_instructions"] > 2000
    assert rows["floor: string refusal, one script"]["server_instructions"] > 2000
    designs = [name for name in rows if name.startswith("design ")]
    assert len(designs) >= 8  # designs (two on Redis 6), two keys, two modes, EVALSHA (FCALL)
    for name in designs:
        assert rows[name]["server_instructions"] > 2000
    assert results["targets"]
    assert all(isinstance(met, bool) for met in results["targets"].values())
    assert len(results["designs"]) == len(designs) // 2
    for verdict in results["designs"].values():
        assert set(verdict) == {"execution", "refusal"}
    assert (tmp_path / "cost.rst").read_text().startswith(".. list-table::")
