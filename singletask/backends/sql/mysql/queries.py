"""The SQL of the MySQL / MariaDB lock store (:mod:`singletask.backends.sql.mysql`).

The table layout is described in :mod:`singletask.backends.sql.core`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pymysql

#: Server error code of an ADD COLUMN whose column exists (another worker added it).
_DUPLICATE_COLUMN = 1060

SCHEMA = """
CREATE TABLE IF NOT EXISTS {table} (
    `key` VARBINARY(1024) NOT NULL PRIMARY KEY,
    token VARBINARY(255) NULL,
    task_id VARBINARY(255) NULL,
    meta TEXT NULL,
    lease_expires DATETIME(6) NOT NULL,
    fence BIGINT NOT NULL,
    done TEXT NULL,
    next_task VARBINARY(255) NULL,
    next_expires DATETIME(6) NULL,
    expires_at DATETIME(6) NOT NULL,
    full_key MEDIUMBLOB NULL,
    slot_fence BIGINT NULL,
    rate_next DATETIME(6) NULL,
    debounce_latest VARBINARY(255) NULL,
    debounce_opened DATETIME(6) NULL,
    debounce_until DATETIME(6) NULL,
    debounce_pending DATETIME(6) NULL,
    debounce_before DATETIME(6) NULL,
    INDEX {index} (expires_at)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"""

#: The columns an older version's table may lack, and their types: a table made before one
#: existed gains it (instant on MariaDB 10.3+ and MySQL 8.0.12+), with ADD_COLUMN.
ADDED_COLUMNS = {
    "full_key": "MEDIUMBLOB NULL", "slot_fence": "BIGINT NULL", "rate_next": "DATETIME(6) NULL",
    "debounce_latest": "VARBINARY(255) NULL", "debounce_opened": "DATETIME(6) NULL",
    "debounce_until": "DATETIME(6) NULL", "debounce_pending": "DATETIME(6) NULL",
    "debounce_before": "DATETIME(6) NULL",
}  # fmt: skip
ADD_COLUMN = "ALTER TABLE {table} ADD COLUMN {column} {kind}"
#: The table's columns among ``key`` and ADDED_COLUMNS (none: there is no table yet).
FIND_COLUMNS = (
    "SELECT column_name FROM information_schema.columns "
    "WHERE table_schema = COALESCE(%s, DATABASE()) AND table_name = %s "
    f"AND column_name IN ('key', {', '.join(repr(name) for name in ADDED_COLUMNS)})"
)

#: Lock keys longer than this many bytes are stored in a fixed-size form (see
#: ``core.stored_key``), which fits the VARBINARY(1024) primary key.
KEY_BYTES = 950

#: Run once on every new connection.
SESSION = (
    "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED; "
    "SET SESSION sql_mode = 'STRICT_ALL_TABLES,NO_ENGINE_SUBSTITUTION', "
    "innodb_lock_wait_timeout = %(wait)s"
)

CLOCK_US = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01', @st_now)"

# Lock the key's row (inserting a free one if the key has none); only then read the clock
# (``@st_now``), so a lease never starts before the wait for a rival's row lock ends. Then take
# the row where the WHERE allows: free, expired, the caller's token, or a holder starting with
# the takeover prefix. The fence is assigned before token and lease_expires, so it tests their
# old values. The final SELECT returns the row as it now is: the caller holds the lock iff its
# token is the holder's.
LOCK_ROW = """
START TRANSACTION;
INSERT INTO {table} (`key`, full_key, lease_expires, fence, expires_at)
VALUES (%(key)s, %(full_key)s, UTC_TIMESTAMP(6), 0, UTC_TIMESTAMP(6))
ON DUPLICATE KEY UPDATE `key` = `key`;
SET @st_now = UTC_TIMESTAMP(6);"""

ACQUIRE = f"""{LOCK_ROW}
UPDATE {{table}} SET
    fence = IF(token <=> %(token)s AND lease_expires > @st_now, fence,
               GREATEST(GREATEST(fence, COALESCE(slot_fence, 0)) + 1, {CLOCK_US})),
    task_id = %(task_id)s,
    meta = %(meta)s,
    full_key = %(full_key)s,
    expires_at = GREATEST(expires_at, @st_now + INTERVAL %(row_us)s MICROSECOND),
    lease_expires = @st_now + INTERVAL %(lease_us)s MICROSECOND,
    token = %(token)s
WHERE `key` = %(key)s AND (token IS NULL OR lease_expires <= @st_now OR token = %(token)s
    OR (%(prefix)s <> '' AND LEFT(token, LENGTH(%(prefix)s)) = %(prefix)s));
SELECT token, meta, fence, done, TIMESTAMPDIFF(MICROSECOND, @st_now, lease_expires)
FROM {{table}} WHERE `key` = %(key)s;
COMMIT"""

LIVE = "token IS NOT NULL AND lease_expires > UTC_TIMESTAMP(6)"

RELEASE = f"""
UPDATE {{table}} SET done = COALESCE(%(done)s, done), token = NULL, task_id = NULL, meta = NULL,
    lease_expires = UTC_TIMESTAMP(6)
WHERE `key` = %(key)s AND token = %(token)s AND {LIVE}"""

EXTEND = f"""
UPDATE {{table}} SET
    expires_at = GREATEST(expires_at, UTC_TIMESTAMP(6) + INTERVAL %(row_us)s MICROSECOND),
    lease_expires = UTC_TIMESTAMP(6) + INTERVAL %(lease_us)s MICROSECOND
WHERE `key` = %(key)s AND token = %(token)s AND {LIVE}"""

# Lock the row (inserting a free one if the key has none), then set the follow-up unless a live
# one is pending; return the pending one.
CLAIM_NEXT = f"""{LOCK_ROW}
UPDATE {{table}} SET next_task = %(task_id)s,
    expires_at = GREATEST(expires_at, @st_now + INTERVAL %(row_us)s MICROSECOND),
    next_expires = @st_now + INTERVAL %(ttl_us)s MICROSECOND
WHERE `key` = %(key)s AND (next_task IS NULL OR next_expires <= @st_now);
SELECT next_task FROM {{table}} WHERE `key` = %(key)s;
COMMIT"""

CLEAR_NEXT = """
UPDATE {table} SET next_task = NULL, next_expires = NULL
WHERE `key` = %(key)s AND next_task = %(task_id)s"""

HOLDER = f"""
SELECT token, meta, fence, TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), lease_expires)
FROM {{table}} WHERE `key` = %(key)s AND {LIVE}"""

ITER = f"""
SELECT `key`, COALESCE(full_key, `key`), token, meta, fence,
    TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), lease_expires)
