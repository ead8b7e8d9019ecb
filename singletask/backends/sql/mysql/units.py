"""Named limits in the MySQL / MariaDB lock store (:mod:`singletask.backends.sql.mysql`): their
tables and SQL. The layout, and how a take stays one atomic step, are in :mod:`..units`.

A take or a give is one transaction, a script sent as one request (as the store's slot
acquisition): its limits are a derived table of one ``SELECT`` per limit (``ITEM``, joined
with ``UNION ALL``), and a take locks their rows (one multi-row upsert, in stored-key order)
before it reads the clock into ``@st_now``. The reads use window functions (``SUM() OVER``,
``ROW_NUMBER()``): named limits need MySQL 8.0+ or MariaDB 10.2+.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pymysql

from ...base import AcquireResult, Units, units_meta
from ...holders import MAX_SHOWN
from ...turns import Line
from .. import core
from ..lines import Seen, decide, dump, leave, line_table, load
from ..units import Limit, SQLUnits, limit_tables
from .queries import CLOCK_US, RELEASE, as_text, run_script

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import TypeVar

    T = TypeVar("T")

__all__ = ["MySQLUnits", "create_tables", "queries"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS {limits} (
    `key` VARBINARY(1024) NOT NULL PRIMARY KEY,
    full_key MEDIUMBLOB NULL,
    size BIGINT NOT NULL,
    period_us BIGINT NULL,
    expires_at DATETIME(6) NOT NULL,
    INDEX {limits_index} (expires_at)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4;
CREATE TABLE IF NOT EXISTS {holds} (
    `key` VARBINARY(1024) NOT NULL,
    token VARBINARY(255) NOT NULL,
    units BIGINT NOT NULL,
    `at` DATETIME(6) NOT NULL,
    expires_at DATETIME(6) NOT NULL,
    meta TEXT NULL,
    PRIMARY KEY (`key`, token),
    INDEX {holds_index} (expires_at)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4;
CREATE TABLE IF NOT EXISTS {lines} (
    `key` VARBINARY(1024) NOT NULL PRIMARY KEY,
    line MEDIUMTEXT NOT NULL,
    expires_at DATETIME(6) NOT NULL,
    INDEX {lines_index} (expires_at)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"""

#: How many of the three tables exist.
FIND_TABLES = (
    "SELECT count(*) FROM information_schema.tables "
    "WHERE table_schema = COALESCE(%s, DATABASE()) AND table_name IN (%s, %s, %s)"
)

#: One limit of the call's derived table ``c``: stored key, full key, size, units, period in
#: microseconds (NULL: concurrency) and its place in the call.
ITEM = (
    "SELECT CAST(%(k{n})s AS BINARY) AS k, CAST(%(f{n})s AS BINARY) AS f, "
    "CAST(%(s{n})s AS SIGNED) AS size, CAST(%(u{n})s AS SIGNED) AS u, "
    "CAST(%(p{n})s AS SIGNED) AS p, {n} AS ord"
)

# The templates below name the tables ``{limits}`` and ``{holds}`` (replaced once, by
# :func:`queries`) and the call's limits ``{n}``, ``{items}`` or ``{locks}`` (formatted at each
# call). Every statement that writes finds its rows by primary key (one row, or one limit's
# holds): InnoDB then locks no row of another limit, nor through the index on ``expires_at``
# (whose neighbouring entries a take under way may hold), whatever a sweep or take is doing.

# A hold ``h`` of the limit ``c`` counts at @st_now while its row has not run out and, for a
# rate, its start is within the window the call gives.
_LIVE = "h.expires_at > @st_now AND (c.p IS NULL OR h.`at` > @st_now - INTERVAL c.p MICROSECOND)"

# A take is one transaction: TAKE_BEGIN, SWEEP per limit, TAKE_DECIDE, HOLD (concurrency) or
# START (rate) and SIZE per limit, TAKE_END; the limits in stored-key order. The limits' rows
# are locked first ({locks}: LOCK per limit, inserted if missing), then the clock read, and
# their expired holds deleted (the expiry read through an expression: its index is not used).
# The first limit without room (by its place in the call) is read into @st_ord, with its units
# used by other tokens (@st_used) and, for a rate, the microseconds until enough of its oldest
# starts leave the window (@st_wait); a rate counts nothing more for a token with a start
# counted already. Only with room everywhere are the caller's holds written (a concurrency
# hold replaced: its renewal; a rate's start only if it has none counted) and each limit's row
# given the size and period, and made to outlive them.
TAKE_BEGIN = """
START TRANSACTION;
INSERT INTO {limits} (`key`, full_key, size, expires_at) VALUES {locks}
ON DUPLICATE KEY UPDATE `key` = `key`;
SET @st_now = UTC_TIMESTAMP(6), @st_ord = NULL, @st_used = NULL, @st_need = NULL,
    @st_wait = NULL;"""
