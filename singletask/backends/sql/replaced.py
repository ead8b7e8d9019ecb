"""The SQL stores' preemption records (``lock_policy = "replace"``).

A preemption leaves a record naming the preemptor's task id under the preempted owner token,
kept for the preemptor's first lease; the preempted holder reads it once, after its renewal or
release failed (:meth:`~singletask.backends.base.LockBackend.replaced_by`).

PostgreSQL and MySQL keep it as a row of the lock table under the store key
:func:`record_key` (the companion naming of :mod:`singletask.protocol.slots`): no ``token`` (so it
is no lock and is never listed), ``task_id`` the preemptor's, ``expires_at`` the end of the record,
after which the sweep of expired rows deletes it. SQLite keeps it in a table of its own,
``singletask_replaced``, whose expired rows go with the next record written.
"""

from __future__ import annotations

import sqlite3
from typing import Final

from ...protocol.slots import companion_key

__all__ = [
    "MYSQL_LEAVE", "MYSQL_READ", "POSTGRES_LEAVE", "POSTGRES_READ", "SQLITE_SCHEMA",
    "record_key", "sqlite_leave", "sqlite_read",
]  # fmt: skip


def record_key(key: str, token: str) -> str:
    """The store key of the record of ``token``'s preemption on ``key`` (a key or a slot)."""
    return companion_key(key, f"replaced:{token}")


#: Arguments: key, full_key (of record_key), task_id, ttl (seconds).
POSTGRES_LEAVE: Final = """
INSERT INTO {table} AS l (key, full_key, task_id, lease_expires, fence, expires_at)
VALUES (%(key)s, %(full_key)s, %(task_id)s, statement_timestamp(), 0,
        statement_timestamp() + %(ttl)s * interval '1 second')
ON CONFLICT (key) DO UPDATE SET task_id = EXCLUDED.task_id, expires_at = EXCLUDED.expires_at"""

#: Arguments: key (of record_key). One row, the preemptor's task id, while the record lasts.
POSTGRES_READ: Final = """
SELECT task_id FROM {table}
WHERE key = %(key)s AND token IS NULL AND expires_at > statement_timestamp()"""

#: Arguments: key, full_key (of record_key), task_id, ttl_us (microseconds).
MYSQL_LEAVE: Final = """
INSERT INTO {table} (`key`, full_key, task_id, lease_expires, fence, expires_at)
VALUES (%(key)s, %(full_key)s, %(task_id)s, UTC_TIMESTAMP(6), 0,
        UTC_TIMESTAMP(6) + INTERVAL %(ttl_us)s MICROSECOND)
ON DUPLICATE KEY UPDATE task_id = VALUES(task_id), expires_at = VALUES(expires_at)"""

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
