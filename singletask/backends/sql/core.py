"""What the PostgreSQL and MySQL lock stores share: the table layout, URL options.

The SQL itself lives in each store's package (:mod:`~singletask.backends.sql.postgres`,
:mod:`~singletask.backends.sql.mysql`); this module holds only what is the same for both. Their
connection pool is :mod:`~singletask.backends.sql.pool`.

One row per lock key, in one table (``singletask_locks`` unless a setting names another)::

    key            the stored key (primary key: every operation finds its row through it): the
                   lock key itself, or for a key longer than the store's limit a fixed-size
                   form, its first bytes + "#" + its SHA-256 (see :func:`stored_key`)
    full_key       the lock key when ``key`` holds the fixed-size form, else NULL
    token          owner token of the holder, NULL once released
    task_id        the holder's task id (release_held_by compares it in SQL)
    meta           the holder's metadata, a JSON object
    lease_expires  end of the holder's lease; the lock is held while token is set and this is
                   later than the database's clock
    fence          the last fencing token issued for the key (kept when the lock is released)
    done           the completion marker of the key's last normal release
    next_task      pending follow-up task id (coalescing), with next_expires
    expires_at     when the whole row may be deleted: never earlier than FENCE_RETENTION after
                   its last lease, nor than its follow-up claim
    slot_fence     on a key's own row: the last fencing token issued for any of the key's holder
                   slots (:mod:`singletask.protocol.slots`); a key's next token exceeds it and
                   ``fence``
    rate_next      on a key's own row: the time of its next allowed start (``lock_rate``), set
                   by each start, when the acquisition gave an interval
    debounce_*     on a key's own row: its debounce window (``lock_debounce``): the latest send
                   (``debounce_latest``), when the window opened (``debounce_opened``; NULL
                   once the latest send's run closed it, the send still named until
                   ``debounce_until``), and when it ends unless a send renews it
                   (``debounce_until``); a window past it is gone

A row's ``expires_at`` is never earlier than its ``rate_next`` nor its ``debounce_until``; a row
with only those (no ``token``) holds no lock, and is never listed.

The row outlives its lock on purpose: it keeps the fence, so a later acquisition gets a greater
token. A holder slot is a row of its own (its store key,
:func:`singletask.protocol.slots.slot_key`), but its fences and completion marker are its
key's: every acquisition of a slot first locks the key's row (inserted free if missing), so
the key's fence counter is kept in one place.

Rows past ``expires_at`` are deleted in batches by whichever worker process notices they are
due (at most once per RECLAIM_INTERVAL per process), through the index on ``expires_at``.

Named limits (``take_units``) live in two companion tables, ``<table>_limits`` and
``<table>_limit_holds``: see :mod:`.units`.
"""

from __future__ import annotations

import abc
import functools
import hashlib
import json
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, TypeVar
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from ...exceptions import ConfigurationError, LockKeyError
from ...protocol.slots import base_key, slot_index, slot_keys
from ..base import AcquireResult, Holder, LockBackend, StoreState, Units, check_lease
from ..urls import TABLE_SCHEMES, check_port, check_table
from . import bookkeeping, replaced

# TABLE_SCHEMES, check_table: the ``table`` option's rules, from singletask.backends.urls (the
# settings check the option there, without importing a store family).

__all__ = [
    "CONFLICT_ATTEMPTS",
    "DEFAULT_TABLE",
    "FENCE_RETENTION",
    "RECLAIM_BATCH",
    "RECLAIM_INTERVAL",
    "TABLE_SCHEMES",
    "SQLBackend",
    "SQLOptions",
    "check_table",
    "conflict_pause",
    "dump_meta",
    "like_prefix",
    "listed_prefixes",
    "load_holder",
    "split_url",
    "stored_key",
]

#: The table used unless the ``table`` option (setting ``singletask_backend_table``) names one.
DEFAULT_TABLE = "singletask_locks"

#: How long a key's row (last fencing token, completion marker) outlives its last lease.
FENCE_RETENTION = 7 * 24 * 3600.0

#: Seconds between two sweeps of expired rows by one process, and rows deleted per sweep.
RECLAIM_INTERVAL = 60.0
RECLAIM_BATCH = 1000

