"""Named limits in the PostgreSQL lock store (:mod:`singletask.backends.sql.postgres`): their
tables and SQL. The layout, and how a take stays one atomic step, are in :mod:`..units`.

A take is one transaction, one simple-query message (``TAKE``): its limits' rows locked in
stored-key order, then with the clock read after those locks, one statement that reads the
live holds, decides, and writes the caller's holds only when every limit has room. A give is
one statement (``GIVE``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from ....exceptions import LockKeyError
from ...base import AcquireResult, Units, units_meta
from ...holders import MAX_SHOWN
from ...turns import Line
from .. import core
from ..lines import Decision, Seen, decide, dump, leave, line_table, load
from ..units import Limit, SQLUnits, limit_tables
from .queries import PREAMBLE, RELEASE, SCRIPT

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import TypeVar

    T = TypeVar("T")

__all__ = ["PostgresUnits", "create_tables", "queries"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS {limits} (
    key text COLLATE "C" PRIMARY KEY,
    full_key text,
    size bigint NOT NULL,
    period float8,
    expires_at timestamptz NOT NULL
)"""
HOLDS_SCHEMA = """
CREATE TABLE IF NOT EXISTS {holds} (
    key text COLLATE "C" NOT NULL,
    token text COLLATE "C" NOT NULL,
    units bigint NOT NULL,
    at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL,
    meta text,
    PRIMARY KEY (key, token)
)"""
LINES_SCHEMA = """
CREATE TABLE IF NOT EXISTS {lines} (
    key text COLLATE "C" PRIMARY KEY,
    line text NOT NULL,
    expires_at timestamptz NOT NULL
)"""
INDEX = "CREATE INDEX IF NOT EXISTS {limits_index} ON {limits} (expires_at)"
HOLDS_INDEX = "CREATE INDEX IF NOT EXISTS {holds_index} ON {holds} (expires_at)"
LINES_INDEX = "CREATE INDEX IF NOT EXISTS {lines_index} ON {lines} (expires_at)"
FIND_TABLES = """SELECT to_regclass(%(l)s) IS NOT NULL AND to_regclass(%(h)s) IS NOT NULL
    AND to_regclass(%(w)s) IS NOT NULL"""
#: The same inside the transaction that creates them, after its advisory lock: read from the
#: catalog with the statement's snapshot (``to_regclass`` may answer from a cache that has not
#: seen a table another session created meanwhile).
FOUND_TABLES = """
SELECT count(*) = 3 FROM pg_catalog.pg_class
WHERE relname IN (%(ln)s, %(hn)s, %(wn)s) AND relnamespace = coalesce(%(schema)s::text,
    current_schema())::regnamespace"""

# A hold counts at ``n.now`` while its row has not run out and, for a rate (``a.period``), its
# start is within the window the take gives.
_LIVE = """l.expires_at > n.now
        AND (a.period IS NULL OR l.at > n.now - a.period * interval '1 second')"""

# The limits of the call: stored key, full key, size, units, period (NULL: concurrency), ord.
_ASKED = """a AS (SELECT s.* FROM unnest(%(keys)s::text[], %(fulls)s::text[],
        %(sizes)s::bigint[], %(units)s::bigint[], %(periods)s::float8[]) WITH ORDINALITY
    AS s(key, full_key, size, units, period, ord))"""

