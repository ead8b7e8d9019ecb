"""PostgreSQL and MySQL/MariaDB stores under hostile timing and odd inputs (issue 23).

Each test runs once per server on a table of its own: a rival session holding the row lock
(the lease must start when the row is taken), a server whose default isolation is stricter
than READ COMMITTED, lock keys of thousands of characters, a link that stalls without closing
(every call returns BackendTimeout in bounded time, and frees its pool slot), a release by
holder raced by an acquire, and passwords that never reach a message.
"""

from __future__ import annotations

import contextlib
import random
import string
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from singletask import ConfigurationError, SingletaskError
from singletask.backends import backend_from_url
from singletask.backends.sql.mysql import MySQLBackend
from singletask.exceptions import BackendError, BackendTimeout, LockKeyError

from ..faultproxy import FaultProxy
from ..servers import SQL_URLS, free_port

KINDS = ["postgresql", "mysql"]
SqlStore = tuple[str, str]
T = TypeVar("T")


@contextlib.contextmanager
def session(kind: str) -> Iterator[Any]:
    """A connection of the test's own, outside the store (autocommit off for MySQL)."""
    if kind == "postgresql":
        import psycopg

        with psycopg.connect(SQL_URLS[kind]) as conn:
            yield conn
        return
    import pymysql

    args = MySQLBackend.from_url(SQL_URLS[kind])._connect_args
    conn = pymysql.connect(**{k: v for k, v in args.items() if k not in ("client_flag",)})
    conn.autocommit(False)
    try:
        yield conn
    finally:
        conn.close()


def hold_row_lock(kind: str, table: str, key: str, seconds: float) -> threading.Thread:
    """Lock the row of ``key`` in a transaction of another session for ``seconds``; returns
    once the lock is held (the thread commits when the time is up)."""
    held = threading.Event()

    def run() -> None:
        with session(kind) as conn:
            cursor = conn.cursor()
            column = "key" if kind == "postgresql" else "`key`"
            cursor.execute(f"SELECT token FROM {table} WHERE {column} = %s FOR UPDATE", (key,))
            held.set()
            time.sleep(seconds)
            conn.commit()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert held.wait(10)
    return thread


