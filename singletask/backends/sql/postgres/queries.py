"""The SQL of the PostgreSQL lock store (:mod:`singletask.backends.sql.postgres`), and how it
classifies its driver's errors.

Each operation's statement is formatted into ``SCRIPT``: one READ COMMITTED transaction with
its own time limits, sent as one simple-query message. The table layout is described in
:mod:`singletask.backends.sql.core`.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import psycopg

from ....exceptions import BackendError, BackendTimeout, BackendUnavailable, ConfigurationError

#: Created on first use. ``key`` sorts bytewise (COLLATE "C") so prefix scans use its index.
SCHEMA = """
CREATE TABLE IF NOT EXISTS {table} (
    key text COLLATE "C" PRIMARY KEY,
    token text,
    task_id text,
    meta text,
    lease_expires timestamptz NOT NULL,
    fence bigint NOT NULL,
    done text,
    next_task text,
    next_expires timestamptz,
    expires_at timestamptz NOT NULL,
    full_key text,
    slot_fence bigint,
    rate_next timestamptz,
    debounce_latest text,
    debounce_opened timestamptz,
    debounce_until timestamptz,
    debounce_pending timestamptz,
    debounce_before timestamptz
)"""
INDEX = "CREATE INDEX IF NOT EXISTS {index} ON {table} (expires_at)"
#: The columns later versions added, with their types: a table made by an older version gains
#: them (nullable columns: no rewrite, no long lock).
ADDED_COLUMNS = {
    "full_key": "text", "slot_fence": "bigint", "rate_next": "timestamptz",
    "debounce_latest": "text", "debounce_opened": "timestamptz", "debounce_until": "timestamptz",
    "debounce_pending": "timestamptz", "debounce_before": "timestamptz",
}  # fmt: skip
ADD_COLUMNS = "ALTER TABLE {table} " + ", ".join(
    f"ADD COLUMN IF NOT EXISTS {name} {kind}" for name, kind in ADDED_COLUMNS.items()
)
#: Whether the table exists, with every column this version adds to an older table.
FIND_TABLE = (
    f"SELECT to_regclass(%(t)s) IS NOT NULL, (SELECT count(*) = {len(ADDED_COLUMNS)} "
    "FROM pg_attribute WHERE attrelid = to_regclass(%(t)s) AND NOT attisdropped "
    f"AND attname IN ({', '.join(repr(name) for name in ADDED_COLUMNS)}))"
)

#: Lock keys longer than this many UTF-8 bytes are stored in a fixed-size form (see
#: ``core.stored_key``); a B-tree entry holds at most about 2,700 bytes.
KEY_BYTES = 2000

#: Run once on each new connection (a statement, not a startup parameter, which PgBouncer
#: would refuse): the session's isolation and server-side time limits, whatever the server's,
#: database's or role's defaults. Each operation is then one prepared statement in autocommit.
SESSION = (
    "SELECT set_config('statement_timeout', %(ms)s, false), "
    "set_config('lock_timeout', %(ms)s, false), "
    "set_config('default_transaction_isolation', 'read committed', false)"
)

#: With ``transaction_pooling``, every operation is this transaction instead, sent as one
#: simple-query message (one round trip, arguments bound on the client, nothing prepared):
#: isolation and time limits are the transaction's own, so nothing depends on session state,
#: which PgBouncer in transaction mode does not keep.
SCRIPT = (
    "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL statement_timeout = {ms}; "
    "SET LOCAL lock_timeout = {ms}; {statement}; COMMIT"
)
PREAMBLE = 3  # results before the statement's own: BEGIN, SET, SET

# The row as the caller may take it, judged at ``n.now``: the clock read once, after the row
# is locked (a sub-SELECT of the SET is evaluated on the locked row), so a lease never starts
# before the wait for a rival's row lock ends. True when the old row ``l`` is free, expired,
# the caller's own token, or a holder whose token starts with the (non-empty) takeover prefix.
NOW = """(SELECT c.now, (extract(epoch FROM c.now) * 1000000)::bigint AS us,
    (l.token IS NULL OR l.lease_expires <= c.now OR l.token = EXCLUDED.token
     OR (%(prefix)s <> '' AND starts_with(l.token, %(prefix)s))) AS take
    FROM (SELECT clock_timestamp() AS now) AS c) AS n"""

# Insert the caller's row, or rewrite the existing one only where ``n.take`` holds. Returns the
# row as it now is: the caller holds the lock iff its token is the holder's. The fence stays for
# a re-acquire by the live holder, else becomes max(last + 1, clock in microseconds).
ACQUIRE = f"""
INSERT INTO {{table}} AS l
    (key, full_key, token, task_id, meta, lease_expires, fence, expires_at)
