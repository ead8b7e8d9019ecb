"""``singletask web``: the command's checks, and the server it starts (a subprocess, as an
operator runs it): read-only on loopback by default, loopback host names only there, a warning
for another address.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from singletask.backends.base import LockBackend
from singletask.cli import singletask

from .helpers import hold

ROOT = Path(__file__).resolve().parents[3]


def invoke(*args: str, **env: str) -> Any:
    try:
        runner = CliRunner(mix_stderr=False)  # type: ignore[call-arg]  # click < 8.2
    except TypeError:
        runner = CliRunner()
    return runner.invoke(singletask, list(args), env=env, prog_name="singletask")


def test_the_command_refuses_release_without_a_token(tmp_path: Path) -> None:
    """--allow-release needs --token-file or SINGLETASK_WEB_TOKEN (never a plain option)."""
    url = f"sqlite:///{tmp_path}/locks.db"
    done = invoke("web", "--url", url, "--allow-release", SINGLETASK_WEB_TOKEN="")
    assert done.exit_code == 2
    assert "--allow-release needs a token" in done.stderr
    empty = tmp_path / "token"
    empty.write_text("\n")
    done = invoke("web", "--url", url, "--allow-release", "--token-file", str(empty))
    assert done.exit_code == 2
    assert "is empty" in done.stderr
    done = invoke("web", "--url", url, "--allow-release", SINGLETASK_WEB_TOKEN="short")
    assert done.exit_code == 2
    assert "at least 16 characters" in done.stderr
    assert invoke("web").exit_code == 2
    done = invoke("web", "--url", "nosuch://host")
    assert done.exit_code == 2
    assert "unknown scheme 'nosuch'" in done.stderr


def serve(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    """``python -m singletask web ARGS --port 0`` in a subprocess; returns it and its URL."""
    process = subprocess.Popen(
        [sys.executable, "-m", "singletask", "web", "--port", "0", *args],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stderr is not None
    lines = []
    for line in process.stderr:
        lines.append(line)
        if " at http://" in line:
            return process, line.rsplit(" at ", 1)[1].split()[0]
    process.wait(10)
    raise AssertionError("the page did not start:\n" + "".join(lines))


def test_the_command_serves_read_only_on_loopback_by_default(
    store: tuple[str, LockBackend],
) -> None:
    hold(store[1], "singletask:proj.sync:1", "id-1")
    process, url = serve("--url", store[0])
    try:
        assert url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(url + "api/locks", timeout=30) as answer:
            assert [r["holder"] for r in json.load(answer)["locks"]] == ["id-1"]
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(url + "api/release", method="POST"))
        assert refused.value.code == 404
        refused.value.close()
        rebound = urllib.request.Request(url + "api/locks", headers={"Host": "evil.example:80"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(rebound, timeout=30)
        assert refused.value.code == 400
        refused.value.close()
        named = urllib.request.Request(url + "api/locks", headers={"Host": "localhost"})
        with urllib.request.urlopen(named, timeout=30) as answer:
            assert answer.status == 200
    finally:
        process.terminate()
        process.communicate(timeout=30)


def test_the_command_warns_before_listening_beyond_loopback(tmp_path: Path) -> None:
    """The warning comes before the URL line (so on the first lines of the log)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "singletask", "web", "--port", "0", "--address", "0.0.0.0",
         "--url", f"sqlite:///{tmp_path}/locks.db"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stderr is not None
    first = process.stderr.readline()
    process.terminate()
    process.communicate(timeout=30)
    assert "warning: listening on 0.0.0.0, not a loopback address" in first
    assert "there is no token" in first
