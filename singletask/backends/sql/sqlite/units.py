"""Named limits (``take_units`` / ``give_units``) of the SQLite lock store.

Private to :mod:`singletask.backends.sql.sqlite`: :func:`take` and :func:`give` run inside the
caller's ``BEGIN IMMEDIATE`` transaction (one per call, all or nothing across every limit
named), with ``now`` read from the store's clock (``time.time()``) in that transaction;
:func:`state` is read by the operators' listing, on a connection that may be read-only.

The holds live in a table of their own, ``singletask_units``, created next to the others
(``CREATE TABLE IF NOT EXISTS``, so a database of an older version gains it on first use):
one row per (limit key, token), a concurrency limit's hold or a rate's start:

* ``key``: the limit's store key (:func:`singletask.protocol.limits.limit_key`);
* ``token``: the owner token that took the units; ``units``: how many;
* ``period``: the rate's window in seconds, NULL for a concurrency limit;
* ``at``: a hold's deadline (concurrency), a start's time (rate);
* ``size``: the limit's size; ``size`` and ``period`` are the limit's as its last take gave
  them: a take sets them on every row of the limit;
* ``task_id``, ``task``: from the take's ``meta``, for operators (NULL when it gave none).

The waiting lines of fair turns (:mod:`..lines`) live in ``singletask_lines`` (:data:`LINES`):
one row per limit with tickets waiting (``key``, ``line``: its JSON, ``expires``: when its last
ticket's lease runs out), read by a take in the same statement as the limit's holds.

Every row expires at ``at + coalesce(period, 0)`` (:data:`UNTIL`): a hold at its deadline, a
start ``period`` after it. Reads ignore rows past it; a take or give deletes those of the
limits it names, and the rest go when a process opens the database and every
:data:`~.windows.PRUNE_EVERY` writes of this process.
"""

from __future__ import annotations

import itertools
import sqlite3
from collections.abc import Mapping, Sequence
from typing import Any, Final

from ...base import StoreState, Units, UnitsResult
from ...holders import MAX_SHOWN
from ...turns import Line
from ..lines import Seen, decide, dump, leave, load
from .windows import PRUNE_EVERY

__all__ = ["LINES", "SCHEMA", "TABLE", "UNTIL", "give", "prune", "state", "take"]

#: The table of holds and starts.
TABLE: Final = "singletask_units"
#: The table of the limits' waiting lines (fair turns).
LINES: Final = "singletask_lines"

SCHEMA: Final = (
    # Per (limit key, token): a concurrency hold (period NULL, at: its deadline) or a rate's
    # start (at: its time); the row expires at UNTIL.
    f"""
    CREATE TABLE IF NOT EXISTS {TABLE} (
        key TEXT NOT NULL,
        token TEXT NOT NULL,
        units INTEGER NOT NULL,
        period REAL,
        at REAL NOT NULL,
        size INTEGER NOT NULL,
        task_id TEXT,
        task TEXT,
        PRIMARY KEY (key, token)
    )
    """,
    # Per limit with tickets waiting: its line (JSON) and when its last ticket's lease ends.
    f"""
    CREATE TABLE IF NOT EXISTS {LINES} (
        key TEXT PRIMARY KEY,
        line TEXT NOT NULL,
        expires REAL NOT NULL
    )
    """,
)

#: When a row stops counting (its expiry): a hold's deadline, a start's time plus the period.
UNTIL: Final = "(at + coalesce(period, 0.0))"

_writes = itertools.count(1)


def prune(conn: sqlite3.Connection, now: float) -> None:
    """Delete the holds and starts that stopped counting, of every limit."""
    conn.execute(f"DELETE FROM {TABLE} WHERE {UNTIL} <= ?", (now,))
    conn.execute(f"DELETE FROM {LINES} WHERE expires <= ?", (now,))


def _wrote(conn: sqlite3.Connection, now: float) -> None:
    if next(_writes) % PRUNE_EVERY == 0:
        prune(conn, now)


def _drop_expired(conn: sqlite3.Connection, key: str, now: float) -> None:
    """Delete the holds and starts of the limit ``key`` that stopped counting."""
    conn.execute(f"DELETE FROM {TABLE} WHERE key = ? AND {UNTIL} <= ?", (key, now))


def _seen(conn: sqlite3.Connection, token: str, item: Units, now: float) -> Seen:
    """The limit of ``item`` as a take by ``token`` finds it (its expired holds deleted): one
    statement, and for a rate without room, its starts."""
    _drop_expired(conn, item.key, now)
    used, mine, text = conn.execute(
        f"SELECT coalesce(sum(CASE WHEN token != :token THEN units END), 0), "
        f"coalesce(max(token = :token), 0), "
        f"(SELECT line FROM {LINES} WHERE key = :key AND expires > :now) "
        f"FROM {TABLE} WHERE key = :key AND {UNTIL} > :now",
        {"token": token, "key": item.key, "now": now},
    ).fetchone()
    starts: list[tuple[int, float]] = []
    if item.period is not None and not mine and used + item.units > item.size:
        starts = conn.execute(
            f"SELECT units, at FROM {TABLE} WHERE key = ? AND {UNTIL} > ? ORDER BY at, rowid",
            (item.key, now),
        ).fetchall()
    return Seen(int(used), bool(mine), load(text, now), starts)


