"""Named limits of the SQLite store (``take_units`` / ``give_units``): what only it does, beside
the contract (tests/contract/test_contract_units.py): several processes sharing the file, a
file of an older version, the listing's read-only reads, and rows another program wrote."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import sqlite3
import time
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path

import pytest

from singletask.backends.base import Units
from singletask.backends.sql.sqlite import SQLiteBackend
from singletask.backends.sql.sqlite.units import LINES
from singletask.exceptions import BackendTimeout
from singletask.protocol.limits import limit_key

from .test_sql_units import race_in_line

#: Two concurrency limits, taken alone or together, and a rate.
SMALL = Units(limit_key("app:", "{db}-small"), 3, 1)
LARGE = Units(limit_key("app:", "{db}-large"), 5, 2)
RATE = Units(limit_key("app:", "starts", rate=True), 7, 1, 60.0)


def _tables(path: Path) -> set[str]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return {name for (name,) in conn.execute("SELECT name FROM sqlite_master")}


def _hold_units(
    path: str,
    worker: int,
    rounds: int,
    small: Synchronized[int],
    large: Synchronized[int],
    results: multiprocessing.Queue,  # type: ignore[type-arg]
) -> None:
    """In a separate process: take SMALL, or SMALL and LARGE together, count the units held
    while holding them, give them back; report takes and the most units ever counted."""
    backend = SQLiteBackend(path)
    wins, most_small, most_large = 0, 0, 0
    for n in range(rounds):
        token = f"w{worker}-{n}"
        limits = [SMALL, LARGE] if n % 2 else [SMALL]
        if not backend.take_units(token, 10, limits).taken:
            continue
        wins += 1
        # Counted after the take, uncounted before the give: never more than the store holds.
        with small.get_lock():
            small.value += SMALL.units
            most_small = max(most_small, small.value)
        if LARGE in limits:
            with large.get_lock():
                large.value += LARGE.units
                most_large = max(most_large, large.value)
        time.sleep(0.001)
        with small.get_lock():
            small.value -= SMALL.units
        if LARGE in limits:
            with large.get_lock():
                large.value -= LARGE.units
        assert backend.give_units(token, limits) == [True] * len(limits)
    backend.close()
    results.put((wins, most_small, most_large))


def test_processes_sharing_the_file_never_hold_more_units_than_a_limit_has(
    tmp_path: Path,
) -> None:
    # Given six processes taking units of two limits (one, or both at once) from one file
    path = str(tmp_path / "locks.db")
    SQLiteBackend(path).acquire("warm-up", "t", 1)  # create the database before the race
    small = multiprocessing.Value("i", 0)
    large = multiprocessing.Value("i", 0)
    results: multiprocessing.Queue = multiprocessing.Queue()  # type: ignore[type-arg]
    workers = [
        multiprocessing.Process(target=_hold_units, args=(path, i, 120, small, large, results))
        for i in range(6)
    ]

    # When they all take and give back as fast as they can
    for process in workers:
        process.start()
    for process in workers:
        process.join(120)
    outcomes = [results.get(timeout=5) for _ in workers]

    # Then each finished, took sometimes, and no limit ever held more than its size
    assert all(process.exitcode == 0 for process in workers)
    assert sum(wins for wins, _, _ in outcomes) > 0
    assert max(most for _, most, _ in outcomes) <= SMALL.size
    assert max(most for _, _, most in outcomes) <= LARGE.size
    # and every hold was given back
    assert not [s for s in SQLiteBackend(path).iter_state("app:") if s.kind == "limit"]


def _start(path: str, worker: int, results: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """In a separate process: try to start 40 times against RATE (a new token each time)."""
    backend = SQLiteBackend(path)
    started = sum(backend.take_units(f"w{worker}-{n}", 10, [RATE]).taken for n in range(40))
    backend.close()
    results.put(started)


def test_processes_sharing_the_file_never_start_more_than_a_rate_allows(tmp_path: Path) -> None:
    path = str(tmp_path / "locks.db")
    SQLiteBackend(path).acquire("warm-up", "t", 1)
    results: multiprocessing.Queue = multiprocessing.Queue()  # type: ignore[type-arg]
    workers = [multiprocessing.Process(target=_start, args=(path, i, results)) for i in range(5)]
    for process in workers:
        process.start()
    for process in workers:
        process.join(120)
    outcomes = [results.get(timeout=5) for _ in workers]

    assert all(process.exitcode == 0 for process in workers)
    assert sum(outcomes) == RATE.size


def test_iter_state_on_a_missing_file_creates_nothing(tmp_path: Path) -> None:
    path = tmp_path / "locks.db"
    backend = SQLiteBackend(path)

    assert list(backend.iter_state("")) == []
    assert list(backend.iter_state("app:", page_size=1)) == []
    assert not path.exists()


def test_iter_state_on_a_file_without_the_limits_table_lists_the_rest_and_creates_nothing(
    tmp_path: Path,
) -> None:
    """A file of an older version (no singletask_units) read by a process that has not written
    to it: its follow-ups are listed, and no table is created."""
    path = tmp_path / "locks.db"
    old = SQLiteBackend(path)
    assert old.claim_next("app:sync", "id-1", 30) == "id-1"
    old.close()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("DROP TABLE singletask_units")
        conn.commit()

    found = list(SQLiteBackend(path).iter_state("app:", page_size=1))

    assert [(s.kind, s.key, s.task_id) for s in found] == [("follow_up", "app:sync", "id-1")]
    assert "singletask_units" not in _tables(path)


def test_iter_state_on_a_file_without_any_table_of_the_store_lists_nothing(
    tmp_path: Path,
) -> None:
    path = tmp_path / "locks.db"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE other (x)")
        conn.commit()

    assert list(SQLiteBackend(path).iter_state("")) == []
    assert _tables(path) == {"other"}


def test_a_database_of_an_older_version_gains_the_limits_table(tmp_path: Path) -> None:
    path = tmp_path / "locks.db"
    old = SQLiteBackend(path)
    assert old.acquire("held", "t0", 30).acquired
    old.close()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("DROP TABLE singletask_units")
        conn.commit()

    backend = SQLiteBackend(path)
    assert backend.take_units("t1", 30, [SMALL, RATE]).taken
    assert backend.give_units("t1", [SMALL]) == [True]
    holder = backend.holder("held")
    assert holder is not None
    assert holder.token == "t0"
    backend.close()


def test_limits_are_listed_once_each_in_pages_by_a_reader_and_by_the_writer(
    tmp_path: Path,
) -> None:
    """A limit has a row per hold: small pages still list each limit once, beside the other
    records of the prefix, whether the process wrote to the file or only reads it."""
    path = tmp_path / "locks.db"
    writer = SQLiteBackend(path)
    for n in range(3):
        assert writer.take_units(f"t{n}", 30, [SMALL, RATE], meta={"task_id": f"id-{n}"}).taken
    assert writer.claim_next("app:sync", "id-f", 30) == "id-f"
    expected = sorted([("follow_up", "app:sync"), ("limit", SMALL.key), ("limit", RATE.key)])

    for backend in (writer, SQLiteBackend(path)):
        for page_size in (1, 2, 500):
            found = list(backend.iter_state("app:", page_size=page_size))
            assert sorted((s.kind, s.key) for s in found) == expected
        [small] = [s for s in backend.iter_state("app:") if s.key == SMALL.key]
        assert small.detail["used"] == 3
        assert [h["task_id"] for h in small.detail["holds"]] == ["id-0", "id-1", "id-2"]
    writer.close()


def test_a_limit_shows_at_most_max_shown_holds_and_counts_them_all(tmp_path: Path) -> None:
    backend = SQLiteBackend(tmp_path / "locks.db")
    wide = Units(limit_key("app:", "wide"), 500, 1)
    for n in range(130):
        assert backend.take_units(f"t{n:03d}", 30, [wide]).taken

    [state] = backend.iter_state("app:")

    assert state.detail["used"] == 130
    assert len(state.detail["holds"]) == 100
    assert state.detail["holds"][0]["token"] == "t000"
    backend.close()


def test_a_take_sets_the_size_and_period_of_every_row_of_its_limit(tmp_path: Path) -> None:
    """As the memory store: a limit's size and period are as its last take gave them."""
    backend = SQLiteBackend(tmp_path / "locks.db")
    assert backend.take_units("t1", 30, [Units(RATE.key, 7, 1, 60.0)]).taken
    assert backend.take_units("t2", 30, [Units(RATE.key, 9, 1, 30.0)]).taken

    [state] = backend.iter_state("app:")

    assert (state.detail["size"], state.detail["period"]) == (9, 30.0)
    assert all(h["ttl"] <= 30.0 for h in state.detail["holds"])
    backend.close()