# One transaction: the limits' rows locked in stored-key order (%(locks)s; one missing is
# inserted, expiring as a hold of the take would, %(keeps)s, so that no sweep deletes it while
# the take is under way), and their expired holds deleted. Then, the clock read after the
# locks: the live holds (h), per limit the units of the other tokens and whether the caller has
# a start counted already (r), the first limit without room (f) and, for a rate, when enough of
# its oldest starts leave the window (w). With room everywhere, the caller's holds are written
# (a concurrency hold replaced: its renewal; a rate's start only if it has none counted) and
# each limit's row records the size and period and outlives them. Returns no row when taken,
# else one: the first limit without room, its units used, the seconds until a rate has room.
# The take's statements, shared with ACQUIRE_UNITS: the conditions ``_IF_WHERE`` and ``_IF_``
# (empty in TAKE) keep them from locking anything there when the key cannot be taken.
_TAKE_LOCKS = """
INSERT INTO {limits} AS m (key, full_key, size, expires_at)
SELECT s.key, s.full_key, 0, clock_timestamp() + s.keep * interval '1 second'
FROM unnest(%(locks)s::text[], %(lock_fulls)s::text[], %(keeps)s::float8[]) WITH ORDINALITY
    AS s(key, full_key, keep, o)_IF_WHERE
ORDER BY s.o
ON CONFLICT (key) DO UPDATE SET size = m.size;
DELETE FROM {holds} WHERE _IF_key = ANY(%(locks)s::text[]) AND expires_at <= clock_timestamp();"""
_HELD = f"""
WITH n AS (SELECT clock_timestamp() AS now),
{_ASKED},
h AS (SELECT a.ord, l.token, l.units, l.at FROM a JOIN {{holds}} AS l ON l.key = a.key, n
    WHERE {_LIVE}),
r AS (SELECT a.*,
        (SELECT coalesce(sum(h.units), 0) FROM h
         WHERE h.ord = a.ord AND h.token <> %(token)s)::bigint AS used,
        EXISTS (SELECT FROM h WHERE h.ord = a.ord AND h.token = %(token)s) AS mine
    FROM a)"""
# The first limit without room, and whether the take needs the lines of fair turns (x.slow):
# a line of one of its limits exists, or a take with a turn is refused (it waits in line).
# Then nothing is written: the store takes again reading the lines (TAKE_READ, TAKE_WRITE).
_F = """
f AS (SELECT * FROM r WHERE NOT ((r.period IS NOT NULL AND r.mine) OR r.used + r.units <= r.size)
    ORDER BY r.ord LIMIT 1),"""
_X = """
x AS (SELECT EXISTS (SELECT FROM {lines} AS q JOIN a ON q.key = a.key, n
        WHERE q.expires_at > n.now) OR (%(turned)s AND EXISTS (SELECT FROM f)) AS slow),"""
_TAKE_DECIDE = (
    _HELD
    + ","
    + _F
    + _X
    + """
w AS (SELECT min(x.ends) AS ends FROM f, LATERAL (
        SELECT h.at + f.period * interval '1 second' AS ends,
            sum(h.units) OVER (ORDER BY h.at, h.token) AS run
        FROM h WHERE h.ord = f.ord AND h.token <> %(token)s) AS x
    WHERE f.period IS NOT NULL AND x.run >= f.used + f.units - f.size),
t AS (INSERT INTO {holds} AS l (key, token, units, at, expires_at, meta)
    SELECT r.key, %(token)s, r.units,
        CASE WHEN r.period IS NULL THEN n.now + %(ttl)s::float8 * interval '1 second'
            ELSE n.now END,
        n.now + coalesce(r.period, %(ttl)s::float8) * interval '1 second', %(meta)s
    FROM r, n, x WHERE NOT EXISTS (SELECT FROM f) AND NOT x.slow
        AND NOT (r.period IS NOT NULL AND r.mine)
    ON CONFLICT (key, token) DO UPDATE SET units = EXCLUDED.units, at = EXCLUDED.at,
        expires_at = EXCLUDED.expires_at, meta = EXCLUDED.meta),
u AS (UPDATE {limits} AS m SET full_key = r.full_key, size = r.size, period = r.period,
        expires_at = greatest(m.expires_at,
            n.now + coalesce(r.period, %(ttl)s::float8) * interval '1 second')
    FROM r, n, x WHERE m.key = r.key AND NOT EXISTS (SELECT FROM f) AND NOT x.slow)"""
)
_BEGIN = """
BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL statement_timeout = {ms};
SET LOCAL lock_timeout = {ms};"""
TAKE = (
    _BEGIN
    + _TAKE_LOCKS.replace("_IF_WHERE", "").replace("_IF_", "")
    + _TAKE_DECIDE
    + """
SELECT f.ord, f.used, extract(epoch FROM w.ends - n.now)::float8 FROM f, w, n, x WHERE NOT x.slow
UNION ALL
SELECT 0, 0, NULL FROM x WHERE x.slow;
COMMIT"""
)