FROM {{table}} WHERE `key` LIKE %(scan)s ESCAPE '!' AND `key` > %(after)s
    AND COALESCE(full_key, `key`) LIKE %(pattern)s ESCAPE '!' AND {LIVE}
ORDER BY `key` LIMIT %(limit)s"""

# Lock the row first, whatever it holds (a locking read whose WHERE does not match would let
# the row go again under READ COMMITTED, and a rival's acquire could commit before the UPDATE);
# then read the live holder (of task_id, when given) and free it, under that one lock and clock.
RELEASE_HOLDER = f"""{LOCK_ROW}
SELECT token, meta, fence, TIMESTAMPDIFF(MICROSECOND, @st_now, lease_expires)
FROM {{table}} WHERE `key` = %(key)s AND token IS NOT NULL AND lease_expires > @st_now
    AND (%(task_id)s IS NULL OR task_id = %(task_id)s);
UPDATE {{table}} SET token = NULL, task_id = NULL, meta = NULL, lease_expires = @st_now
WHERE `key` = %(key)s AND token IS NOT NULL AND lease_expires > @st_now
    AND (%(task_id)s IS NULL OR task_id = %(task_id)s);
COMMIT"""

# Holder slots (singletask.protocol.slots). ``{slots}`` is a derived table of the candidate slots,
# one ``SELECT`` of ``k`` (stored key), ``f`` (full key) and ``ord`` (1 for the first) per slot
# (SLOT, joined with UNION ALL).
SLOT = "SELECT CAST(%(k{n})s AS BINARY) AS k, %(f{n})s AS f, {n} AS ord"

# One transaction. The key's own row is locked first (inserted free if missing): it serialises
# every acquisition of the key's slots and keeps the key's fence counter (greatest of fence and
# slot_fence); then the slots' rows that exist. Only then is the clock read, and the slot chosen:
# the caller's own live one, else a live holder with the takeover prefix, else the first free or
# expired one. A choice other than the caller's own slot is a start: with an interval
# (``rate_us``) it is dropped while the key's ``rate_next`` is ahead (``@st_wait``: the
# microseconds left). The chosen row is inserted if missing and taken as ACQUIRE takes a key;
# the key's row records the fence and a start's ``rate_next``. The final SELECT returns the live
# holders of the slots by ordinal, with the key's marker (the caller took a slot iff its token
# is among them), and a row of ordinal 0 with ``@st_wait`` when the rate refused a start.
ACQUIRE_SLOT = f"""
START TRANSACTION;
INSERT INTO {{table}} (`key`, full_key, lease_expires, fence, expires_at)
VALUES (%(base)s, %(base_full)s, UTC_TIMESTAMP(6), 0, UTC_TIMESTAMP(6))
ON DUPLICATE KEY UPDATE `key` = `key`;
SELECT `key` FROM {{table}} WHERE `key` IN (SELECT k FROM ({{{{slots}}}}) AS c)
ORDER BY `key` FOR UPDATE;
SET @st_now = UTC_TIMESTAMP(6), @st_pick = NULL, @st_full = NULL, @st_rank = NULL;
SELECT c.k, c.f, CASE WHEN l.token IS NULL OR l.lease_expires <= @st_now THEN 2
        WHEN l.token = %(token)s THEN 0
        WHEN %(prefix)s <> '' AND LEFT(l.token, LENGTH(%(prefix)s)) = %(prefix)s THEN 1
        ELSE 3 END AS st_rank
    INTO @st_pick, @st_full, @st_rank
