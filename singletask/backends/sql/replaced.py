"""The SQL stores' preemption records (``lock_policy = "replace"``).

A preemption leaves a record naming the preemptor's task id under the preempted owner token,
kept for the preemptor's first lease, in the transaction of the takeover itself (PostgreSQL and
MySQL: the statement :data:`POSTGRES_RECORD` or :data:`MYSQL_RECORD` before its ``COMMIT``;
SQLite: :func:`sqlite_leave`); the preempted holder reads it once, after its renewal or release
failed (:meth:`~singletask.backends.base.LockBackend.replaced_by`). The record of a token is
the first one written while it lasts: a token is preempted once.

PostgreSQL and MySQL keep it as a row of the lock table under the store key
:func:`record_key` (the companion naming of :mod:`singletask.protocol.slots`): no ``token`` (so it
is no lock and is never listed), ``task_id`` the preemptor's, ``expires_at`` the end of the record,
after which the sweep of expired rows deletes it. SQLite keeps it in a table of its own,
``singletask_replaced``, whose expired rows go with the next record written.
"""

from __future__ import annotations

import sqlite3
from typing import Final

from ...protocol.slots import base_key, companion_key

__all__ = [
    "MYSQL_READ", "MYSQL_RECORD", "POSTGRES_READ", "POSTGRES_RECORD", "SQLITE_SCHEMA",
    "record_key", "sqlite_leave", "sqlite_read", "with_record",
]  # fmt: skip


def record_key(key: str, token: str) -> str:
    """The store key of the record of ``token``'s preemption on ``key`` (a key or one of its
    slots: the record is the lock key's companion either way, known before the slot is)."""
    return companion_key(base_key(key), f"replaced:{token}")


def with_record(script: str, record: str) -> str:
    """The transaction ``script`` (ending in ``COMMIT``) with the statement ``record`` just
    before its ``COMMIT``: the takeover and its record commit together."""
    head, mark, tail = script.rpartition("COMMIT")
    assert mark, "a transaction script ends in COMMIT"
    assert not tail.strip(), "a transaction script ends in COMMIT"
    return f"{head.rstrip().rstrip(';')};\n{record.strip()};\nCOMMIT"


#: Inside the takeover's transaction, after it. Arguments: record, record_full (of record_key),
#: successor (the preemptor's task id, '' for none), ttl (seconds), token (the preemptor's) and
#: taken (the stored keys it may have taken). Written only when ``token`` holds one of them now,
#: and only over a record that ran out.
POSTGRES_RECORD: Final = """
INSERT INTO {table} AS l (key, full_key, task_id, lease_expires, fence, expires_at)
SELECT %(record)s, %(record_full)s, %(successor)s, statement_timestamp(), 0,
    statement_timestamp() + %(ttl)s * interval '1 second'
WHERE EXISTS (SELECT FROM {table} WHERE key = ANY(%(taken)s::text[]) AND token = %(token)s)
ON CONFLICT (key) DO UPDATE SET task_id = EXCLUDED.task_id, expires_at = EXCLUDED.expires_at
WHERE l.expires_at <= statement_timestamp()"""

#: Arguments: key (of record_key). One row, the preemptor's task id, while the record lasts.
POSTGRES_READ: Final = """
SELECT task_id FROM {table}
WHERE key = %(key)s AND token IS NULL AND expires_at > statement_timestamp()"""

#: As POSTGRES_RECORD; ttl_us (microseconds) for ttl, taken a list of stored keys.
MYSQL_RECORD: Final = """
INSERT INTO {table} (`key`, full_key, task_id, lease_expires, fence, expires_at)
SELECT %(record)s, %(record_full)s, %(successor)s, UTC_TIMESTAMP(6), 0,
    UTC_TIMESTAMP(6) + INTERVAL %(ttl_us)s MICROSECOND
FROM DUAL WHERE EXISTS (SELECT 1 FROM {table} WHERE `key` IN %(taken)s AND token = %(token)s)
ON DUPLICATE KEY UPDATE
    task_id = IF(expires_at > UTC_TIMESTAMP(6), task_id, VALUES(task_id)),
    expires_at = IF(expires_at > UTC_TIMESTAMP(6), expires_at, VALUES(expires_at))"""

#: Arguments: key (of record_key).
MYSQL_READ: Final = """
SELECT task_id FROM {table}
WHERE `key` = %(key)s AND token IS NULL AND expires_at > UTC_TIMESTAMP(6)"""

#: SQLite: per preempted (key, token), the preemptor's task id until ``until`` (time.time()).
SQLITE_SCHEMA: Final = (
    """
    CREATE TABLE IF NOT EXISTS singletask_replaced (
        key TEXT NOT NULL,
        token TEXT NOT NULL,
        successor TEXT NOT NULL,
        until REAL NOT NULL,
        PRIMARY KEY (key, token)
    )
    """,
)


def sqlite_leave(
    conn: sqlite3.Connection, key: str, token: str, successor: str, until: float, now: float
) -> None:
    """Write the record inside the caller's transaction, deleting the records that ran out."""
    conn.execute("DELETE FROM singletask_replaced WHERE until <= ?", (now,))
    conn.execute(
        "INSERT INTO singletask_replaced (key, token, successor, until) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (key, token) DO UPDATE SET successor = excluded.successor, "
        "until = excluded.until",
        (key, token, successor, until),
    )


def sqlite_read(conn: sqlite3.Connection, key: str, token: str, now: float) -> str | None:
    """The preemptor's task id while the record of ``token`` on ``key`` lasts, else None."""
    row = conn.execute(
        "SELECT successor FROM singletask_replaced WHERE key = ? AND token = ? AND until > ?",
        (key, token, now),
    ).fetchone()
    return None if row is None else str(row[0])