#: A transaction the server aborted to break a deadlock (or, on PostgreSQL, as a serialization
#: failure) committed nothing, and is sent again: up to this many attempts in all, after a
#: random pause that doubles each time (:func:`conflict_pause`), so that the transactions that
#: met stop meeting. Past them, the operation ends in :class:`~singletask.BackendTimeout`: the
#: store could not serve it in time, and the task's ``lock_on_backend_error`` decides.
CONFLICT_ATTEMPTS = 6

R = TypeVar("R")


def conflict_pause(attempt: int) -> None:
    """Sleep before attempt ``attempt + 1`` of a transaction aborted ``attempt`` times: up to
    5, 10, 20, 40, then 80 ms."""
    time.sleep(random.uniform(0.0, 0.005 * 2 ** min(attempt - 1, 4)))


class SQLOptions:
    """The options of a SQL lock store that are not the driver's own.

    Args:
        table: The lock table (``table`` or ``schema.table``).
        pool_size: Most connections one process keeps open at once.
        timeout: Seconds allowed to connect, to run one statement, and to wait for a pooled
            connection.
    """

    def __init__(self, *, table: str = DEFAULT_TABLE, pool_size: int = 4, timeout: float = 5.0):
        self.table = check_table(table)
        if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 1:
            raise ConfigurationError(
                f"option pool_size: expected an integer >= 1, got {pool_size!r}"
            )
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ConfigurationError(f"option timeout: expected seconds > 0, got {timeout!r}")
        self.pool_size = pool_size
        self.timeout = float(timeout)


_OWN_OPTIONS = {"table": str, "pool_size": int, "timeout": float}


def split_url(url: str, options: Mapping[str, object]) -> tuple[str, SQLOptions]:
    """Separate singletask's options (``table``, ``pool_size``, ``timeout``) from ``url``.

    They may be given in the URL's query string or as keyword options (which win). Returns the
    URL without them (every other query option is the driver's) and the options.

    Raises:
        ConfigurationError: An option is invalid or unknown, or the port is not a number from 1
            to 65535.
    """
    check_port(url)
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    own: dict[str, object] = {}
    rest = []
    for name, value in query:
        if name in _OWN_OPTIONS:
            try:
                own[name] = _OWN_OPTIONS[name](value)
            except ValueError:
                raise ConfigurationError(f"URL option {name}={value!r} is invalid") from None
        else:
            rest.append((name, value))
    unknown = set(options) - set(_OWN_OPTIONS)
    if unknown:
        raise ConfigurationError(
            f"unknown option(s) {', '.join(sorted(unknown))}; "
            f"a SQL lock store takes {', '.join(_OWN_OPTIONS)}"
        )
    own.update(options)
    return urlunsplit(parts._replace(query=urlencode(rest, quote_via=quote))), SQLOptions(**own)  # type: ignore[arg-type]


def dump_meta(meta: Mapping[str, str] | None) -> tuple[str, str | None]:
    """The ``meta`` and ``task_id`` column values for a holder's metadata."""
    fields = dict(meta or {})
    return json.dumps(fields, separators=(",", ":")), fields.get("task_id")


def load_holder(token: str, meta: str | None, ttl: float | None, fence: int | None) -> Holder:
    """A :class:`Holder` from the columns of a row."""
    fields: dict[str, str] = json.loads(meta) if meta else {}
    return Holder(token, fields.get("task_id"), ttl, fields, fence)


def _head(raw: bytes, limit: int) -> str:
    """The longest start of the UTF-8 text ``raw`` of at most ``limit`` bytes."""
    return raw[:limit].decode("utf-8", "ignore")


def stored_key(key: str, limit: int) -> tuple[str, str | None]:
    """The ``key`` and ``full_key`` column values of lock key ``key``.

    A key of at most ``limit`` UTF-8 bytes is stored as it is (``full_key`` NULL). A longer one
    is stored as its first ``limit`` bytes (cut at a character boundary), ``#`` and the hex
    SHA-256 of the whole key: a fixed size that fits the primary key's index, longer than
    ``limit`` bytes so it never equals a key stored as it is, and sharing the key's start so a
    prefix scan still finds it. ``full_key`` then keeps the key for listing.

    Raises:
        LockKeyError: The key cannot be encoded as UTF-8 (a lone surrogate).
    """
    try:
        raw = key.encode()
    except UnicodeEncodeError as exc:
        raise LockKeyError(f"lock key {key!r} is not valid Unicode text: {exc}") from exc
    if len(raw) <= limit:
        return key, None
    return f"{_head(raw, limit)}#{hashlib.sha256(raw).hexdigest()}", key