FROM ({{{{slots}}}}) AS c LEFT JOIN {{table}} AS l ON l.`key` = c.k
HAVING st_rank < 3 ORDER BY st_rank, c.ord LIMIT 1;
SELECT GREATEST(fence, COALESCE(slot_fence, 0)), rate_next INTO @st_last, @st_rate
FROM {{table}} WHERE `key` = %(base)s;
SET @st_wait = IF(@st_rank > 0 AND %(rate_us)s IS NOT NULL AND @st_rate > @st_now,
    TIMESTAMPDIFF(MICROSECOND, @st_now, @st_rate), NULL);
SET @st_pick = IF(@st_wait IS NULL, @st_pick, NULL);
INSERT INTO {{table}} (`key`, full_key, lease_expires, fence, expires_at)
SELECT @st_pick, @st_full, @st_now, 0, @st_now FROM DUAL WHERE @st_pick IS NOT NULL
ON DUPLICATE KEY UPDATE `key` = `key`;
UPDATE {{table}} SET
    fence = IF(@st_rank = 0, fence, GREATEST(fence + 1, @st_last + 1, {CLOCK_US})),
    task_id = %(task_id)s,
    meta = %(meta)s,
    full_key = @st_full,
    expires_at = GREATEST(expires_at, @st_now + INTERVAL %(row_us)s MICROSECOND),
    lease_expires = @st_now + INTERVAL %(lease_us)s MICROSECOND,
    token = %(token)s
WHERE `key` = @st_pick;
SELECT fence INTO @st_fence FROM {{table}} WHERE `key` = @st_pick;
UPDATE {{table}} SET slot_fence = GREATEST(COALESCE(slot_fence, 0), @st_fence),
    rate_next = IF(@st_rank > 0 AND %(rate_us)s IS NOT NULL,
        @st_now + INTERVAL %(rate_us)s MICROSECOND, rate_next),
    expires_at = GREATEST(expires_at, @st_now + INTERVAL %(row_us)s MICROSECOND,
        @st_now + INTERVAL COALESCE(%(rate_us)s, 0) MICROSECOND)
WHERE `key` = %(base)s AND @st_pick IS NOT NULL;
SELECT c.ord, l.token, l.meta, l.fence, TIMESTAMPDIFF(MICROSECOND, @st_now, l.lease_expires),
    b.done