def _write_lines(
    conn: sqlite3.Connection, units: Sequence[Units], lines: list[tuple[int, Line]]
) -> None:
    """Write the lines back (a line without tickets: its row deleted)."""
    for n, line in lines:
        key = units[n - 1].key
        if not line:
            conn.execute(f"DELETE FROM {LINES} WHERE key = ?", (key,))
            continue
        text, expires = dump(line)
        conn.execute(
            f"INSERT INTO {LINES} (key, line, expires) VALUES (?, ?, ?) "
            "ON CONFLICT (key) DO UPDATE SET line = excluded.line, expires = excluded.expires",
            (key, text, expires),
        )


def _line(conn: sqlite3.Connection, key: str, now: float) -> Line | None:
    row = conn.execute(
        f"SELECT line FROM {LINES} WHERE key = ? AND expires > ?", (key, now)
    ).fetchone()
    return None if row is None else load(row[0], now)


def take(
    conn: sqlite3.Connection,
    token: str,
    ttl: float,
    units: Sequence[Units],
    meta: Mapping[str, str] | None,
    now: float,
) -> UnitsResult:
    """:meth:`~singletask.backends.base.LockBackend.take_units`, ``ttl`` and ``units``
    checked, inside the caller's transaction: every limit read, then decided as the
    in-process store decides (:func:`..lines.decide`), their lines written back."""
    decision = decide(units, [_seen(conn, token, item, now) for item in units], now, meta)
    _write_lines(conn, units, decision.lines)
    if decision.refusal is not None:
        n, used, retry_after = decision.refusal
        return UnitsResult(False, units[n - 1].key, used, retry_after)
    task_id, task = (meta or {}).get("task_id"), (meta or {}).get("task")
    for item in units:
        values: dict[str, Any] = {
            "key": item.key, "token": token, "units": item.units, "period": item.period,
            "size": item.size, "task_id": task_id, "task": task,
        }  # fmt: skip
        # The limit's size and period as this take gives them, on each of its rows.
        conn.execute(
            f"UPDATE {TABLE} SET size = :size, period = :period "
            "WHERE key = :key AND (size != :size OR period IS NOT :period)",
            values,
        )
        insert = (
            f"INSERT INTO {TABLE} (key, token, units, period, at, size, task_id, task) "
            "VALUES (:key, :token, :units, :period, :at, :size, :task_id, :task) "
        )
        if item.period is None:  # a hold, or its renewal: replaced
            conn.execute(
                insert + "ON CONFLICT (key, token) DO UPDATE SET units = excluded.units, "
                "at = excluded.at, task_id = excluded.task_id, task = excluded.task",
                {**values, "at": now + ttl},
            )
        else:  # a start, unless the token's is counted already (its expired row is gone)
            conn.execute(insert + "ON CONFLICT (key, token) DO NOTHING", {**values, "at": now})
    _wrote(conn, now)
    return UnitsResult(True)


def give(conn: sqlite3.Connection, token: str, units: Sequence[Units], now: float) -> list[bool]:
    """:meth:`~singletask.backends.base.LockBackend.give_units`, ``units`` checked, inside the
    caller's transaction."""
    found = []
    turned = [item for item in units if item.turn is not None]
    if turned:  # their tickets leave the lines
        lines = [_line(conn, item.key, now) for item in turned]
        _write_lines(conn, turned, leave(turned, lines))
    for item in units:
        _drop_expired(conn, item.key, now)
        where = f"WHERE key = ? AND token = ? AND {UNTIL} > ?"
        if item.period is None or item.units == 0:
            cursor = conn.execute(f"DELETE FROM {TABLE} {where}", (item.key, token, now))
        else:  # the real cost: the start keeps its time
            cursor = conn.execute(
                f"UPDATE {TABLE} SET units = ? {where}", (item.units, item.key, token, now)
            )
        found.append(cursor.rowcount > 0)
    _wrote(conn, now)
    return found


def state(conn: sqlite3.Connection, key: str, raw: bytes, now: float) -> StoreState | None:
    """The record of the limit stored under ``raw`` (shown as ``key``) while it has a hold or
    start that counts: its size, period, units in use and holds (oldest first, at most
    :data:`~singletask.backends.holders.MAX_SHOWN`)."""
    live = f"FROM {TABLE} WHERE key = CAST(? AS TEXT) AND {UNTIL} > ?"
    used, last = conn.execute(f"SELECT sum(units), max({UNTIL}) {live}", (raw, now)).fetchone()
    rows = conn.execute(
        f"SELECT token, units, size, period, {UNTIL}, task_id, task {live} "
        "ORDER BY at, rowid LIMIT ?",
        (raw, now, MAX_SHOWN),
    ).fetchall()
    if last is None or not rows:
        return None
    holds = [
        {"token": token, "units": units, "task_id": task_id, "task": task, "ttl": until - now}
        for token, units, _, _, until, task_id, task in rows
    ]
    _, _, size, period, _, _, _ = rows[0]  # every row of a limit has its size and period
    detail = {"size": size, "period": period, "used": used, "holds": holds}
    return StoreState("limit", key, None, last - now, detail)
