"""The example project of the "Testing your tasks" page passes, run as its users would run it.

``examples/testing/`` is a small project with its own ``pytest.ini``; docs/testing.rst includes its
files. Each run here is a separate ``pytest`` process started in that folder, so singletask's
plugin is loaded through its ``pytest11`` entry point, exactly as in a user's project.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import redis

from ..servers import unavailable

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ROOT / "examples" / "testing"


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args]


def pytest_in(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m pytest`` in ``folder`` (its own ini file applies), without caches."""
    return subprocess.run(
        command(*args), cwd=folder, env=ENV, capture_output=True, text=True, timeout=180
    )


ENV = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> dict[str, subprocess.CompletedProcess[str] | str]:
    """The example project run twice at the same time: in-process locks on two xdist workers,
    and locks on the session's Redis (``--singletask-backend-url``)."""
    commands = {"memory": command("-n", "2")}
    found: dict[str, subprocess.CompletedProcess[str] | str] = {}
    try:
        url = request.getfixturevalue("redis_url")
        with redis.Redis.from_url(url) as client:
            client.ping()
    except (pytest.skip.Exception, redis.RedisError) as exc:
        found["redis"] = str(exc)
    else:
        commands["redis"] = command(f"--singletask-backend-url={url}")
    processes = {
        name: subprocess.Popen(
            args, cwd=PROJECT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, args in commands.items()
    }
    for name, process in processes.items():
        try:
            stdout, stderr = process.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        found[name] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    return found


def passed(runs: dict[str, subprocess.CompletedProcess[str] | str], name: str) -> str:
    run = runs[name]
    if isinstance(run, str):
        unavailable(run)
        return ""
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def test_the_example_project_passes_on_two_xdist_workers(
    runs: dict[str, subprocess.CompletedProcess[str] | str],
) -> None:
    """Eager tests and in-process worker tests, in two pytest-xdist processes."""
    assert "9 passed" in passed(runs, "memory")


def test_the_example_project_passes_on_a_real_redis(
    runs: dict[str, subprocess.CompletedProcess[str] | str],
) -> None:
    """``--singletask-backend-url`` puts the fixture's locks on a real server instead."""
    assert "9 passed" in passed(runs, "redis")


def test_the_plugin_turns_off_with_p_no_singletask() -> None:
    """``-p no:singletask`` removes the fixtures (and nothing else)."""
    run = pytest_in(PROJECT, "-p", "no:singletask", "test_eager.py::test_which_calls_share_a_lock")
    assert run.returncode == 0, run.stdout + run.stderr
    run = pytest_in(
        PROJECT, "-p", "no:singletask", "test_eager.py::test_a_duplicate_sync_is_skipped"
    )
    assert run.returncode == 1
    assert "fixture 'singletask_locks' not found" in run.stdout


def test_the_fixtures_act_on_celery_app_or_else_the_current_app(tmp_path: Path) -> None:
    """Without a ``singletask_app`` of the project's own, the fixtures pick the right app."""
    # Given a project that does not say which app to isolate
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\naddopts = -p no:celery -p celery.contrib.pytest\n"
    )
    (tmp_path / "test_default_app.py").write_text(
        textwrap.dedent(
            """
            import celery

            current = celery.Celery("current")  # becomes the current app


            def test_celery_app_when_the_test_uses_it(celery_app, singletask_locks):
                assert singletask_locks.app is celery_app


            def test_the_current_app_otherwise(singletask_locks):
                assert singletask_locks.app is current
            """
        )
    )

    # When its tests run / Then both pass
    run = pytest_in(tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 passed" in run.stdout
