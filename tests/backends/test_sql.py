"""PostgreSQL and MySQL/MariaDB stores: what the contract suite cannot see.

Each test runs once per server (``postgresql``, ``mysql``) on a table of its own, dropped after
it: URLs and options, the table created by racing processes, the indexes at 100,000 rows, reclaim
of expired rows, autocommit, the database's clock, fork safety, errors of a server that is down
or read-only, and the operator primitives (iter_locks, release_held_by, force_release).
"""

from __future__ import annotations

import multiprocessing
import sys
import time
from typing import Any
from unittest import mock

import pytest

from singletask import ConfigurationError
from singletask.backends import backend_from_url
from singletask.backends.sql.mysql import MySQLBackend
from singletask.backends.sql.postgres import PostgresBackend
from singletask.exceptions import BackendError, BackendUnavailable

from ..servers import SQL_URLS, free_port

KINDS = ["postgresql", "mysql"]
pytestmark = pytest.mark.parametrize("sql_store", KINDS, indirect=True)

SqlStore = tuple[str, str]


def run_sql(kind: str, statement: str) -> list[tuple[Any, ...]]:
    """Run one statement on a connection of its own (autocommit); return its rows."""
    if kind == "postgresql":
        import psycopg

        with psycopg.connect(SQL_URLS[kind], autocommit=True) as conn:
            cursor = conn.execute(statement)  # type: ignore[arg-type]
            return cursor.fetchall() if cursor.description else []
    import pymysql

    args = MySQLBackend.from_url(SQL_URLS[kind])._connect_args
    conn = pymysql.connect(**{k: v for k, v in args.items() if k != "client_flag"})
    try:
        with conn.cursor() as cursor:
            cursor.execute(statement)
            return list(cursor.fetchall())
    finally:
        conn.close()


# -- URLs and options ----------------------------------------------------------------------------


def test_urls_name_the_table_pool_and_timeout(sql_store: SqlStore, kind: str) -> None:
    """Options come from the URL's query or from keyword options (which win)."""
    url, table = sql_store
    # When a backend is built from a URL with singletask's options in its query
    backend = backend_from_url(f"{url}?table={table}&pool_size=2&timeout=3")

    # Then it is the dialect's backend with those options, and it works
    assert isinstance(backend, PostgresBackend if kind == "postgresql" else MySQLBackend)
    assert (backend.table, backend.timeout) == (table, 3.0)
    assert backend.acquire("k", "t", 5).acquired
    # And a keyword option wins over the query
    assert backend_from_url(f"{url}?table=st_other", table=table).table == table
    backend.close()