def within(seconds: float, call: Callable[[], T]) -> T:
    """``call()``'s result or exception, failing the test if it has not returned in time (a
    store that blocks for ever must fail the test, not hang it)."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:
            outcome.append((False, exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still blocked after {seconds}s"
    ok, value = outcome[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


# -- the lease starts when the row is taken (finding 1) -----------------------------------------


@pytest.mark.parametrize("sql_store", KINDS, indirect=True)
def test_a_lease_starts_when_the_row_lock_is_taken_not_before_the_wait(
    sql_store: SqlStore, store: Any
) -> None:
    """An acquire that waits for a rival session's row lock gets its whole lease from the
    moment it takes the row: the wait is not counted against it."""
    table = sql_store[1]
    # Given a free row whose lock another session holds for 2 seconds
    assert store.acquire("k", "first", 30).acquired
    assert store.release("k", "first")
    rival = hold_row_lock(kind_of(sql_store), table, "k", 2.0)

    # When the key is acquired with a 10-second lease (it waits for the rival's commit)
    started = time.monotonic()
    assert store.acquire("k", "second", 10).acquired
    waited = time.monotonic() - started
    rival.join(10)

    # Then it waited, and the lease the store counts is still (about) the whole 10 seconds
    assert waited >= 1.5
    holder = store.holder("k")
    assert holder is not None
    assert holder.ttl > 9.0, f"{10 - holder.ttl:.1f}s of the lease went to the wait"


def kind_of(sql_store: SqlStore) -> str:
    return "postgresql" if sql_store[0].startswith("postgresql") else "mysql"


@pytest.mark.parametrize("sql_store", KINDS, indirect=True)
@pytest.mark.parametrize("pooling", [False, True], ids=["session", "transaction_pooling"])
def test_a_rival_row_lock_longer_than_the_timeout_is_a_backend_timeout(
    sql_store: SqlStore, pooling: bool
) -> None:
    """The server-side wait limit applies to each operation (set per session, or per
    transaction with PostgreSQL's transaction_pooling): the caller gets BackendTimeout after
    about ``timeout``, the server's error chained."""
    url, table = sql_store
    if pooling and kind_of(sql_store) == "mysql":
        pytest.skip("transaction_pooling is PostgreSQL's")
    query = "?transaction_pooling=1" if pooling else ""
    store = backend_from_url(f"{url}{query}", table=table, timeout=1)
    assert store.acquire("k", "t", 30).acquired
    rival = hold_row_lock(kind_of(sql_store), table, "k", 4.0)

    started = time.monotonic()
    with pytest.raises(BackendTimeout) as info:
        within(10, lambda: store.acquire("k", "other", 30))

    assert time.monotonic() - started < 3.0
    assert type(info.value.__cause__).__module__.split(".")[0] in ("psycopg", "pymysql")
    rival.join(10)
    store.close()


# -- stricter isolation, long keys, bad input (finding 2) ---------------------------------------


def _stricter_isolation(kind: str, url: str, table: str, pooling: bool) -> Any:
    """A store whose server-side session default is REPEATABLE READ (PostgreSQL, as a role or
    database default would set it) or SERIALIZABLE (MySQL, through the connection's
    init_command), without touching the shared server's own defaults."""
    if kind == "postgresql":
        strict = "options=-c%20default_transaction_isolation%3Drepeatable%5C%20read"
        return backend_from_url(f"{url}?{strict}&transaction_pooling={int(pooling)}", table=table)
    backend = backend_from_url(url, table=table)
    backend._connect_args["init_command"] = "SET SESSION TRANSACTION ISOLATION LEVEL SERIALIZABLE"
    return backend


@pytest.mark.parametrize("sql_store", KINDS, indirect=True)
@pytest.mark.parametrize("pooling", [False, True], ids=["session", "transaction_pooling"])
def test_a_server_defaulting_to_a_stricter_isolation_never_fails_a_race(
    sql_store: SqlStore, pooling: bool
) -> None:
    """Workers racing for one key on sessions whose default isolation is stricter than READ
    COMMITTED see no error at all: the store sets its own isolation (per session, or per
    transaction with transaction_pooling), and retries what the server aborted to serialise
    them."""
    url, table = sql_store
    kind = kind_of(sql_store)
    if kind == "mysql" and pooling:
        pytest.skip("transaction_pooling is PostgreSQL's")
    setup = backend_from_url(url, table=table)
    setup.acquire("warm-up", "t", 1)  # the table exists
    setup.close()
    stores = [_stricter_isolation(kind, url, table, pooling) for _ in range(6)]
    errors: list[BaseException] = []
    wins = [0]

    def worker(n: int) -> None:
        store = stores[n]
        for round_ in range(60):
            token = f"w{n}-{round_}"
            try:
                if store.acquire("shared", token, 5).acquired:
                    wins[0] += 1
                    store.extend("shared", token, 5)
                    store.release("shared", token, completed=token)
            except BaseException as exc:  # collected: the test names them
                errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(len(stores))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)

    assert [repr(error) for error in errors] == []
    assert wins[0] > 0
    for store in stores:
        store.close()


def _long_key(length: int, seed: int) -> str:
    rng = random.Random(seed)  # random letters: no compression can shrink them
    return "app:long:" + "".join(rng.choice(string.ascii_letters) for _ in range(length))


