"""Rate records (``lock_rate``) and debounce windows (``lock_debounce``) of the SQLite lock store.

Private to :mod:`singletask.backends.sql.sqlite`: each function runs inside the caller's
``BEGIN IMMEDIATE`` transaction, with ``now`` read from the store's clock (``time.time()``) in
that transaction. Both live in tables of their own, created next to the lock and fence tables
(``CREATE TABLE IF NOT EXISTS``, so a database of an older version gains them on first use),
and never listed as locks. Every row carries its own deadline, after which it counts as gone;
rows past it are deleted when a process opens the database and every
:data:`PRUNE_EVERY` writes.

A debounce window closed by :func:`debounce_take` keeps its row (same ``latest`` and
``until``) with ``opened`` set to :data:`CLOSED` (-1): the column is ``NOT NULL``, and a
database of an older version may already have the table, whose column SQLite cannot alter, so
a sentinel stands for "closed" instead of NULL. Real opening times (``time.time()``) are never
negative.
"""

from __future__ import annotations

import itertools
import sqlite3

__all__ = ["CLOSED", "SCHEMA", "debounce", "debounce_take", "debounce_undo", "prune", "start"]

SCHEMA = (
    # Per key: the earliest time (time.time()) of its next start; the row expires then.
    """
    CREATE TABLE IF NOT EXISTS singletask_rates (
        key TEXT PRIMARY KEY,
        allowed REAL NOT NULL
    )
    """,
    # Per key: its debounce window, the latest send and when the window opened (CLOSED once
    # closed); the row expires at ``until``.
    """
    CREATE TABLE IF NOT EXISTS singletask_debounce (
        key TEXT PRIMARY KEY,
        latest TEXT NOT NULL,
        opened REAL NOT NULL,
        until REAL NOT NULL
    )
    """,
)

#: The ``opened`` of a closed debounce window (the column is NOT NULL; see the module docs).
CLOSED = -1.0

#: Rows that ran out are deleted once every this many writes of this process (and whenever a
#: process opens the database), so that keys used once do not stay for ever.
PRUNE_EVERY = 1024

_writes = itertools.count(1)


def prune(conn: sqlite3.Connection, now: float) -> None:
    """Delete the rate records and debounce windows that ran out."""
    conn.execute("DELETE FROM singletask_rates WHERE allowed <= ?", (now,))
    conn.execute("DELETE FROM singletask_debounce WHERE until <= ?", (now,))


def _wrote(conn: sqlite3.Connection, now: float) -> None:
    if next(_writes) % PRUNE_EVERY == 0:
        prune(conn, now)


def start(conn: sqlite3.Connection, key: str, interval: float, now: float) -> float | None:
    """Record a start of ``key`` if ``interval`` has passed since its last one: its next start
    is allowed ``interval`` seconds from ``now``. Returns None when it did, else the seconds
    until a start is allowed (nothing is written)."""
    row = conn.execute("SELECT allowed FROM singletask_rates WHERE key = ?", (key,)).fetchone()
    if row is not None and row[0] > now:
        return float(row[0]) - now
    conn.execute(
        "INSERT OR REPLACE INTO singletask_rates (key, allowed) VALUES (?, ?)",
        (key, now + interval),
    )
    _wrote(conn, now)
    return None


def debounce(
    conn: sqlite3.Connection, key: str, task_id: str, ttl: float, now: float
) -> tuple[str | None, float, str | None]:
    """Make ``task_id`` the latest send of the window of ``key`` (opening one if none is open:
    no row, the last one ran out, or it is closed), lasting ``ttl`` seconds from ``now``.
    Returns the previous latest send (None: this call opened the window), the window's age,
    and the latest send of the closed window it opened a new one over (else None)."""
    row = conn.execute(
        "SELECT latest, opened, until FROM singletask_debounce WHERE key = ?", (key,)
    ).fetchone()
    latest: str | None = None
    closed: str | None = None
    opened, until = now, now + ttl
    if row is not None and row[2] > now and row[1] >= 0:  # a window is open (not CLOSED)
        latest, opened = str(row[0]), float(row[1])
    elif row is not None and row[2] > now:  # a closed window, replaced
        closed = str(row[0])
    if row is not None:  # never shorter than an earlier send asked: it may start later
        until = max(until, float(row[2]))
    conn.execute(
        "INSERT OR REPLACE INTO singletask_debounce (key, latest, opened, until) "
        "VALUES (?, ?, ?, ?)",
        (key, task_id, opened, until),
    )
    _wrote(conn, now)
    return latest, max(0.0, now - opened), closed  # the wall clock may step back


def debounce_take(conn: sqlite3.Connection, key: str, task_id: str, now: float) -> str | None:
    """Close the open window of ``key`` if ``task_id`` is its latest send (the row stays, with
    ``opened`` set to :data:`CLOSED`); return the window's latest send, also when it is already
    closed (None when there is no row or it ran out)."""
    row = conn.execute(
        "SELECT latest, opened, until FROM singletask_debounce WHERE key = ?", (key,)
    ).fetchone()
    if row is None:
        return None
    if row[2] <= now:
        conn.execute("DELETE FROM singletask_debounce WHERE key = ?", (key,))
        return None
    if row[0] == task_id and row[1] >= 0:
        conn.execute("UPDATE singletask_debounce SET opened = ? WHERE key = ?", (CLOSED, key))
    return str(row[0])


def debounce_undo(
    conn: sqlite3.Connection,
    key: str,
    task_id: str,
    previous: str | None,
    closed: str | None,
    now: float,
) -> bool:
    """Take back the :func:`debounce` of ``task_id`` if the open window of ``key`` still names
    it: ``previous`` is the latest again (``opened`` and ``until`` kept), or without one the
    closed window ``closed`` is back (``opened`` :data:`CLOSED`, ``until`` kept), or without
    either the row is deleted. Returns whether it changed anything."""
    where = " WHERE key = ? AND latest = ? AND opened >= 0 AND until > ?"
    if previous is not None:
        change = "UPDATE singletask_debounce SET latest = ?" + where
        cursor = conn.execute(change, (previous, key, task_id, now))
    elif closed is not None:
        change = "UPDATE singletask_debounce SET latest = ?, opened = ?" + where
        cursor = conn.execute(change, (closed, CLOSED, key, task_id, now))
    else:
        cursor = conn.execute("DELETE FROM singletask_debounce" + where, (key, task_id, now))
    return cursor.rowcount > 0