# acquire with units (a key that is no holder slot), one transaction. Its locks are taken in
# one order: the key's row, then the limits' rows in stored-key order, then holds; a take
# locks limit rows then holds, a give and a release with units (the key's row first) holds
# only: no two of them wait for each other in a circle. First the key's row is locked
# (inserted free if missing) and judged after that lock, as ACQUIRE judges it: whether the
# caller may take it is kept in a transaction-local setting (``singletask.take``) the other
# statements read. Only then, and only when it may, the take's statements: its limits' rows
# locked, their expired holds deleted, the live ones read and the caller's written when every
# limit has room. With room, the key is taken as ACQUIRE takes it (k), by the clock read after
# the limits' locks. Returns one row: (0, fence, -, marker) taken; (1, ord, used, -, -,
# seconds) as TAKE, a limit without room (nothing written but the key's free row if it had
# none, as a slot's acquisition leaves it); (2, fence, -, token, meta, seconds left) the key
# held by another token (no limit read).
_TAKE_GATE = "current_setting('singletask.take')::bool"
_KEY_GATE = """
INSERT INTO {table} AS l (key, full_key, lease_expires, fence, expires_at)
VALUES (%(key)s, %(full_key)s, clock_timestamp(), 0, clock_timestamp())
ON CONFLICT (key) DO UPDATE SET fence = l.fence
RETURNING set_config('singletask.take', (l.token IS NULL OR l.lease_expires <= clock_timestamp()
    OR l.token = %(token)s OR (%(prefix)s <> '' AND starts_with(l.token, %(prefix)s)))::text,
    true);"""
_GATED_LOCKS = _TAKE_LOCKS.replace("_IF_WHERE", f"\n    WHERE {_TAKE_GATE}").replace(
    "_IF_", f"{_TAKE_GATE} AND "
)
_GATED_ASKED = f"{_ASKED[:-1]}\n    WHERE {_TAKE_GATE})"
_ACQUIRE_END = f""",
k AS (UPDATE {{table}} AS l SET
        fence = CASE WHEN l.token = %(token)s AND l.lease_expires > n.now THEN l.fence
            ELSE greatest(greatest(l.fence, coalesce(l.slot_fence, 0)) + 1,
                (extract(epoch FROM n.now) * 1000000)::bigint) END,
        token = %(token)s, task_id = %(task_id)s, meta = %(key_meta)s,
        lease_expires = n.now + %(ttl)s::float8 * interval '1 second',
        expires_at = greatest(l.expires_at,
            n.now + (%(ttl)s::float8 + %(keep)s::float8) * interval '1 second'),
        full_key = %(full_key)s
    FROM n, x WHERE l.key = %(key)s AND {_TAKE_GATE} AND NOT EXISTS (SELECT FROM f)
        AND NOT x.slow
    RETURNING l.fence, l.done)
SELECT 0, k.fence, NULL::bigint, k.done, NULL::text, NULL::float8 FROM k
UNION ALL
SELECT 1, f.ord, f.used, NULL, NULL, extract(epoch FROM w.ends - n.now)::float8
FROM f, w, n, x WHERE NOT x.slow
UNION ALL
SELECT 2, l.fence, NULL, l.token, l.meta, extract(epoch FROM l.lease_expires - n.now)::float8
FROM {{table}} AS l, n WHERE l.key = %(key)s AND NOT {_TAKE_GATE}
UNION ALL
SELECT 3, 0, NULL, NULL, NULL, NULL FROM x WHERE x.slow;
COMMIT"""
ACQUIRE_UNITS = (
    _BEGIN + _KEY_GATE + _GATED_LOCKS + _TAKE_DECIDE.replace(_ASKED, _GATED_ASKED) + _ACQUIRE_END
)

# Fair turns (:mod:`..lines`): a take that needs the lines (x.slow above) is one transaction
# of two messages. TAKE_READ (ACQUIRE_READ: after the key's row, as ACQUIRE_UNITS) locks the
# limits' rows as TAKE does, then reads per limit (in the call's order) its units used by other
# tokens, whether the caller holds some, the clock (epoch seconds), its line and, for a rate,
# the others' starts oldest first (units, epoch seconds). The store decides in Python; then
# TAKE_WRITE (ACQUIRE_WRITE) writes as TAKE would, by the decision (%(taken)s), writes the
# lines back (%(line_keys)s ...; deleting %(line_drops)s), and commits.
_READ = """
SELECT r.ord, r.used, r.mine, extract(epoch FROM n.now)::float8, q.line,
    (SELECT coalesce(json_agg(json_build_array(h.units, extract(epoch FROM h.at))
        ORDER BY h.at, h.token), '[]'::json)
     FROM h WHERE h.ord = r.ord AND r.period IS NOT NULL AND h.token <> %(token)s)
FROM r CROSS JOIN n LEFT JOIN {lines} AS q ON q.key = r.key AND q.expires_at > n.now
ORDER BY r.ord"""
_LINES_WRITE = """,
ld AS (DELETE FROM {lines} WHERE key = ANY(%(line_drops)s::text[])),
ls AS (INSERT INTO {lines} AS q (key, line, expires_at)
    SELECT s.key, s.line, to_timestamp(s.ends)
    FROM unnest(%(line_keys)s::text[], %(lines)s::text[], %(line_ends)s::float8[])
        AS s(key, line, ends)
    ON CONFLICT (key) DO UPDATE SET line = EXCLUDED.line, expires_at = EXCLUDED.expires_at)"""
