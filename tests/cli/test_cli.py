"""The ``singletask`` command line: help, version, and refusing options the demo cannot use."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from singletask import __version__
from singletask.cli import singletask

ROOT = Path(__file__).resolve().parents[2]


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(singletask, list(args), prog_name="singletask")
    return result.exit_code, result.output


def test_help_lists_the_demo() -> None:
    """`singletask --help` names the demo command."""
    # When
    code, output = invoke("--help")

    # Then
    assert code == 0, output
    assert "demo" in output
    assert "Usage: singletask" in output


def test_demo_help_documents_every_option_and_the_exit_status() -> None:
    """`singletask demo --help` says what it runs, its options and what its exit status means."""
    # When
    code, output = invoke("demo", "--help")

    # Then
    assert code == 0, output
    for option in ["--quick", "--broker", "--backend", "--locks", "--concurrency", "--plain"]:
        assert option in output
    assert "prefork" in output
    assert "130 when interrupted" in output


def test_version() -> None:
    code, output = invoke("--version")
    assert code == 0
    assert __version__ in output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--concurrency", "1"], "1 is not in the range 2<=x<=16"),
        (["--broker", "localhost:6379"], "expected a URL such as redis://"),
        (["--broker", "memory://"], "lives inside one process"),
        (["--broker", "nosuchtransport://x"], "no kombu transport"),
        (["--backend", "cache+memory://"], "lives inside one process"),
        (["--backend", "nosuchbackend://x"], "no Celery result backend"),
        (["--locks", "memory://"], "lives inside one process"),
        (["--locks", "etcd://x"], "known schemes: "),
        (["--locks", "sqlite:///:memory:"], "private to one process"),
        (["--colour"], "No such option"),
    ],
)
def test_a_bad_option_is_refused_before_anything_starts(args: list[str], message: str) -> None:
    """A usage error: exit status 2 and a message naming the problem; no worker is started."""
    # When
    code, output = invoke("demo", *args)

    # Then
    assert code == 2, output
    assert message in output


@pytest.mark.parametrize(
    "command",
    [
        [sys.executable, "-m", "singletask", "demo", "--help"],
        # The `celery.commands` entry point of the installed package.
        [sys.executable, "-m", "celery", "singletask", "demo", "--help"],
    ],
    ids=["python -m singletask", "celery singletask"],
)
def test_the_demo_is_reachable_from_python_m_and_from_celery(command: list[str]) -> None:
    # When
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)

    # Then
    assert done.returncode == 0, done.stdout + done.stderr
    assert "--broker URL" in done.stdout