#: A limit's row as the take's lock inserts it when missing: expiring as a hold of the take
#: would (``e``), so that no sweep deletes it while the take is under way.
LOCK = "(%(k{n})s, %(f{n})s, 0, UTC_TIMESTAMP(6) + INTERVAL %(e{n})s MICROSECOND)"
SWEEP = """
DELETE FROM {holds} WHERE `key` = %(k{n})s AND expires_at + INTERVAL 0 MICROSECOND <= @st_now;"""
# Fair turns (:mod:`..lines`): when a line of one of the limits exists, or a take with a turn
# (%(turned)s) is refused, @st_ord is -1 and nothing is written: the store takes again in a
# transaction of two requests, TAKE_BEGIN, SWEEP and READ, then, decided in Python, DECIDED,
# HOLD or START and SIZE, LINE_SET or LINE_DROP per line, TAKE_END (acquire: as ACQUIRE_*).
TAKE_DECIDE = """
SELECT IF(r.slow, -1, r.ord), r.used, r.used + r.u - r.size INTO @st_ord, @st_used, @st_need
FROM (SELECT g.*, MAX(g.lined) OVER () OR (%(turned)s AND MAX(g.refused) OVER ()) AS slow
    FROM (SELECT b.*, NOT ((b.p IS NOT NULL AND b.mine) OR b.used + b.u <= b.size) AS refused
        FROM (SELECT c.ord, c.size, c.u, c.p,
                COALESCE(SUM(IF(h.token = %(token)s, 0, h.units)), 0) AS used,
                COALESCE(MAX(h.token = %(token)s), 0) AS mine,
                EXISTS (SELECT 1 FROM {lines} AS q
                    WHERE q.`key` = c.k AND q.expires_at > @st_now) AS lined
            FROM ({items}) AS c LEFT JOIN {holds} AS h ON h.`key` = c.k AND _LIVE
            GROUP BY c.ord, c.size, c.u, c.p, c.k) AS b) AS g) AS r
WHERE r.refused OR r.slow
ORDER BY r.refused DESC, r.ord LIMIT 1;
SELECT MIN(x.ends) INTO @st_wait FROM (
    SELECT TIMESTAMPDIFF(MICROSECOND, @st_now, h.`at` + INTERVAL c.p MICROSECOND) AS ends,
        SUM(h.units) OVER (ORDER BY h.`at`, h.token) AS run
    FROM ({items}) AS c JOIN {holds} AS h ON h.`key` = c.k AND _LIVE
    WHERE c.ord = @st_ord AND c.p IS NOT NULL AND h.token <> %(token)s) AS x
WHERE x.run >= @st_need;""".replace("_LIVE", _LIVE)
# Per limit in the call's order: units used by others, whether the caller holds some, the
# clock and its line; then the rates' starts of other tokens, oldest first.
READ = """
SELECT c.ord, COALESCE(SUM(IF(h.token = %(token)s, 0, h.units)), 0),
    COALESCE(MAX(h.token = %(token)s), 0), TIMESTAMPDIFF(MICROSECOND, _EPOCH, @st_now),
    (SELECT q.line FROM {lines} AS q WHERE q.`key` = c.k AND q.expires_at > @st_now)
FROM ({items}) AS c LEFT JOIN {holds} AS h ON h.`key` = c.k AND _LIVE
GROUP BY c.ord, c.k ORDER BY c.ord;
SELECT c.ord, h.units, TIMESTAMPDIFF(MICROSECOND, _EPOCH, h.`at`)
FROM ({items}) AS c JOIN {holds} AS h ON h.`key` = c.k AND _LIVE
WHERE c.p IS NOT NULL AND h.token <> %(token)s ORDER BY c.ord, h.`at`, h.token;""".replace(
    "_LIVE", _LIVE
).replace("_EPOCH", "TIMESTAMP'1970-01-01 00:00:00'")
DECIDED = """
SET @st_ord = %(decided)s;"""
LINE_SET = """
INSERT INTO {lines} (`key`, line, expires_at)
VALUES (%(lk{n})s, %(lt{n})s, TIMESTAMP'1970-01-01 00:00:00' + INTERVAL %(le{n})s MICROSECOND)
ON DUPLICATE KEY UPDATE line = VALUES(line), expires_at = VALUES(expires_at);"""
LINE_DROP = """
DELETE FROM {lines} WHERE `key` = %(lk{n})s;"""
# A give with turns: TAKE_BEGIN locks its limits' rows; LEAVE_READ reads their lines; then,
# in the second request, LINE_SET or LINE_DROP, GIVE_NOW, GIVE per limit, COMMIT.
LEAVE_READ = """
SELECT (SELECT q.line FROM {lines} AS q WHERE q.`key` = c.k AND q.expires_at > @st_now),
    TIMESTAMPDIFF(MICROSECOND, TIMESTAMP'1970-01-01 00:00:00', @st_now)
FROM ({items}) AS c ORDER BY c.ord;"""
GIVE_NOW = """
SET @st_now = UTC_TIMESTAMP(6);"""
HOLD = """
INSERT INTO {holds} (`key`, token, units, `at`, expires_at, meta)
SELECT %(k{n})s, %(token)s, %(u{n})s, @st_now + INTERVAL %(lease_us)s MICROSECOND,
    @st_now + INTERVAL %(lease_us)s MICROSECOND, %(meta)s
FROM DUAL WHERE @st_ord IS NULL
ON DUPLICATE KEY UPDATE units = VALUES(units), meta = VALUES(meta),
    expires_at = VALUES(expires_at), `at` = VALUES(`at`);"""
