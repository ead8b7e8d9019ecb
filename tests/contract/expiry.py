"""What each backend of the ``backend`` fixture stores, with the time left before it expires.

The contract suite checks after every backend operation that no record of the test's keys is
left without an expiry (see ``test_contract.py``), through the ``backend_records`` fixture of
``tests/conftest.py``, which calls the inspector registered here under the ``backend`` fixture's
param. To plug a new store into that check, add one function to :data:`INSPECTORS` that lists
the records the store holds whose key contains ``match``: ``{record name: seconds left}``, with
``None`` for a record that never expires. Read the store as directly as you can (its server, its
tables), not through the backend under test. See ``tests/contract/README.md``.
"""

from __future__ import annotations

import math
import sqlite3
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from singletask.backends.base import MAX_LEASE, LockBackend
from singletask.backends.memory import MemoryBackend
from singletask.backends.sql.core import FENCE_RETENTION as SQLITE_FENCE_RETENTION
from singletask.backends.sql.lines import line_table
from singletask.backends.sql.sqlite import SQLiteBackend
from singletask.backends.sql.units import limit_tables

from ..backends.memcached_records import inspect_memcached

#: (backend under test, the test's request, text every key of the test contains) -> records.
Inspector = Callable[[LockBackend, pytest.FixtureRequest, str], dict[str, float | None]]


def _redis(
    backend: LockBackend, request: pytest.FixtureRequest, match: str
) -> dict[str, float | None]:
    """Every key holding ``match`` (lock hashes and their ``{...}:fence`` hashes) and its PTTL."""
    client = redis.Redis.from_url(request.getfixturevalue("redis_url"))
    try:
        found: dict[str, float | None] = {}
        # KEYS, not SCAN: one round trip on the suite's own server, after every operation
        for raw in client.keys(f"*{match}*"):
            pttl = client.pttl(raw)
            if pttl == -2:
                continue  # expired between SCAN and PTTL
            found[raw.decode()] = None if pttl < 0 else pttl / 1000
        return found
    finally:
        client.close()


def _memory(
    backend: LockBackend, request: pytest.FixtureRequest, match: str
) -> dict[str, float | None]:
    """The in-process store's own records: locks, fence records, rates, windows and limits'
    holds, with their deadlines."""
    assert isinstance(backend, MemoryBackend)
    now = time.monotonic()
    found: dict[str, float | None] = {}
    with backend._mutex:
        for key, entry in backend._entries.items():
            if match in key and entry.expires_at > now:
                found[f"lock {key}"] = entry.expires_at - now
        for key, record in backend._fences.items():
            if match in key and record.expires_at > now:
                found[f"fence {key}"] = record.expires_at - now
        for key, allowed in backend._rates.items():
            if match in key and allowed > now:
                found[f"rate {key}"] = allowed - now
        for key, window in backend._windows.items():
            if match in key and window.until > now:
                found[f"debounce {key}"] = window.until - now
        for key, limit in backend._limits.records.items():
            for token, hold in limit.holds.items():
                left = limit.until(hold) - now
                if match in key and left > 0:
                    found[f"limit {key} {token}"] = left
    return found


def _sqlite(
    backend: LockBackend, request: pytest.FixtureRequest, match: str
) -> dict[str, float | None]:
    """Rows of every table (locks, fences, rates, debounce windows, preemption records, limits'
    holds and starts), read over a connection of the test's own."""
    assert isinstance(backend, SQLiteBackend)
    now = time.time()
    pattern = f"%{match}%"
    conn = sqlite3.connect(backend.path, timeout=30)
    try:
        found: dict[str, float | None] = {}
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
        if "singletask_locks" in tables:
            for key, expires_at in conn.execute(
                "SELECT key, expires_at FROM singletask_locks WHERE key LIKE ?", (pattern,)
            ):
                if expires_at is None or expires_at > now:
                    found[f"lock {key}"] = None if expires_at is None else expires_at - now
        if "singletask_fences" in tables:
            for key, touched, next_until in conn.execute(
                "SELECT key, touched, next_until FROM singletask_fences WHERE key LIKE ?",
                (pattern,),
            ):
                if touched is None:
                    found[f"fence {key}"] = None
                    continue
                until = max(touched + SQLITE_FENCE_RETENTION, next_until or 0.0)
                if until > now:
                    found[f"fence {key}"] = until - now
        # Rate records expire when the next start is allowed, debounce windows at ``until``
        for kind, table, column in (
            ("rate", "singletask_rates", "allowed"),
            ("debounce", "singletask_debounce", "until"),
            ("replaced", "singletask_replaced", "until"),  # preemption records
        ):
            if table in tables:
                for key, deadline in conn.execute(
                    f"SELECT key, {column} FROM {table} WHERE key LIKE ?", (pattern,)
                ):
                    if deadline is None or deadline > now:
                        found[f"{kind} {key}"] = None if deadline is None else deadline - now
        # A limit's hold expires at its deadline (``at``), a rate's start ``period`` after it
        if "singletask_units" in tables:
            for key, token, at, period in conn.execute(
                "SELECT key, token, at, period FROM singletask_units WHERE key LIKE ?",
                (pattern,),
            ):
                until = None if at is None else at + (period or 0.0)
                if until is None or until > now:
                    found[f"limit {key} {token}"] = None if until is None else until - now
        # A limit's waiting line (fair turns) expires when its last ticket's lease runs out
        if "singletask_lines" in tables:
            for key, expires in conn.execute(
                "SELECT key, expires FROM singletask_lines WHERE key LIKE ?", (pattern,)
            ):
                if expires is None or expires > now:
                    found[f"line {key}"] = None if expires is None else expires - now
        return found
    finally:
        conn.close()


