"""The bookkeeping records of the SQL lock stores, listed for operators
(:meth:`~singletask.backends.base.LockBackend.iter_state`).

On PostgreSQL and MySQL they are columns of a key's own row (see :mod:`.core`): its pending
follow-up (``next_task`` until ``next_expires``), its debounce window (``debounce_*``), its rate
record (``rate_next``). :data:`POSTGRES_STATE` and :data:`MYSQL_STATE` read one page of the
rows under a prefix that hold one of them live, judged by the database's clock, in the columns
:func:`records` takes (SQLite keeps them in tables of their own: :mod:`.sqlite.reads`). Nothing
here writes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..base import StoreState

__all__ = ["MYSQL_STATE", "POSTGRES_STATE", "records"]

# The columns both queries return: stored key, lock key, the live follow-up's task id (or
# NULL), its seconds left, the live window's latest send (or NULL), whether it is open, its
# age in seconds, its seconds left, the rate record's seconds until the next start (or NULL).
POSTGRES_STATE = """
SELECT key, coalesce(full_key, key),
    CASE WHEN next_expires > statement_timestamp() THEN next_task END,
    extract(epoch FROM next_expires - statement_timestamp())::float8,
    CASE WHEN debounce_until > statement_timestamp() THEN debounce_latest END,
    debounce_opened IS NOT NULL,
    extract(epoch FROM statement_timestamp() - debounce_opened)::float8,
    extract(epoch FROM debounce_until - statement_timestamp())::float8,
    CASE WHEN rate_next > statement_timestamp()
        THEN extract(epoch FROM rate_next - statement_timestamp())::float8 END
FROM {table} WHERE key LIKE %(scan)s ESCAPE '!' AND key > %(after)s
    AND coalesce(full_key, key) LIKE %(pattern)s ESCAPE '!'
    AND (next_task IS NOT NULL AND next_expires > statement_timestamp()
        OR debounce_until > statement_timestamp() OR rate_next > statement_timestamp())
ORDER BY key LIMIT %(limit)s"""

MYSQL_STATE = """
SELECT `key`, COALESCE(full_key, `key`),
    CASE WHEN next_expires > UTC_TIMESTAMP(6) THEN next_task END,
    TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), next_expires) / 1000000,
    CASE WHEN debounce_until > UTC_TIMESTAMP(6) THEN debounce_latest END,
    debounce_opened IS NOT NULL,
    TIMESTAMPDIFF(MICROSECOND, debounce_opened, UTC_TIMESTAMP(6)) / 1000000,
    TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), debounce_until) / 1000000,
    CASE WHEN rate_next > UTC_TIMESTAMP(6)
        THEN TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), rate_next) / 1000000 END
FROM {table} WHERE `key` LIKE %(scan)s ESCAPE '!' AND `key` > %(after)s
    AND COALESCE(full_key, `key`) LIKE %(pattern)s ESCAPE '!'
    AND (next_task IS NOT NULL AND next_expires > UTC_TIMESTAMP(6)
        OR debounce_until > UTC_TIMESTAMP(6) OR rate_next > UTC_TIMESTAMP(6))
ORDER BY `key` LIMIT %(limit)s"""


def _seconds(value: Any) -> float | None:
    return None if value is None else float(value)


def records(
    row: Sequence[Any], decode: Callable[[Any], str | None] = lambda value: value
) -> Iterator[StoreState]:
    """The records of one row of :data:`POSTGRES_STATE` or :data:`MYSQL_STATE` (values read
    with ``decode``, which turns a driver's bytes into text)."""
    key = decode(row[1]) or ""
    follow_up, follow_left, latest, opened, age, window_left, rate_left = row[2:9]
    if follow_up is not None:
        yield StoreState("follow_up", key, decode(follow_up), _seconds(follow_left))
    if latest is not None:
        is_open = bool(opened)
        detail = {"open": is_open, "age": max(0.0, float(age)) if is_open else None}
        yield StoreState("window", key, decode(latest), _seconds(window_left), detail)
    if rate_left is not None:
        left = float(rate_left)
        yield StoreState("rate", key, None, left, {"next_start_in": left})