_DECIDED = _TAKE_DECIDE.replace(
    _F, "\nf AS (SELECT * FROM r WHERE NOT %(taken)s ORDER BY r.ord LIMIT 1),"
).replace(_X, "\nx AS (SELECT false AS slow),")
TAKE_READ = _BEGIN + _TAKE_LOCKS.replace("_IF_WHERE", "").replace("_IF_", "") + _HELD + _READ
TAKE_WRITE = _DECIDED + _LINES_WRITE + "\nSELECT count(*) FROM f;\nCOMMIT"
ACQUIRE_READ = _BEGIN + _KEY_GATE + _GATED_LOCKS + _HELD.replace(_ASKED, _GATED_ASKED) + _READ
ACQUIRE_WRITE = _DECIDED.replace(_ASKED, _GATED_ASKED) + _LINES_WRITE + _ACQUIRE_END
# A give whose units carry turns: their limits' rows locked as TAKE locks them, their lines read
# (LEAVE_READ: stored key, line, the clock); then LEAVE_WRITE writes the lines back and gives
# the units as GIVE does, in the same transaction.
LEAVE_READ = (
    _BEGIN
    + _TAKE_LOCKS.replace("_IF_WHERE", "").replace("_IF_", "")
    + """
SELECT q.line, extract(epoch FROM clock_timestamp())::float8
FROM unnest(%(keys)s::text[]) WITH ORDINALITY AS s(key, ord)
LEFT JOIN {lines} AS q ON q.key = s.key AND q.expires_at > clock_timestamp()
ORDER BY s.ord"""
)

# One statement: the caller's counting hold of each limit is deleted (a concurrency limit's,
# or a rate's given back as 0 units), or its units set (a rate's start, kept where it is).
# Returns the ord of each limit where the caller had one.
GIVE = f"""
WITH n AS (SELECT clock_timestamp() AS now),
a AS (SELECT s.* FROM unnest(%(keys)s::text[], %(units)s::bigint[], %(periods)s::float8[])
    WITH ORDINALITY AS s(key, units, period, ord)),
d AS (DELETE FROM {{holds}} AS l USING a, n
    WHERE l.key = a.key AND l.token = %(token)s AND (a.period IS NULL OR a.units = 0)
        AND {_LIVE}
    RETURNING a.ord),
c AS (UPDATE {{holds}} AS l SET units = a.units FROM a, n
    WHERE l.key = a.key AND l.token = %(token)s AND a.period IS NOT NULL AND a.units > 0
        AND {_LIVE}
    RETURNING a.ord)
SELECT ord FROM d UNION ALL SELECT ord FROM c"""

# release with units (a key that is no holder slot), one transaction: the key freed if the
# token holds it (RELEASE; its row locked first, as an acquisition locks it), then the token's
# holds of the concurrency limits given back (GIVE), whether it held the key or not. Returns
# whether it freed the key.
RELEASE_UNITS = (
    _BEGIN
    + f"""
WITH r AS ({RELEASE.strip()} RETURNING key) SELECT count(*) FROM r;
{GIVE.strip()};
COMMIT"""
)
LEAVE_WRITE = f"""
WITH n AS (SELECT 1){_LINES_WRITE} SELECT;
{GIVE.strip()};
COMMIT"""