@pytest.mark.parametrize("sql_store", KINDS, indirect=True)
def test_a_lock_key_of_thousands_of_characters_is_an_ordinary_lock(
    sql_store: SqlStore, kind: str, store: Any
) -> None:
    """A 3,000-character key (and one of 12,000) works like any other: acquire, exclude,
    inspect, list under a short and a long prefix, renew, release, fence, and release by
    holder; keys sharing their first thousands of characters stay distinct locks."""
    first, twin = _long_key(3000, 1), _long_key(3000, 1)[:-1] + "!"
    huge = _long_key(12_000, 2)
    # When each is acquired, Then each is held, and excludes a rival
    acquired = store.acquire(first, "t1", 30, meta={"task_id": "task-1"})
    assert acquired.acquired
    assert store.acquire(twin, "t2", 30).acquired
    assert store.acquire(huge, "t3", 30).acquired
    assert not store.acquire(first, "rival", 30).acquired
    # And inspecting and listing give the keys as written
    holder = store.holder(first)
    assert holder is not None
    assert holder.token == "t1"
    listed = {key for key, _ in store.iter_locks("app:long:")}
    assert listed == {first, twin, huge}
    assert sorted(key for key, _ in store.iter_locks(first[:2500])) == sorted([first, twin])
    assert [key for key, _ in store.iter_locks(first)] == [first]
    # And renewal, release and a later acquisition work, the fence growing
    assert store.extend(first, "t1", 30)
    assert store.extend_many([(first, "t1", 30), (huge, "t3", 30)]) == [True, True]
    assert store.release(first, "t1")
    again = store.acquire(first, "t4", 30, meta={"task_id": "task-4"})
    assert again.acquired
    assert again.fence > acquired.fence
    removed = store.release_held_by(first, "task-4")
    assert removed is not None
    assert removed.token == "t4"
    assert store.claim_next(huge, "next-1", 30) == "next-1"
    assert store.clear_next(huge, "next-1")


@pytest.mark.parametrize("sql_store", KINDS, indirect=True)
def test_a_key_written_like_a_stored_long_key_is_another_lock(
    sql_store: SqlStore, kind: str, store: Any
) -> None:
    """A long key is stored in a fixed-size form; a user key whose text is exactly that form
    is still a different lock (no key a user can write maps onto another lock's row)."""
    from singletask.backends.sql import core
    from singletask.backends.sql.mysql.queries import KEY_BYTES as MYSQL_BYTES
    from singletask.backends.sql.postgres.queries import KEY_BYTES as POSTGRES_BYTES

    long_key = _long_key(3000, 3)
    stored, _ = core.stored_key(long_key, POSTGRES_BYTES if kind == "postgresql" else MYSQL_BYTES)
    assert store.acquire(long_key, "t1", 30).acquired
    assert store.acquire(stored, "t2", 30).acquired
    assert store.holder(long_key).token == "t1"
    assert store.holder(stored).token == "t2"


@pytest.mark.parametrize("sql_store", ["postgresql"], indirect=True)
def test_a_key_postgresql_cannot_store_is_a_lock_key_error_not_an_outage(
    sql_store: SqlStore, store: Any
) -> None:
    """Bad input is the caller's error, stated: not BackendUnavailable (which would empty the
    pool and, with lock_on_backend_error = "run", run the body unlocked)."""
    assert store.acquire("fine", "t", 30).acquired
    generation = store._pool.generation

    with pytest.raises(LockKeyError, match="NUL"):
        store.acquire("bad\x00key", "t", 30)
    with pytest.raises(LockKeyError):
        store.acquire("bad\ud800key", "t", 30)

    assert store._pool.generation == generation
    assert store.extend("fine", "t", 30)


# -- a link that stalls (finding 4) -------------------------------------------------------------


@pytest.fixture
def stalling(sql_store: SqlStore) -> Iterator[tuple[FaultProxy, str]]:
    """The test's server through a fault proxy (which can stall: every connection kept open,
    new ones accepted, nothing forwarded either way), and its URL through the proxy."""
    proxy, url = FaultProxy.for_url(sql_store[0])
    with proxy:
        yield proxy, url


