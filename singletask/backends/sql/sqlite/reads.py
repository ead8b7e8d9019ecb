"""What the SQLite lock store reads for operators and for :meth:`holder`, without writing.

Private to :mod:`singletask.backends.sql.sqlite`. A process that has not written to the
database yet reads through a connection opened read-only (``mode=ro``): it creates neither the
file nor a table, and changes nothing (no journal mode, no pruning). A missing file or table
holds no lock. The rows are judged by ``now`` (``time.time()``); rows that ran out are left for
the writers to delete. The operators' listing of bookkeeping records reads the tables the file
has: one made by an older version, without the newer tables, still lists what it holds.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Protocol, TypeVar

from ....protocol.slots import base_key
from ...base import Holder, StoreState
from ..core import load_holder
from . import units
from .windows import CLOSED

__all__ = ["MISSING", "Reader", "as_text", "holder_row", "locks", "open_reader", "states"]

T = TypeVar("T")

#: A page of rows and the stored key (its raw bytes: a key another program wrote may not be
#: UTF-8) to read the next page after (None: done).
Page = tuple[list[T], bytes | None]

#: What an OperationalError says when the database has no such table (yet).
MISSING = "no such table"


class Reader(Protocol):
    """The store's ``_read``: ``work`` on a connection, ``absent`` when there is no table."""

    def __call__(
        self, operation: str, key: str, work: Callable[[sqlite3.Connection], T], absent: T
    ) -> T: ...


def locks(read: Reader, prefix: str, page_size: int) -> Iterator[tuple[str, Holder]]:
    """The live locks under ``prefix``: two key ranges, the keys that start with ``prefix``
    (plain keys, and slots of keys with a ``}``), then those that start with ``{`` + ``prefix``
    (the other slots), unless the first range holds them already (a prefix of only ``{``)."""
    starts = [prefix] if ("{" + prefix).startswith(prefix) else [prefix, "{" + prefix]
    for start in starts:
        after: bytes | None = None
        while True:
            empty: Page[tuple[str, Holder]] = ([], None)
            work = partial(_lock_page, start=start, after=after, size=page_size, now=time.time())
            page, after = read("list", start, work, empty)
            yield from ((key, held) for key, held in page if base_key(key).startswith(prefix))
            if after is None:
                break


def states(read: Reader, prefix: str, page_size: int) -> Iterator[StoreState]:
    """The live bookkeeping records of the keys under ``prefix``, a page of keys at a time."""
    after: bytes | None = None
    while True:
        empty: Page[StoreState] = ([], None)
        work = partial(_state_page, prefix=prefix, after=after, size=page_size, now=time.time())
        page, after = read("list state", prefix, work, empty)
        yield from page
        if after is None:
            return


def open_reader(path: Path, timeout: float) -> sqlite3.Connection | None:
    """A read-only connection to the database at ``path``; None when there is no file."""
    if not path.exists():
        return None
    conn = sqlite3.connect(
        f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=timeout, check_same_thread=False
    )
    conn.text_factory = as_text
    return conn


def as_text(stored: bytes) -> str:
    """A text value as read: UTF-8, each byte that is not shown as a backslash escape (another
    program may have written such text into the file); a listing never fails on it."""
    return stored.decode("utf-8", "backslashreplace")


def holder_row(conn: sqlite3.Connection, key: str, now: float) -> Holder | None:
    """The live holder of ``key``."""
    row = conn.execute(
        "SELECT token, expires_at, meta, fence FROM singletask_locks "
        "WHERE key = ? AND expires_at > ?",
        (key, now),
    ).fetchone()
    return None if row is None else load_holder(row[0], row[2], row[1] - now, row[3])


def _lock_page(
    conn: sqlite3.Connection, start: str, after: bytes | None, size: int, now: float
) -> Page[tuple[str, Holder]]:
    """The live locks among the ``size`` first rows whose key starts with ``start``
    (after ``after``), in key order, and the key to read the next page after (None: done)."""
    # Keys with the prefix are contiguous in key order (BINARY collation: the raw bytes, which
    # a key's raw bytes cast back to text compare as).
    rows: list[tuple[str, bytes, str, float, str, int]] = conn.execute(
        "SELECT key, CAST(key AS BLOB), token, expires_at, meta, fence FROM singletask_locks "
        f"WHERE key {'>=' if after is None else '>'} CAST(? AS TEXT) ORDER BY key LIMIT ?",
        (start.encode() if after is None else after, size),
    ).fetchall()
    found: list[tuple[str, Holder]] = []
    for key, _raw, token, expires_at, stored, fence in rows:
        if not key.startswith(start):
            return found, None
        if expires_at > now:
            found.append((key, load_holder(token, stored, expires_at - now, fence)))
    return found, (rows[-1][1] if len(rows) == size else None)