FROM ({{{{slots}}}}) AS c JOIN {{table}} AS l ON l.`key` = c.k
JOIN {{table}} AS b ON b.`key` = %(base)s
WHERE l.token IS NOT NULL AND l.lease_expires > @st_now
UNION ALL SELECT 0, NULL, NULL, NULL, @st_wait, NULL FROM DUAL WHERE @st_wait IS NOT NULL
ORDER BY 1;
COMMIT"""

# Release of a holder slot: the key's row is locked first (as a slot acquisition locks it),
# then the slot freed if the token holds it, and a marker recorded on the key's row.
RELEASE_SLOT = f"""
START TRANSACTION;
SELECT `key` FROM {{table}} WHERE `key` = %(base)s FOR UPDATE;
UPDATE {{table}} SET token = NULL, task_id = NULL, meta = NULL, lease_expires = UTC_TIMESTAMP(6)
WHERE `key` = %(key)s AND token = %(token)s AND {LIVE};
SET @st_released = ROW_COUNT();
UPDATE {{table}} SET done = COALESCE(%(done)s, done) WHERE `key` = %(base)s AND @st_released > 0;
SELECT @st_released;
COMMIT"""

# Debounce windows, on the key's own row: locked first (inserted free if missing), then, with
# the clock read after the lock, the open window's latest send and age are read (NULL and 0
# when none is open: ``debounce_until`` not later than now, or the window closed, its
# ``debounce_opened`` NULL), and the latest send of an unexpired closed window (NULL unless
# the window is closed: what DEBOUNCE_UNDO puts back), and the window is given the new latest
# send, opened now unless it was open (assigned before debounce_until changes), and kept until
# ``ttl_us`` from now or, if an earlier send asked for longer, until then (never shortened),
# pending ``pending_us`` from now (with ``pending_us`` > 0; assigned after debounce_before
# keeps the superseded send's pending deadline: MySQL assigns left to right).
DEBOUNCE = f"""{LOCK_ROW}
SET @st_open = COALESCE(
    (SELECT debounce_until > @st_now AND debounce_opened IS NOT NULL FROM {{table}}
     WHERE `key` = %(key)s), 0);
SELECT IF(@st_open, debounce_latest, NULL),
    IF(@st_open, TIMESTAMPDIFF(MICROSECOND, debounce_opened, @st_now), 0),
    IF(NOT @st_open AND debounce_until > @st_now, debounce_latest, NULL)
FROM {{table}} WHERE `key` = %(key)s;
UPDATE {{table}} SET
    debounce_before = IF(%(pending_us)s > 0 AND @st_open, debounce_pending, NULL),
    debounce_pending = IF(%(pending_us)s > 0, @st_now + INTERVAL %(pending_us)s MICROSECOND, NULL),
    debounce_opened = IF(@st_open, debounce_opened, @st_now),
    debounce_latest = %(task_id)s,
    debounce_until = GREATEST(COALESCE(debounce_until, @st_now),
        @st_now + INTERVAL %(ttl_us)s MICROSECOND),
    expires_at = GREATEST(expires_at, @st_now + INTERVAL %(ttl_us)s MICROSECOND)
WHERE `key` = %(key)s;
COMMIT"""

# The pending latest send of the open window was published: it is pending no more, if the
# window still names it. One statement in autocommit.
DEBOUNCE_PUBLISHED = """
UPDATE {table} SET debounce_pending = NULL, debounce_before = NULL
WHERE `key` = %(key)s AND debounce_latest = %(task_id)s AND debounce_opened IS NOT NULL
    AND debounce_pending IS NOT NULL AND debounce_until > UTC_TIMESTAMP(6)"""

# The window's latest send and the microseconds it stays pending (0 unless it is another send,
# pending), the row locked first (so a send that supersedes it commits before, or after this).
# In an open window, another latest send still pending past its deadline is taken back: the
# caller's send becomes the latest. The open window is then closed (``debounce_opened`` and the
# pending columns NULL; its latest send and ``debounce_until`` kept) when that send is the
# caller's; no row when no window is unexpired.
DEBOUNCE_TAKE = """
START TRANSACTION;
SELECT `key` FROM {table} WHERE `key` = %(key)s FOR UPDATE;
SET @st_now = UTC_TIMESTAMP(6);
UPDATE {table} SET debounce_latest = %(task_id)s
WHERE `key` = %(key)s AND debounce_latest <> %(task_id)s AND debounce_opened IS NOT NULL
    AND (debounce_pending <= @st_now OR (%(overdue)s AND debounce_pending IS NOT NULL))
    AND debounce_until > @st_now;