VALUES (%(key)s, %(full_key)s, %(token)s, %(task_id)s, %(meta)s,
        clock_timestamp() + %(ttl)s * interval '1 second',
        (extract(epoch FROM clock_timestamp()) * 1000000)::bigint,
        clock_timestamp() + (%(ttl)s + %(keep)s) * interval '1 second')
ON CONFLICT (key) DO UPDATE SET
    (fence, token, task_id, meta, lease_expires, expires_at, full_key) = (SELECT
        CASE WHEN l.token = EXCLUDED.token AND l.lease_expires > n.now THEN l.fence
            WHEN n.take THEN greatest(greatest(l.fence, coalesce(l.slot_fence, 0)) + 1, n.us)
            ELSE l.fence END,
        CASE WHEN n.take THEN EXCLUDED.token ELSE l.token END,
        CASE WHEN n.take THEN EXCLUDED.task_id ELSE l.task_id END,
        CASE WHEN n.take THEN EXCLUDED.meta ELSE l.meta END,
        CASE WHEN n.take THEN n.now + %(ttl)s * interval '1 second' ELSE l.lease_expires END,
        CASE WHEN n.take THEN greatest(l.expires_at,
            n.now + (%(ttl)s + %(keep)s) * interval '1 second') ELSE l.expires_at END,
        EXCLUDED.full_key
    FROM {NOW})
RETURNING token, meta, fence, done,
    extract(epoch FROM lease_expires - clock_timestamp())::float8"""

LIVE = "token IS NOT NULL AND lease_expires > statement_timestamp()"

# Frees the row (keeping fence and follow-up) if the token holds it; records the marker if given.
RELEASE = """
UPDATE {table} SET token = NULL, task_id = NULL, meta = NULL,
    lease_expires = clock_timestamp(), done = coalesce(%(done)s, done)
WHERE key = %(key)s AND token = %(token)s AND lease_expires > clock_timestamp()"""

# Updates that may wait for a row lock read the clock when they run (clock_timestamp()): a
# renewed lease starts when the row is taken, and an expiry during the wait counts.
EXTEND = """
UPDATE {table} SET lease_expires = clock_timestamp() + %(ttl)s * interval '1 second',
    expires_at = greatest(expires_at,
        clock_timestamp() + (%(ttl)s + %(keep)s) * interval '1 second')
WHERE key = %(key)s AND token = %(token)s AND token IS NOT NULL
    AND lease_expires > clock_timestamp()"""

# One statement for every lease: returns the (key, token) pairs renewed.
EXTEND_MANY = """
UPDATE {table} AS l SET lease_expires = clock_timestamp() + v.ttl * interval '1 second',
    expires_at = greatest(l.expires_at,
        clock_timestamp() + (v.ttl + %(keep)s) * interval '1 second')
FROM unnest(%(keys)s::text[], %(tokens)s::text[], %(ttls)s::float8[]) AS v(key, token, ttl)
WHERE l.key = v.key AND l.token = v.token AND l.lease_expires > clock_timestamp()
RETURNING l.key, l.token"""

# Makes task_id the pending follow-up unless a live one is pending; returns the pending one.
CLAIM_NEXT = """
INSERT INTO {table} AS l
    (key, full_key, lease_expires, fence, next_task, next_expires, expires_at)
VALUES (%(key)s, %(full_key)s, statement_timestamp(), 0, %(task_id)s,
        statement_timestamp() + %(ttl)s * interval '1 second',
        statement_timestamp() + greatest(%(ttl)s, %(keep)s) * interval '1 second')
ON CONFLICT (key) DO UPDATE SET
    next_task = CASE WHEN l.next_task IS NOT NULL AND l.next_expires > statement_timestamp()
        THEN l.next_task ELSE EXCLUDED.next_task END,
    next_expires = CASE WHEN l.next_task IS NOT NULL AND l.next_expires > statement_timestamp()
        THEN l.next_expires ELSE EXCLUDED.next_expires END,
    expires_at = greatest(l.expires_at, EXCLUDED.expires_at)
