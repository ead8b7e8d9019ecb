"""Named limits on the PostgreSQL and MySQL/MariaDB stores: what the contract suite cannot see.

Each test runs once per server on a table of its own (its limits' tables, ``<table>_limits``
and ``<table>_limit_holds``, dropped with it): takes by separate processes and connections, a
take that waits for a limit's row held elsewhere, the tables created on first use and never by
a read, expired rows deleted, long limit keys, and the operator's listing in pages.
"""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from singletask.backends import backend_from_url
from singletask.backends.base import Turn, Units
from singletask.backends.holders import MAX_SHOWN
from singletask.backends.sql.lines import line_table
from singletask.backends.sql.units import limit_tables
from singletask.exceptions import BackendTimeout, BackendUnavailable
from singletask.protocol.limits import limit_key

from ..servers import free_port
from .test_sql import run_sql
from .test_sql_faults import session, within

KINDS = ["postgresql", "mysql"]
both = pytest.mark.parametrize("sql_store", KINDS, indirect=True)

SqlStore = tuple[str, str]


def concurrency(name: str, size: int, units: int = 1) -> Units:
    return Units(limit_key("app:", name), size, units)


def rate(name: str, size: int, units: int = 1, period: float = 30.0) -> Units:
    return Units(limit_key("app:", name, rate=True), size, units, period)


def key_column(kind: str) -> str:
    return "key" if kind == "postgresql" else "`key`"


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def holds_of(kind: str, table: str, limit: Units) -> set[str]:
    """The tokens of the rows of ``limit`` in the holds table (live or not), read directly."""
    holds = limit_tables(table)[1]
    rows = run_sql(
        kind, f"SELECT token FROM {holds} WHERE {key_column(kind)} = '{limit.key}'"
    )  # the test's own keys: no quoting to fear
    return {text(row[0]) for row in rows}


def tables_present(kind: str, table: str) -> set[str]:
    names = (table, *limit_tables(table))
    if kind == "postgresql":
        rows = run_sql(
            kind,
            "SELECT tablename FROM pg_tables WHERE tablename IN ("
            + ", ".join(f"'{name}'" for name in names)
            + ")",
        )
    else:
        rows = run_sql(
            kind,
            "SELECT table_name FROM information_schema.tables WHERE table_schema = DATABASE() "
            "AND table_name IN (" + ", ".join(f"'{name}'" for name in names) + ")",
        )
    return {text(row[0]) for row in rows}


# -- one transaction, under concurrent processes --------------------------------------------------


def _take_in_a_process(
    url: str, table: str, n: int, start: Any, results: Any, limits: list[Units]
) -> None:
    """In a process of its own (its own connections): wait for the start signal, then take
    ``limits`` (in this process's order) at once with every other process."""
    backend = backend_from_url(url, table=table)
    mine = limits if n % 2 else list(reversed(limits))
    start.wait(30)
    try:
        results.put((f"p{n}", backend.take_units(f"p{n}", 30, mine).taken, None))
    except Exception as exc:
        results.put((f"p{n}", False, repr(exc)))
    backend.close()


@both
def test_processes_racing_for_several_limits_take_all_or_nothing_and_never_too_much(
    sql_store: SqlStore, kind: str
) -> None:
    """Ten processes, each on connections of its own, take a concurrency limit of 3, one of
    2 and a rate of 4 together (half of them naming the limits in the other order), at the
    same moment, on tables that do not exist yet. No error (no deadlock left unresolved);
    exactly two take; and the holds in the tables are those two in every limit: a take is one
    transaction, never half written."""
    url, table = sql_store
    limits = [concurrency("wide", 3), concurrency("narrow", 2), rate("calls", 4)]
    ctx = multiprocessing.get_context("fork")
    start, results = ctx.Barrier(10), ctx.Queue()
    workers = [
        ctx.Process(target=_take_in_a_process, args=(url, table, n, start, results, limits))
        for n in range(10)
    ]
    for process in workers:
        process.start()
    outcomes = [results.get(timeout=60) for _ in workers]
    for process in workers:
        process.join(30)

    assert [error for _, _, error in outcomes if error] == []
    takers = {token for token, taken, _ in outcomes if taken}
    assert len(takers) == 2
    for limit in limits:
        assert holds_of(kind, table, limit) == takers


