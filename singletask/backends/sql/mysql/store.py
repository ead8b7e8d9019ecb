"""The MySQL / MariaDB lock store: one row per lock key, every operation one round trip.

URL: ``mysql://user:password@host:3306/dbname`` (also ``mariadb://`` and ``mysql+pymysql://``),
with the query options ``unix_socket``, ``ssl_ca``, ``ssl_cert``, ``ssl_key`` and singletask's
own: ``table`` (default ``singletask_locks``), ``pool_size`` (4) and ``timeout`` (5 seconds).
Needs ``pip install "singletask[mysql]"`` (PyMySQL). Written for MySQL 5.7+ and MariaDB
10.3+ (InnoDB); tested on MariaDB.

How it holds its guarantees (the table layout is in :mod:`singletask.backends.sql.core`):

* MySQL has no ``RETURNING`` and evaluates the assignments of an UPDATE left to right, so an
  operation that must decide and report in one step is a short script sent as *one* request
  (``CLIENT.MULTI_STATEMENTS``): ``START TRANSACTION``, a row-locking upsert, one conditional
  UPDATE (its WHERE decides; it is evaluated before any assignment), a SELECT of the row as it
  now is, ``COMMIT``. The other operations are single statements in autocommit mode. Sessions
  run READ COMMITTED, strict SQL mode, and ``CLIENT.FOUND_ROWS`` (an UPDATE counts the rows it
  matched). A script that fails midway is rolled back: its connection is closed, never reused.
* Leases are judged by the database's clock: ``UTC_TIMESTAMP(6)`` into ``DATETIME(6)`` columns,
  taken once per script (``@st_now``), never the worker's clock nor the session time zone.
* Keys, tokens and task ids are ``VARBINARY``: compared byte for byte, never case-folded or
  padded by a collation.
* A new fencing token is ``GREATEST(last + 1, database time in microseconds)``; the row keeps
  the last one after release, so tokens of a key strictly increase (the Redis store's rule).
* The table is created (or gains the columns a later version added) on a process's first
  write; reads (``holder``, the listings) create nothing: a missing table holds no lock.
* InnoDB may abort a transaction as a deadlock victim when workers race for a key that does
  not exist yet, or for a limit and its line; nothing of it was committed, so the script is
  sent again after a short random pause (``core.CONFLICT_ATTEMPTS`` attempts in all, then
  ``BackendTimeout``).
* Named limits (``take_units``, ``give_units``): two companion tables, made on a process's
  first use of them, the SQL in :mod:`singletask.backends.sql.mysql.units` (the layout in
  :mod:`singletask.backends.sql.units`); they need MySQL 8.0+ or MariaDB 10.2+ (window
  functions).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

import pymysql
from pymysql.constants import CLIENT

from ....exceptions import BackendError, BackendTimeout, BackendUnavailable, ConfigurationError
from ....protocol.slots import base_key, slot_index, slot_keys
from ...base import AcquireResult, Holder, Units, check_lease, check_taken
from ...urls import mask_url
from .. import bookkeeping as S
from .. import core, pool, slots
from .. import replaced as R
from . import queries as Q
from . import units as U
from .queries import KEY_BYTES
from .queries import as_text as _text
from .queries import run_script as _script

__all__ = ["MySQLBackend"]

T = TypeVar("T")

logger = logging.getLogger("singletask.backends.sql.mysql")  # its name before 0.4.0

#: Server error codes: deadlock victim (retried), waits that timed out, no such table (a read
#: before the first write: no lock).
_NO_SUCH_TABLE = 1146
_DEADLOCK = 1213
_TIMEOUTS = {1205, 1969, 3024}  # lock wait timeout, MariaDB / MySQL statement time limits

_URL_OPTIONS = {"unix_socket", "ssl_ca", "ssl_cert", "ssl_key"}


def _error_class(exc: pymysql.MySQLError) -> type[BackendError]:
    code = exc.args[0] if exc.args and isinstance(exc.args[0], int) else 0
    if code in _TIMEOUTS or "timed out" in str(exc):
        return BackendTimeout
    if isinstance(exc, pymysql.err.InterfaceError) or code in {2003, 2006, 2013, 2055}:
        return BackendUnavailable
    return BackendError


def _keys(key: str) -> dict[str, str | None]:
    """The ``key`` and ``full_key`` arguments of lock key ``key``."""
    stored, full = core.stored_key(key, KEY_BYTES)
    return {"key": stored, "full_key": full}


def _us(seconds: float) -> int:
    return max(1, int(seconds * 1_000_000))


def _holder(row: Sequence[Any]) -> Holder:
    token, meta, fence, left_us = row[:4]
    return core.load_holder(
        _text(token) or "", meta, None if left_us is None else left_us / 1e6, fence
    )


class MySQLBackend(U.MySQLUnits):
    """Locks in a MySQL or MariaDB table (InnoDB); see the module docstring.

    Args:
        connect_args: Keyword arguments of :func:`pymysql.connect` (host, port, user, ...).
        table: The lock table, ``name`` or ``database.name``; created by the first write.
        pool_size: Most connections one process opens.
        timeout: Seconds allowed to connect, to read or write a reply, to wait for a row lock,
            and to wait for a free pooled connection.
    """

    def __init__(
        self,
        connect_args: Mapping[str, Any],
        *,
        table: str = core.DEFAULT_TABLE,
        pool_size: int = 4,
        timeout: float = 5.0,
        display: str = "MySQL",
    ) -> None:
        options = core.SQLOptions(table=table, pool_size=pool_size, timeout=timeout)
        self._connect_args = {
            **connect_args,
            "charset": "utf8mb4",
            "autocommit": True,
            "client_flag": CLIENT.MULTI_STATEMENTS | CLIENT.FOUND_ROWS,
            "connect_timeout": options.timeout,
            "read_timeout": options.timeout,
            "write_timeout": options.timeout,
        }
        self.table = options.table
        self.timeout = options.timeout
        self._display = display
        quoted = self._table = ".".join(f"`{part}`" for part in options.table.split("."))
        index = f"`{options.table.split('.')[-1]}_expires_at`"
        self._q = {
            name: text.format(table=quoted, index=index)
            for name, text in {
                "schema": Q.SCHEMA, "acquire": Q.ACQUIRE,
                "release": Q.RELEASE, "extend": Q.EXTEND,
                "claim_next": Q.CLAIM_NEXT, "clear_next": Q.CLEAR_NEXT, "holder": Q.HOLDER,
                "iter": Q.ITER, "release_holder": Q.RELEASE_HOLDER, "reclaim": Q.RECLAIM,
                "record": R.MYSQL_RECORD, "replaced_by": R.MYSQL_READ,
                "acquire_slot": Q.ACQUIRE_SLOT, "release_slot": Q.RELEASE_SLOT,
                "debounce": Q.DEBOUNCE, "debounce_take": Q.DEBOUNCE_TAKE,
                "debounce_undo": Q.DEBOUNCE_UNDO, "state": S.MYSQL_STATE,
                "debounce_published": Q.DEBOUNCE_PUBLISHED, "exists": core.TABLE_EXISTS,
            }.items()
        }  # fmt: skip
        self._q.update(U.queries(options.table))  # named limits
        self._pool: pool.Pool[pymysql.connections.Connection[Any]] = pool.Pool(
            self._connect, lambda conn: conn.close(), size=options.pool_size,
            timeout=options.timeout, describe=repr(self),
        )  # fmt: skip
        self._reclaimer, self._units_reclaimer = core.Reclaimer(), core.Reclaimer()
        self._ready: tuple[int, int] | None = None  # (pid, pool generation) the table was checked
        self._units_ready: tuple[int, int] | None = None  # the same, of the limits' tables

    @classmethod
    def from_url(cls, url: str, **options: Any) -> MySQLBackend:
        scheme = url.partition("://")[0].lower()
        if scheme not in ("mysql", "mariadb", "mysql+pymysql") or "://" not in url:
            raise ConfigurationError(
                f"{mask_url(url)!r}: a MySQL lock URL looks like "
                "mysql://user:password@host:3306/dbname"
            )
        plain, own = core.split_url(url, options)
        parts = urlsplit(plain)
        database = unquote(parts.path.lstrip("/"))
        if not database:
            raise ConfigurationError(
                f"{mask_url(url)!r}: name the database, as in mysql://host:3306/dbname"
            )
        args: dict[str, Any] = {
            "host": parts.hostname or "localhost",
            "port": parts.port or 3306,
            "user": unquote(parts.username) if parts.username else None,
            "password": unquote(parts.password) if parts.password else "",
            "database": database,
        }
        for name, value in parse_qsl(parts.query):
            if name not in _URL_OPTIONS:
                raise ConfigurationError(
                    f"{mask_url(url)!r}: unknown URL option {name!r}; "
                    f"known: {', '.join(sorted({*_URL_OPTIONS, 'table', 'pool_size', 'timeout'}))}"
                )
            args[name] = value
        return cls(
            args, table=own.table, pool_size=own.pool_size, timeout=own.timeout,
            display=mask_url(url).split("?")[0],
        )  # fmt: skip

    def __repr__(self) -> str:
        return f"<MySQLBackend {self._display} table={self.table}>"

    def _connect(self) -> pymysql.connections.Connection[Any]:
        conn = pymysql.connect(**self._connect_args)
        try:
            with conn.cursor() as cursor:
                _script(cursor, Q.SESSION, {"wait": max(1, round(self.timeout))})
        except BaseException:
            conn.close()
            raise
        return conn

    def _run(
        self, operation: str, key: str, work: Callable[[pymysql.cursors.Cursor], T],
        *, writes: bool = True, units: bool = False, both: bool = False,
    ) -> T:  # fmt: skip
        """Run ``work`` on a pooled connection (``writes``: creating the table first if
        missing, then deleting expired rows now and then; with ``units``, the tables of named
        limits instead, :mod:`.units`; with ``both``, both): the boundary where driver errors
        become singletask's. A script InnoDB aborted as a deadlock victim committed nothing and
        is sent again (:func:`.core.conflict_pause`); a pooled connection that turns out to be
        dead (the server closed it while it was idle, ``wait_timeout``, or restarted) is
        replaced and ``work`` runs once more: every operation is safe to repeat (see the
        docs)."""
        deadlocks, stale_retried = 0, False
        while True:
            reused = False
            try:
                with self._pool.checkout() as (conn, reused), conn.cursor() as cursor:
                    tables = ((False, True) if both else (units,)) if writes else ()
                    for limits in tables:
                        self._prepare(cursor, limits)
                    result = work(cursor)
                    for limits in tables:
                        if (self._units_reclaimer if limits else self._reclaimer).due():
                            self._reclaim(cursor, limits)
                    return result
            except pymysql.MySQLError as exc:
                if exc.args and exc.args[0] == _DEADLOCK:
                    deadlocks += 1
                    if deadlocks < core.CONFLICT_ATTEMPTS:
                        core.conflict_pause(deadlocks)
                        continue  # rolled back whole: nothing of it was committed
                    message = f"{self!r}: {operation} {key!r} a deadlock victim {deadlocks} times"
                    raise BackendTimeout(f"{message}: {exc}") from exc
                error = _error_class(exc)
                if error is BackendUnavailable:
                    self._pool.clear()  # the server went away: its other connections are dead
                    if reused and not stale_retried:
                        stale_retried = True
                        continue
                raise error(f"{self!r}: {operation} {key!r} failed: {exc}") from exc

    def _prepare(self, cursor: pymysql.cursors.Cursor, units: bool) -> None:
        """Create the lock table (with ``units``: the limits' tables) if missing, unless this
        process checked it since its pool was last reset."""
        checked = (os.getpid(), self._pool.generation)
        if units and self._units_ready != checked:
            U.create_tables(cursor, self.table, self._q["limits_schema"])
            self._units_ready = checked
        elif not units and self._ready != checked:
            Q.create_table(cursor, self.table, self._table, self._q["schema"])
            self._ready = checked

    def _reclaim(self, cursor: pymysql.cursors.Cursor, units: bool = False) -> None:
        """Delete a batch of expired rows (of the limits' tables, with ``units``); a failure (a
        read-only database) only logs: the operation it follows has succeeded."""
        try:
            if units:
                U.reclaim(cursor, self._q, core.RECLAIM_BATCH)
            else:
                cursor.execute(self._q["reclaim"], {"limit": core.RECLAIM_BATCH})
        except pymysql.MySQLError as exc:
            logger.warning("%r: could not delete expired rows: %s", self, exc)

    def _acquire(
        self, key: str, token: str, ttl: float, meta: Mapping[str, str] | None,
        takeover_prefix: str | None,
    ) -> AcquireResult:  # fmt: skip
        stored, task_id = core.dump_meta(meta)
        args = {
            **_keys(key), "token": token, "task_id": task_id, "meta": stored,
            "lease_us": _us(ttl), "row_us": _us(ttl + core.FENCE_RETENTION),
            "prefix": takeover_prefix or "",
        }  # fmt: skip
        rows = self._run("acquire", key, lambda c: _script(c, self._q["acquire"], args)[4])
        token_now, meta_now, fence, done, left_us = rows[0]
        if _text(token_now) == token:
            return AcquireResult(True, fence=fence, completed=done)
        return AcquireResult(False, _holder((token_now, meta_now, fence, left_us)))

    def _take_slot(
        self, key: str, names: list[str], token: str, ttl: float,
        meta: Mapping[str, str] | None, takeover_prefix: str | None,
        interval: float | None = None, record: dict[str, Any] | None = None,
    ) -> AcquireResult:  # fmt: skip
        """One transaction: ``queries.ACQUIRE_SLOT`` (with ``record``, the arguments of a
        preemption's record, and that record)."""
        ttl = check_lease(ttl, "acquire")
        args = slots.slot_args(_keys, key, names, token, meta, takeover_prefix)
        args.update(lease_us=_us(ttl), row_us=_us(ttl + core.FENCE_RETENTION))
        args["rate_us"] = None if interval is None else _us(interval)
        for n, (stored, full) in enumerate(
            zip(args.pop("keys"), args.pop("fulls"), strict=True), 1
        ):
            args[f"k{n}"], args[f"f{n}"] = stored, full
        selects = " UNION ALL ".join(Q.SLOT.format(n=n) for n in range(1, len(names) + 1))
        text = self._q["acquire_slot"].format(slots=selects)
        if record is not None:  # a preemption: its record in the same transaction
            args.update(record)
            text = R.with_record(text, self._q["record"])
        read = -3 if record is not None else -2
        rows = self._run("acquire", names[0], lambda c: _script(c, text, args)[read])
        return slots.slot_outcome(
            names, token,
            [(n, _text(holder), meta_now, fence, None if left is None else left / 1e6, done)
             for n, holder, meta_now, fence, left, done in rows],
        )  # fmt: skip

    def debounce(
        self, key: str, task_id: str, ttl: float, *, pending: float = 0.0
    ) -> tuple[str | None, float, str | None]:
        args = {**_keys(key), "task_id": task_id, "ttl_us": _us(check_lease(ttl, "debounce")),
                "pending_us": _us(pending) if pending > 0 else 0}  # fmt: skip
        rows = self._run("debounce", key, lambda c: _script(c, self._q["debounce"], args)[4])
        latest, age_us, closed = rows[0]
        return _text(latest), max(0.0, int(age_us) / 1e6), _text(closed)

    def debounce_published(self, key: str, task_id: str) -> bool:
        args = {**_keys(key), "task_id": task_id}
        text = self._q["debounce_published"]
        return self._run("debounce_published", key, lambda c: c.execute(text, args) > 0)

    def debounce_take(
        self, key: str, task_id: str, *, overdue: bool = False
    ) -> tuple[str | None, float]:
        args = {**_keys(key), "task_id": task_id, "overdue": bool(overdue)}
        rows = self._run(
            "debounce_take", key, lambda c: _script(c, self._q["debounce_take"], args)[5]
        )
        return (_text(rows[0][0]), max(0, int(rows[0][1])) / 1e6) if rows else (None, 0.0)

    def debounce_undo(
        self, key: str, task_id: str, previous: str | None, *, closed: str | None = None
    ) -> bool:
        args = {**_keys(key), "task_id": task_id, "previous": previous, "closed": closed}
        text = self._q["debounce_undo"]
        return self._run("debounce_undo", key, lambda c: c.execute(text, args) > 0)

    def release(
        self, key: str, token: str, *, completed: str | None = None, units: Sequence[Units] = ()
    ) -> bool:
        held = [item for item in units if item.period is None]
        if held and not slot_index(key):  # the key and the holds: one transaction
            check_taken(held, "release", give=True)
            return self._release_units(key, token, completed, held)
        self._give_units_before(token, units)
        args = {**_keys(key), "token": token, "done": completed}
        if slot_index(key):  # a holder slot: its marker is its key's
            args["base"] = _keys(base_key(key))["key"]
            results = self._run("release", key, lambda c: _script(c, self._q["release_slot"], args))
            return bool(results[-2][0][0])
        return self._run("release", key, lambda c: c.execute(self._q["release"], args) > 0)

    def extend(self, key: str, token: str, ttl: float) -> bool:
        return self.extend_many([(key, token, ttl)])[0]

    def extend_many(self, leases: Sequence[tuple[str, str, float]]) -> list[bool]:
        if not leases:
            return []
        for _, _, ttl in leases:
            check_lease(ttl, "extend")  # all of them, before any lease changes

        def work(cursor: pymysql.cursors.Cursor) -> list[bool]:
            # One request with one UPDATE per lease; each reports the rows it matched.
            text = ";\n".join(
                self._q["extend"].replace("%(", f"%({i}_") for i in range(len(leases))
            )
            args: dict[str, Any] = {}
            for i, (key, token, ttl) in enumerate(leases):
                args.update({f"{i}_key": _keys(key)["key"], f"{i}_token": token,
                             f"{i}_lease_us": _us(ttl),
                             f"{i}_row_us": _us(ttl + core.FENCE_RETENTION)})  # fmt: skip
            cursor.execute(text, args)
            counts = [cursor.rowcount]
            while cursor.nextset():
                counts.append(cursor.rowcount)
            return [count > 0 for count in counts]

        return self._run("extend", leases[0][0] if len(leases) == 1 else "locks", work)

    def claim_next(self, key: str, task_id: str, ttl: float) -> str:
        ttl = check_lease(ttl, "claim_next")
        args = {
            **_keys(key), "task_id": task_id, "ttl_us": _us(ttl),
            "row_us": _us(max(ttl, core.FENCE_RETENTION)),
        }  # fmt: skip
        rows = self._run("claim_next", key, lambda c: _script(c, self._q["claim_next"], args)[4])
        return _text(rows[0][0]) or task_id

    def preempt(
        self, key: str, limit: int, token: str, ttl: float, victim: str, *,
        meta: Mapping[str, str] | None = None,
    ) -> AcquireResult:  # fmt: skip
        """The takeover and its preemption record in one transaction (:mod:`..replaced`)."""
        ttl = check_lease(ttl, "preempt")
        names = [key] if limit == 1 else slot_keys(key, limit)
        stored_record = self._record_args(key, victim)
        record: dict[str, Any] = {
            "record": stored_record["key"], "record_full": stored_record["full_key"],
            "successor": (meta or {}).get("task_id") or "", "ttl_us": _us(ttl),
            "taken": [_keys(name)["key"] for name in names],
        }  # fmt: skip
        if limit > 1:
            return self._take_slot(key, names, token, ttl, meta, victim, record=record)
        stored, task_id = core.dump_meta(meta)
        args = {
            **_keys(key), "token": token, "task_id": task_id, "meta": stored,
            "lease_us": _us(ttl), "row_us": _us(ttl + core.FENCE_RETENTION),
            "prefix": victim, **record,
        }  # fmt: skip
        text = R.with_record(self._q["acquire"], self._q["record"])
        rows = self._run("preempt", key, lambda c: _script(c, text, args)[4])
        token_now, meta_now, fence, done, left_us = rows[0]
        if _text(token_now) == token:
            return AcquireResult(True, fence=fence, completed=done, key=key)
        return AcquireResult(False, _holder((token_now, meta_now, fence, left_us)))

    def clear_next(self, key: str, task_id: str) -> bool:
        args = {**_keys(key), "task_id": task_id}
        return self._run("clear_next", key, lambda c: c.execute(self._q["clear_next"], args) > 0)

    _key_bytes = KEY_BYTES

    def _decode(self, value: Any) -> str | None:
        return _text(value)

    def _page_key(self, row: Sequence[Any]) -> str | bytes:
        return row[0] or b""  # the stored key as stored (see iter_locks)

    def _select(
        self, operation: str, key: str, query: str, args: Mapping[str, object]
    ) -> Sequence[Sequence[Any]]:
        def work(cursor: pymysql.cursors.Cursor) -> Sequence[Sequence[Any]]:
            cursor.execute(self._q[query], args)
            return cursor.fetchall()

        try:
            return self._run(operation, key, work, writes=False)
        except BackendError as exc:
            cause = exc.__cause__
            if isinstance(cause, pymysql.MySQLError) and cause.args[:1] == (_NO_SUCH_TABLE,):
                return []  # no table yet: no lock
            raise

    def holder(self, key: str) -> Holder | None:
        rows = self._select("inspect", key, "holder", _keys(key))
        return _holder(rows[0]) if rows else None

    def iter_locks(self, prefix: str, *, page_size: int = 500) -> Iterator[tuple[str, Holder]]:
        """Yield every live lock under ``prefix``, reading pages of ``page_size`` keys in key
        order (each page one primary-key range scan)."""
        fetch = functools.partial(self._select, "list", prefix, "iter")
        for scan in core.listed_prefixes(prefix):  # the keys, then slots named {<key>}:slot:<i>
            # The next page starts after the stored key as stored (bytes): read back as text, a
            # key that is not UTF-8 would be escaped and sort before itself.
            for row in core.pages(fetch, scan, page_size, lambda r: r[0] or b"", KEY_BYTES):
                key = _text(row[1]) or ""
                if core.is_listed(key, prefix):
                    yield key, _holder(row[2:])

    def _release_holder(self, operation: str, key: str, task_id: str | None) -> Holder | None:
        args = {**_keys(key), "task_id": task_id}
        results = self._run(operation, key, lambda c: _script(c, self._q["release_holder"], args))
        rows = next((rows for rows in results if rows), None)  # only the holder's SELECT has rows
        return _holder(rows[0]) if rows else None

    def close(self) -> None:
        self._pool.clear()