def _redis_deployment(
    backend: LockBackend, request: pytest.FixtureRequest, match: str
) -> dict[str, float | None]:
    """A Redis deployment (a cluster: every primary; Sentinel: the master; TLS), read through
    the redis-py client the backend built, with plain SCAN and PTTL (not its scripts)."""
    from singletask.backends.redis import RedisBackend

    assert isinstance(backend, RedisBackend)
    client = backend.client
    found: dict[str, float | None] = {}
    for raw in client.scan_iter(match=f"*{match}*", count=1000):
        pttl = client.pttl(raw)
        if pttl == -2:
            continue
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        found[name] = None if pttl < 0 else pttl / 1000
    return found


#: One connection per SQL server, kept for the session: an inspection after every operation
#: must be quick, or the contract tests' 0.2 s leases run out between two operations.
_CONNECTIONS: dict[str, Any] = {}


def close_connections() -> None:
    """Close the inspection connections (at the end of the session)."""
    while _CONNECTIONS:
        _CONNECTIONS.popitem()[1].close()


def _cached(kind: str, connect: Callable[[], Any]) -> Any:
    if kind not in _CONNECTIONS:
        _CONNECTIONS[kind] = connect()
    return _CONNECTIONS[kind]


def _postgresql(
    backend: LockBackend, request: pytest.FixtureRequest, match: str
) -> dict[str, float | None]:
    """Rows of the backend's table, by ``expires_at`` (when the whole row may be deleted), and
    of its tables of named limits."""
    import psycopg
    from psycopg import sql

    from singletask.backends.sql.postgres import PostgresBackend

    from ..servers import SQL_URLS

    assert isinstance(backend, PostgresBackend)
    conn = _cached("postgresql", lambda: psycopg.connect(SQL_URLS["postgresql"], autocommit=True))
    limits, holds = limit_tables(backend.table)
    found: dict[str, float | None] = {}
    # The lock table's rows; the rows of named limits (one per limit, one per hold or start)
    for kind, table, columns in (
        ("row", backend.table, "key"), ("limit", limits, "key"), ("hold", holds, "key, token"),
        ("line", line_table(backend.table), "key"),  # a limit's waiting line (fair turns)
    ):  # fmt: skip
        query = sql.SQL(
            "SELECT concat_ws(' ', {}), "
            "extract(epoch FROM expires_at - statement_timestamp())::float8 "
            "FROM {} WHERE strpos(key, %s) > 0"
        ).format(sql.SQL(columns), sql.Identifier(*table.split(".")))
        if conn.execute("SELECT to_regclass(%s)", (table,)).fetchone() == (None,):
            continue
        rows = conn.execute(query, (match,)).fetchall()
        found.update((f"{kind} {key}", left) for key, left in rows if left is None or left > 0)
    return found


def _mysql(
    backend: LockBackend, request: pytest.FixtureRequest, match: str
) -> dict[str, float | None]:
    """Rows of the backend's table, by ``expires_at`` (when the whole row may be deleted), and
    of its tables of named limits."""
    import pymysql

    from singletask.backends.sql.mysql import MySQLBackend

    assert isinstance(backend, MySQLBackend)
    args = {k: v for k, v in backend._connect_args.items() if k != "client_flag"}
    conn = _cached("mysql", lambda: pymysql.connect(**{**args, "autocommit": True}))
    limits, holds = limit_tables(backend.table)
    found: dict[str, float | None] = {}
    # The lock table's rows; the rows of named limits (one per limit, one per hold or start)
    for kind, full_name, columns in (
        ("row", backend.table, "`key`"), ("limit", limits, "`key`"),
        ("hold", holds, "`key`, ' ', token"),
        ("line", line_table(backend.table), "`key`"),  # a limit's waiting line (fair turns)
    ):  # fmt: skip
        with conn.cursor() as cursor:
            schema, _, name = full_name.rpartition(".")
            cursor.execute(
                "SELECT 1 FROM information_schema.tables WHERE table_schema = "
                "coalesce(nullif(%s, ''), database()) AND table_name = %s",
                (schema, name),
            )
            if cursor.fetchone() is None:
                continue
            table = ".".join(f"`{part}`" for part in full_name.split("."))
            cursor.execute(
                f"SELECT CONCAT({columns}), "
                "TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) / 1e6 "
                f"FROM {table} WHERE LOCATE(%s, `key`) > 0",
                (match,),
            )
            rows = cursor.fetchall()
        found.update(
            (f"{kind} {bytes(key).decode()}", None if left is None else float(left))
            for key, left in rows
            if left is None or float(left) > 0
        )
    return found


#: One inspector per param of the ``backend`` fixture (tests/conftest.py).
INSPECTORS: dict[str, Inspector] = {
    "memory": _memory,
    "redis": _redis,
    "redis-client": _redis,
    "redis-scripts": _redis_deployment,
    "redis-cluster": _redis_deployment,
    "redis-sentinel": _redis_deployment,
    "rediss": _redis_deployment,
    "rediss-cluster": _redis_deployment,
    "sqlite": _sqlite,
    "postgresql": _postgresql,
    "mysql": _mysql,
    "memcached": inspect_memcached,
    "django-memcached": inspect_memcached,
    "django-redis": _redis,  # Django's RedisCache: the key with its ":<version>:" prefix
}


#: The latest expiry a record may have: the longest lease, plus the 7 days a fence record is
#: kept after it (the SQL stores keep lock and fence record in one row), plus a minute of slack.
LATEST_EXPIRY = MAX_LEASE + 7 * 24 * 3600.0 + 60


def without_expiry(records: dict[str, float | None]) -> dict[str, float | None]:
    """The records that never expire, or whose expiry is beyond what a backend may set."""
    return {
        name: left
        for name, left in records.items()
        if left is None or not math.isfinite(left) or left > LATEST_EXPIRY
    }