@both
def test_threads_with_stores_of_their_own_never_start_more_than_the_rate(
    sql_store: SqlStore,
) -> None:
    """Twelve threads, each with a store (a pool) of its own, start units of one rate: the
    units admitted never exceed it, whatever the interleaving of their transactions."""
    url, table = sql_store
    stores = [backend_from_url(url, table=table) for _ in range(12)]
    stores[0].take_units("warm-up", 30, [rate("other", 1)])  # the tables exist
    start = threading.Barrier(12)
    admitted: list[int] = []

    def worker(n: int) -> None:
        start.wait(30)
        for round_ in range(5):
            units = 1 + (n + round_) % 3
            if stores[n].take_units(f"t{n}-{round_}", 30, [rate("tokens", 10, units)]).taken:
                admitted.append(units)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    assert 8 <= sum(admitted) <= 10
    [listed] = [s for s in stores[0].iter_state("app:") if s.key == rate("tokens", 10).key]
    assert listed.detail["used"] == sum(admitted)
    for store in stores:
        store.close()


@both
def test_a_take_that_waits_for_a_limit_row_held_elsewhere_times_out_and_writes_nothing(
    sql_store: SqlStore, kind: str
) -> None:
    """A take waits for the rows of its limits (another session holds one): past the store's
    timeout it fails with BackendTimeout, and the limit it had locked before keeps no hold of
    it (the transaction is rolled back whole)."""
    url, table = sql_store
    store = backend_from_url(url, table=table, timeout=1)
    first, second = concurrency("a-first", 1), concurrency("b-second", 1)  # locked in that order
    assert store.take_units("warm-up", 30, [first, second]).taken
    assert store.give_units("warm-up", [first, second]) == [True, True]
    held = threading.Event()

    def rival() -> None:
        with session(kind) as conn:
            cursor = conn.cursor()
            cursor.execute(
                f"SELECT size FROM {limit_tables(table)[0]} WHERE {key_column(kind)} = %s "
                "FOR UPDATE",
                (second.key,),
            )
            held.set()
            time.sleep(4)
            conn.commit()

    thread = threading.Thread(target=rival, daemon=True)
    thread.start()
    assert held.wait(10)

    started = time.monotonic()
    with pytest.raises(BackendTimeout):
        within(10, lambda: store.take_units("late", 30, [first, second]))
    assert time.monotonic() - started < 3.0
    thread.join(10)

    assert holds_of(kind, table, first) == set()
    assert store.take_units("other", 30, [first, second]).taken
    store.close()


# -- a key and its units: one transaction ---------------------------------------------------------