def test_holds_and_starts_that_ran_out_are_deleted_when_a_process_opens_the_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "locks.db"
    backend = SQLiteBackend(path)
    assert backend.take_units("short", 0.05, [SMALL]).taken
    assert backend.take_units("short", 30, [Units(RATE.key, 7, 1, 0.05)]).taken
    assert backend.take_units("long", 30, [LARGE]).taken
    backend.close()
    time.sleep(0.1)

    # A write opens the file: it prunes (a read, a listing, changes nothing).
    assert SQLiteBackend(path).release("any", "token") is False
    with contextlib.closing(sqlite3.connect(path)) as conn:
        rows = conn.execute("SELECT key, token FROM singletask_units").fetchall()
    assert rows == [(LARGE.key, "long")]


def test_a_busy_database_is_a_backend_timeout(tmp_path: Path) -> None:
    """Another process holding the write lock past the busy timeout: the driver's error is
    singletask's, and nothing was taken."""
    path = tmp_path / "locks.db"
    backend = SQLiteBackend(path, timeout=0.1)
    assert backend.take_units("t0", 30, [SMALL]).taken
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as other:
        other.execute("BEGIN IMMEDIATE")
        with pytest.raises(BackendTimeout, match="take_units"):
            backend.take_units("t1", 30, [SMALL])
        with pytest.raises(BackendTimeout, match="give_units"):
            backend.give_units("t0", [SMALL])
        other.execute("ROLLBACK")
    assert backend.give_units("t0", [SMALL]) == [True]
    assert backend.give_units("t1", [SMALL]) == [False]
    backend.close()