@pytest.mark.parametrize("sql_store", KINDS, indirect=True)
def test_a_stalled_server_gives_backend_timeout_in_bounded_time_and_frees_the_slot(
    sql_store: SqlStore, stalling: tuple[FaultProxy, str]
) -> None:
    """A server (or link) that stops answering without closing the connection: acquire,
    renew and release each return BackendTimeout within the timeout plus a margin, never
    block for ever, and leave no pool slot taken."""
    proxy, url = stalling
    table = sql_store[1]
    # Given a store with one pooled connection, through a link that then stalls
    store = backend_from_url(url, table=table, timeout=1, pool_size=1)
    assert store.acquire("k", "t", 30).acquired
    proxy.stall()

    # When it is used, Then every call fails with BackendTimeout in bounded time
    for call in (
        lambda: store.extend("k", "t", 30),
        lambda: store.release("k", "t"),
        lambda: store.acquire("other", "t", 30),
    ):
        started = time.monotonic()
        with pytest.raises(BackendError) as info:
            within(15, call)
        elapsed = time.monotonic() - started
        assert isinstance(info.value, BackendTimeout), repr(info.value)
        assert info.value.__cause__ is not None
        assert elapsed < 1 + 1 + 3, f"took {elapsed:.1f}s"  # timeout, margin, connect

    # And once the link is back, the one pool slot is free and the store works again
    proxy.resume()
    assert within(15, lambda: store.extend("k", "t", 30))
    store.close()


@pytest.mark.parametrize("sql_store", ["postgresql"], indirect=True)
def test_no_startup_parameter_a_pooler_refuses(sql_store: SqlStore) -> None:
    """PgBouncer refuses the ``options`` startup parameter: the store sends none of its own
    (its time limits and isolation are set inside each transaction)."""
    from psycopg.conninfo import conninfo_to_dict

    url, table = sql_store
    store = backend_from_url(url, table=table)
    params = conninfo_to_dict(store._conninfo)
    assert "options" not in params
    # Client-side bounds only (libpq keeps them, the server never sees them)
    assert int(params["connect_timeout"]) >= 2
    assert params["keepalives"] == "1"
    assert int(params["tcp_user_timeout"]) > 0
    store.close()


# -- release by holder is atomic (finding 9) ----------------------------------------------------


def _running(conn: Any, text: str) -> bool:
    """Whether a statement containing ``text`` runs on the MySQL server now."""
    cursor = conn.cursor()
    cursor.execute(
        "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE INFO LIKE %s AND ID != "
        "CONNECTION_ID()",
        (f"%{text}%",),
    )
    (count,) = cursor.fetchone()
    conn.rollback()
    return bool(count)


@pytest.mark.parametrize("sql_store", KINDS, indirect=True)
@pytest.mark.parametrize("before", ["no row yet", "held by another task"])
def test_release_held_by_never_frees_a_lock_it_reports_as_not_held(
    sql_store: SqlStore, store: Any, before: str
) -> None:
    """release_held_by(key, task) decides and frees in one step: an acquire by that task that
    commits between the call's reading of the row and its update (a row that did not exist
    yet, or one a rival then released) is never freed by a call that answers "not held"."""
    url, table = sql_store
    if kind_of(sql_store) == "postgresql":
        pytest.skip("one statement on PostgreSQL: no point between its read and its update")
    # Given the key (with no row yet, or held by task-2), and release_held_by(task-1) paused
    # for 1 s between its reading of the row and its update
    if before == "held by another task":
        assert store.acquire("k", "t2", 30, meta={"task_id": "task-2"}).acquired
    slow = backend_from_url(url, table=table)
    text = slow._q["release_holder"]
    at = text.rindex("UPDATE")  # the update that frees the row
    pause = f"SLEEP(1.{random.randrange(10**6):06d})"  # this test's own, to find it running
    slow._q["release_holder"] = f"{text[:at]}DO {pause};\n{text[at:]}"
    released: list[Any] = []
    thread = threading.Thread(target=lambda: released.append(slow.release_held_by("k", "task-1")))
    thread.start()
    with session("mysql") as watcher:  # the call has read the row once its pause runs
        deadline = time.monotonic() + 10
        while not _running(watcher, pause):
            assert time.monotonic() < deadline, "release_held_by never reached its pause"
            time.sleep(0.01)

    # When, meanwhile, task-1 acquires the key (after task-2 released it)
    if before == "held by another task":
        assert store.release("k", "t2")
    assert store.acquire("k", "t1", 30, meta={"task_id": "task-1"}).acquired
    thread.join(10)

    # Then the call answered "not held" and the lock it did not see is still held
    assert released == [None]
    holder = store.holder("k")
    assert holder is not None, "release_held_by freed a lock it reported as not held"
    assert holder.token == "t1"
    slow.close()