@both
def test_an_acquire_refused_by_a_limit_never_makes_the_key_held_even_briefly(
    sql_store: SqlStore, kind: str
) -> None:
    """Threads keep acquiring a free key with a limit that has no room while another thread
    polls the key's holder: the key, its row judged and the limit refused in one transaction,
    is never seen held (taking it, then giving it back in a second step, would show it)."""
    url, table = sql_store
    key, limit = "app:lock", concurrency("full", 1)
    stores = [backend_from_url(url, table=table) for _ in range(4)]
    assert stores[0].take_units("elsewhere", 60, [limit]).taken
    done = threading.Event()
    seen: list[Any] = []
    outcomes: list[Any] = []

    def poll() -> None:
        while not done.is_set():
            holder = stores[0].holder(key)
            if holder is not None:
                seen.append(holder)

    def refused(n: int) -> None:
        for round_ in range(40):
            result = stores[n].acquire(key, f"t{n}-{round_}", 30, units=[limit])
            outcomes.append((result.acquired, result.limit))

    poller = threading.Thread(target=poll)
    poller.start()
    workers = [threading.Thread(target=refused, args=(n,)) for n in (1, 2, 3)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join(60)
    done.set()
    poller.join(10)

    assert seen == []
    assert outcomes == [(False, limit.key)] * 120
    assert holds_of(kind, table, limit) == {"elsewhere"}
    for store in stores:
        store.close()


def _lock_rows(kind: str, table: str, column: str, value: str, held: Any, hold: float) -> None:
    """In a session of the test's own: lock the row of ``table`` whose ``column`` is ``value``
    (FOR UPDATE), set ``held``, keep it ``hold`` seconds, commit."""
    with session(kind) as conn:
        cursor = conn.cursor()
        cursor.execute(f"SELECT 1 FROM {table} WHERE {column} = %s FOR UPDATE", (value,))
        held.set()
        time.sleep(hold)
        conn.commit()


@both
def test_an_acquire_of_a_held_key_reads_no_limit(sql_store: SqlStore, kind: str) -> None:
    """The key's row is judged first: held by another token, the acquire is refused by its
    holder at once, without waiting for the row of its limit that another session has locked;
    a free key waits for that row (its units are taken after the key's row, in one
    transaction), past the store's timeout, and then nothing of it is written."""
    url, table = sql_store
    store = backend_from_url(url, table=table, timeout=1)
    limit = concurrency("locked", 1)
    assert store.take_units("warm-up", 30, [limit]).taken  # the limit's row exists
    assert store.give_units("warm-up", [limit]) == [True]
    assert store.acquire("app:held", "holder", 30).acquired
    held = threading.Event()
    rival = threading.Thread(
        target=_lock_rows,
        args=(kind, limit_tables(table)[0], key_column(kind), limit.key, held, 3),
        daemon=True,
    )
    rival.start()
    assert held.wait(10)

    started = time.monotonic()
    result = within(10, lambda: store.acquire("app:held", "other", 30, units=[limit]))
    assert time.monotonic() - started < 0.8
    assert (result.acquired, result.limit) == (False, None)
    assert result.holder is not None
    assert result.holder.token == "holder"

    with pytest.raises(BackendTimeout):
        within(10, lambda: store.acquire("app:free", "other", 30, units=[limit]))
    assert store.holder("app:free") is None
    rival.join(10)
    assert holds_of(kind, table, limit) == set()
    assert store.acquire("app:free", "other", 30, units=[limit]).acquired
    store.close()


@both
def test_a_release_with_units_gives_them_back_with_the_key_not_before(
    sql_store: SqlStore, kind: str
) -> None:
    """A release whose key's row another session has locked waits for it, its holds still
    held (given back in the same transaction as the key, after its row: not in a step of
    their own before); then both go together."""
    url, table = sql_store
    store = backend_from_url(url, table=table, timeout=5)
    limit = concurrency("pool", 2)
    assert store.acquire("app:lock", "mine", 30, units=[limit]).acquired
    held = threading.Event()
    rival = threading.Thread(
        target=_lock_rows, args=(kind, table, key_column(kind), "app:lock", held, 1.5),
        daemon=True,
    )  # fmt: skip
    rival.start()
    assert held.wait(10)
    released: list[bool] = []
    releaser = threading.Thread(
        target=lambda: released.append(store.release("app:lock", "mine", units=[limit]))
    )
    releaser.start()
    time.sleep(0.7)

    assert released == []
    assert holds_of(kind, table, limit) == {"mine"}
    releaser.join(10)
    rival.join(10)
    assert released == [True]
    assert holds_of(kind, table, limit) == set()
    assert store.holder("app:lock") is None
    store.close()


@both
def test_acquires_with_overlapping_limits_never_admit_too_many_nor_deadlock(
    sql_store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight threads, each with a store of its own, acquire a few shared keys with units of
    overlapping limits (named in either order), hold them a moment and release them with their
    units, while others take and give the same limits alone. A deadlock or serialization
    failure is not retried here (it would fail the call): there is none, no key has two
    holders, and no limit more holders than its size at any moment."""
    from singletask.backends.sql import core

    monkeypatch.setattr(core, "CONFLICT_ATTEMPTS", 1)
    url, table = sql_store
    sizes = {"a": 2, "b": 3, "c": 2}
    limits = {name: concurrency(name, size) for name, size in sizes.items()}
    keys = [f"app:k{n}" for n in range(5)]
    stores = [backend_from_url(url, table=table, timeout=10) for _ in range(8)]
    for key in keys:  # the rows exist: racing inserts of a new row are not what this tests
        assert stores[0].acquire(key, "warm-up", 30, units=list(limits.values())).acquired
        assert stores[0].release(key, "warm-up", units=list(limits.values()))
    guard = threading.Lock()
    in_use = dict.fromkeys(sizes, 0)
    holders: dict[str, str] = {}
    errors: list[str] = []
    too_many: list[str] = []
    admitted = [0]
    start = threading.Barrier(8)
    orders = [["a", "b"], ["b", "a"], ["b", "c"], ["c", "b"], ["a", "c", "b"], ["c", "a"]]

    def enter(token: str, names: list[str], key: str | None) -> None:
        with guard:
            if key is not None:
                if key in holders:
                    too_many.append(f"{key}: {holders[key]} and {token}")
                holders[key] = token
            for name in names:
                in_use[name] += 1
                if in_use[name] > sizes[name]:
                    too_many.append(f"{name}: {in_use[name]}")
            admitted[0] += 1

    def leave(names: list[str], key: str | None) -> None:
        with guard:
            if key is not None:
                holders.pop(key, None)
            for name in names:
                in_use[name] -= 1

    def worker(n: int) -> None:
        store = stores[n]
        start.wait(30)
        for round_ in range(25):
            names = orders[(n + round_) % len(orders)]
            units = [limits[name] for name in names]
            token = f"t{n}-{round_}"
            try:
                if n % 4 == 3:  # units alone
                    if store.take_units(token, 30, units).taken:
                        enter(token, names, None)
                        time.sleep(0.002)
                        leave(names, None)
                        store.give_units(token, units)
                    continue
                key = keys[(n + round_) % len(keys)]
                if store.acquire(key, token, 30, units=units).acquired:
                    enter(token, names, key)
                    time.sleep(0.002)
                    leave(names, key)
                    assert store.release(key, token, units=units)
            except Exception as exc:
                errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)

    assert errors == []
    assert too_many == []
    assert admitted[0] > 20
    for store in stores:
        store.close()


# -- the tables -----------------------------------------------------------------------------------


@both
def test_the_limit_tables_are_made_by_the_first_take_never_by_locks_or_reads(
    sql_store: SqlStore, kind: str, store: Any
) -> None:
    """A store whose tasks name no limit has no limit tables: locks and bookkeeping do not make
    them, and the operator's listing reads nothing from them while they are missing."""
    table = sql_store[1]
    assert store.acquire("app:k", "t", 30).acquired
    assert store.claim_next("app:k", "next-task", 30) == "next-task"

    listed = list(store.iter_state("app:"))

    assert [(s.kind, s.key) for s in listed] == [("follow_up", "app:k")]
    assert tables_present(kind, table) == {table}

    assert store.take_units("t", 30, [concurrency("pool", 1)]).taken
    assert tables_present(kind, table) == {table, *limit_tables(table)}
    assert {s.kind for s in store.iter_state("app:")} == {"follow_up", "limit"}


@both
def test_a_store_without_any_table_lists_nothing(sql_store: SqlStore, kind: str) -> None:
    url, table = sql_store
    store = backend_from_url(url, table=table)

    assert list(store.iter_state("")) == []
    assert tables_present(kind, table) == set()
    store.close()


def _first_take(url: str, table: str, n: int, start: Any, results: Any) -> None:
    backend = backend_from_url(url, table=table)
    start.wait(30)
    try:
        taken = backend.take_units(f"p{n}", 30, [concurrency("shared", 3)]).taken
        results.put((taken, None))
    except Exception as exc:
        results.put((False, repr(exc)))
    backend.close()


@both
def test_many_processes_make_the_limit_tables_at_once(sql_store: SqlStore) -> None:
    """Eight processes take units for the first time at the same moment, the tables missing:
    every one succeeds or is refused for room, and exactly the limit's size take."""
    url, table = sql_store
    ctx = multiprocessing.get_context("fork")
    start, results = ctx.Barrier(8), ctx.Queue()
    workers = [
        ctx.Process(target=_first_take, args=(url, table, n, start, results)) for n in range(8)
    ]
    for process in workers:
        process.start()
    outcomes = [results.get(timeout=60) for _ in workers]
    for process in workers:
        process.join(30)

    assert [error for _, error in outcomes if error] == []
    assert sum(taken for taken, _ in outcomes) == 3


@both
def test_expired_rows_are_deleted_by_takes_and_by_the_sweep(
    sql_store: SqlStore, kind: str, store: Any
) -> None:
    """Holds that ran out are deleted by the next take of their limit; the rows of limits no
    take touches again go with the next sweep of a process that takes units; live ones stay."""
    url, table = sql_store
    pool, calls, live = concurrency("pool", 5), rate("calls", 5, period=0.2), rate("live", 5)
    assert store.take_units("old", 0.2, [pool, calls]).taken
    assert store.take_units("kept", 30, [live]).taken
    time.sleep(0.6)

    # A take of the limit deletes its holds that ran out
    assert store.take_units("new", 30, [pool]).taken
    assert holds_of(kind, table, pool) == {"new"}
    assert holds_of(kind, table, calls) == {"old"}  # no take of it since

    # The first sweep of another process (due at its first take) deletes the rest
    other = backend_from_url(url, table=table)
    assert other.take_units("elsewhere", 30, [concurrency("elsewhere", 1)]).taken
    assert holds_of(kind, table, calls) == set()
    assert holds_of(kind, table, live) == {"kept"}
    limits = {
        text(row[0])
        for row in run_sql(kind, f"SELECT {key_column(kind)} FROM {limit_tables(table)[0]}")
    }
    assert calls.key not in limits
    assert {pool.key, live.key} <= limits
    other.close()


@both
def test_a_limit_key_longer_than_an_index_entry_is_stored_in_a_fixed_size_form(
    store: Any,
) -> None:
    """A limit under a prefix of thousands of characters is an ordinary limit, listed under its
    whole key."""
    prefix = "app:" + "p" * 3000 + ":"
    limit = Units(limit_key(prefix, "pool"), 1, 1)
    assert store.take_units("a", 30, [limit]).taken
    assert not store.take_units("b", 30, [limit]).taken

    [listed] = [s for s in store.iter_state(prefix) if s.kind == "limit"]

    assert listed.key == limit.key
    assert store.give_units("a", [limit]) == [True]


# -- for operators --------------------------------------------------------------------------------


@both
def test_iter_state_pages_through_the_limits_and_shows_their_oldest_holds(store: Any) -> None:
    """Limits under the prefix (LIKE wildcards in it taken literally), page by page in key
    order; a limit's listing shows at most MAX_SHOWN holds, oldest first, and counts them all."""
    for n in range(5):
        assert store.take_units(f"t{n}", 30, [Units(f"app_:%limit:l{n}", 2, 1)]).taken
    assert store.take_units("x", 30, [Units("appx:%limit:l0", 2, 1)]).taken  # '_' is literal
    crowd = Units("app_:%rate:crowd", MAX_SHOWN + 5, 1, 30.0)
    for n in range(MAX_SHOWN + 1):
        assert store.take_units(f"c{n:03d}", 30, [crowd]).taken

    listed = [s for s in store.iter_state("app_:", page_size=2) if s.kind == "limit"]

    assert [s.key for s in listed] == [*(f"app_:%limit:l{n}" for n in range(5)), crowd.key]
    shown = listed[-1].detail["holds"]
    assert listed[-1].detail["used"] == MAX_SHOWN + 1
    assert [h["token"] for h in shown] == [f"c{n:03d}" for n in range(MAX_SHOWN)]


@pytest.mark.parametrize("sql_store", ["postgresql"], indirect=True)
def test_limits_work_through_a_transaction_pooler(sql_store: SqlStore) -> None:
    """With transaction_pooling every operation is a transaction of its own, nothing prepared:
    takes, gives and the listing work the same."""
    url, table = sql_store
    store = backend_from_url(f"{url}?transaction_pooling=1", table=table)
    limits = [concurrency("pool", 1), rate("calls", 2, 2)]
    assert store.take_units("a", 30, limits, meta={"task_id": "id-a"}).taken
    refused = store.take_units("b", 30, limits)
    assert (refused.taken, refused.limit) == (False, limits[0].key)
    assert store.give_units("a", limits) == [True, True]
    assert not store.take_units("b", 30, limits).taken  # the rate's start is spent

    [listed] = [s for s in store.iter_state("app:") if s.kind == "limit"]
    assert listed.detail["holds"][0]["task_id"] == "id-a"
    store.close()


@both
def test_a_server_that_does_not_answer_is_backend_unavailable(
    sql_store: SqlStore, kind: str
) -> None:
    url = (
        f"postgresql://postgres@127.0.0.1:{free_port()}/test"
        if kind == "postgresql"
        else f"mysql://root@127.0.0.1:{free_port()}/test"
    )
    store = backend_from_url(url, table=sql_store[1], timeout=2)
    with pytest.raises(BackendUnavailable):
        store.take_units("a", 30, [concurrency("pool", 1)])
    with pytest.raises(BackendUnavailable):
        store.give_units("a", [concurrency("pool", 1)])
    store.close()


def race_in_line(stores: list[Any], tickets_of: Callable[[str], set[str]]) -> None:
    """Fair turns under races, each thread on a store of its own (``tickets_of``: the tickets
    stored in a limit's line, read directly): takes with turns refused at the same moment all
    get their ticket (the line is changed by one transaction at a time, none lost); then, the
    room freed, every ticket and two takes without a turn come back at once, round after
    round: exactly one is let in each round, always a ticket, until none waits."""
    waiting = len(stores) - 2
    limit = concurrency("turns", 1)

    def item(token: str) -> Units:
        if token.startswith("x"):
            return limit
        return Units(limit.key, 1, 1, turn=Turn(token, f"group-{token}", lease=60, hold=60))

    def race(tokens: list[str]) -> list[str]:
        start, admitted = threading.Barrier(len(tokens)), []

        def worker(n: int, token: str) -> None:
            start.wait(30)
            if stores[n].take_units(token, 30, [item(token)]).taken:
                admitted.append(token)

        threads = [threading.Thread(target=worker, args=pair) for pair in enumerate(tokens)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        return admitted

    assert stores[0].take_units("first", 30, [limit]).taken
    tickets = [f"w{n}" for n in range(waiting)]
    assert race(tickets) == []
    assert tickets_of(limit.key) == set(tickets)
    holder = "first"
    while tickets:
        stores[0].give_units(holder, [limit])
        admitted = race([*tickets, "x1", "x2"])
        assert len(admitted) == 1, admitted
        assert admitted[0] in tickets, admitted
        holder = admitted[0]
        tickets.remove(holder)
    assert tickets_of(limit.key) == set()


@both
def test_racing_takes_with_turns_never_lose_a_ticket_nor_both_pass_one(
    sql_store: SqlStore, kind: str
) -> None:
    url, table = sql_store
    stores = [backend_from_url(url, table=table) for _ in range(7)]

    def tickets_of(key: str) -> set[str]:
        rows = run_sql(
            kind, f"SELECT line FROM {line_table(table)} WHERE {key_column(kind)} = '{key}'"
        )  # the test's own key: no quoting to fear
        return {name for (line,) in rows for name in json.loads(text(line))["k"]}

    try:
        race_in_line(stores, tickets_of)
    finally:
        for store in stores:
            store.close()
