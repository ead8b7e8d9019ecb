"""The SQL of the MySQL / MariaDB lock store (:mod:`singletask.backends.mysql`).

The table layout is described in :mod:`singletask.backends._sql`.
"""

from __future__ import annotations

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
    INDEX {index} (expires_at)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"""

# A table made before full_key existed gains it (instant on MariaDB 10.3+ and MySQL 8.0.12+).
ADD_FULL_KEY = "ALTER TABLE {table} ADD COLUMN full_key MEDIUMBLOB NULL"

#: Lock keys longer than this many bytes are stored in a fixed-size form (see
#: ``_sql.stored_key``), which fits the VARBINARY(1024) primary key.
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
               GREATEST(fence + 1, {CLOCK_US})),
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

RECLAIM = """
DELETE FROM {table} WHERE expires_at < UTC_TIMESTAMP(6) ORDER BY expires_at LIMIT %(limit)s"""
