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
negative. For the same reason the pending state of an open window's latest send (its message
being published) lives in a table of its own, ``singletask_debounce_pending``: a row per key
while its latest send is pending, with its deadline and the superseded send's (if that one was
pending), for :func:`debounce_undo` to put back.
"""

from __future__ import annotations

import itertools
import sqlite3

__all__ = [
    "CLOSED", "SCHEMA", "debounce", "debounce_published", "debounce_take", "debounce_undo",
    "prune", "start",
]  # fmt: skip

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
    # Per key whose open window's latest send is pending: until when, and the deadline of the
    # send it superseded if that one was pending (NULL else).
    """
    CREATE TABLE IF NOT EXISTS singletask_debounce_pending (
        key TEXT PRIMARY KEY,
        pending REAL NOT NULL,
        before REAL
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
    conn.execute(
        "DELETE FROM singletask_debounce_pending WHERE key NOT IN "
        "(SELECT key FROM singletask_debounce WHERE opened >= 0)"
    )


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


def _pending(conn: sqlite3.Connection, key: str) -> tuple[float, float | None] | None:
    """The pending deadline of the latest send of the window of ``key`` and of the send it
    superseded, or None when it is published."""
    row = conn.execute(
        "SELECT pending, before FROM singletask_debounce_pending WHERE key = ?", (key,)
    ).fetchone()
    return None if row is None else (float(row[0]), None if row[1] is None else float(row[1]))


def _set_pending(
    conn: sqlite3.Connection, key: str, pending: float | None, before: float | None = None
) -> None:
    """Make the latest send of the window of ``key`` pending until ``pending`` (None:
    published)."""
    conn.execute("DELETE FROM singletask_debounce_pending WHERE key = ?", (key,))
    if pending is not None:
        conn.execute(
            "INSERT INTO singletask_debounce_pending (key, pending, before) VALUES (?, ?, ?)",
            (key, pending, before),
        )


def debounce(
    conn: sqlite3.Connection, key: str, task_id: str, ttl: float, now: float, pending: float = 0.0
) -> tuple[str | None, float, str | None]:
    """Make ``task_id`` the latest send of the window of ``key`` (opening one if none is open:
    no row, the last one ran out, or it is closed), lasting ``ttl`` seconds from ``now``,
    pending ``pending`` seconds (if > 0). Returns the previous latest send (None: this call
    opened the window), the window's age, and the latest send of the closed window it opened
    a new one over (else None)."""
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
    superseded = _pending(conn, key) if latest is not None else None
    conn.execute(
        "INSERT OR REPLACE INTO singletask_debounce (key, latest, opened, until) "
        "VALUES (?, ?, ?, ?)",
        (key, task_id, opened, until),
    )
    mark = now + pending if pending > 0 else None
    _set_pending(conn, key, mark, superseded[0] if superseded and mark else None)
    _wrote(conn, now)
    return latest, max(0.0, now - opened), closed  # the wall clock may step back


def debounce_published(conn: sqlite3.Connection, key: str, task_id: str, now: float) -> bool:
    """The pending latest send ``task_id`` of the open window of ``key`` was published: it is
    pending no more. Returns whether it changed anything."""
    row = conn.execute(
        "SELECT 1 FROM singletask_debounce WHERE key = ? AND latest = ? AND opened >= 0 "
        "AND until > ?",
        (key, task_id, now),
    ).fetchone()
    if row is None or _pending(conn, key) is None:
        return False
    _set_pending(conn, key, None)
    return True


def debounce_take(
    conn: sqlite3.Connection, key: str, task_id: str, now: float, *, overdue: bool = False
) -> tuple[str | None, float]:
    """Close the open window of ``key`` if ``task_id`` is its latest send (the row stays, with
    ``opened`` set to :data:`CLOSED`); return the window's latest send, also when it is already
    closed (None when there is no row or it ran out), and the seconds it stays pending (0
    unless it is another send, pending). Another latest send pending past its deadline (with
    ``overdue``, pending at all) is taken back first: ``task_id`` becomes the latest."""
    row = conn.execute(
        "SELECT latest, opened, until FROM singletask_debounce WHERE key = ?", (key,)
    ).fetchone()
    if row is None:
        return None, 0.0
    if row[2] <= now:
        conn.execute("DELETE FROM singletask_debounce WHERE key = ?", (key,))
        _set_pending(conn, key, None)
        return None, 0.0
    latest, is_open = str(row[0]), row[1] >= 0
    pending = _pending(conn, key) if is_open and latest != task_id else None
    if pending is not None and pending[0] > now and not overdue:
        return latest, pending[0] - now
    if pending is not None:  # past its deadline (or overdue): taken back
        latest = task_id
    if latest == task_id and is_open:
        conn.execute(
            "UPDATE singletask_debounce SET latest = ?, opened = ? WHERE key = ?",
            (task_id, CLOSED, key),
        )
        _set_pending(conn, key, None)
    return latest, 0.0


def debounce_undo(
    conn: sqlite3.Connection,
    key: str,
    task_id: str,
    previous: str | None,
    closed: str | None,
    now: float,
) -> bool:
    """Take back the :func:`debounce` of ``task_id`` if the open window of ``key`` still names
    it: ``previous`` is the latest again (``opened`` and ``until`` kept, pending again if it
    was when ``task_id`` superseded it), or without one the closed window ``closed`` is back
    (``opened`` :data:`CLOSED`, ``until`` kept), or without either the row is deleted.
    Returns whether it changed anything."""
    where = " WHERE key = ? AND latest = ? AND opened >= 0 AND until > ?"
    if previous is not None:
        pending = _pending(conn, key)
        change = "UPDATE singletask_debounce SET latest = ?" + where
        cursor = conn.execute(change, (previous, key, task_id, now))
        if cursor.rowcount > 0:  # previous pending again, if it was
            _set_pending(conn, key, pending[1] if pending else None)
        return cursor.rowcount > 0
    if closed is not None:
        change = "UPDATE singletask_debounce SET latest = ?, opened = ?" + where
        cursor = conn.execute(change, (closed, CLOSED, key, task_id, now))
    else:
        cursor = conn.execute("DELETE FROM singletask_debounce" + where, (key, task_id, now))
    if cursor.rowcount > 0:
        _set_pending(conn, key, None)
    return cursor.rowcount > 0