# The caller's start that START's upsert meets (its expired rows deleted already) is replaced
# only if it stopped counting in the window the take gives (_GONE, which reads ``at`` before
# it is assigned, last).
START = """
INSERT INTO {holds} (`key`, token, units, `at`, expires_at, meta)
SELECT %(k{n})s, %(token)s, %(u{n})s, @st_now, @st_now + INTERVAL %(p{n})s MICROSECOND,
    %(meta)s
FROM DUAL WHERE @st_ord IS NULL
ON DUPLICATE KEY UPDATE units = IF(_GONE, VALUES(units), units),
    meta = IF(_GONE, VALUES(meta), meta),
    expires_at = IF(_GONE, VALUES(expires_at), expires_at),
    `at` = IF(_GONE, VALUES(`at`), `at`);""".replace(
    "_GONE", "`at` <= @st_now - INTERVAL %(p{n})s MICROSECOND"
)
SIZE = """
UPDATE {limits} SET full_key = %(f{n})s, size = %(s{n})s, period_us = %(p{n})s,
    expires_at = GREATEST(expires_at, @st_now + INTERVAL %(e{n})s MICROSECOND)
WHERE `key` = %(k{n})s AND @st_ord IS NULL;"""
TAKE_END = """
SELECT @st_ord, @st_used, @st_wait;
COMMIT"""

# acquire with units (a key that is no holder slot) is one transaction, its locks in one order:
# the key's row, then the limits' rows in stored-key order, then holds (a take locks limit rows
# then holds, a give and a release with units, the key's row first, holds only): none waits
# for another in a circle. ACQUIRE_BEGIN locks the key's row (inserted free if missing), reads
# the clock, and judges it as ACQUIRE does (@st_take: free, expired, the caller's, or a holder
# with the takeover prefix). Then the take as TAKE_BEGIN ... SIZE, its limits' rows locked
# (ACQUIRE_LOCKS, {locks}: LOCK_ITEM per limit in stored-key order) and swept (SWEEP_IF), its
# decision read from its limits ({items}) and SIZE_IF, each only when @st_take (through a
# derived table that is empty otherwise: no row of a limit is read nor locked when the key is
# held); @st_ord is 0 when not, so that HOLD and START write nothing either. ACQUIRE_END takes
# the key as ACQUIRE does when every limit had room, by the clock read after their locks, and
# returns @st_ord, @st_used, @st_wait (0: the key held; else as TAKE_END) and the key's row.
ACQUIRE_BEGIN = """
START TRANSACTION;
INSERT INTO {table} (`key`, full_key, lease_expires, fence, expires_at)
VALUES (%(key)s, %(full_key)s, UTC_TIMESTAMP(6), 0, UTC_TIMESTAMP(6))
ON DUPLICATE KEY UPDATE `key` = `key`;
SET @st_now = UTC_TIMESTAMP(6);
SET @st_take = COALESCE((SELECT token IS NULL OR lease_expires <= @st_now OR token = %(token)s
    OR (%(prefix)s <> '' AND LEFT(token, LENGTH(%(prefix)s)) = %(prefix)s)
    FROM {table} WHERE `key` = %(key)s), 0);"""