def like_prefix(prefix: str) -> str:
    """A LIKE pattern (escape character ``!``) matching the strings that start with ``prefix``."""
    return prefix.replace("!", "!!").replace("%", "!%").replace("_", "!_") + "%"


def listed_prefixes(prefix: str) -> list[str]:
    """The stored-key prefixes :meth:`iter_locks` scans for the locks under ``prefix``: the
    prefix itself, and ``{`` + prefix, where the holder slots of a key without ``}`` are (see
    :mod:`singletask.protocol.slots`); the second is left out where the first scan covers it already
    (a prefix of ``{`` only, or empty). Every key found is then checked with :func:`is_listed`."""
    return [prefix] if ("{" + prefix).startswith(prefix) else [prefix, "{" + prefix]


def is_listed(key: str, prefix: str) -> bool:
    """Whether the store key ``key`` (a key or a holder slot) belongs under ``prefix``."""
    return base_key(key).startswith(prefix)


#: A read that answers one row when the lock table exists, and fails as a missing table (which
#: ``_select`` answers with no rows) when it does not: :meth:`SQLBackend.missing_table`.
TABLE_EXISTS = "SELECT count(*) FROM {table} WHERE 1 = 0"


class SQLBackend(LockBackend):
    """What the PostgreSQL and MySQL stores share above their SQL: holder slots taken by one
    script (``_take_slot``), rate records and debounce windows on the key's row, the operator
    releases (``_release_holder``)."""

    supports_limit = True
    supports_rate = True
    supports_debounce = True
    supports_replace = True

    @classmethod
    def check_url(cls, url: str) -> None:
        cls.from_url(url).close()  # builds nothing but the (lazy) pool: no connection

    @classmethod
    def check_table_option(cls, url: str, table: str, where: str) -> str:
        return check_table(table, where)

    def acquire(
        self, key: str, token: str, ttl: float, *,
        meta: Mapping[str, str] | None = None, takeover_prefix: str | None = None,
        units: Sequence[Units] = (),
    ) -> AcquireResult:  # fmt: skip
        if slot_index(key):  # a holder slot: its fences are its key's
            taken = self._take_slot(base_key(key), [key], token, ttl, meta, takeover_prefix)
            result = AcquireResult(taken.acquired, taken.holder, taken.fence, taken.completed)
        else:
            result = self._acquire(key, token, check_lease(ttl, "acquire"), meta, takeover_prefix)
        return self._take_units_after(result, key, token, ttl, units, meta, takeover_prefix)

    def acquire_slot(
        self, key: str, limit: int, token: str, ttl: float, *,
        meta: Mapping[str, str] | None = None, takeover_prefix: str | None = None,
        interval: float | None = None, units: Sequence[Units] = (),
    ) -> AcquireResult:  # fmt: skip
        names = slot_keys(key, limit)
        if interval is not None:
            interval = check_lease(interval, "acquire_slot interval")
        result = self._take_slot(key, names, token, ttl, meta, takeover_prefix, interval)
        return self._take_units_after(result, key, token, ttl, units, meta, takeover_prefix)

    def release_held_by(self, key: str, task_id: str) -> Holder | None:
        return self._release_holder("release_held_by", key, task_id)

    def force_release(self, key: str) -> Holder | None:
        return self._release_holder("force_release", key, None)

    #: Keys longer than this many bytes are stored in a fixed-size form (:func:`stored_key`).
    _key_bytes: ClassVar[int]

    def _record_args(self, key: str, token: str) -> dict[str, Any]:
        """The ``key`` and ``full_key`` arguments of the row of ``token``'s preemption record."""
        stored, full = stored_key(replaced.record_key(key, token), self._key_bytes)
        return {"key": stored, "full_key": full}

    def replaced_by(self, key: str, token: str) -> str | None:
        rows = self._select("inspect", key, "replaced_by", self._record_args(key, token))
        if rows:
            return self._decode(rows[0][0]) or ""
        return super().replaced_by(key, token)  # no record: a preemptor that still holds, if any

    def iter_state(self, prefix: str, *, page_size: int = 500) -> Iterator[StoreState]:
        """Pages of ``page_size`` rows in key order, read as :meth:`iter_locks` reads (a key's
        records are columns of its own row: :mod:`.bookkeeping`)."""
        fetch = functools.partial(self._select, "list state", prefix, "state")
        decode = self._decode
        for row in pages(fetch, prefix, max(1, page_size), self._page_key, self._key_bytes):
            if (decode(row[1]) or "").startswith(prefix):
                yield from bookkeeping.records(row, decode)

    #: The lock table's name, as the ``table`` option gave it.
    table: str

    def missing_table(self) -> str | None:
        """``None`` when the lock table exists, else what is missing, in words (``table
        'name'``). Read-only: it creates nothing, so an operator's listing can tell a mistyped
        ``table`` option from a store that holds no lock.

        Raises:
            BackendError: The store failed.
        """
        if self._select("check the table", self.table, "exists", {}):
            return None
        return f"table {self.table!r}"

    def _decode(self, value: Any) -> str | None:
        """A text column's value as the driver returns it, as text (bytes as UTF-8, any byte
        that is not UTF-8 written as a backslash escape)."""
        if isinstance(value, bytes):
            return value.decode(errors="backslashreplace")
        return None if value is None else str(value)

    def _page_key(self, row: Sequence[Any]) -> str | bytes:
        """The stored key of a listing's row, to read the next page after: as the driver
        returns it, so that it compares as stored."""
        return self._decode(row[0]) or ""

    @abc.abstractmethod
    def _select(
        self, operation: str, key: str, query: str, args: Mapping[str, object]
    ) -> Sequence[Sequence[Any]]:
        """The rows of the read-only query ``query`` (its name): creates no table, deletes no
        row, and returns no rows when the table does not exist."""

    @abc.abstractmethod
    def _acquire(
        self, key: str, token: str, ttl: float, meta: Mapping[str, str] | None,
        takeover_prefix: str | None,
    ) -> AcquireResult:  # fmt: skip
        """:meth:`acquire` of a key that is no holder slot; ``ttl`` is checked."""

    @abc.abstractmethod
    def _take_slot(
        self, key: str, names: list[str], token: str, ttl: float,
        meta: Mapping[str, str] | None, takeover_prefix: str | None,
        interval: float | None = None,
    ) -> AcquireResult:  # fmt: skip
        """Take the first slot of ``names`` (holder slots of ``key``) that qualifies, in one
        transaction; with ``interval`` (checked), only as the key's rate allows a start."""

    @abc.abstractmethod
    def _release_holder(self, operation: str, key: str, task_id: str | None) -> Holder | None:
        """Free the live lock ``key`` (held by ``task_id``, when given); return its holder."""