# -- secrets (finding 7) ------------------------------------------------------------------------


@pytest.mark.parametrize("sql_store", KINDS, indirect=True)
def test_a_password_with_a_bare_percent_never_reaches_a_message(
    sql_store: SqlStore, kind: str
) -> None:
    """A URL whose password holds a bare '%' (not percent-encoded): the error (and its chained
    cause) is singletask's and names no password."""
    scheme = "postgresql" if kind == "postgresql" else "mysql"
    url = f"{scheme}://user:pa%ss-w0rd@127.0.0.1:{free_port()}/test"

    def use() -> None:
        backend = backend_from_url(url, timeout=1)
        assert "ss-w0rd" not in repr(backend)
        backend.acquire("k", "t", 5)

    with pytest.raises(SingletaskError) as info:
        use()

    assert isinstance(info.value, ConfigurationError | BackendError)
    assert info.value.__cause__ is not None
    seen = f"{info.value} {info.value!r} {info.value.__cause__} {info.value.__cause__!r}"
    assert "ss-w0rd" not in seen


@pytest.mark.parametrize("sql_store", KINDS, indirect=True)
def test_a_table_made_by_an_earlier_version_gains_full_key_and_keeps_its_locks(
    sql_store: SqlStore, kind: str
) -> None:
    """A table without the full_key column (made by an earlier version) is upgraded on first
    use: its held locks stay held, and long keys work."""
    from singletask.backends.sql.mysql import queries as mysql_queries
    from singletask.backends.sql.postgres import queries as postgres_queries

    url, table = sql_store
    # Given the table as an earlier version made it, with a held lock in it
    schema = (postgres_queries if kind == "postgresql" else mysql_queries).SCHEMA
    old = schema.replace(",\n    full_key text", "").replace(",\n    full_key MEDIUMBLOB NULL", "")
    assert "full_key" not in old
    now = "now()" if kind == "postgresql" else "UTC_TIMESTAMP(6)"
    key = "key" if kind == "postgresql" else "`key`"
    with session(kind) as conn:
        cursor = conn.cursor()
        cursor.execute(old.format(table=table, index=f"{table}_expires_at"))
        if kind == "postgresql":
            cursor.execute(f"CREATE INDEX {table}_expires_at ON {table} (expires_at)")
        cursor.execute(
            f"INSERT INTO {table} ({key}, token, meta, lease_expires, fence, expires_at) "
            f"VALUES ('held', 't1', '{{}}', {now} + INTERVAL '30' SECOND, 1, "
            f"{now} + INTERVAL '8' DAY)"
        )
        conn.commit()

    # When a store of this version uses it
    store = backend_from_url(url, table=table)
    refused = store.acquire("held", "t2", 30)
    long_key = _long_key(3000, 4)

    # Then the lock made before is still held, and a long key works
    with session(kind) as conn:
        cursor = conn.cursor()
        cursor.execute(f"SELECT full_key FROM {table} WHERE {key} = 'held'")
        assert list(cursor.fetchall()) == [(None,)]
    assert not refused.acquired
    assert refused.holder.token == "t1"
    assert store.acquire(long_key, "t3", 30).acquired
    assert [key for key, _ in store.iter_locks("app:long:")] == [long_key]
    store.close()