ACQUIRE_LOCKS = """
INSERT INTO {limits} (`key`, full_key, size, expires_at)
SELECT c.k, c.f, 0, UTC_TIMESTAMP(6) + INTERVAL c.e MICROSECOND FROM ({locks}) AS c
WHERE @st_take ORDER BY c.o
ON DUPLICATE KEY UPDATE `key` = `key`;
SET @st_now = UTC_TIMESTAMP(6), @st_ord = IF(@st_take, NULL, 0), @st_used = NULL,
    @st_need = NULL, @st_wait = NULL;"""
LOCK_ITEM = (
    "SELECT CAST(%(k{n})s AS BINARY) AS k, CAST(%(f{n})s AS BINARY) AS f, "
    "CAST(%(e{n})s AS SIGNED) AS e, {o} AS o"
)
SWEEP_IF = """
DELETE h FROM {holds} AS h
    JOIN (SELECT CAST(%(k{n})s AS BINARY) AS k FROM DUAL WHERE @st_take) AS c ON h.`key` = c.k
WHERE h.expires_at + INTERVAL 0 MICROSECOND <= @st_now;"""
#: The call's limits of TAKE_DECIDE, none unless the key may be taken.
ITEMS_IF = "SELECT * FROM ({items}) AS g WHERE @st_take"
SIZE_IF = """
UPDATE {limits} AS m
    JOIN (SELECT CAST(%(k{n})s AS BINARY) AS k FROM DUAL WHERE @st_ord IS NULL) AS c
    ON m.`key` = c.k
SET m.full_key = %(f{n})s, m.size = %(s{n})s, m.period_us = %(p{n})s,
    m.expires_at = GREATEST(m.expires_at, @st_now + INTERVAL %(e{n})s MICROSECOND);"""
ACQUIRE_END = f"""
UPDATE {{table}} SET
    fence = IF(token <=> %(token)s AND lease_expires > @st_now, fence,
               GREATEST(GREATEST(fence, COALESCE(slot_fence, 0)) + 1, {CLOCK_US})),
    task_id = %(task_id)s,
    meta = %(key_meta)s,
    full_key = %(full_key)s,
    expires_at = GREATEST(expires_at, @st_now + INTERVAL %(row_us)s MICROSECOND),
    lease_expires = @st_now + INTERVAL %(lease_us)s MICROSECOND,
    token = %(token)s
WHERE `key` = %(key)s AND @st_ord IS NULL;
SELECT @st_ord, @st_used, @st_wait;
SELECT token, meta, fence, done, TIMESTAMPDIFF(MICROSECOND, @st_now, lease_expires)
FROM {{table}} WHERE `key` = %(key)s;
COMMIT"""

# release with units (a key that is no holder slot) is one transaction: the key freed if the
# token holds it (RELEASE: its row locked first, as an acquisition locks it) and how many rows
# that freed, then the clock read and the token's holds of the concurrency limits given back
# (GIVE per limit in stored-key order), whether it held the key or not; then RELEASE_END.
RELEASE_BEGIN = f"""
START TRANSACTION;
{RELEASE.strip()};
SELECT ROW_COUNT();
SET @st_now = UTC_TIMESTAMP(6);"""
RELEASE_END = """
COMMIT"""

