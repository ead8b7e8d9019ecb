"""The PostgreSQL lock store: one row per lock key, every operation one round trip.

URL: ``postgresql://user:password@host:5432/dbname`` (also ``postgres://`` and
``postgresql+psycopg://``), with libpq's query options (``sslmode``, ``connect_timeout``, ...)
and singletask's own: ``table`` (default ``singletask_locks``), ``pool_size`` (4),
``timeout`` (5 seconds), ``prepare_threshold`` (psycopg's, default 5) and
``transaction_pooling`` (0; 1 behind PgBouncer in transaction mode).
Needs ``pip install "singletask[postgres]"`` (psycopg 3).

How it holds its guarantees (the table layout is in :mod:`singletask.backends.sql.core`, the SQL
in :mod:`singletask.backends.sql.postgres.queries`, that of debounce windows in
:mod:`singletask.backends.sql.postgres.windows`):

* Each new connection sets its session's isolation (READ COMMITTED) and server-side time limits
  (``statement_timeout``, ``lock_timeout``: the store's ``timeout``) with one statement, never
  with startup parameters; then every operation is a single statement in autocommit mode, its
  own transaction. With ``transaction_pooling`` the session keeps nothing: each operation is
  ``BEGIN ISOLATION LEVEL READ COMMITTED``, ``SET LOCAL`` limits, the statement and ``COMMIT``
  in one message. Acquire is ``INSERT ... ON CONFLICT DO UPDATE`` whose every assignment is
  conditional on the old row, ``RETURNING`` the row as it now is: one atomic step.
* Leases are judged by the database's clock; a lease starts when its row is taken
  (``clock_timestamp()`` read once after the row lock), not when a statement that waited for
  a rival's row lock began. The workers' clocks never matter.
* Waits are bounded on the client too: ``connect_timeout``, TCP keepalives and
  ``tcp_user_timeout``, and a deadline (``timeout`` + 1 s) after which the connection's socket
  is shut down, so a stalled server or link gives BackendTimeout instead of blocking.
* Errors are classified (``queries.error_class``): a serialization failure or deadlock
  committed nothing and is sent again (3 attempts in all); a key PostgreSQL cannot store (NUL)
  is a LockKeyError before anything is sent. Keys over ``KEY_BYTES`` (2,000) UTF-8 bytes are
  stored in a fixed-size form (``core.stored_key``).
* A new fencing token is ``greatest(last + 1, database time in microseconds)``; the row keeps
  the last one after release, so tokens of a key strictly increase (the Redis store's rule).
* The table and its index on ``expires_at`` are created on a process's first write, serialised
  by a transaction-level advisory lock, so many workers starting at once do not trip over each
  other. Reads (``holder``, the listings) create nothing: a missing table holds no lock.
* Named limits (``take_units``, ``give_units``): two companion tables, made on a process's
  first use of them, the SQL in :mod:`singletask.backends.sql.postgres.units` (the layout in
  :mod:`singletask.backends.sql.units`).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ....exceptions import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    ConfigurationError,
    LockKeyError,
)  # fmt: skip
from ....protocol.slots import base_key, slot_index, slot_keys
from ...base import AcquireResult, Holder, Units, check_lease, check_taken
from ...urls import mask_url
from .. import bookkeeping as S
from .. import core, pool, slots
from .. import replaced as R
from ..watchdog import WATCHDOG
from . import queries as Q
from . import units as U
from . import windows as W
from .queries import KEY_BYTES

__all__ = ["PostgresBackend"]

T = TypeVar("T")

logger = logging.getLogger("singletask.backends.sql.postgres")  # its name before 0.4.0


class PostgresBackend(U.PostgresUnits):
    """Locks in a PostgreSQL table; see the module docstring.

    Args:
        conninfo: A libpq connection string or ``postgresql://`` URL.
        table: The lock table, ``name`` or ``schema.name``; created by the first write.
        pool_size: Most connections one process opens.
        timeout: Seconds allowed to connect, per statement (``statement_timeout``,
            ``lock_timeout``), and to wait for a free pooled connection; the client drops a
            connection that has not answered a second after it.
        prepare_threshold: psycopg's: executions of a statement before it is prepared on the
            server; None never prepares (for PgBouncer in transaction mode before 1.21).
        transaction_pooling: Keep no session state (for PgBouncer in transaction mode): each
            operation is one transaction that sets its own isolation and time limits, its
            arguments bound on the client, never prepared (a little slower).
    """

    def __init__(
        self,
        conninfo: str,
        *,
        table: str = core.DEFAULT_TABLE,
        pool_size: int = 4,
        timeout: float = 5.0,
        prepare_threshold: int | None = 5,
        transaction_pooling: bool = False,
    ) -> None:
        options = core.SQLOptions(table=table, pool_size=pool_size, timeout=timeout)
        self._prepare_threshold = prepare_threshold
        self.transaction_pooling = transaction_pooling
        self._preamble = Q.PREAMBLE if transaction_pooling else 0
        try:
            params = conninfo_to_dict(conninfo)
        except psycopg.ProgrammingError as exc:
            reason = Q.scrub(str(exc))  # chained as a copy: the driver's text quotes the token
            raise ConfigurationError(
                f"invalid PostgreSQL URL or conninfo: {reason} (percent-encode '%', '@', ':' "
                "and '/' in a URL's user name and password)"
            ) from type(exc)(reason)
        # Client-side bounds (libpq's own, never sent to the server): connecting, and TCP
        # keepalives with a user timeout, so a dead link is noticed even between statements.
        params.setdefault("connect_timeout", max(2, round(options.timeout)))
        params.setdefault("keepalives", 1)
        params.setdefault("keepalives_idle", max(1, round(options.timeout)))
        params.setdefault("keepalives_interval", max(1, round(options.timeout / 3)))
        params.setdefault("keepalives_count", 3)
        params.setdefault("tcp_user_timeout", int((options.timeout + Q.MARGIN) * 1000))
        params.setdefault("application_name", "singletask")
        self._conninfo = make_conninfo("", **params)
        self.table = options.table
        self.timeout = options.timeout
        self._display = mask_url(conninfo) if "://" in conninfo else "PostgreSQL"
        names = options.table.split(".")
        # An index is created in its table's schema; its name is never qualified.
        fmt = {"table": sql.Identifier(*names), "index": sql.Identifier(f"{names[-1]}_expires_at")}
        self._ms = int(options.timeout * 1000)
        ms = sql.Literal(self._ms)
        self._q: dict[str, sql.Composed] = {
            name: sql.SQL(text).format(ms=ms, **fmt)
            for name, text in {
                "schema": Q.SCHEMA, "index": Q.INDEX, "add_columns": Q.ADD_COLUMNS,
                # Scripts of several statements: always one transaction, one message.
                "acquire_slot": Q.SLOT_SCRIPT, "release_slot": Q.RELEASE_SLOT,
                "debounce": W.DEBOUNCE,
                # lock_policy "replace": the takeover and its record, one transaction.
                "preempt": R.with_record(
                    Q.SCRIPT.replace("{statement}", Q.ACQUIRE), R.POSTGRES_RECORD
                ),
                "preempt_slot": R.with_record(Q.SLOT_SCRIPT, R.POSTGRES_RECORD),
            }.items()
        }  # fmt: skip
        wrap = sql.SQL(Q.SCRIPT if transaction_pooling else "{statement}")
        self._q.update(
            (name, wrap.format(ms=ms, statement=sql.SQL(text).format(**fmt)))
            for name, text in {
                "acquire": Q.ACQUIRE, "release": Q.RELEASE, "extend": Q.EXTEND,
                "extend_many": Q.EXTEND_MANY, "claim_next": Q.CLAIM_NEXT,
                "clear_next": Q.CLEAR_NEXT, "debounce_take": W.DEBOUNCE_TAKE,
                "debounce_undo": W.DEBOUNCE_UNDO, "debounce_published": W.DEBOUNCE_PUBLISHED,
                "holder": Q.HOLDER, "iter": Q.ITER, "release_holder": Q.RELEASE_HOLDER,
                "reclaim": Q.RECLAIM, "state": S.POSTGRES_STATE,
                "replaced_by": R.POSTGRES_READ, "exists": core.TABLE_EXISTS,
            }.items()
        )  # fmt: skip
        self._q.update(U.queries(options.table, ms, transaction_pooling))  # named limits
        self._pool: pool.Pool[psycopg.Connection[Any]] = pool.Pool(
            self._connect, lambda conn: conn.close(), size=options.pool_size,
            timeout=options.timeout, describe=repr(self), broken=lambda conn: conn.closed,
        )  # fmt: skip
        self._ready: tuple[int, int] | None = None  # (pid, pool generation) the table was checked
        self._units_ready: tuple[int, int] | None = None  # the same, of the limits' tables
        self._reclaimer, self._units_reclaimer = core.Reclaimer(), core.Reclaimer()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> PostgresBackend:
        scheme, sep, rest = url.partition("://")
        if scheme.lower() not in ("postgresql", "postgres", "postgresql+psycopg") or not sep:
            raise ConfigurationError(
                f"{mask_url(url)!r}: a PostgreSQL lock URL looks like "
                "postgresql://user:password@host:5432/dbname"
            )
        plain, own = core.split_url(f"postgresql://{rest}", options)
        conninfo, threshold, pooling = Q.own_url_options(plain)
        return cls(
            conninfo, table=own.table, pool_size=own.pool_size, timeout=own.timeout,
            prepare_threshold=threshold, transaction_pooling=pooling,
        )  # fmt: skip

    def __repr__(self) -> str:
        return f"<PostgresBackend {self._display} table={self.table}>"

    def _connect(self) -> psycopg.Connection[Any]:
        conn = psycopg.connect(self._conninfo, autocommit=True)
        conn.prepare_threshold = self._prepare_threshold
        if not self.transaction_pooling:
            try:
                args = {"ms": str(self._ms)}
                self._call(conn, "connect", lambda: conn.execute(Q.SESSION, args))
            except BaseException:
                conn.close()
                raise
        return conn

    def _call(self, conn: psycopg.Connection[Any], what: str, call: Callable[[], T]) -> T:
        """Run ``call`` on ``conn``, bounded on the client: a server or link that stalls past
        ``timeout`` (plus a margin) has the connection's socket shut down, and is a timeout."""
        limit = self.timeout + Q.MARGIN
        with WATCHDOG.guard(limit, functools.partial(Q.shut, conn)) as alarm:
            try:
                result = call()
            except psycopg.Error as exc:
                if alarm.fired:
                    raise BackendTimeout(f"{self!r}: {what}: no reply within {limit}s") from exc
                raise
        if alarm.fired:  # answered as the socket was shut: the pool must not keep it
            conn.close()
        return result

    def _run(
        self, operation: str, key: str, name: str, args: Mapping[str, Any],
        read: Callable[[psycopg.Cursor[Any]], T], *, writes: bool = True, units: bool = False,
        both: bool = False,
    ) -> T:  # fmt: skip
        """Run the script ``name`` on a pooled connection and ``read`` its result (``writes``:
        creating the table first if missing, then deleting expired rows now and then; with
        ``units``, the tables of named limits instead, :mod:`.units`; with ``both``, both): the
        boundary where driver errors become singletask's. A serialization failure or
        deadlock committed nothing and is sent again (:func:`.core.conflict_pause`); a pooled
        connection that turns out to be dead (the server closed it while it was idle, or
        restarted) is replaced and the script runs once more: every operation is safe to
        repeat (see the docs)."""
        what = f"{operation} {key!r}"
        stale_retried = False
        for attempt in range(1, core.CONFLICT_ATTEMPTS + 1):
            try:
                with self._pool.checkout() as (conn, reused):
                    try:
                        if writes:
                            for tables in (False, True) if both else (units,):
                                self._prepare(conn, what, tables)
                        result = self._call(
                            conn, what, lambda: read(self._script(conn, name, args))
                        )
                        for tables in ((False, True) if both else (units,)) if writes else ():
                            if (self._units_reclaimer if tables else self._reclaimer).due():
                                sweep = functools.partial(self._reclaim, conn, tables)
                                self._call(conn, "reclaim", sweep)
                        return result
                    except psycopg.Error as exc:
                        conn.close()  # its state is unknown (maybe inside a failed transaction)
                        if exc.sqlstate in Q.RETRIED and attempt < core.CONFLICT_ATTEMPTS:
                            core.conflict_pause(attempt)
                            continue  # rolled back whole; the connection is replaced
                        if exc.sqlstate in Q.RETRIED:
                            message = f"{self!r}: {what} aborted {attempt} times (a conflict)"
                            raise BackendTimeout(f"{message}: {exc}") from exc
                        error = Q.error_class(exc)
                        if error is BackendUnavailable:
                            self._pool.clear()  # the server went away: the others are dead too
                            if reused and not stale_retried:
                                stale_retried = True
                                continue
                        raise error(f"{self!r}: {what} failed: {exc}") from exc
            except psycopg.Error as exc:  # connecting failed
                raise Q.error_class(exc)(f"{self!r}: {what} failed: {exc}") from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _script(
        self, conn: psycopg.Connection[Any], name: str, args: Mapping[str, Any]
    ) -> psycopg.Cursor[Any]:
        """Send the operation ``name`` (with ``transaction_pooling``, wrapped in
        ``queries.SCRIPT``); the cursor is left on the result of its statement."""
        skip = Q.SKIPPED.get(name)
        pooled = self.transaction_pooling or skip is not None
        cursor = psycopg.ClientCursor(conn) if pooled else conn.cursor()
        cursor.execute(self._q[name], args)
        for _ in range(self._preamble if skip is None else skip):
            cursor.nextset()
        return cursor

    def _prepare(self, conn: psycopg.Connection[Any], what: str, units: bool) -> None:
        """Create the lock table (with ``units``: the limits' tables) if missing, unless this
        process checked it since its pool was last reset."""
        checked = (os.getpid(), self._pool.generation)
        if (self._units_ready if units else self._ready) == checked:
            return
        create = U.create_tables if units else Q.create_table
        self._call(conn, what, lambda: create(conn, self.table, self._q))
        if units:
            self._units_ready = checked
        else:
            self._ready = checked

    def _reclaim(self, conn: psycopg.Connection[Any], units: bool = False) -> None:
        """Delete a batch of expired rows (of the limits' tables, with ``units``); a failure (a
        read-only database) only logs: the operation it follows has succeeded."""
        try:
            name = "reclaim_units" if units else "reclaim"
            self._script(conn, name, {"limit": core.RECLAIM_BATCH})
        except psycopg.Error as exc:
            logger.warning("%r: could not delete expired rows: %s", self, exc)
            if not conn.closed:
                conn.close()  # left inside the failed transaction: not reusable

    def _keys(self, key: str) -> dict[str, str | None]:
        """The ``key`` and ``full_key`` arguments of lock key ``key``.

        Raises:
            LockKeyError: The key holds a NUL character, which PostgreSQL text cannot hold.
        """
        if "\x00" in key:
            raise LockKeyError(f"lock key {key!r}: PostgreSQL text cannot hold a NUL character")
        stored, full = core.stored_key(key, KEY_BYTES)
        return {"key": stored, "full_key": full}

    def _acquire(
        self, key: str, token: str, ttl: float, meta: Mapping[str, str] | None,
        takeover_prefix: str | None,
    ) -> AcquireResult:  # fmt: skip
        stored, task_id = core.dump_meta(meta)
        args = {
            **self._keys(key), "token": token, "task_id": task_id, "meta": stored, "ttl": ttl,
            "keep": core.FENCE_RETENTION, "prefix": takeover_prefix or "",
        }  # fmt: skip
        row = self._run("acquire", key, "acquire", args, lambda c: c.fetchone())
        assert row is not None  # an upsert always returns its row
        holder, meta_text, fence, done, left = row
        if holder == token:
            return AcquireResult(True, fence=fence, completed=done)
        return AcquireResult(False, core.load_holder(holder, meta_text, left, fence))

    def _take_slot(
        self, key: str, names: list[str], token: str, ttl: float,
        meta: Mapping[str, str] | None, takeover_prefix: str | None,
        interval: float | None = None,
    ) -> AcquireResult:  # fmt: skip
        """One transaction: ``queries.SLOT_SCRIPT``."""
        args = slots.slot_args(self._keys, key, names, token, meta, takeover_prefix)
        args.update(ttl=check_lease(ttl, "acquire"), keep=core.FENCE_RETENTION, interval=interval)
        rows = self._run("acquire", names[0], "acquire_slot", args, lambda c: c.fetchall())
        return slots.slot_outcome(names, token, rows)

    def debounce(
        self, key: str, task_id: str, ttl: float, *, pending: float = 0.0
    ) -> tuple[str | None, float, str | None]:
        stored = self._keys(key)
        args = {"base": stored["key"], "base_full": stored["full_key"], "task_id": task_id,
                "ttl": check_lease(ttl, "debounce"), "pending": float(pending)}  # fmt: skip
        row = self._run("debounce", key, "debounce", args, lambda c: c.fetchone())
        assert row is not None  # the row was inserted if missing
        return row[0], max(0.0, row[1]), row[2]

    def debounce_published(self, key: str, task_id: str) -> bool:
        args = {**self._keys(key), "task_id": task_id}
        return self._run(
            "debounce_published", key, "debounce_published", args, lambda c: c.rowcount > 0
        )

    def debounce_take(
        self, key: str, task_id: str, *, overdue: bool = False
    ) -> tuple[str | None, float]:
        args = {**self._keys(key), "task_id": task_id, "overdue": bool(overdue)}
        row = self._run("debounce_take", key, "debounce_take", args, lambda c: c.fetchone())
        return (None, 0.0) if row is None else (str(row[0]), max(0.0, float(row[1])))

    def debounce_undo(
        self, key: str, task_id: str, previous: str | None, *, closed: str | None = None
    ) -> bool:
        args = {**self._keys(key), "task_id": task_id, "previous": previous, "closed": closed}
        return self._run("debounce_undo", key, "debounce_undo", args, lambda c: c.rowcount > 0)

    def release(
        self, key: str, token: str, *, completed: str | None = None, units: Sequence[Units] = ()
    ) -> bool:
        held = [item for item in units if item.period is None]
        if held and not slot_index(key):  # the key and the holds: one transaction
            check_taken(held, "release", give=True)
            return self._release_units(key, token, completed, held)
        self._give_units_before(token, units)
        args = {**self._keys(key), "token": token, "done": completed}
        if slot_index(key):  # a holder slot: its marker is its key's
            args["base"] = self._keys(base_key(key))["key"]
            return self._run(
                "release", key, "release_slot", args, lambda c: bool(c.fetchall()[0][0])
            )
        return self._run("release", key, "release", args, lambda c: c.rowcount > 0)

    def extend(self, key: str, token: str, ttl: float) -> bool:
        args = {**self._keys(key), "token": token, "ttl": check_lease(ttl, "extend")}
        args["keep"] = core.FENCE_RETENTION
        return self._run("extend", key, "extend", args, lambda c: c.rowcount > 0)

    def extend_many(self, leases: Sequence[tuple[str, str, float]]) -> list[bool]:
        if not leases:
            return []
        keys = [self._keys(key)["key"] for key, _, _ in leases]
        args = {
            "keys": keys, "tokens": [token for _, token, _ in leases],
            "ttls": [check_lease(ttl, "extend") for _, _, ttl in leases],
            "keep": core.FENCE_RETENTION,
        }  # fmt: skip
        what = f"{len(leases)} locks"
        renewed = set(self._run("extend", what, "extend_many", args, lambda c: c.fetchall()))
        return [
            (stored, token) in renewed for stored, (_, token, _) in zip(keys, leases, strict=True)
        ]

    def claim_next(self, key: str, task_id: str, ttl: float) -> str:
        ttl = check_lease(ttl, "claim_next")
        args = {**self._keys(key), "task_id": task_id, "ttl": ttl, "keep": core.FENCE_RETENTION}
        row = self._run("claim_next", key, "claim_next", args, lambda c: c.fetchone())
        assert row is not None
        return str(row[0])

    def preempt(
        self, key: str, limit: int, token: str, ttl: float, victim: str, *,
        meta: Mapping[str, str] | None = None,
    ) -> AcquireResult:  # fmt: skip
        """The takeover (``acquire`` or ``acquire_slot``'s statements) and its preemption record
        in one transaction (:mod:`..replaced`)."""
        ttl = check_lease(ttl, "preempt")
        names = [key] if limit == 1 else slot_keys(key, limit)
        record = {
            "record": self._record_args(key, victim)["key"],
            "record_full": self._record_args(key, victim)["full_key"],
            "successor": (meta or {}).get("task_id") or "", "token": token,
            "taken": [self._keys(name)["key"] for name in names],
        }  # fmt: skip
        if limit == 1:
            stored, task_id = core.dump_meta(meta)
            args = {
                **self._keys(key), "token": token, "task_id": task_id, "meta": stored,
                "ttl": ttl, "keep": core.FENCE_RETENTION, "prefix": victim, **record,
            }  # fmt: skip
            row = self._run("preempt", key, "preempt", args, lambda c: c.fetchone())
            assert row is not None  # an upsert always returns its row
            holder, meta_text, fence, done, left = row
            if holder == token:
                return AcquireResult(True, fence=fence, completed=done, key=key)
            return AcquireResult(False, core.load_holder(holder, meta_text, left, fence))
        args = slots.slot_args(self._keys, key, names, token, meta, victim)
        args.update(ttl=ttl, keep=core.FENCE_RETENTION, interval=None, **record)
        rows = self._run("preempt", names[0], "preempt_slot", args, lambda c: c.fetchall())
        return slots.slot_outcome(names, token, rows)

    def clear_next(self, key: str, task_id: str) -> bool:
        args = {**self._keys(key), "task_id": task_id}
        return self._run("clear_next", key, "clear_next", args, lambda c: c.rowcount > 0)

    _key_bytes = KEY_BYTES

    def _select(
        self, operation: str, key: str, query: str, args: Mapping[str, object]
    ) -> list[Any]:
        try:
            return self._run(operation, key, query, args, lambda c: c.fetchall(), writes=False)
        except BackendError as exc:
            if isinstance(exc.__cause__, psycopg.errors.UndefinedTable):
                return []  # no table yet: no lock
            raise

    def holder(self, key: str) -> Holder | None:
        rows = self._select("inspect", key, "holder", self._keys(key))
        return core.load_holder(rows[0][0], rows[0][1], rows[0][3], rows[0][2]) if rows else None

    def iter_locks(self, prefix: str, *, page_size: int = 500) -> Iterator[tuple[str, Holder]]:
        """Yield every live lock under ``prefix``, reading pages of ``page_size`` keys in key
        order (each page one indexed range scan)."""
        fetch = functools.partial(self._select, "list", prefix, "iter")
        for scan in core.listed_prefixes(prefix):  # the keys, then slots named {<key>}:slot:<i>
            for _, key, token, meta, fence, left in core.pages(
                fetch, scan, page_size, lambda r: r[0], KEY_BYTES
            ):
                if core.is_listed(key, prefix):
                    yield key, core.load_holder(token, meta, left, fence)

    def _release_holder(self, operation: str, key: str, task_id: str | None) -> Holder | None:
        args = {**self._keys(key), "task_id": task_id}
        row = self._run(operation, key, "release_holder", args, lambda c: c.fetchone())
        return None if row is None else core.load_holder(row[0], row[1], row[3], row[2])

    def close(self) -> None:
        self._pool.clear()
        self._ready = self._units_ready = None