RETURNING next_task"""

CLEAR_NEXT = """
UPDATE {table} SET next_task = NULL, next_expires = NULL
WHERE key = %(key)s AND next_task = %(task_id)s"""

HOLDER = f"""
SELECT token, meta, fence, extract(epoch FROM lease_expires - statement_timestamp())::float8
FROM {{table}} WHERE key = %(key)s AND {LIVE}"""

# One page of live locks under a prefix, after the last key of the previous page.
ITER = f"""
SELECT key, coalesce(full_key, key), token, meta, fence,
    extract(epoch FROM lease_expires - statement_timestamp())::float8
FROM {{table}} WHERE key LIKE %(scan)s ESCAPE '!' AND key > %(after)s
    AND coalesce(full_key, key) LIKE %(pattern)s ESCAPE '!' AND {LIVE}
ORDER BY key LIMIT %(limit)s"""

# Frees a live lock (if held by task_id, when given) and returns the holder it removed; the row
# is locked first so the returned holder is the one the update removed.
RELEASE_HOLDER = f"""
WITH old AS (
    SELECT key, token, meta, fence,
        extract(epoch FROM lease_expires - statement_timestamp())::float8 AS ttl
    FROM {{table}} WHERE key = %(key)s AND {LIVE}
        AND (%(task_id)s::text IS NULL OR task_id = %(task_id)s::text)
    FOR UPDATE)
UPDATE {{table}} AS l SET token = NULL, task_id = NULL, meta = NULL,
    lease_expires = statement_timestamp()
FROM old WHERE l.key = old.key
RETURNING old.token, old.meta, old.fence, old.ttl"""

# Holder slots (singletask.protocol.slots): the statements of one script (SLOT_SCRIPT), one
# transaction. First the key's own row is locked (inserted free if missing): it serialises every
# acquisition of the key's slots and keeps the key's fence counter (greatest of fence and
# slot_fence).
SLOT_LOCK_KEY = """
INSERT INTO {table} AS l (key, full_key, lease_expires, fence, expires_at)
VALUES (%(base)s, %(base_full)s, clock_timestamp(), 0, clock_timestamp())
ON CONFLICT (key) DO UPDATE SET fence = l.fence"""

# Then the slots' rows that exist, in key order.
SLOT_LOCK_ROWS = """
SELECT key FROM {table} WHERE key = ANY(%(keys)s::text[]) ORDER BY key FOR UPDATE"""

# Then, with the clock read after those locks: rank each slot (0: the caller's own live one,
# 1: a live holder with the takeover prefix, 2: free or expired, 3: held) and pick the first of
# the best rank below 3 (p). A pick of rank 1 or 2 is a start: with an interval it is taken
# (q) only when the key's ``rate_next`` has passed, and it sets ``rate_next`` to now + interval.
# The pick is taken as ACQUIRE takes a key; the key's row (the pick itself for slot 0) records
# the fence, the rate and outlives both. Returns the ordinal taken (1 for the first slot) with
# its holder, fence and the key's marker; or, when every slot is held, every holder; or, when
# the rate refused a start, one row of ordinal 0 with the seconds until one is allowed.
SLOT_TAKE = """
WITH n AS (SELECT c.now, (extract(epoch FROM c.now) * 1000000)::bigint AS us
    FROM (SELECT clock_timestamp() AS now) AS c),
b AS (SELECT greatest(fence, coalesce(slot_fence, 0)) AS fence, done, rate_next
    FROM {table} WHERE key = %(base)s),
c AS (SELECT s.ord, s.key, s.full_key, l.token, l.meta, l.fence, l.lease_expires,
        CASE WHEN l.token IS NULL OR l.lease_expires <= n.now THEN 2
            WHEN l.token = %(token)s THEN 0
            WHEN %(prefix)s <> '' AND starts_with(l.token, %(prefix)s) THEN 1
            ELSE 3 END AS rank
    FROM n CROSS JOIN unnest(%(keys)s::text[], %(fulls)s::text[]) WITH ORDINALITY
        AS s(key, full_key, ord)
    LEFT JOIN {table} AS l ON l.key = s.key),