# A give is one transaction: GIVE_BEGIN, GIVE per limit in stored-key order, COMMIT: the
# caller's counting hold of the limit is locked and returned (its place in the call), then
# deleted (a concurrency limit's, or a rate's given back as 0 units) or given its units (a
# rate's start, kept where it is).
GIVE_BEGIN = """
START TRANSACTION;
SET @st_now = UTC_TIMESTAMP(6);"""
GIVE = """
SELECT {n} FROM {holds} WHERE _MINE FOR UPDATE;
DELETE FROM {holds} WHERE _MINE AND (%(p{n})s IS NULL OR %(u{n})s = 0);
UPDATE {holds} SET units = %(u{n})s WHERE _MINE AND %(p{n})s IS NOT NULL AND %(u{n})s > 0;
""".replace(
    "_MINE",
    "`key` = %(k{n})s AND token = %(token)s AND expires_at > @st_now "
    "AND (%(p{n})s IS NULL OR `at` > @st_now - INTERVAL %(p{n})s MICROSECOND)",
)

# One page of the live limits under a prefix (p: those with a hold that counts), after the
# last stored key of the page before; per limit, its units used and its last hold's end, and
# its first MAX_SHOWN holds, oldest first. Read-only, one statement (one clock).
STATE = """
WITH p AS (SELECT m.`key`, COALESCE(m.full_key, m.`key`) AS name, m.size, m.period_us
    FROM {limits} AS m
    WHERE m.`key` LIKE %(scan)s ESCAPE '!' AND m.`key` > %(after)s
        AND COALESCE(m.full_key, m.`key`) LIKE %(pattern)s ESCAPE '!'
        AND EXISTS (SELECT 1 FROM {holds} AS l
            WHERE l.`key` = m.`key` AND l.expires_at > UTC_TIMESTAMP(6))
    ORDER BY m.`key` LIMIT %(limit)s),
h AS (SELECT l.`key`, l.token, l.units, l.meta, l.expires_at,
        ROW_NUMBER() OVER (PARTITION BY l.`key` ORDER BY l.`at`, l.token) AS n,
        SUM(l.units) OVER (PARTITION BY l.`key`) AS used,
        MAX(l.expires_at) OVER (PARTITION BY l.`key`) AS last
    FROM {holds} AS l JOIN p ON p.`key` = l.`key`
    WHERE l.expires_at > UTC_TIMESTAMP(6))
SELECT p.`key`, p.name, p.size, p.period_us / 1000000, h.used,
    TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), h.last) / 1000000,
    h.token, h.units, h.meta,
    TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), h.expires_at) / 1000000
FROM p JOIN h ON h.`key` = p.`key` WHERE h.n <= MAX_SHOWN ORDER BY p.`key`, h.n""".replace(
    "MAX_SHOWN", str(MAX_SHOWN)
)

# The sweep: a batch of expired rows of each table, read first (a consistent read: it locks
# nothing), then deleted by primary key if still expired: RECLAIM_HOLDS per limit ({tokens}
# its expired holds), RECLAIM_LIMITS.
EXPIRED = """
SELECT `key`, token FROM {holds} WHERE expires_at < UTC_TIMESTAMP(6)
ORDER BY expires_at LIMIT %(limit)s;
SELECT `key` FROM {limits} WHERE expires_at < UTC_TIMESTAMP(6)
ORDER BY expires_at LIMIT %(limit)s;
SELECT `key` FROM {lines} WHERE expires_at < UTC_TIMESTAMP(6)
ORDER BY expires_at LIMIT %(limit)s"""
RECLAIM_HOLDS = """
DELETE FROM {holds} WHERE `key` = %(k{n})s AND token IN %(t{n})s
    AND expires_at + INTERVAL 0 MICROSECOND < UTC_TIMESTAMP(6);"""
RECLAIM_LINES = """
DELETE FROM {lines} WHERE `key` IN %(lines)s
    AND expires_at + INTERVAL 0 MICROSECOND < UTC_TIMESTAMP(6);"""
RECLAIM_LIMITS = """
DELETE FROM {limits} WHERE `key` IN %(limits)s
    AND expires_at + INTERVAL 0 MICROSECOND < UTC_TIMESTAMP(6);"""


