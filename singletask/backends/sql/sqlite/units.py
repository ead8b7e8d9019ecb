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

Every row expires at ``at + coalesce(period, 0)`` (:data:`UNTIL`): a hold at its deadline, a
start ``period`` after it. Reads ignore rows past it; a take or give deletes those of the
limits it names, and the rest go when a process opens the database and every
:data:`~.windows.PRUNE_EVERY` writes of this process.

A limit's waiting line (fair turns, :mod:`singletask.backends.turns`) is one row of
``singletask_lines`` (:data:`LINES`): ``key``, the line as JSON (``Line.to_json``, times of
the store's clock) and ``until``, its last ticket's expiry; read and written in the same
transaction as the limit's holds, deleted when it has no ticket left, pruned with them.
"""

from __future__ import annotations

import itertools
import json
import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from ...base import StoreState, Units, UnitsResult
from ...holders import MAX_SHOWN
from ...turns import Line, fits, settle
from .windows import PRUNE_EVERY

__all__ = ["LINES", "SCHEMA", "TABLE", "UNTIL", "give", "prune", "state", "take"]

#: The table of holds and starts.
TABLE: Final = "singletask_units"

#: The table of the limits' waiting lines.
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
    # Per limit key: its waiting line, as JSON, until its last ticket's lease runs out.
    f"""
    CREATE TABLE IF NOT EXISTS {LINES} (
        key TEXT PRIMARY KEY,
        line TEXT NOT NULL,
        until REAL NOT NULL
    )
    """,
)

#: When a row stops counting (its expiry): a hold's deadline, a start's time plus the period.
UNTIL: Final = "(at + coalesce(period, 0.0))"

_writes = itertools.count(1)


def prune(conn: sqlite3.Connection, now: float) -> None:
    """Delete the holds and starts that stopped counting, of every limit."""
    conn.execute(f"DELETE FROM {TABLE} WHERE {UNTIL} <= ?", (now,))
    conn.execute(f"DELETE FROM {LINES} WHERE until <= ?", (now,))


def _wrote(conn: sqlite3.Connection, now: float) -> None:
    if next(_writes) % PRUNE_EVERY == 0:
        prune(conn, now)


def _drop_expired(conn: sqlite3.Connection, key: str, now: float) -> None:
    """Delete the holds and starts of the limit ``key`` that stopped counting."""
    conn.execute(f"DELETE FROM {TABLE} WHERE key = ? AND {UNTIL} <= ?", (key, now))


def _line(conn: sqlite3.Connection, key: str, now: float) -> Line | None:
    """The live waiting line of limit ``key``, if it has one."""
    row = conn.execute(f"SELECT line FROM {LINES} WHERE key = ? AND until > ?", (key, now))
    found = row.fetchone()
    return Line.from_json(json.loads(found[0])).live(now) if found else None


def _keep_line(conn: sqlite3.Connection, key: str, line: Line) -> None:
    """Write limit ``key``'s line back, or delete it when no ticket is left."""
    until = line.last()
    if until is None:
        conn.execute(f"DELETE FROM {LINES} WHERE key = ?", (key,))
        return
    conn.execute(
        f"INSERT INTO {LINES} (key, line, until) VALUES (?, ?, ?) "
        "ON CONFLICT (key) DO UPDATE SET line = excluded.line, until = excluded.until",
        (key, json.dumps(line.to_json()), until),
    )


@dataclass
class _Seen:
    """What a take found of one limit: the units others use, whether a start of the token is
    counted already (a retried take), whether it fits, and its line."""

    item: Units
    used: int
    counted: bool
    fitted: bool = True
    line: Line | None = None


def _room(conn: sqlite3.Connection, token: str, item: Units, now: float) -> _Seen:
    """What limit ``item`` has for ``token``'s take: its units used by others, its line, and
    whether it fits (a rate start of ``token`` already counted fits: a retried take)."""
    _drop_expired(conn, item.key, now)
    used, mine = conn.execute(
        f"SELECT coalesce(sum(CASE WHEN token != :token THEN units END), 0), "
        f"coalesce(max(token = :token), 0) FROM {TABLE} WHERE key = :key AND {UNTIL} > :now",
        {"token": token, "key": item.key, "now": now},
    ).fetchone()
    seen = _Seen(item, int(used), bool(mine) and item.period is not None)
    if not seen.counted:
        seen.line = _line(conn, item.key, now)
        seen.fitted = fits(seen.line, item, seen.used, now, holding=bool(mine))
    return seen


def _refusal(conn: sqlite3.Connection, seen: _Seen, now: float) -> UnitsResult:
    """The refusal of a take that limit ``seen.item`` had no room for."""
    item, used = seen.item, seen.used
    retry_after = None
    if item.period is not None and used + item.units > item.size:
        # The oldest starts leave the window first: wait for enough of them.
        free, need = 0, used + item.units - item.size
        for units, at in conn.execute(
            f"SELECT units, at FROM {TABLE} WHERE key = ? AND {UNTIL} > ? ORDER BY at, rowid",
            (item.key, now),
        ):
            free += units
            if free >= need:
                retry_after = max(at + item.period - now, 0.001)
                break
    return UnitsResult(False, item.key, used, retry_after)


def take(
    conn: sqlite3.Connection,
    token: str,
    ttl: float,
    units: Sequence[Units],
    meta: Mapping[str, str] | None,
    now: float,
) -> UnitsResult:
    """:meth:`~singletask.backends.base.LockBackend.take_units`, ``ttl`` and ``units``
    checked, inside the caller's transaction."""
    found = [_room(conn, token, item, now) for item in units]
    refused = next((seen for seen in found if not seen.fitted), None)
    for seen in found:  # the lines of the limits named, whether taken or not
        if not seen.counted and (seen.line is not None or seen.item.turn is not None):
            line = seen.line if seen.line is not None else Line()
            settle(line, seen.item, seen.used, seen.fitted, refused is None, now, meta)
            _keep_line(conn, seen.item.key, line)
    if refused is not None:
        return _refusal(conn, refused, now)
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
    for item in units:
        line = _line(conn, item.key, now) if item.turn is not None else None
        if line is not None and item.turn is not None and line.drop(item.turn.ticket):
            _keep_line(conn, item.key, line)
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
    waiting = _waiting(conn, raw, now)
    detail = {"size": size, "period": period, "used": used, "holds": holds, "waiting": waiting}
    return StoreState("limit", key, None, last - now, detail)


def _waiting(conn: sqlite3.Connection, raw: bytes, now: float) -> int:
    """The tickets in the line of the limit stored under ``raw`` (0 in a file of a version
    without lines, read before any process of this version wrote it)."""
    try:
        row = conn.execute(
            f"SELECT line FROM {LINES} WHERE key = CAST(? AS TEXT) AND until > ?", (raw, now)
        ).fetchone()
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return 0
        raise
    return len(Line.from_json(json.loads(row[0])).live(now).tickets) if row else 0