p AS (SELECT * FROM c WHERE rank < 3 ORDER BY rank, ord LIMIT 1),
q AS (SELECT p.ord, p.key, p.full_key, p.key = %(base)s AS own,
        CASE WHEN p.rank = 0 THEN p.fence
            ELSE greatest(b.fence + 1, coalesce(p.fence, 0) + 1, n.us) END AS fence,
        CASE WHEN p.rank > 0 THEN n.now + %(interval)s::float8 * interval '1 second' END AS rate
    FROM p, b, n WHERE p.rank = 0 OR %(interval)s::float8 IS NULL OR b.rate_next IS NULL
        OR b.rate_next <= n.now),
slot AS (
    INSERT INTO {table} AS l
        (key, full_key, token, task_id, meta, lease_expires, fence, expires_at)
    SELECT q.key, q.full_key, %(token)s, %(task_id)s, %(meta)s,
        n.now + %(ttl)s * interval '1 second', q.fence,
        n.now + (%(ttl)s + %(keep)s) * interval '1 second'
    FROM q, n WHERE NOT q.own
    ON CONFLICT (key) DO UPDATE SET (token, task_id, meta, lease_expires, fence, expires_at,
        full_key) = (EXCLUDED.token, EXCLUDED.task_id, EXCLUDED.meta, EXCLUDED.lease_expires,
        EXCLUDED.fence, greatest(l.expires_at, EXCLUDED.expires_at), EXCLUDED.full_key)),
k AS (
    UPDATE {table} AS l SET
        (token, task_id, meta, lease_expires, fence) = (SELECT
            CASE WHEN q.own THEN %(token)s ELSE l.token END,
            CASE WHEN q.own THEN %(task_id)s ELSE l.task_id END,
            CASE WHEN q.own THEN %(meta)s ELSE l.meta END,
            CASE WHEN q.own THEN n.now + %(ttl)s * interval '1 second' ELSE l.lease_expires END,
            CASE WHEN q.own THEN q.fence ELSE l.fence END),
        slot_fence = greatest(coalesce(l.slot_fence, 0), q.fence),
        rate_next = coalesce(q.rate, l.rate_next),
        expires_at = greatest(l.expires_at, q.rate,
            n.now + (%(ttl)s + %(keep)s) * interval '1 second')
    FROM q, n WHERE l.key = %(base)s)
SELECT q.ord, %(token)s::text, %(meta)s::text, q.fence, %(ttl)s::float8, b.done
FROM q, b
UNION ALL
SELECT c.ord, c.token, c.meta, c.fence, extract(epoch FROM c.lease_expires - n.now)::float8,
    NULL FROM c, n WHERE c.rank = 3 AND NOT EXISTS (SELECT FROM p)
UNION ALL
SELECT 0, NULL, NULL, NULL, extract(epoch FROM b.rate_next - n.now)::float8, NULL
FROM p, b, n WHERE NOT EXISTS (SELECT FROM q)
ORDER BY 1"""

#: The transaction of a slot acquisition, one simple-query message (with the store's time
#: limits, as SCRIPT).
SLOT_SCRIPT = (
    "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL statement_timeout = {ms}; "
    f"SET LOCAL lock_timeout = {{ms}}; {SLOT_LOCK_KEY}; {SLOT_LOCK_ROWS}; {SLOT_TAKE}; COMMIT"
)

# Release of a holder slot: the key's row is locked first (as a slot acquisition locks it), then
# the slot freed if the token holds it, and a marker recorded on the key's row.
RELEASE_SLOT = f"""
BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL statement_timeout = {{ms}};
SET LOCAL lock_timeout = {{ms}};
SELECT FROM {{table}} WHERE key = %(base)s FOR UPDATE;
WITH r AS ({RELEASE.strip()} RETURNING key),
k AS (UPDATE {{table}} SET done = %(done)s
    WHERE key = %(base)s AND %(done)s::text IS NOT NULL AND EXISTS (SELECT FROM r))