UPDATE {table} SET debounce_opened = NULL, debounce_pending = NULL, debounce_before = NULL
WHERE `key` = %(key)s AND debounce_latest = %(task_id)s AND debounce_opened IS NOT NULL
    AND debounce_until > @st_now;
SELECT debounce_latest, IF(debounce_opened IS NOT NULL AND debounce_pending > @st_now,
        TIMESTAMPDIFF(MICROSECOND, @st_now, debounce_pending), 0)
FROM {table} WHERE `key` = %(key)s AND debounce_until > @st_now FOR UPDATE;
COMMIT"""

# Takes back a send whose message was never published, if the open window still names it: the
# send it superseded is the latest again; or without one (it opened the window), the closed
# window it opened a new one over is back (``debounce_opened`` NULL, the latest ``closed``,
# ``debounce_until`` kept: the longer expiry), or without that the window is gone (the row
# stays, for its other records); the restored send pending again until ``debounce_before``
# if it was. One statement in autocommit: the row lock is its atomicity. (MySQL assigns left
# to right: debounce_pending before debounce_before, debounce_latest, which the others do not
# read, last.)
DEBOUNCE_UNDO = """
UPDATE {table} SET
    debounce_opened = IF(%(previous)s IS NULL, NULL, debounce_opened),
    debounce_pending = IF(%(previous)s IS NULL, NULL, debounce_before),
    debounce_before = NULL,
    debounce_until = IF(COALESCE(%(previous)s, %(closed)s) IS NULL, NULL, debounce_until),
    debounce_latest = COALESCE(%(previous)s, %(closed)s)
WHERE `key` = %(key)s AND debounce_latest = %(task_id)s AND debounce_opened IS NOT NULL
    AND debounce_until > UTC_TIMESTAMP(6)"""

RECLAIM = """
DELETE FROM {table} WHERE expires_at < UTC_TIMESTAMP(6) ORDER BY expires_at LIMIT %(limit)s"""


def as_text(value: bytes | str | None) -> str | None:
    """A VARBINARY value as text: UTF-8, any byte that is not UTF-8 written as a backslash
    escape (a row another program wrote is shown, never fails a listing)."""
    return value.decode(errors="backslashreplace") if isinstance(value, bytes) else value


def run_script(cursor: pymysql.cursors.Cursor, text: str, args: Mapping[str, Any]) -> list[Any]:
    """Send the statements of ``text`` as one request; return the rows each one returned."""
    cursor.execute(text, args)
    results = [cursor.fetchall()]
    while cursor.nextset():
        results.append(cursor.fetchall())
    return results


def create_table(cursor: pymysql.cursors.Cursor, table: str, quoted: str, create: str) -> None:
    """Create ``table`` (``quoted``: as SQL names it) with the statement ``create`` if missing
    (looked up first: CREATE TABLE IF NOT EXISTS needs the CREATE privilege even when the
    table exists), or add the columns it lacks. MySQL's metadata lock makes racing CREATE
    TABLE IF NOT EXISTS safe."""
    schema, _, name = table.rpartition(".")
    cursor.execute(FIND_COLUMNS, (schema or None, name))
    found = {as_text(row[0]) for row in cursor.fetchall()}
    if not found:
        run_script(cursor, create, {})
    for column, kind in ADDED_COLUMNS.items():
        if found and column not in found:
            try:
                cursor.execute(ADD_COLUMN.format(table=quoted, column=column, kind=kind))
            except pymysql.MySQLError as exc:
                if exc.args[:1] != (_DUPLICATE_COLUMN,):  # another worker added it
                    raise