def _state_page(
    conn: sqlite3.Connection, prefix: str, after: bytes | None, size: int, now: float
) -> Page[StoreState]:
    """The records of the ``size`` first keys under ``prefix`` (after ``after``, in key
    order) with a live follow-up, window, rate or limit record, and the last of them (None:
    done)."""
    bound = f"key {'>=' if after is None else '>'} CAST(:from AS TEXT)"
    tables = _tables(conn)
    selects = [
        # DISTINCT: a limit has a row per hold; each table gives its ``size`` first keys
        f"SELECT key FROM (SELECT DISTINCT key FROM {table} WHERE {bound} AND {live} "
        "ORDER BY key LIMIT :limit)"
        for table, live in _LIVE
        if table in tables
    ]
    if not selects:
        return [], None
    union = " UNION ".join(selects)
    rows: list[tuple[str, bytes]] = conn.execute(
        f"SELECT key, CAST(key AS BLOB) FROM ({union}) ORDER BY key LIMIT :limit",
        {"from": prefix.encode() if after is None else after, "now": now, "limit": size},
    ).fetchall()
    found: list[StoreState] = []
    for key, raw in rows:
        if not key.startswith(prefix):
            return found, None
        found.extend(_records(conn, key, raw, now, tables))
    return found, (rows[-1][1] if len(rows) == size else None)


#: The tables of bookkeeping records, and when a row of each is live.
_LIVE = (
    ("singletask_fences", "next IS NOT NULL AND next_until > :now"),
    ("singletask_debounce", "until > :now"),
    ("singletask_rates", "allowed > :now"),
    (units.TABLE, f"{units.UNTIL} > :now"),
)


def _tables(conn: sqlite3.Connection) -> set[str]:
    """The tables of bookkeeping records the file has."""
    names = [table for table, _ in _LIVE]
    marks = ", ".join("?" * len(names))
    return {
        str(name)
        for (name,) in conn.execute(
            f"SELECT name FROM sqlite_master WHERE type = 'table' AND name IN ({marks})", names
        )
    }


def _records(
    conn: sqlite3.Connection, key: str, raw: bytes, now: float, tables: set[str]
) -> Iterator[StoreState]:
    """The live records of the stored key ``raw``, shown as ``key``, from ``tables``."""
    if "singletask_fences" in tables:
        yield from _follow_up(conn, key, raw, now)
    if "singletask_debounce" in tables:
        yield from _window(conn, key, raw, now)
    if "singletask_rates" in tables:
        yield from _rate(conn, key, raw, now)
    if units.TABLE in tables:
        limit = units.state(conn, key, raw, now)
        if limit is not None:
            yield limit


def _follow_up(conn: sqlite3.Connection, key: str, raw: bytes, now: float) -> Iterator[StoreState]:
    follow = conn.execute(
        "SELECT next, next_until FROM singletask_fences WHERE key = CAST(? AS TEXT) "
        "AND next IS NOT NULL AND next_until > ?",
        (raw, now),
    ).fetchone()
    if follow is not None:
        yield StoreState("follow_up", key, follow[0], follow[1] - now)


def _window(conn: sqlite3.Connection, key: str, raw: bytes, now: float) -> Iterator[StoreState]:
    window = conn.execute(
        "SELECT latest, opened, until FROM singletask_debounce "
        "WHERE key = CAST(? AS TEXT) AND until > ?",
        (raw, now),
    ).fetchone()
    if window is not None:
        latest, opened, until = window
        is_open = opened != CLOSED
        detail = {"open": is_open, "age": max(0.0, now - opened) if is_open else None}
        yield StoreState("window", key, latest, until - now, detail)


def _rate(conn: sqlite3.Connection, key: str, raw: bytes, now: float) -> Iterator[StoreState]:
    rate = conn.execute(
        "SELECT allowed FROM singletask_rates WHERE key = CAST(? AS TEXT) AND allowed > ?",
        (raw, now),
    ).fetchone()
    if rate is not None:
        yield StoreState("rate", key, None, rate[0] - now, {"next_start_in": rate[0] - now})