SELECT count(*) FROM r;
COMMIT"""

#: The scripts of several statements (sent as one message in every mode), and how many results
#: come before the one the operation reads.
SKIPPED = {
    "acquire_slot": PREAMBLE + 2, "release_slot": PREAMBLE + 1, "debounce": PREAMBLE + 1,
    "preempt": PREAMBLE, "preempt_slot": PREAMBLE + 2, "take_units": PREAMBLE + 2,
    "acquire_units": PREAMBLE + 3, "release_units": PREAMBLE,
    # fair turns: a take's two messages, and a give's with turns (postgres/units.py)
    "take_read": PREAMBLE + 2, "take_write": 0, "acquire_read": PREAMBLE + 3,
    "acquire_write": 0, "leave_read": PREAMBLE + 2, "leave_write": 1,
}  # fmt: skip

RECLAIM = """
DELETE FROM {table} WHERE key IN (
    SELECT key FROM {table} WHERE expires_at < statement_timestamp()
    ORDER BY expires_at LIMIT %(limit)s FOR UPDATE SKIP LOCKED)"""


#: SQLSTATEs: serialization failure and deadlock (nothing was committed: sent again), and the
#: server ending or refusing sessions (shutdown, crash recovery, too many connections).
RETRIED = {"40001", "40P01"}
GONE = {"57P01", "57P02", "57P03", "53300"}
#: Seconds the client waits past ``timeout`` before it drops a connection that does not answer
#: (the server's own limits, set to ``timeout``, normally answer first).
MARGIN = 1.0
FLAGS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def error_class(exc: psycopg.Error) -> type[BackendError]:
    """Timeouts; a connection that failed or a server that went away; anything else (an error
    of the statement, bad input, a read-only server) is a plain BackendError."""
    state = exc.sqlstate or ""
    if isinstance(exc, psycopg.errors.QueryCanceled | psycopg.errors.LockNotAvailable):
        return BackendTimeout
    if "timeout expired" in str(exc):  # libpq's connect_timeout
        return BackendTimeout
    if state.startswith("08") or state in GONE:
        return BackendUnavailable
    if isinstance(exc, psycopg.OperationalError) and not state:  # raised by the client: the link
        return BackendUnavailable
    return BackendError


def shut(conn: psycopg.Connection[Any]) -> None:
    """Shut the connection's socket down: a call blocked reading it returns at once."""
    with socket.socket(fileno=os.dup(conn.pgconn.socket)) as sock:
        sock.shutdown(socket.SHUT_RDWR)


def scrub(text: str) -> str:
    """A libpq parse error without the tokens it quotes (one may be the password)."""
    return re.sub(r'"[^"]*"', '"***"', text)


def own_url_options(url: str) -> tuple[str, int | None, bool]:
    """Take the options that are psycopg's or singletask's, no libpq parameters, out of the
    query of ``url``: returns the URL without them, ``prepare_threshold`` (5 unless given) and
    ``transaction_pooling``. A raw ``@`` in the user info is encoded: the user info ends at the
    last ``@`` (as for every other store's URL); libpq would end it at the first, and put the
    rest of a password with a raw ``@`` in its host name.

    Raises:
        ConfigurationError: An option's value is invalid.
    """
    parts = urlsplit(url)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if "@" in userinfo:
        parts = parts._replace(netloc=userinfo.replace("@", "%40") + at + hostport)
    query = parse_qsl(parts.query, keep_blank_values=True)
    given = [value for name, value in query if name == "prepare_threshold"]
    pooling = [value for name, value in query if name == "transaction_pooling"]
    own_names = ("prepare_threshold", "transaction_pooling")
    rest_query = urlencode([q for q in query if q[0] not in own_names], quote_via=quote)
    flag = pooling[-1].lower() if pooling else "0"
    if flag not in FLAGS:
        raise ConfigurationError(
            f"URL option transaction_pooling={pooling[-1]!r}: expected 1 or 0 (true/false)"
        )
    threshold: int | None = 5
    if given and given[-1].lower() == "none":
        threshold = None
    elif given and given[-1].isdigit():
        threshold = int(given[-1])
    elif given:
        raise ConfigurationError(
            f"URL option prepare_threshold={given[-1]!r}: expected a number or 'none'"
        )
    return urlunsplit(parts._replace(query=rest_query)), threshold, FLAGS[flag]


def create_table(conn: psycopg.Connection[Any], table: str, q: Mapping[str, Any]) -> None:
    """Create ``table`` (its index, the columns a later version added) with the statements of
    ``q``, unless it has them all already."""
    # Looked up first: CREATE ... IF NOT EXISTS needs the CREATE privilege even when the
    # table exists, and a user may have only been given the table.
    found = conn.execute(FIND_TABLE, {"t": table}).fetchone()
    if found == (True, True):
        return
    # CREATE TABLE IF NOT EXISTS alone can fail when two sessions race to create the same
    # table (a unique violation in the catalog): an advisory lock serialises them.
    with conn.transaction():
        lock_name = f"singletask:{table}"
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (lock_name,))
        conn.execute(q["schema"])
        conn.execute(q["index"])
        conn.execute(q["add_columns"])