def queries(table: str) -> dict[str, str]:
    """The statements of named limits for the lock table ``table``, their tables named."""
    limits, holds = (name.split(".") for name in limit_tables(table))
    lines = line_table(table).split(".")
    names = {
        "{lines}": ".".join(f"`{part}`" for part in lines), "{lines_index}": f"`{lines[-1]}_ex`",
        "{table}": ".".join(f"`{part}`" for part in table.split(".")),
        "{limits}": ".".join(f"`{part}`" for part in limits),
        "{holds}": ".".join(f"`{part}`" for part in holds),
        "{limits_index}": f"`{limits[-1]}_ex`", "{holds_index}": f"`{holds[-1]}_ex`",
    }  # fmt: skip
    found = {}
    for name, text in {
        "limits_schema": SCHEMA, "take_begin": TAKE_BEGIN, "sweep": SWEEP,
        "take_decide": TAKE_DECIDE, "hold": HOLD, "start": START, "size": SIZE,
        "take_end": TAKE_END, "give_begin": GIVE_BEGIN, "give": GIVE, "limit_state": STATE,
        "expired": EXPIRED, "reclaim_holds": RECLAIM_HOLDS, "reclaim_limits": RECLAIM_LIMITS,
        "acquire_begin": ACQUIRE_BEGIN, "acquire_locks": ACQUIRE_LOCKS, "sweep_if": SWEEP_IF,
        "size_if": SIZE_IF, "acquire_end": ACQUIRE_END, "release_begin": RELEASE_BEGIN,
        "read": READ, "line_set": LINE_SET, "line_drop": LINE_DROP, "leave_read": LEAVE_READ,
        "reclaim_lines": RECLAIM_LINES,
    }.items():  # fmt: skip
        for mark, value in names.items():
            text = text.replace(mark, value)
        found[name] = text
    return found


def create_tables(cursor: pymysql.cursors.Cursor, table: str, create: str) -> None:
    """Create the tables of named limits of ``table`` with the statements ``create`` unless
    both exist (looked up first, as ``queries.create_table`` does for the lock table)."""
    schema, _, name = table.rpartition(".")
    cursor.execute(FIND_TABLES, (schema or None, *limit_tables(name), line_table(name)))
    row = cursor.fetchone()
    if row is None or int(row[0]) < 3:
        run_script(cursor, create, {})


def reclaim(cursor: pymysql.cursors.Cursor, q: Mapping[str, str], limit: int) -> None:
    """Delete a batch of expired rows of the limits' tables (``q``: :func:`queries`): two
    requests, the first of which only reads."""
    holds, limits, lines = run_script(cursor, q["expired"], {"limit": limit})
    tokens: dict[bytes, list[bytes]] = {}
    for key, token in holds:
        tokens.setdefault(key, []).append(token)
    args: dict[str, Any] = {}
    text = []
    for n, key in enumerate(sorted(tokens), 1):
        args[f"k{n}"], args[f"t{n}"] = key, tokens[key]
        text.append(q["reclaim_holds"].format(n=n))
    if limits:
        args["limits"] = [row[0] for row in limits]
        text.append(q["reclaim_limits"])
    if lines:
        args["lines"] = [row[0] for row in lines]
        text.append(q["reclaim_lines"])
    if text:
        run_script(cursor, "".join(text), args)


def _us(seconds: float) -> int:
    return max(1, round(seconds * 1_000_000))