# One page of the live limits under a prefix (p: those with a hold that counts), after the
# last stored key of the page before; per limit, its units used and its last hold's end, and
# its first MAX_SHOWN holds, oldest first. Read-only.
STATE = f"""
WITH p AS (SELECT m.key, coalesce(m.full_key, m.key) AS name, m.size, m.period
    FROM {{limits}} AS m
    WHERE m.key LIKE %(scan)s ESCAPE '!' AND m.key > %(after)s
        AND coalesce(m.full_key, m.key) LIKE %(pattern)s ESCAPE '!'
        AND EXISTS (SELECT FROM {{holds}} AS l
            WHERE l.key = m.key AND l.expires_at > statement_timestamp())
    ORDER BY m.key LIMIT %(limit)s),
h AS (SELECT l.key, l.token, l.units, l.meta, l.expires_at,
        row_number() OVER (PARTITION BY l.key ORDER BY l.at, l.token) AS n,
        sum(l.units) OVER (PARTITION BY l.key) AS used,
        max(l.expires_at) OVER (PARTITION BY l.key) AS last
    FROM {{holds}} AS l JOIN p ON p.key = l.key
    WHERE l.expires_at > statement_timestamp())
SELECT p.key, p.name, p.size, p.period, h.used::bigint,
    extract(epoch FROM h.last - statement_timestamp())::float8,
    h.token, h.units, h.meta, extract(epoch FROM h.expires_at - statement_timestamp())::float8
FROM p JOIN h ON h.key = p.key WHERE h.n <= {MAX_SHOWN} ORDER BY p.key, h.n"""

# A batch of expired rows of each table; rows a take has locked are skipped.
RECLAIM = """
WITH q AS (DELETE FROM {lines} WHERE key IN (
    SELECT key FROM {lines} WHERE expires_at < statement_timestamp()
    ORDER BY expires_at LIMIT %(limit)s FOR UPDATE SKIP LOCKED)),
h AS (DELETE FROM {holds} WHERE (key, token) IN (
    SELECT key, token FROM {holds} WHERE expires_at < statement_timestamp()
    ORDER BY expires_at LIMIT %(limit)s FOR UPDATE SKIP LOCKED))
DELETE FROM {limits} WHERE key IN (
    SELECT key FROM {limits} WHERE expires_at < statement_timestamp()
    ORDER BY expires_at LIMIT %(limit)s FOR UPDATE SKIP LOCKED)"""

#: How many results come before the one ``TAKE`` reads: BEGIN, SET, SET, the locks, the DELETE.
TAKE_SKIPPED = PREAMBLE + 2


def queries(table: str, ms: sql.Composable, pooled: bool) -> dict[str, sql.Composed]:
    """The statements of named limits for the lock table ``table`` (``ms``: the statement
    time limit; ``pooled``: with ``transaction_pooling``, each statement in ``SCRIPT``)."""
    limits, holds = (name.split(".") for name in limit_tables(table))
    lines = line_table(table).split(".")
    fmt = {
        "table": sql.Identifier(*table.split(".")),
        "limits": sql.Identifier(*limits), "holds": sql.Identifier(*holds),
        "lines": sql.Identifier(*lines), "lines_index": sql.Identifier(f"{lines[-1]}_ex"),
        "limits_index": sql.Identifier(f"{limits[-1]}_ex"),
        "holds_index": sql.Identifier(f"{holds[-1]}_ex"),
    }  # fmt: skip
    q = {name: sql.SQL(text).format(**fmt) for name, text in {
        "limits_schema": SCHEMA, "limits_index": INDEX, "holds_schema": HOLDS_SCHEMA,
        "holds_index": HOLDS_INDEX, "lines_schema": LINES_SCHEMA, "lines_index": LINES_INDEX,
    }.items()}  # fmt: skip
    for name, text in {
        "take_units": TAKE, "acquire_units": ACQUIRE_UNITS, "release_units": RELEASE_UNITS,
        "take_read": TAKE_READ, "take_write": TAKE_WRITE, "acquire_read": ACQUIRE_READ,
        "acquire_write": ACQUIRE_WRITE, "leave_read": LEAVE_READ, "leave_write": LEAVE_WRITE,
    }.items():  # fmt: skip
        q[name] = sql.SQL(text).format(ms=ms, **fmt)
    wrap = sql.SQL(SCRIPT if pooled else "{statement}")
    for name, text in {"give_units": GIVE, "limit_state": STATE, "reclaim_units": RECLAIM}.items():
        q[name] = wrap.format(ms=ms, statement=sql.SQL(text).format(**fmt))
    return q