@pytest.mark.parametrize(
    "option", [{"table": "Locks"}, {"table": "a;drop"}, {"pool_size": 0}, {"colour": "red"}]
)
def test_bad_options_are_refused_at_once(sql_store: SqlStore, option: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        backend_from_url(sql_store[0], **option)


def test_a_missing_driver_names_the_extra_to_install(
    sql_store: SqlStore, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without its driver, a store fails at once with the pip command that installs it."""
    # Given the driver cannot be imported (and the store's package is not loaded yet)
    driver, package, extra = {
        "postgresql": ("psycopg", "singletask.backends.sql.postgres", "postgres"),
        "mysql": ("pymysql", "singletask.backends.sql.mysql", "mysql"),
    }[kind]
    monkeypatch.setitem(sys.modules, driver, None)
    for module in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, module)

    # When a backend is built / Then the error names the extra
    with pytest.raises(ConfigurationError, match=rf"pip install 'singletask\[{extra}\]'"):
        backend_from_url(sql_store[0])


def test_a_password_never_shows_in_errors_or_repr(sql_store: SqlStore, kind: str) -> None:
    """A server that does not answer is BackendUnavailable, the driver error chained, the
    password masked."""
    # Given a URL with a password, pointing at a port where nothing listens
    scheme = "postgresql" if kind == "postgresql" else "mysql"
    backend = backend_from_url(f"{scheme}://user:s3cret@127.0.0.1:{free_port()}/test", timeout=2)

    # When it is used
    with pytest.raises(BackendUnavailable) as info:
        backend.acquire("k", "t", 5)

    # Then the error is singletask's, chained to the driver's, and names no password
    assert info.value.__cause__ is not None
    assert "s3cret" not in str(info.value)
    assert "s3cret" not in repr(backend)


# -- the table -----------------------------------------------------------------------------------


def _first_use(url: str, table: str, n: int, start: Any, results: Any) -> None:
    """In a separate process: wait for the start signal, then acquire a key of its own and the
    shared key, at once with every other process."""
    backend = backend_from_url(url, table=table)
    start.wait(30)
    try:
        mine = backend.acquire(f"own-{n}", f"t{n}", 30).acquired
        shared = backend.acquire("shared", f"t{n}", 30).acquired
        results.put((mine, shared, None))
    except Exception as exc:
        results.put((False, False, repr(exc)))
    backend.close()


def test_many_processes_create_the_table_at_once(sql_store: SqlStore) -> None:
    """The table does not exist; eight processes use it for the first time at the same moment.
    Every one succeeds, and exactly one of them wins the key they all want."""
    url, table = sql_store
    ctx = multiprocessing.get_context("fork")
    start, results = ctx.Barrier(8), ctx.Queue()
    workers = [
        ctx.Process(target=_first_use, args=(url, table, n, start, results)) for n in range(8)
    ]
    for process in workers:
        process.start()
    outcomes = [results.get(timeout=60) for _ in workers]
    for process in workers:
        process.join(30)

    assert [error for _, _, error in outcomes if error] == []
    assert all(mine for mine, _, _ in outcomes)
    assert sum(shared for _, shared, _ in outcomes) == 1


def _fill(kind: str, table: str, rows: int) -> None:
    """Insert ``rows`` held locks (keys ``bulk:<n>``) in one statement."""
    if kind == "postgresql":
        run_sql(
            kind,
            f"INSERT INTO {table} (key, token, task_id, meta, lease_expires, fence, expires_at) "
            f"SELECT 'bulk:' || g, 'tok-' || g, 'task-' || g, '{{}}', now() + interval '1 hour', "
            f"g, now() + interval '8 days' FROM generate_series(1, {rows}) AS g",
        )
        run_sql(kind, f"ANALYZE {table}")
        return
    digits = " UNION ALL ".join(f"SELECT {d} AS d" for d in range(10))
    parts = " CROSS JOIN ".join(f"({digits}) AS p{i}" for i in range(len(str(rows - 1))))
    number = " + ".join(f"p{i}.d * {10**i}" for i in range(len(str(rows - 1))))
    run_sql(
        kind,
        f"INSERT INTO {table} (`key`, token, task_id, meta, lease_expires, fence, expires_at) "
        f"SELECT CONCAT('bulk:', n), CONCAT('tok-', n), CONCAT('task-', n), '{{}}', "
        f"UTC_TIMESTAMP(6) + INTERVAL 1 HOUR, n, UTC_TIMESTAMP(6) + INTERVAL 8 DAY "
        f"FROM (SELECT {number} AS n FROM {parts}) AS numbers WHERE n < {rows}",
    )
    run_sql(kind, f"ANALYZE TABLE {table}")


def test_at_100000_held_locks_every_lookup_uses_an_index(
    sql_store: SqlStore, kind: str, store: Any
) -> None:
    """With 100,000 locks held, finding a key, listing a prefix and reclaiming expired rows each
    go through an index (so acquire costs the same as with an empty table: see bench/ for the
    timings), and acquire still works."""
    # Given 100,000 held locks
    table = sql_store[1]
    assert store.acquire("probe", "t", 30).acquired  # creates the table
    _fill(kind, table, 100_000)
    assert run_sql(kind, f"SELECT count(*) FROM {table}")[0][0] == 100_001

    # When the planner is asked how it finds one key, a prefix, and the expired rows
    if kind == "postgresql":

        def plan(query: str) -> str:
            return "\n".join(row[0] for row in run_sql(kind, f"EXPLAIN {query}"))

        by_key = plan(f"SELECT * FROM {table} WHERE key = 'bulk:500'")
        by_prefix = plan(
            f"SELECT * FROM {table} WHERE key LIKE 'bulk:5!_%' ESCAPE '!' AND key > '' "
            "ORDER BY key LIMIT 500"
        )
        expired = plan(f"SELECT key FROM {table} WHERE expires_at < now() LIMIT 1000")
        # Then each is an index scan, never a sequential scan of the table
        assert f"{table}_pkey" in by_key
        assert f"{table}_pkey" in by_prefix
        assert f"{table}_expires_at" in expired
        assert "Seq Scan" not in by_key + by_prefix + expired
    else:

        def index(query: str) -> tuple[str, str]:
            rows = run_sql(kind, f"EXPLAIN {query}")
            return rows[0][3], rows[0][5]  # access type, index used

        by_key = index(f"SELECT * FROM {table} WHERE `key` = 'bulk:500'")
        by_prefix = index(
            f"SELECT * FROM {table} WHERE `key` LIKE 'bulk:5!_%' ESCAPE '!' AND `key` > '' "
            "ORDER BY `key` LIMIT 500"
        )
        expired = index(
            f"DELETE FROM {table} WHERE expires_at < UTC_TIMESTAMP(6) "
            "ORDER BY expires_at LIMIT 1000"
        )
        # Then each reads through an index (const lookup, or a range of one)
        assert by_key == ("const", "PRIMARY")
        assert by_prefix == ("range", "PRIMARY")
        assert expired[1] == f"{table}_expires_at"
    # And acquiring among them still works
    assert store.acquire("bulk:7", "other", 30).holder.token == "tok-7"
    assert store.acquire("fresh", "t", 30).acquired


def test_expired_rows_are_reclaimed_by_the_workers_themselves(
    sql_store: SqlStore, kind: str, store: Any
) -> None:
    """A row whose retention ran out is deleted by a worker process on its next write (no
    separate job); live locks and retained rows stay, and fencing still increases."""
    url, table = sql_store
    # Given a released lock whose row's retention has run out, and a live lock
    first = store.acquire("old", "t1", 30)
    assert store.release("old", "t1")
    assert store.acquire("live", "t2", 30).acquired
    key = "key" if kind == "postgresql" else "`key`"
    run_sql(
        kind,
        f"UPDATE {table} SET expires_at = lease_expires - interval '1' second WHERE {key} = 'old'"
        if kind == "postgresql"
        else f"UPDATE {table} SET expires_at = lease_expires - INTERVAL 1 SECOND "
        f"WHERE {key} = 'old'",
    )

    # When another worker process (a new backend: its first sweep is due) writes anything (a
    # read, holder() or a listing, deletes nothing: it is read-only)
    other = backend_from_url(url, table=table)
    assert other.holder("live") is not None
    assert len(run_sql(kind, f"SELECT {key} FROM {table}")) == 2
    assert other.extend("live", "t2", 30)

    # Then the expired row is gone, the live one stays
    keys = sorted(row[0] for row in run_sql(kind, f"SELECT {key} FROM {table}"))
    assert [k.decode() if isinstance(k, bytes) else k for k in keys] == ["live"]
    # And a new acquisition of the reclaimed key still gets a greater fencing token
    again = store.acquire("old", "t3", 30)
    assert again.acquired
    assert again.fence > first.fence
    other.close()


# -- transactions, clock, processes --------------------------------------------------------------


def test_an_acquire_is_committed_when_it_returns(
    sql_store: SqlStore, kind: str, store: Any
) -> None:
    """Autocommit: another connection sees the lock at once, and can lock its row without
    waiting (no transaction of the backend is left open on it)."""
    table = sql_store[1]
    assert store.acquire("k", "tok", 30).acquired

    key = "key" if kind == "postgresql" else "`key`"
    rows = run_sql(kind, f"SELECT token FROM {table} WHERE {key} = 'k' FOR UPDATE NOWAIT")
    token = rows[0][0]
    assert (token.decode() if isinstance(token, bytes) else token) == "tok"


def test_sessions_are_autocommit_and_read_committed(kind: str, store: Any) -> None:
    """The isolation level and commit mode the docs state are the ones the sessions run."""
    import pymysql

    assert store.acquire("k", "t", 30).acquired
    with store._pool.connection() as conn:
        if kind == "postgresql":
            assert conn.autocommit is True
            level = conn.execute("SHOW transaction_isolation").fetchone()[0]
        else:
            assert conn.get_autocommit() is True
            with conn.cursor() as cursor:
                # MySQL 8 and MariaDB 11.1+ call it transaction_isolation, older MariaDB only
                # tx_isolation.
                try:
                    cursor.execute("SELECT @@session.transaction_isolation")
                except pymysql.MySQLError:
                    cursor.execute("SELECT @@session.tx_isolation")
                level = cursor.fetchone()[0]
    assert level.lower().replace("-", " ") == "read committed"


def test_leases_follow_the_database_clock_not_the_workers(store: Any) -> None:
    """Two workers whose clocks are an hour apart (either way) still exclude each other, and
    each sees the lease the database counts."""
    real = time.time()
    with mock.patch("time.time", return_value=real + 3600):
        assert store.acquire("k", "ahead", 30).acquired
    with mock.patch("time.time", return_value=real - 3600):
        refused = store.acquire("k", "behind", 30)
        holder = store.holder("k")
    assert not refused.acquired
    assert holder is not None
    assert holder.token == "ahead"
    assert 0 < holder.ttl <= 30


def _child_acquires(url: str, table: str, results: Any, backend: Any) -> None:
    results.put(backend.acquire("child", "c", 30).acquired)


def test_a_forked_process_opens_its_own_connections(sql_store: SqlStore, store: Any) -> None:
    """A backend used before fork works in the child (on connections of its own) and still in
    the parent afterwards."""
    url, table = sql_store
    assert store.acquire("parent", "p", 30).acquired
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    child = ctx.Process(target=_child_acquires, args=(url, table, results, store))
    child.start()
    assert results.get(timeout=30) is True
    child.join(30)
    assert child.exitcode == 0
    assert store.holder("child") is not None
    assert store.extend("parent", "p", 30)


def test_a_pooled_connection_the_server_closed_is_replaced_without_an_error(
    kind: str, store: Any
) -> None:
    """A server that ends an idle session (MySQL ``wait_timeout``, a restart, an idle-session
    killer) does not fail the next operation: the dead connection is replaced once."""
    # Given a backend whose pooled connection the server has ended while it was idle
    assert store.acquire("k", "t", 30).acquired
    with store._pool.connection() as conn:
        session = conn.info.backend_pid if kind == "postgresql" else conn.thread_id()
    if kind == "postgresql":
        run_sql(kind, f"SELECT pg_terminate_backend({session})")
    else:
        run_sql(kind, f"KILL {session}")
    time.sleep(0.2)

    # When it is used again / Then the operation succeeds, on a new session
    assert store.extend("k", "t", 30)
    with store._pool.connection() as conn:
        assert (conn.info.backend_pid if kind == "postgresql" else conn.thread_id()) != session


def test_a_read_only_database_gives_backend_error(
    sql_store: SqlStore, kind: str, store: Any
) -> None:
    """A read-only server (a replica, a database in read-only mode) refuses writes: the caller
    gets BackendError with the driver's error chained, never the driver's own exception."""
    url, table = sql_store
    assert store.acquire("k", "t", 30).acquired  # the table exists
    # Given sessions the server runs read-only
    if kind == "postgresql":
        read_only = backend_from_url(
            f"{url}?options=-c%20default_transaction_read_only%3Don", table=table
        )
    else:
        read_only = backend_from_url(url, table=table)
        read_only._connect_args["init_command"] = "SET SESSION TRANSACTION READ ONLY"

    # When the lock made before is read there, Then it is found (the table exists, so nothing
    # tries to create it: a read-only user or replica can inspect locks)
    held = read_only.holder("k")
    assert held is not None
    assert held.token == "t"

    # When a lock is acquired there
    with pytest.raises(BackendError) as info:
        read_only.acquire("other", "t", 30)

    # Then the error is singletask's, with the driver's cause
    assert "read-only" in str(info.value).lower() or "read only" in str(info.value).lower()
    assert type(info.value.__cause__).__module__.split(".")[0] in ("psycopg", "pymysql")
    read_only.close()


# -- operator primitives --------------------------------------------------------------------------


def test_iter_locks_pages_through_live_locks_under_a_prefix(store: Any) -> None:
    """Only live locks whose key starts with the prefix (LIKE wildcards in it taken literally),
    page by page, in key order."""
    for n in range(5):
        assert store.acquire(f"app:a_{n}", f"t{n}", 30, meta={"task_id": f"id{n}"}).acquired
    assert store.acquire("app:ab", "x", 30).acquired  # '_' must not match 'b'
    assert store.acquire("app:a_9", "gone", 30).acquired
    assert store.release("app:a_9", "gone")
    assert store.acquire("other:a_1", "y", 30).acquired

    listed = list(store.iter_locks("app:a_", page_size=2))

    assert [key for key, _ in listed] == [f"app:a_{n}" for n in range(5)]
    assert [holder.task_id for _, holder in listed] == [f"id{n}" for n in range(5)]
    assert all(0 < holder.ttl <= 30 and holder.fence for _, holder in listed)


def test_release_held_by_removes_only_that_tasks_lock(store: Any) -> None:
    """release_held_by frees the key only for the holder's task id; the fence is kept, and the
    old holder finds its lease gone."""
    first = store.acquire("k", "tok", 30, meta={"task_id": "task-1"})

    assert store.release_held_by("k", "task-2") is None
    assert store.holder("k") is not None
    removed = store.release_held_by("k", "task-1")

    assert removed is not None
    assert (removed.token, removed.task_id, removed.fence) == ("tok", "task-1", first.fence)
    assert store.holder("k") is None
    assert store.release_held_by("k", "task-1") is None
    assert not store.extend("k", "tok", 30)
    assert not store.release("k", "tok")
    assert store.acquire("k", "next", 30).fence > first.fence


def test_force_release_removes_whoever_holds_the_key(store: Any) -> None:
    first = store.acquire("k", "tok", 30, meta={"task_id": "task-1"})

    removed = store.force_release("k")

    assert removed is not None
    assert removed.token == "tok"
    assert store.force_release("k") is None
    assert store.acquire("k", "next", 30).fence > first.fence


def test_keys_and_tokens_compare_byte_for_byte(store: Any) -> None:
    """Keys differing only in case or trailing space are different locks; so are tokens."""
    assert store.acquire("Key", "tok", 30).acquired
    assert store.acquire("key", "tok", 30).acquired
    assert store.acquire("key ", "tok", 30).acquired
    assert not store.acquire("key", "TOK", 30).acquired
    assert not store.acquire("key", "tok ", 30).acquired