def pages(
    fetch: Callable[[dict[str, object]], Sequence[R]],
    prefix: str,
    page_size: int,
    key_of: Callable[[R], str | bytes],
    limit: int,
) -> Iterator[R]:
    """The rows of the lock table's listing query under ``prefix``, in stored-key order, fetched
    in pages of ``page_size``: ``fetch(args)`` runs the query with the arguments ``scan`` (a
    pattern on the stored key: its index finds every candidate, see :func:`stored_key` whose
    ``limit`` is given), ``pattern`` (on the full key), ``after`` (the last stored key of the
    page before) and ``limit``; ``key_of`` reads a row's stored key."""
    after: str | bytes = ""
    scan = like_prefix(_head(prefix.encode(errors="surrogatepass"), limit - 4))
    while True:
        args: dict[str, object] = {
            "scan": scan,
            "pattern": like_prefix(prefix),
            "after": after,
            "limit": page_size,
        }
        rows = fetch(args)
        yield from rows
        if len(rows) < page_size:
            return
        after = key_of(rows[-1])


class Reclaimer:
    """Decides when this process deletes a batch of expired rows: at most every ``interval``.

    No lock: two threads may both sweep now and then, which is harmless, and a forked child
    can never inherit a lock held by a thread of its parent.
    """

    def __init__(self, interval: float = RECLAIM_INTERVAL) -> None:
        self._interval = interval
        self._next = 0.0

    def due(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self._interval
        return True