def create_tables(conn: psycopg.Connection[Any], table: str, q: Mapping[str, Any]) -> None:
    """Create the tables of named limits of ``table`` (and their indexes) unless they exist,
    as ``queries.create_table`` creates the lock table: looked up first, then created under the
    same advisory lock."""
    limits, holds = limit_tables(table)
    found = {"l": limits, "h": holds, "w": line_table(table)}
    if conn.execute(FIND_TABLES, found).fetchone() == (True,):
        return
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"singletask:{table}",))
        # Looked up again: another session may have created them meanwhile, and CREATE INDEX
        # IF NOT EXISTS would lock each table in turn (against the takes already using them).
        schema, _, name = table.rpartition(".")
        ln, hn = limit_tables(name)
        args = {"ln": ln, "hn": hn, "wn": line_table(name), "schema": schema or None}
        if conn.execute(FOUND_TABLES, args).fetchone() == (True,):
            return
        for name in (
            "limits_schema",
            "limits_index",
            "holds_schema",
            "holds_index",
            "lines_schema",
            "lines_index",
        ):
            conn.execute(q[name])


class PostgresUnits(SQLUnits):
    """``take_units`` and ``give_units`` of :class:`~.store.PostgresBackend`."""

    if TYPE_CHECKING:  # the store's own

        def _run(
            self, operation: str, key: str, name: str, args: Mapping[str, Any],
            read: Callable[[psycopg.Cursor[Any]], T], *, writes: bool = True,
            units: bool = False, both: bool = False,
        ) -> T: ...  # fmt: skip

        def _keys(self, key: str) -> dict[str, str | None]: ...

        def _script(
            self, conn: psycopg.Connection[Any], name: str, args: Mapping[str, Any]
        ) -> psycopg.Cursor[Any]: ...

    def _limit_key(self, key: str) -> tuple[str, str | None]:
        if "\x00" in key:
            raise LockKeyError(f"limit {key!r}: PostgreSQL text cannot hold a NUL character")
        return core.stored_key(key, self._key_bytes)

    def _take(
        self, token: str, ttl: float, limits: list[Limit], meta: Mapping[str, str] | None,
        what: str,
    ) -> tuple[int, int, float | None] | None:  # fmt: skip
        args = self._take_args(token, ttl, limits, meta)
        row = self._run("take_units", what, "take_units", args, lambda c: c.fetchone(), units=True)
        if row is None or int(row[0]) > 0:
            return None if row is None else (int(row[0]), int(row[1]), row[2])
        refused, _ = self._run(
            "take_units", what, "take_read", args,
            lambda c: self._in_turn(c, "take_write", args, limits, meta), units=True,
        )  # fmt: skip
        return refused

    def _in_turn(
        self, cursor: psycopg.Cursor[Any], write: str, args: dict[str, Any], limits: list[Limit],
        meta: Mapping[str, str] | None,
    ) -> tuple[tuple[int, int, float | None] | None, Any]:  # fmt: skip
        """A take with the lines of fair turns, between its two messages: ``cursor`` on the
        rows of ``TAKE_READ`` (none: the key of an acquire is held), decided by
        :func:`..lines.decide`, then ``write`` sent. Returns the refusal and ``write``'s row."""
        rows = cursor.fetchall()
        decision = Decision(None, [])
        if rows:
            now = float(rows[0][3])
            seen = [
                Seen(int(used), bool(mine), load(line, now),
                     [(int(units), float(at)) for units, at in starts or ()])
                for _, used, mine, _, line, starts in rows
            ]  # fmt: skip
            decision = decide([limit.item for limit in limits], seen, now, meta)
        written = {**args, "taken": decision.refusal is None,
                   **self._line_args(limits, decision.lines)}  # fmt: skip
        return decision.refusal, self._script(cursor.connection, write, written).fetchone()

    @staticmethod
    def _line_args(limits: list[Limit], lines: list[tuple[int, Line]]) -> dict[str, Any]:
        """The arguments that write ``lines`` back (``(ord, line)``; empty: deleted)."""
        kept = [(limits[n - 1].key, *dump(line)) for n, line in lines if line]
        return {
            "line_drops": [limits[n - 1].key for n, line in lines if not line],
            "line_keys": [key for key, _, _ in kept], "lines": [text for _, text, _ in kept],
            "line_ends": [ends for _, _, ends in kept],
        }  # fmt: skip

    def _take_args(
        self, token: str, ttl: float, limits: list[Limit], meta: Mapping[str, str] | None
    ) -> dict[str, Any]:
        """The arguments of ``TAKE``'s statements (``meta``: kept with each hold)."""
        locks = sorted(limits, key=lambda limit: limit.key.encode())
        return {
            "token": token, "ttl": ttl, "meta": core.dump_meta(meta)[0],
            "turned": any(limit.turn is not None for limit in limits),
            "locks": [limit.key for limit in locks],
            "lock_fulls": [limit.full_key for limit in locks],
            "keeps": [ttl if limit.period is None else limit.period for limit in locks],
            "keys": [limit.key for limit in limits],
            "fulls": [limit.full_key for limit in limits],
            "sizes": [limit.size for limit in limits],
            "units": [limit.units for limit in limits],
            "periods": [limit.period for limit in limits],
        }  # fmt: skip

    def _acquire_units(
        self, key: str, token: str, ttl: float, meta: Mapping[str, str] | None,
        takeover_prefix: str | None, limits: list[Limit], what: str,
    ) -> AcquireResult | tuple[int, int, float | None]:  # fmt: skip
        """One transaction: ``ACQUIRE_UNITS``."""
        stored, task_id = core.dump_meta(meta)
        args = self._take_args(token, ttl, limits, units_meta(meta))
        args.update(
            self._keys(key), task_id=task_id, key_meta=stored, keep=core.FENCE_RETENTION,
            prefix=takeover_prefix or "",
        )  # fmt: skip
        row = self._run("acquire", key, "acquire_units", args, lambda c: c.fetchone(), both=True)
        assert row is not None  # one of the four outcomes
        if row[0] == 3:  # the lines of fair turns are needed
            tickets = units_meta(meta)
            refused, row = self._run(
                "acquire", key, "acquire_read", args,
                lambda c: self._in_turn(c, "acquire_write", args, limits, tickets), both=True,
            )  # fmt: skip
            if refused is not None:
                return refused
        outcome, number, used, text, meta_text, seconds = row
        if outcome == 0:
            return AcquireResult(True, fence=number, completed=text)
        if outcome == 1:
            return int(number), int(used), seconds
        return AcquireResult(False, core.load_holder(text, meta_text, seconds, number))

    def _release_units(
        self, key: str, token: str, completed: str | None, held: list[Units]
    ) -> bool:
        """One transaction: ``RELEASE_UNITS`` (``held``: concurrency limits, checked)."""
        limits = self._limits(held)
        args = {
            **self._keys(key), "token": token, "done": completed,
            "keys": [limit.key for limit in limits], "units": [limit.units for limit in limits],
            "periods": [None for _ in limits],
        }  # fmt: skip
        row = self._run("release", key, "release_units", args, lambda c: c.fetchone(), both=True)
        return bool(row and row[0])

    def _give(self, token: str, limits: list[Limit], what: str) -> set[int]:
        args = {
            "token": token, "keys": [limit.key for limit in limits],
            "units": [limit.units for limit in limits],
            "periods": [limit.period for limit in limits],
        }  # fmt: skip
        if any(limit.turn is not None for limit in limits):  # their tickets leave the lines
            args.update(self._take_args(token, 1.0, limits, None))
            args["units"] = [limit.units for limit in limits]
            rows = self._run(
                "give_units", what, "leave_read", args,
                lambda c: self._leave(c, args, limits), units=True,
            )  # fmt: skip
        else:
            rows = self._run(
                "give_units", what, "give_units", args, lambda c: c.fetchall(), units=True
            )  # fmt: skip
        return {int(row[0]) for row in rows}

    def _leave(
        self, cursor: psycopg.Cursor[Any], args: dict[str, Any], limits: list[Limit]
    ) -> list[Any]:
        """A give with turns between its two messages: ``cursor`` on ``LEAVE_READ``'s rows."""
        rows = cursor.fetchall()
        now = float(rows[0][1])
        changed = leave([limit.item for limit in limits], [load(row[0], now) for row in rows])
        written = {**args, **self._line_args(limits, changed)}
        return self._script(cursor.connection, "leave_write", written).fetchall()
