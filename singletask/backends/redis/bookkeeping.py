"""The bookkeeping records of the Redis stores, listed for operators
(:meth:`~singletask.backends.base.LockBackend.iter_state`).

They are the companion records of :mod:`~singletask.backends.redis.rates` that hold something
live: a fence hash with a pending follow-up claim (fields ``next``, ``next_until``), a rate
record, a debounce window; and the records of named limits (:mod:`~.units`) with a hold or
start that counts, each read by a read-only script over its three keys. Found with one SCAN
MATCH (never KEYS) under the same pattern as the locks
(:func:`~singletask.backends.redis.slots.scan_pattern`), each page of names read in one
pipeline together with the server's clock; nothing is written.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import redis

from ...protocol.limits import split_limit_key
from ...protocol.slots import split_companion
from ..base import StoreState
from ..holders import MAX_SHOWN
from .slots import COMPANION_ENDS, scan_pattern
from .units import LIMIT_STATE_SCRIPT, limit_keys, limit_state
from .wire import as_text

__all__ = ["scan_state"]

#: The companion records that hold bookkeeping, and the kind of record each is.
_KINDS = {"fence": "follow_up", "debounce": "window", "rate": "rate"}


def scan_state(
    client: redis.Redis, prefix: str, page_size: int, *, transaction: bool = True
) -> Iterator[StoreState]:
    """The live bookkeeping records of the keys under ``prefix`` on ``client`` (one server, or
    one node of a cluster: ``transaction`` False), ``page_size`` names a page. Raises redis-py's
    errors."""
    page: list[tuple[str, str, str]] = []
    for raw in client.scan_iter(match=scan_pattern(prefix), count=page_size):
        name = as_text(raw)
        found = split_companion(name)
        if _is_limit(name, prefix):
            page.append((name, name, "limit"))
        elif found is not None and found[1] in _KINDS and found[0].startswith(prefix):
            page.append((name, found[0], _KINDS[found[1]]))
        else:
            continue
        if len(page) >= page_size:
            yield from _read_page(client, page, transaction)
            page = []
    if page:
        yield from _read_page(client, page, transaction)


def _is_limit(name: str, prefix: str) -> bool:
    """Whether ``name`` is the key of a named limit under ``prefix`` (not one of its companion
    records, whose names hold the limit's key as well)."""
    return (
        name.startswith(prefix)
        and not name.endswith(COMPANION_ENDS)
        and split_limit_key(name) is not None
    )


def _read_page(
    client: redis.Redis, page: list[tuple[str, str, str]], transaction: bool
) -> Iterator[StoreState]:
    """The live records among ``page`` (``(store key, lock key, kind)``); a record that is
    gone, or of another type than its name says (not one of ours), is left out."""
    with client.pipeline(transaction=transaction) as pipe:
        pipe.time()
        for name, _, kind in page:
            if kind == "follow_up":
                pipe.hmget(name, ["next", "next_until"])
            elif kind == "window":
                pipe.hmget(name, ["l", "o"])
            elif kind == "limit":
                pipe.eval(LIMIT_STATE_SCRIPT, 3, *limit_keys(name), MAX_SHOWN)
            else:
                pipe.get(name)
            pipe.pttl(name)
        replies = pipe.execute(raise_on_error=False)
    clock = replies[0]
    if isinstance(clock, Exception):
        raise clock
    now_us = int(clock[0]) * 1_000_000 + int(clock[1])
    for index, (_, key, kind) in enumerate(page):
        value, pttl = replies[1 + 2 * index], replies[2 + 2 * index]
        if isinstance(value, Exception) or isinstance(pttl, Exception) or int(pttl) < 0:
            continue  # gone (-2), no expiry (-1: not ours), or not of the type it should be
        if kind == "limit":
            record = limit_state(key, value)
        else:
            record = _record(kind, key, value, int(pttl) / 1000, now_us)
        if record is not None:
            yield record


def _record(kind: str, key: str, value: Any, ttl: float, now_us: int) -> StoreState | None:
    """The record of ``key`` of ``kind`` read as ``value``, or None when it holds nothing live."""
    try:
        if kind == "follow_up":
            task_id, until = value
            left = (int(until or 0) * 1000 - now_us) / 1_000_000
            return StoreState(kind, key, as_text(task_id), left) if task_id and left > 0 else None
        if kind == "window":
            latest, opened = value
            if not latest:
                return None
            age = None if opened is None else max(0.0, (now_us - int(opened) * 1000) / 1_000_000)
            detail = {"open": opened is not None, "age": age}
            return StoreState(kind, key, as_text(latest), ttl, detail)
        left = (int(value) - now_us) / 1_000_000 if value is not None else 0.0
        return StoreState(kind, key, None, ttl, {"next_start_in": left}) if left > 0 else None
    except (TypeError, ValueError):
        return None  # a foreign value under one of our names
