"""A lock store in one SQLite file: real cross-process locks for the workers of one host.

URL: ``sqlite:///relative/path/locks.db`` or ``sqlite:////absolute/path/locks.db`` (the
SQLAlchemy convention), with one optional query option, ``?timeout=<seconds>`` (default 5).
Every operation is one ``BEGIN IMMEDIATE`` transaction, so writers are
serialised by SQLite's file lock; the database runs in WAL mode with a busy timeout, so concurrent
worker processes wait for each other instead of failing. Holder slots (``lock_limit``) are rows
of their own, sharing their key's row in the fence table; one transaction takes a free one.
Rate records (``lock_rate``) and debounce windows (``lock_debounce``) are rows of tables of their
own (:mod:`.windows`), read and written in the same kind of transaction; so are the holds and
starts of named limits (``take_units``, :mod:`.units`).

Limits: every process using the file must run on the same host (SQLite's locking does not work
across machines, and is unreliable on network filesystems such as NFS or SMB, which this backend
refuses). Leases use the wall clock (``time.time()``), shared by all processes of the host.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from ....exceptions import BackendError, BackendTimeout, ConfigurationError
from ....protocol.slots import base_key, choose_slot, slot_keys
from ...base import (
    AcquireResult,
    Holder,
    LockBackend,
    StoreState,
    Units,
    UnitsResult,
    check_lease,
    check_taken,
    units_meta,
)
from .. import replaced
from ..core import FENCE_RETENTION, load_holder, stored_key
from . import reads, windows
from . import units as _units
from .files import (
    LIMITS,
    NETWORK_FILESYSTEMS,
    SCHEMA,
    filesystem_type,
    path_from_url,
    timeout_from_url,
)
from .fork import guard

__all__ = ["SQLiteBackend"]

T = TypeVar("T")

_Row = tuple[str, float, str, int]  # token, expires_at, meta (JSON), fence


def _takes_over(row: _Row, takeover_prefix: str | None) -> bool:
    return bool(takeover_prefix) and row[0].startswith(takeover_prefix or "")


def _brief(row: _Row, now: float) -> Holder:
    """The holder of ``row`` as a refused acquisition reports it (no metadata)."""
    token, expires_at, stored, fence = row
    return Holder(token, json.loads(stored).get("task_id"), expires_at - now, {}, fence)


class SQLiteBackend(LockBackend):
    """Locks in a SQLite database file shared by the processes of one host.

    Args:
        path: The database file; created (with its table) when missing. Its folder must exist.
        timeout: Seconds to wait for another process's transaction before giving up.
    """

    supports_limit = True
    supports_rate = True
    supports_debounce = True
    supports_replace = True
    supports_units = True
    supports_turns = True

    def __init__(self, path: str | os.PathLike[str], *, timeout: float = 5.0) -> None:
        self.path = Path(path)
        self.timeout = timeout
        folder = self.path.resolve().parent
        if not folder.is_dir():
            raise ConfigurationError(
                f"SQLite lock database {str(self.path)!r}: folder {str(folder)!r} does not exist "
                f"({LIMITS})"
            )
        kind = filesystem_type(folder)
        if kind in NETWORK_FILESYSTEMS:
            raise ConfigurationError(
                f"SQLite lock database {str(self.path)!r} is on a {kind} network filesystem, "
                f"where SQLite's locking is unreliable: {LIMITS}. Use redis:// for several hosts"
            )
        self._mutex = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._pid: int | None = None
        guard(self)  # no fork() in the middle of one of its transactions (see fork.py)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> SQLiteBackend:
        return cls(path_from_url(url), **{**timeout_from_url(url), **options})

    @classmethod
    def check_url(cls, url: str) -> None:
        path_from_url(url)
        timeout_from_url(url)

    def __repr__(self) -> str:
        return f"<SQLiteBackend {str(self.path)!r}>"

    def _connection(self) -> sqlite3.Connection:
        # One connection per process (a forked child opens its own), shared by its threads.
        if self._conn is None or self._pid != os.getpid():
            conn = sqlite3.connect(
                self.path, timeout=self.timeout, isolation_level=None, check_same_thread=False
            )
            conn.text_factory = reads.as_text
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            for statement in SCHEMA:
                conn.execute(statement)
            conn.execute(
                "DELETE FROM singletask_fences WHERE touched < ? AND coalesce(next_until, 0) < ?",
                (time.time() - FENCE_RETENTION, time.time()),
            )
            windows.prune(conn, time.time())
            _units.prune(conn, time.time())
            self._conn, self._pid = conn, os.getpid()
        return self._conn

    @contextmanager
    def _transaction(self, operation: str, key: str) -> Iterator[sqlite3.Connection]:
        """One serialised write transaction; SQLite errors become singletask's.

        Raises:
            LockKeyError: ``key`` is not valid Unicode text (a lone surrogate). A key of any
                length is stored as it is: SQLite has no limit on a primary key's size.
        """
        stored_key(key, len(key) * 4)  # only checks the text
        with self._mutex:
            try:
                conn = self._connection()
                if conn.in_transaction:  # left open by a call cut short: none of it counts
                    conn.execute("ROLLBACK")
                conn.execute("BEGIN IMMEDIATE")
                try:
                    yield conn
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
            except sqlite3.OperationalError as exc:
                error = (
                    BackendTimeout if "locked" in str(exc) or "busy" in str(exc) else BackendError
                )
                raise error(f"{self!r}: {operation} {key!r} failed: {exc}") from exc
            except sqlite3.Error as exc:
                raise BackendError(f"{self!r}: {operation} {key!r} failed: {exc}") from exc

    @staticmethod
    def _row(conn: sqlite3.Connection, key: str, now: float) -> _Row | None:
        row: _Row | None = conn.execute(
            "SELECT token, expires_at, meta, fence FROM singletask_locks WHERE key = ?", (key,)
        ).fetchone()
        if row is not None and row[1] <= now:
            conn.execute("DELETE FROM singletask_locks WHERE key = ?", (key,))
            return None
        return row

    def acquire(
        self,
        key: str,
        token: str,
        ttl: float,
        *,
        meta: Mapping[str, str] | None = None,
        takeover_prefix: str | None = None,
        units: Sequence[Units] = (),
    ) -> AcquireResult:
        ttl = check_lease(ttl, "acquire")
        if units:
            check_taken(units, "acquire")
            for item in units:
                stored_key(item.key, len(item.key) * 4)  # only checks the text
        with self._transaction("acquire", key) as conn:
            now = time.time()
            return self._acquire_in(conn, key, token, ttl, meta, takeover_prefix, now, units)

    def _acquire_in(
        self, conn: sqlite3.Connection, key: str, token: str, ttl: float,
        meta: Mapping[str, str] | None, takeover_prefix: str | None, now: float,
        units: Sequence[Units] = (),
    ) -> AcquireResult:  # fmt: skip
        """:meth:`acquire` inside the caller's transaction: the key, then its units (nothing
        written when either refuses)."""
        row = self._row(conn, key, now)
        if row is not None and row[0] != token and not _takes_over(row, takeover_prefix):
            return AcquireResult(False, _brief(row, now))
        if units:
            taken = _units.take(conn, token, ttl, units, units_meta(meta), now)
            if not taken.taken:
                return AcquireResult(False, retry_after=taken.retry_after, limit=taken.limit,
                                     used=taken.used)  # fmt: skip
        return self._take(conn, key, row, token, ttl, meta, now)

    def acquire_slot(
        self,
        key: str,
        limit: int,
        token: str,
        ttl: float,
        *,
        meta: Mapping[str, str] | None = None,
        takeover_prefix: str | None = None,
        interval: float | None = None,
        units: Sequence[Units] = (),
    ) -> AcquireResult:
        ttl = check_lease(ttl, "acquire")
        if interval is not None:
            interval = check_lease(interval, "acquire_slot interval")
        with self._transaction("acquire", key) as conn:
            now = time.time()
            result = self._slot_in(conn, key, limit, token, ttl, meta, takeover_prefix, interval,
                                   now)  # fmt: skip
        return self._take_units_after(result, key, token, ttl, units, meta, takeover_prefix)

    def _slot_in(
        self, conn: sqlite3.Connection, key: str, limit: int, token: str, ttl: float,
        meta: Mapping[str, str] | None, takeover_prefix: str | None, interval: float | None,
        now: float,
    ) -> AcquireResult:  # fmt: skip
        """:meth:`acquire_slot` inside the caller's transaction."""
        slots = [(name, self._row(conn, name, now)) for name in slot_keys(key, limit)]
        chosen = choose_slot([r[0] if r else None for _, r in slots], token, takeover_prefix)
        if chosen is None:
            holders = tuple(_brief(row, now) for _, row in slots if row is not None)
            return AcquireResult(False, holders[0], holders=holders)
        name, row = slots[chosen]
        if interval is not None and (row is None or row[0] != token):
            wait = windows.start(conn, key, interval, now)  # a start
            if wait is not None:
                return AcquireResult(False, retry_after=wait)
        return self._take(conn, name, row, token, ttl, meta, now)

    def preempt(
        self,
        key: str,
        limit: int,
        token: str,
        ttl: float,
        victim: str,
        *,
        meta: Mapping[str, str] | None = None,
    ) -> AcquireResult:
        """The takeover and its preemption record in one transaction."""
        ttl = check_lease(ttl, "preempt")
        with self._transaction("preempt", key) as conn:
            now = time.time()
            names = [key] if limit == 1 else slot_keys(key, limit)
            held = {name: row[0] for name in names if (row := self._row(conn, name, now))}
            if limit == 1:
                taken = self._acquire_in(conn, key, token, ttl, meta, victim, now)
            else:
                taken = self._slot_in(conn, key, limit, token, ttl, meta, victim, None, now)
            cur = held.get(taken.key or key) if taken.acquired else None
            if cur is not None and cur != token and cur.startswith(victim):
                successor = (meta or {}).get("task_id") or ""
                replaced.sqlite_leave(conn, base_key(key), victim, successor, now + ttl, now)
        return taken

    @staticmethod
    def _take(
        conn: sqlite3.Connection,
        name: str,
        row: _Row | None,
        token: str,
        ttl: float,
        meta: Mapping[str, str] | None,
        now: float,
    ) -> AcquireResult:
        """Give ``name`` (a key or a holder slot, live row ``row``) to ``token``, inside the
        caller's transaction; a slot shares its key's fence record."""
        key = base_key(name)
        last = conn.execute(
            "SELECT fence, done FROM singletask_fences WHERE key = ?", (key,)
        ).fetchone()
        if row is not None and row[0] == token:
            fence = row[3]
        else:
            # Like Redis: grows while the fence row is kept, and with the clock after that.
            fence = max((last[0] if last else 0) + 1, int(now * 1_000_000))
        conn.execute(
            "INSERT INTO singletask_fences (key, fence, touched) VALUES (?, ?, ?) ON CONFLICT "
            "(key) DO UPDATE SET fence = max(fence, excluded.fence), touched = excluded.touched",
            (key, fence, now),
        )
        conn.execute(
            "INSERT OR REPLACE INTO singletask_locks (key, token, expires_at, meta, fence) "
            "VALUES (?, ?, ?, ?, ?)",
            (name, token, now + ttl, json.dumps(dict(meta or {})), fence),
        )
        return AcquireResult(True, fence=fence, completed=last[1] if last else None, key=name)

    def debounce(
        self, key: str, task_id: str, ttl: float, *, pending: float = 0.0
    ) -> tuple[str | None, float, str | None]:
        ttl = check_lease(ttl, "debounce")
        with self._transaction("debounce", key) as conn:
            return windows.debounce(conn, key, task_id, ttl, time.time(), pending)

    def debounce_published(self, key: str, task_id: str) -> bool:
        with self._transaction("debounce_published", key) as conn:
            return windows.debounce_published(conn, key, task_id, time.time())

    def debounce_take(
        self, key: str, task_id: str, *, overdue: bool = False
    ) -> tuple[str | None, float]:
        with self._transaction("debounce_take", key) as conn:
            return windows.debounce_take(conn, key, task_id, time.time(), overdue=overdue)

    def debounce_undo(
        self, key: str, task_id: str, previous: str | None, *, closed: str | None = None
    ) -> bool:
        with self._transaction("debounce_undo", key) as conn:
            return windows.debounce_undo(conn, key, task_id, previous, closed, time.time())

    def take_units(
        self,
        token: str,
        ttl: float,
        units: Sequence[Units],
        *,
        meta: Mapping[str, str] | None = None,
    ) -> UnitsResult:
        """Every limit named checked, then taken, in one transaction (:mod:`.units`)."""
        ttl = check_lease(ttl, "take_units")
        check_taken(units, "take_units")
        if not units:
            return UnitsResult(True)
        for item in units[1:]:
            stored_key(item.key, len(item.key) * 4)  # only checks the text
        with self._transaction("take_units", units[0].key) as conn:
            return _units.take(conn, token, ttl, units, meta, time.time())

    def give_units(self, token: str, units: Sequence[Units]) -> list[bool]:
        """Every limit named, in one transaction (:mod:`.units`)."""
        check_taken(units, "give_units", give=True)
        if not units:
            return []
        for item in units[1:]:
            stored_key(item.key, len(item.key) * 4)  # only checks the text
        with self._transaction("give_units", units[0].key) as conn:
            return _units.give(conn, token, units, time.time())

    def release(
        self, key: str, token: str, *, completed: str | None = None, units: Sequence[Units] = ()
    ) -> bool:
        held = [item for item in units if item.period is None]
        if held:
            check_taken(held, "release", give=True)
        with self._transaction("release", key) as conn:
            now = time.time()
            if held:  # given back first, in the same transaction
                _units.give(conn, token, held, now)
            row = self._row(conn, key, now)
            if row is None or row[0] != token:
                return False
            conn.execute("DELETE FROM singletask_locks WHERE key = ?", (key,))
            if completed is not None:
                conn.execute(
                    "UPDATE singletask_fences SET done = ?, touched = ? WHERE key = ?",
                    (completed, now, base_key(key)),
                )
            return True

    def extend(self, key: str, token: str, ttl: float) -> bool:
        ttl = check_lease(ttl, "extend")
        with self._transaction("extend", key) as conn:
            now = time.time()
            row = self._row(conn, key, now)
            if row is None or row[0] != token:
                return False
            conn.execute(
                "UPDATE singletask_locks SET expires_at = ? WHERE key = ?", (now + ttl, key)
            )
            return True

    def claim_next(self, key: str, task_id: str, ttl: float) -> str:
        ttl = check_lease(ttl, "claim_next")
        with self._transaction("claim_next", key) as conn:
            now = time.time()
            row = conn.execute(
                "SELECT next, next_until FROM singletask_fences WHERE key = ?", (key,)
            ).fetchone()
            if row is not None and row[0] is not None and (row[1] or 0) > now:
                return str(row[0])
            conn.execute(
                "INSERT INTO singletask_fences (key, fence, next, next_until, touched) "
                "VALUES (?, 0, ?, ?, ?) ON CONFLICT (key) DO UPDATE SET next = excluded.next, "
                "next_until = excluded.next_until, touched = excluded.touched",
                (key, task_id, now + ttl, now),
            )
            return task_id

    def replaced_by(self, key: str, token: str) -> str | None:
        found = self._read(
            "inspect",
            key,
            lambda c: replaced.sqlite_read(c, base_key(key), token, time.time()),
            None,
        )
        return found if found is not None else super().replaced_by(key, token)

    def clear_next(self, key: str, task_id: str) -> bool:
        with self._transaction("clear_next", key) as conn:
            cursor = conn.execute(
                "UPDATE singletask_fences SET next = NULL, next_until = NULL "
                "WHERE key = ? AND next = ?",
                (key, task_id),
            )
            return cursor.rowcount > 0

    def _read(
        self, operation: str, key: str, work: Callable[[sqlite3.Connection], T], absent: T
    ) -> T:
        """``work`` on this process's connection if it has one (its tables exist), else on a
        read-only one (:mod:`.reads`): ``absent`` when there is no file or table yet."""
        with self._mutex:
            try:
                if self._conn is not None and self._pid == os.getpid():
                    return work(self._conn)
                conn = reads.open_reader(self.path, self.timeout)
                if conn is None:
                    return absent
                try:
                    return work(conn)
                finally:
                    conn.close()
            except sqlite3.OperationalError as exc:
                if reads.MISSING in str(exc):
                    return absent
                busy = "locked" in str(exc) or "busy" in str(exc)
                error = BackendTimeout if busy else BackendError
                raise error(f"{self!r}: {operation} {key!r} failed: {exc}") from exc
            except sqlite3.Error as exc:
                raise BackendError(f"{self!r}: {operation} {key!r} failed: {exc}") from exc

    def missing_table(self) -> str | None:
        """``None`` when the database file has its lock table, else what is missing, in words
        (the file, or its table). Read-only: it creates neither, so an operator's listing can
        tell a mistyped path from a store that holds no lock.

        Raises:
            BackendError: The store failed.
        """
        if not self.path.exists():
            return f"database file {str(self.path)!r}"
        probe = "SELECT count(*) FROM singletask_locks WHERE 0"
        if self._read("check the table", "", lambda c: c.execute(probe).fetchall(), []):
            return None
        return f"table singletask_locks in {str(self.path)!r}"

    def holder(self, key: str) -> Holder | None:
        stored_key(key, len(key) * 4)  # only checks the text
        return self._read("inspect", key, lambda c: reads.holder_row(c, key, time.time()), None)

    def iter_locks(self, prefix: str, *, page_size: int = 500) -> Iterator[tuple[str, Holder]]:
        """Pages of ``page_size`` rows in key order, each read on its own (``_read``): the
        keys that start with ``prefix``, then the slots ``{<key>}:slot:<i>`` of the others."""
        return reads.locks(self._read, prefix, max(1, page_size))

    def iter_state(self, prefix: str, *, page_size: int = 500) -> Iterator[StoreState]:
        """Pages of ``page_size`` keys in key order, each read on its own (``_read``)."""
        return reads.states(self._read, prefix, max(1, page_size))

    def _operator_release(self, key: str, task_id: str | None) -> Holder | None:
        with self._transaction("release", key) as conn:
            now = time.time()
            row = self._row(conn, key, now)
            if row is None:
                return None
            token, expires_at, stored, fence = row
            holder = load_holder(token, stored, expires_at - now, fence)
            if task_id is not None and holder.task_id != task_id:
                return None
            # The fence row stays: the next acquisition still gets a larger fencing token.
            conn.execute("DELETE FROM singletask_locks WHERE key = ?", (key,))
        return holder

    def release_held_by(self, key: str, task_id: str) -> Holder | None:
        return self._operator_release(key, task_id)

    def force_release(self, key: str) -> Holder | None:
        return self._operator_release(key, None)

    def close(self) -> None:
        with self._mutex:
            self._disconnect()

    def _disconnect(self) -> None:
        """Close this process's connection, idle since the caller holds ``_mutex``; the next
        use opens a new one (:mod:`.fork` calls it before every fork)."""
        try:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
        finally:
            self._conn = None
