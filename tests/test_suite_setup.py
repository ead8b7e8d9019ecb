"""The test suite as people run it: what it reports when a server is not configured."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_rabbitmq_end_to_end_tests_are_reported_as_skipped_with_the_reason() -> None:
    """Without SINGLETASK_TEST_AMQP_URL, the RabbitMQ runs of the end-to-end tests are collected
    and reported as skipped, saying why (they used to be left out silently). In CI they fail
    instead (see tests/servers.py)."""
    # Given an environment without SINGLETASK_TEST_AMQP_URL, outside CI
    env = {k: v for k, v in os.environ.items() if k not in ("SINGLETASK_TEST_AMQP_URL", "CI")}

    # When the RabbitMQ runs of one end-to-end module are run
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", "-rs", "-q",
         "tests/e2e/test_basic.py", "-m", "amqp"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip

    # Then they are there, skipped, with the reason
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "1 skipped" in out, out
    assert "SKIPPED" in out, out
    assert "SINGLETASK_TEST_AMQP_URL" in out, out
    assert " passed" not in out, out