def test_rows_another_program_wrote_that_are_not_utf8_are_listed_escaped(tmp_path: Path) -> None:
    path = tmp_path / "locks.db"
    writer = SQLiteBackend(path)
    assert writer.take_units("t1", 30, [SMALL]).taken
    with contextlib.closing(sqlite3.connect(path)) as other:
        for tail in (b"\xfe", b"\xff"):
            other.execute(
                "INSERT INTO singletask_units (key, token, units, period, at, size, task_id, "
                "task) VALUES (CAST(? AS TEXT), CAST(? AS TEXT), 1, NULL, ?, 2, "
                "CAST(? AS TEXT), NULL)",
                (b"app:%limit:odd" + tail, b"tok" + tail, time.time() + 60, b"id" + tail),
            )
        other.commit()

    for backend in (writer, SQLiteBackend(path)):
        found = [
            (s.key, [(h["token"], h["task_id"]) for h in s.detail["holds"]])
            for s in backend.iter_state("app:", page_size=1)
        ]
        assert found == [  # in key order: "o" before "{"
            ("app:%limit:odd\\xfe", [("tok\\xfe", "id\\xfe")]),
            ("app:%limit:odd\\xff", [("tok\\xff", "id\\xff")]),
            (SMALL.key, [("t1", None)]),
        ]
    writer.close()


def test_racing_takes_with_turns_never_lose_a_ticket_nor_both_pass_one(tmp_path: Path) -> None:
    """As on the SQL servers (``race_in_line``), each thread on a store of its own."""
    path = tmp_path / "locks.db"
    stores = [SQLiteBackend(path) for _ in range(7)]

    def tickets_of(key: str) -> set[str]:
        with contextlib.closing(sqlite3.connect(path)) as conn:
            rows = conn.execute(f"SELECT line FROM {LINES} WHERE key = ?", (key,)).fetchall()
        return {name for (line,) in rows for name in json.loads(line)["k"]}

    race_in_line(stores, tickets_of)