class MySQLUnits(SQLUnits):
    """``take_units`` and ``give_units`` of :class:`~.store.MySQLBackend`."""

    _q: dict[str, str]

    if TYPE_CHECKING:  # the store's own

        def _run(
            self, operation: str, key: str, work: Callable[[pymysql.cursors.Cursor], T],
            *, writes: bool = True, units: bool = False, both: bool = False,
        ) -> T: ...  # fmt: skip

    @staticmethod
    def _args(limits: list[Limit], args: dict[str, Any]) -> list[Limit]:
        """Put the arguments of ``limits`` in ``args``; return them in stored-key order."""
        for limit in limits:
            n = limit.ord
            args[f"k{n}"], args[f"f{n}"] = limit.key, limit.full_key
            args[f"s{n}"], args[f"u{n}"] = limit.size, limit.units
            args[f"p{n}"] = None if limit.period is None else _us(limit.period)
        return sorted(limits, key=lambda limit: limit.key.encode())

    def _take(
        self, token: str, ttl: float, limits: list[Limit], meta: Mapping[str, str] | None,
        what: str,
    ) -> tuple[int, int, float | None] | None:  # fmt: skip
        q = self._q
        args: dict[str, Any] = {
            "token": token, "lease_us": _us(ttl), "meta": core.dump_meta(meta)[0],
            "turned": any(limit.turn is not None for limit in limits),
        }  # fmt: skip
        ordered = self._args(limits, args)
        for limit in limits:
            args[f"e{limit.ord}"] = _us(ttl if limit.period is None else limit.period)
        head = [q["take_begin"].format(locks=", ".join(LOCK.format(n=x.ord) for x in ordered))]
        head += [q["sweep"].format(n=limit.ord) for limit in ordered]
        items = " UNION ALL ".join(ITEM.format(n=limit.ord) for limit in limits)
        writes = []
        for limit in ordered:
            writes.append(q["hold" if limit.period is None else "start"].format(n=limit.ord))
            writes.append(q["size"].format(n=limit.ord))
        script = "".join([*head, q["take_decide"].format(items=items), *writes, q["take_end"]])
        results = self._run("take_units", what, lambda c: run_script(c, script, args), units=True)
        ord_, used, wait_us = results[-2][0]
        if ord_ is not None and int(ord_) < 0:  # the lines of fair turns are needed
            read = "".join([*head, q["read"].format(items=items)])
            refused, _ = self._run(
                "take_units", what,
                lambda c: self._in_turn(c, read, writes, q["take_end"], args, limits, meta),
                units=True,
            )  # fmt: skip
            return refused
        if ord_ is None:
            return None
        return int(ord_), int(used), None if wait_us is None else int(wait_us) / 1e6

    def _in_turn(
        self, cursor: pymysql.cursors.Cursor, read: str, writes: list[str], end: str,
        args: dict[str, Any], limits: list[Limit], meta: Mapping[str, str] | None,
    ) -> tuple[tuple[int, int, float | None] | None, list[Any]]:  # fmt: skip
        """A take with the lines of fair turns: ``read`` (no rows: an acquire's key is held),
        decided by :func:`..lines.decide`, then ``writes`` by the decision, the lines, ``end``
        (one transaction, two requests). Returns the refusal and ``end``'s results."""
        results = run_script(cursor, read, args)
        rows, found = results[-2], results[-1]
        decided: int | None = 0
        refused, text = None, []
        if rows:
            now = int(rows[0][3]) / 1e6
            starts: dict[int, list[tuple[int, float]]] = {}
            for n, units, at in found:
                starts.setdefault(int(n), []).append((int(units), int(at) / 1e6))
            seen = [
                Seen(int(used), bool(int(mine)), load(line, now), starts.get(int(n), []))
                for n, used, mine, _, line in rows
            ]
            decision = decide([limit.item for limit in limits], seen, now, meta)
            refused = decision.refusal
            decided = None if refused is None else refused[0]
            text = self._line_writes(decision.lines, limits, args)
        script = "".join([DECIDED, *writes, *text, end])
        return refused, run_script(cursor, script, {**args, "decided": decided})

    def _line_writes(
        self, lines: list[tuple[int, Line]], limits: list[Limit], args: dict[str, Any]
    ) -> list[str]:
        """The statements that write ``lines`` back (``(ord, line)``; empty: deleted), their
        arguments put in ``args``."""
        text = []
        for n, line in lines:
            args[f"lk{n}"] = limits[n - 1].key
            if line:
                args[f"lt{n}"], ends = dump(line)
                args[f"le{n}"] = max(0, round(ends * 1_000_000))
            text.append(self._q["line_set" if line else "line_drop"].format(n=n))
        return text

    def _acquire_units(
        self, key: str, token: str, ttl: float, meta: Mapping[str, str] | None,
        takeover_prefix: str | None, limits: list[Limit], what: str,
    ) -> AcquireResult | tuple[int, int, float | None]:  # fmt: skip
        """One transaction: ``ACQUIRE_BEGIN``, the take's statements (each only when the key
        may be taken), ``ACQUIRE_END``."""
        q = self._q
        stored, task_id = core.dump_meta(meta)
        full = core.stored_key(key, self._key_bytes)
        args: dict[str, Any] = {
            "token": token, "lease_us": _us(ttl), "meta": core.dump_meta(units_meta(meta))[0],
            "key": full[0], "full_key": full[1], "task_id": task_id, "key_meta": stored,
            "row_us": _us(ttl + core.FENCE_RETENTION), "prefix": takeover_prefix or "",
        }  # fmt: skip
        ordered = self._args(limits, args)
        for limit in limits:
            args[f"e{limit.ord}"] = _us(ttl if limit.period is None else limit.period)
        locks = " UNION ALL ".join(
            LOCK_ITEM.format(n=limit.ord, o=o) for o, limit in enumerate(ordered, 1)
        )
        args["turned"] = any(limit.turn is not None for limit in limits)
        head = [q["acquire_begin"], q["acquire_locks"].format(locks=locks)]
        head += [q["sweep_if"].format(n=limit.ord) for limit in ordered]
        items = ITEMS_IF.format(items=" UNION ALL ".join(ITEM.format(n=x.ord) for x in limits))
        writes = []
        for limit in ordered:
            writes.append(q["hold" if limit.period is None else "start"].format(n=limit.ord))
            writes.append(q["size_if"].format(n=limit.ord))
        text = [*head, q["take_decide"].format(items=items), *writes, q["acquire_end"]]
        script = "".join(text)
        results = self._run("acquire", key, lambda c: run_script(c, script, args), both=True)
        (ord_, used, wait_us), row = results[-3][0], results[-2][0]
        if ord_ is not None and int(ord_) < 0:  # the lines of fair turns are needed
            read, tickets = "".join([*head, q["read"].format(items=items)]), units_meta(meta)
            refused, results = self._run(
                "acquire", key,
                lambda c: self._in_turn(c, read, writes, q["acquire_end"], args, limits, tickets),
                both=True,
            )  # fmt: skip
            if refused is not None:
                return refused
            (ord_, used, wait_us), row = results[-3][0], results[-2][0]
        if ord_ is None:
            return AcquireResult(True, fence=row[2], completed=row[3])
        if int(ord_) > 0:
            return int(ord_), int(used), None if wait_us is None else int(wait_us) / 1e6
        left = None if row[4] is None else row[4] / 1e6
        holder = as_text(row[0]) or ""
        return AcquireResult(False, core.load_holder(holder, row[1], left, row[2]))

    def _release_units(
        self, key: str, token: str, completed: str | None, held: list[Units]
    ) -> bool:
        """One transaction: ``RELEASE_BEGIN``, ``GIVE`` per limit, ``RELEASE_END`` (``held``:
        concurrency limits, checked)."""
        stored = core.stored_key(key, self._key_bytes)
        args: dict[str, Any] = {"key": stored[0], "token": token, "done": completed}
        ordered = self._args(self._limits(held), args)
        text = [self._q["release_begin"], *(self._q["give"].format(n=x.ord) for x in ordered)]
        script = "".join(text) + RELEASE_END
        results = self._run("release", key, lambda c: run_script(c, script, args), both=True)
        return int(results[2][0][0]) > 0

    def _give(self, token: str, limits: list[Limit], what: str) -> set[int]:
        args: dict[str, Any] = {"token": token}
        ordered = self._args(limits, args)
        gives = [self._q["give"].format(n=x.ord) for x in ordered]
        if any(limit.turn is not None for limit in limits):  # their tickets leave the lines
            results = self._run("give_units", what, lambda c: self._leave(c, args, limits, gives),
                                units=True)  # fmt: skip
        else:
            script = "".join([self._q["give_begin"], *gives]) + "\nCOMMIT"
            results = self._run(
                "give_units", what, lambda c: run_script(c, script, args), units=True
            )  # fmt: skip
        return {int(row[0]) for rows in results for row in rows}

    def _leave(
        self, cursor: pymysql.cursors.Cursor, args: dict[str, Any], limits: list[Limit],
        gives: list[str],
    ) -> list[Any]:  # fmt: skip
        """A give with turns: its limits' rows locked as a take locks them and their lines read,
        then the lines written back and the units given, in one transaction."""
        q = self._q
        for limit in limits:
            args[f"e{limit.ord}"] = _us(1.0)
        ordered = sorted(limits, key=lambda limit: limit.key.encode())
        items = " UNION ALL ".join(ITEM.format(n=limit.ord) for limit in limits)
        read = q["take_begin"].format(locks=", ".join(LOCK.format(n=x.ord) for x in ordered))
        rows = run_script(cursor, read + q["leave_read"].format(items=items), args)[-1]
        now = int(rows[0][1]) / 1e6
        changed = leave([limit.item for limit in limits], [load(row[0], now) for row in rows])
        text = self._line_writes(changed, limits, args)
        return run_script(cursor, "".join([*text, GIVE_NOW, *gives]) + "\nCOMMIT", args)
