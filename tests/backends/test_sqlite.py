"""SQLite-only behaviour: URLs, refusals that state the backend's limits, several processes."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from singletask import ConfigurationError
from singletask.backends import backend_from_url
from singletask.backends.sql.sqlite import SQLiteBackend
from singletask.exceptions import BackendTimeout, LockKeyError
from singletask.protocol.slots import slot_index, slot_keys


def test_sqlite_urls_follow_the_sqlalchemy_convention(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a URL with four slashes (absolute) and one with three (relative to the cwd)
    monkeypatch.chdir(tmp_path)
    absolute = backend_from_url(f"sqlite:///{tmp_path}/abs.db")
    relative = backend_from_url("sqlite:///rel.db")

    # Then both are SQLite backends on the files named
    assert isinstance(absolute, SQLiteBackend)
    assert absolute.path == tmp_path / "abs.db"
    assert isinstance(relative, SQLiteBackend)
    assert relative.path == Path("rel.db")
    # And the database file and table appear at first use
    assert relative.acquire("k", "t", 5).acquired
    assert (tmp_path / "rel.db").exists()


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:"])
def test_a_database_private_to_one_process_is_refused(url: str) -> None:
    with pytest.raises(ConfigurationError, match="one host") as info:
        backend_from_url(url)
    assert "memory://" in str(info.value)


def test_a_missing_folder_is_refused_with_the_limits_stated(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="does not exist") as info:
        backend_from_url(f"sqlite:///{tmp_path}/missing/locks.db")
    assert "one host" in str(info.value)


def test_the_database_runs_in_wal_mode(tmp_path: Path) -> None:
    backend = SQLiteBackend(tmp_path / "locks.db")
    backend.acquire("k", "t", 5)
    with sqlite3.connect(tmp_path / "locks.db") as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    backend.close()


def _contend(path: str, worker: int, rounds: int, results: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """In a separate process: take the lock, check nobody else is inside, leave, repeat."""
    backend = SQLiteBackend(path)
    inside = Path(path).with_suffix(".inside")
    wins = overlaps = 0
    for n in range(rounds):
        token = f"w{worker}-{n}"
        if backend.acquire("shared", token, 10).acquired:
            wins += 1
            try:
                inside.mkdir()  # atomic: fails if another holder is inside
            except FileExistsError:
                overlaps += 1
            else:
                time.sleep(0.001)
                inside.rmdir()
            assert backend.release("shared", token)
    results.put((wins, overlaps))


def test_processes_sharing_the_file_never_hold_the_lock_together(tmp_path: Path) -> None:
    # Given four processes competing for one key in the same database file
    path = str(tmp_path / "locks.db")
    SQLiteBackend(path).acquire("warm-up", "t", 1)  # create the database before the race
    results: multiprocessing.Queue = multiprocessing.Queue()  # type: ignore[type-arg]
    workers = [
        multiprocessing.Process(target=_contend, args=(path, i, 150, results)) for i in range(4)
    ]

    # When they all acquire and release as fast as they can
    for process in workers:
        process.start()
    for process in workers:
        process.join(60)
    outcomes = [results.get(timeout=5) for _ in workers]

    # Then each finished, won sometimes, and no two were ever inside at once
    assert all(process.exitcode == 0 for process in workers)
    assert sum(wins for wins, _ in outcomes) > 0
    assert sum(overlaps for _, overlaps in outcomes) == 0


def _contend_for_slots(path: str, worker: int, rounds: int, results: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """In a separate process: take one of 2 slots, check nobody else is in it, leave, repeat."""
    backend = SQLiteBackend(path)
    wins = overlaps = 0
    for n in range(rounds):
        token = f"w{worker}-{n}"
        taken = backend.acquire_slot("shared", 2, token, 10)
        if taken.acquired:
            assert taken.key is not None
            wins += 1
            inside = Path(path).with_suffix(f".inside-{slot_index(taken.key)}")
            try:
                inside.mkdir()  # atomic: fails if another holder of this slot is inside
            except FileExistsError:
                overlaps += 1
            else:
                time.sleep(0.001)
                inside.rmdir()
            assert backend.release(taken.key, token)
    results.put((wins, overlaps))


def test_processes_sharing_the_file_never_share_a_holder_slot(tmp_path: Path) -> None:
    # Given four processes competing for the two slots of one key in the same database file
    path = str(tmp_path / "locks.db")
    SQLiteBackend(path).acquire("warm-up", "t", 1)  # create the database before the race
    results: multiprocessing.Queue = multiprocessing.Queue()  # type: ignore[type-arg]
    workers = [
        multiprocessing.Process(target=_contend_for_slots, args=(path, i, 100, results))
        for i in range(4)
    ]

    # When they all acquire and release as fast as they can
    for process in workers:
        process.start()
    for process in workers:
        process.join(60)
    outcomes = [results.get(timeout=5) for _ in workers]

    # Then each finished, won sometimes, and no slot ever had two holders at once
    assert all(process.exitcode == 0 for process in workers)
    assert sum(wins for wins, _ in outcomes) > 0
    assert sum(overlaps for _, overlaps in outcomes) == 0


def test_slots_are_listed_under_a_hash_tagged_or_brace_prefix(tmp_path: Path) -> None:
    """A key prefix with a hash tag keeps its slots in one key range; a prefix of only ``{``
    lists each slot once; a prefix that only a slot key's brace starts with lists nothing."""
    backend = SQLiteBackend(tmp_path / "locks.db")
    tagged, plain = "{st}:app.export", "app.sync"
    for key in (tagged, plain):
        for n in range(3):
            assert backend.acquire_slot(key, 3, f"{key}-{n}", 30).acquired

    def listed(prefix: str) -> list[str]:
        keys = [k for k, _ in backend.iter_locks(prefix, page_size=2)]
        assert len(keys) == len(set(keys))
        return sorted(keys)

    assert listed("{st}:") == sorted(slot_keys(tagged, 3))
    assert listed("app.") == sorted(slot_keys(plain, 3))
    assert listed("") == sorted(slot_keys(tagged, 3) + slot_keys(plain, 3))
    assert listed("{") == sorted(slot_keys(tagged, 3))
    assert listed("{app.") == []
    backend.close()


def test_a_lock_key_of_thousands_of_characters_is_an_ordinary_lock(tmp_path: Path) -> None:
    """No size limit on a key: a 12,000-character one is acquired, listed under a long prefix,
    renewed and released like any other; a key that is not valid text is a LockKeyError, not
    a driver error."""
    backend = SQLiteBackend(tmp_path / "locks.db")
    key = "app:long:" + "é" * 12_000  # 24,000 bytes
    twin = key[:-1] + "e"

    first = backend.acquire(key, "t1", 30)
    assert first.acquired
    assert backend.acquire(twin, "t2", 30).acquired
    assert not backend.acquire(key, "rival", 30).acquired
    assert sorted(k for k, _ in backend.iter_locks(key[:11_000])) == sorted([key, twin])
    assert backend.extend(key, "t1", 30)
    assert backend.release(key, "t1")
    assert backend.acquire(key, "t3", 30).fence > first.fence
    with pytest.raises(LockKeyError):
        backend.acquire("bad\ud800key", "t", 30)
    backend.close()


def test_a_database_of_an_older_version_gains_rate_and_debounce_tables(tmp_path: Path) -> None:
    """A file made before rate records and debounce windows (only the lock and fence tables,
    with a lock held) serves them on first use, and keeps its lock."""
    path = tmp_path / "locks.db"
    old = SQLiteBackend(path)
    assert old.acquire("held", "t0", 30).acquired
    old.close()
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TABLE singletask_rates")
        conn.execute("DROP TABLE singletask_debounce")
    conn.close()

    backend = SQLiteBackend(path)
    assert backend.acquire_slot("k", 1, "t1", 30, interval=30).acquired
    assert backend.debounce("k", "send-1", 30) == (None, 0.0, None)
    holder = backend.holder("held")
    assert holder is not None
    assert holder.token == "t0"
    backend.close()


def test_rate_records_and_debounce_windows_are_never_listed_as_locks(tmp_path: Path) -> None:
    backend = SQLiteBackend(tmp_path / "locks.db")
    assert backend.acquire_slot("app.rated", 2, "t1", 30, interval=30).acquired
    assert backend.release("app.rated", "t1")
    backend.debounce("app.debounced", "send-1", 30)
    assert backend.acquire("app.plain", "t2", 30).acquired

    assert [key for key, _ in backend.iter_locks("")] == ["app.plain"]
    assert [key for key, _ in backend.iter_locks("app.", page_size=1)] == ["app.plain"]
    backend.close()


def test_records_that_ran_out_are_deleted_when_a_process_opens_the_file(tmp_path: Path) -> None:
    path = tmp_path / "locks.db"
    backend = SQLiteBackend(path)
    assert backend.acquire_slot("short", 1, "t1", 30, interval=0.05).acquired
    backend.debounce("short", "send-1", 0.05)
    assert backend.acquire_slot("long", 1, "t2", 30, interval=30).acquired
    backend.debounce("long", "send-2", 30)
    backend.close()
    time.sleep(0.1)

    # A write opens the file: it prunes (a read, holder() or a listing, changes nothing).
    assert SQLiteBackend(path).release("any", "token") is False
    with sqlite3.connect(path) as conn:
        rates = [k for (k,) in conn.execute("SELECT key FROM singletask_rates")]
        windows = [k for (k,) in conn.execute("SELECT key FROM singletask_debounce")]
    conn.close()
    assert rates == ["long"]
    assert windows == ["long"]


def _start_rated(path: str, worker: int, results: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """In a separate process: try to start a rated key of 4 slots 50 times."""
    backend = SQLiteBackend(path)
    starts = [
        backend.acquire_slot("rated", 4, f"w{worker}-{n}", 30, interval=60).acquired
        for n in range(50)
    ]
    results.put(sum(starts))


def test_processes_sharing_the_file_start_a_rated_key_once_per_interval(tmp_path: Path) -> None:
    path = str(tmp_path / "locks.db")
    SQLiteBackend(path).acquire("warm-up", "t", 1)  # create the database before the race
    results: multiprocessing.Queue = multiprocessing.Queue()  # type: ignore[type-arg]
    workers = [
        multiprocessing.Process(target=_start_rated, args=(path, i, results)) for i in range(4)
    ]
    for process in workers:
        process.start()
    for process in workers:
        process.join(60)
    outcomes = [results.get(timeout=5) for _ in workers]

    assert all(process.exitcode == 0 for process in workers)
    assert sum(outcomes) == 1


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_process_forked_while_another_thread_writes_can_still_take_locks(tmp_path: Path) -> None:
    """A prefork worker's main process forks a new pool process when one ends, at the moment its
    watcher thread releases the ended one's lock in the same store. SQLite copies into the child
    what the parent's connections hold, not the locks: forked inside a transaction, the child's
    every write, in a connection of its own, failed after the busy timeout ("database is
    locked"; the interaction campaign's long run), or hung. No fork happens inside a
    transaction."""
    # Given a store in which a thread of this process writes without a pause
    path = tmp_path / "locks.db"
    backend = SQLiteBackend(path, timeout=1.0)
    stop = threading.Event()

    def write() -> None:
        while not stop.is_set():
            with contextlib.suppress(BackendTimeout):  # a hung child may hold the file
                backend.acquire("busy", "parent", 5)
                backend.release("busy", "parent")
            time.sleep(0.001)  # a moment out of the file between transactions: no starved child

    writer = threading.Thread(target=write)
    writer.start()
    codes = []
    try:
        # When the process forks, several times, while that thread writes
        for n in range(8):
            pid = os.fork()
            if pid == 0:  # the child takes a lock with a store of its own, as a pool process does
                code = 1
                try:
                    # A child forked inside a transaction fails every write, whatever the wait
                    # (a generous busy timeout only keeps a loaded machine from failing it)
                    taken = SQLiteBackend(path, timeout=5.0).acquire(f"child-{n}", "c", 5).acquired
                    code = 0 if taken else 2
                finally:
                    os._exit(code)
            codes.append(_exit_code(pid, within=10.0))
    finally:
        stop.set()
        writer.join()
    # Then every child took its lock
    assert codes == [0] * 8


def _exit_code(pid: int, within: float) -> int | str:
    """The exit code of child ``pid``, or "hung" (and it is killed) if it runs longer."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "hung"


def _take_keys_when_told(path: str, opened: Any, go: Any, results: Any) -> None:
    """In a forked child: open the store, say so, wait for the word, take keys K0..K19."""
    backend = SQLiteBackend(path)
    backend.holder("warm-up")  # the child's connection is open before the parent closes its own
    opened.set()
    go.wait(30)
    results.put([backend.acquire(f"K{n}", "child", 30).acquired for n in range(20)])


_TAKE_KEYS_LATER = """
import pathlib, sys, time
from singletask.backends.sql.sqlite import SQLiteBackend
backend = SQLiteBackend(sys.argv[1])
backend.holder("warm-up")
print("ready", flush=True)
while not pathlib.Path(sys.argv[1] + ".go").exists():
    time.sleep(0.001)
print(",".join(str(int(backend.acquire(f"K{n}", "later", 30).acquired)) for n in range(20)))
"""


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_child_forked_while_its_parent_had_the_file_open_excludes_processes_started_later(
    tmp_path: Path,
) -> None:
    """SQLite copies into a forked child the parent's record of the file's locks: a child forked
    while its parent had the database open held none of its own and relied on the parent's. When
    the parent then closed its connection (a store dropped and collected), it found itself the
    last user, checkpointed and deleted the WAL and shared-memory files under the running child,
    and a process that opened the file afterwards took every key the child held. The store
    closes its connection before every fork (and opens a new one at its next use)."""
    # Given a process whose store has the file open, and a child forked from it that opened it too
    path = str(tmp_path / "locks.db")
    parent = SQLiteBackend(path)
    assert parent.acquire("warm-up", "parent", 30).acquired
    fork = multiprocessing.get_context("fork")
    opened, go, results = fork.Event(), fork.Event(), fork.Queue()
    child = fork.Process(target=_take_keys_when_told, args=(path, opened, go, results))
    child.start()
    assert opened.wait(30)
    # And the parent closes its store, then another process opens the file
    parent.close()
    later = subprocess.Popen(
        [sys.executable, "-c", _TAKE_KEYS_LATER, path], stdout=subprocess.PIPE, text=True
    )
    assert later.stdout is not None
    assert later.stdout.readline().strip() == "ready"

    # When the child and that process take the same twenty keys at once
    Path(path + ".go").touch()
    go.set()
    by_child = results.get(timeout=60)
    out, _ = later.communicate(timeout=60)
    child.join(30)
    by_later = [bool(int(flag)) for flag in out.strip().split(",")]

    # Then each key was taken by exactly one of them
    assert [a != b for a, b in zip(by_child, by_later, strict=True)] == [True] * 20, (
        by_child,
        by_later,
    )
    # And the parent's store still works, on a new connection
    assert parent.acquire("after", "parent", 30).acquired
    parent.close()


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_connection_that_fails_to_close_before_a_fork_is_reported_and_the_others_still_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given stores with their connections open, one failing to close
    broken, *others = [SQLiteBackend(tmp_path / f"{n}.db") for n in range(6)]
    for store in (broken, *others):
        assert store.acquire("k", "t", 30).acquired
    connection = broken._conn
    assert connection is not None

    def fail() -> None:
        broken._conn = None
        raise sqlite3.OperationalError("cannot close")

    monkeypatch.setattr(broken, "_disconnect", fail)
    reported: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: reported.append(info.exc_value))

    # When the process forks
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    assert _exit_code(pid, within=10.0) == 0

    # Then the failure was reported, and every other store's connection was closed all the same
    assert [type(exc) for exc in reported] == [sqlite3.OperationalError]
    assert [store._conn for store in others] == [None] * len(others)
    # And every store works on
    for store in (broken, *others):
        assert store.holder("k") is not None
    connection.close()
    for store in others:
        store.close()
