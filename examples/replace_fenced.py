"""``lock_policy = "replace"`` with a fenced write: a preempted writer's late UPDATE is refused.

A price sync whose newer request makes the running one worthless: the newer execution takes the
lock over at once, with a larger fencing token. The table keeps the token of its last write in a
``fence`` column and every UPDATE is conditional on it, so a preempted sync that keeps running
(it has not reached its next ``self.lock.check()``) cannot overwrite the newer one's prices.

``define(app, engine_url, table)`` registers the task on ``app``; tests/docs/test_replace_fenced.py
runs it against a real PostgreSQL. The table::

    CREATE TABLE prices (sku TEXT PRIMARY KEY, price NUMERIC NOT NULL, fence BIGINT NOT NULL)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
from celery import Celery

from singletask import LockLost, SingletonTask


def fenced_update(url: str, table: str, sku: str, price: float, fence: int) -> bool:
    """Write ``price`` only if no holder with a newer fencing token has written the row: the
    comparison and the write are one statement. Returns whether the row was written."""
    with psycopg.connect(url) as conn:
        updated = conn.execute(
            f"UPDATE {table} SET price = %s, fence = %s WHERE sku = %s AND fence < %s",
            (price, fence, sku, fence),
        ).rowcount
    return updated == 1


def define(
    app: Celery,
    url: str,
    table: str,
    fetch_price: Callable[[str], float],
    announce: Callable[[str, float], None],
) -> Any:
    """The price sync of ``app``: ``fetch_price(sku)`` (slow), then the fenced write to
    ``table`` of the database at ``url``, then ``announce(sku, price)`` of the price written."""

    @app.task(base=SingletonTask, bind=True, lock_args=("sku",), lock_policy="replace",
              lock_ttl=3, name="prices.sync", shared=False)  # fmt: skip
    def sync_price(self: Any, sku: str) -> float:
        price = fetch_price(sku)  # slow: a newer sync may take the lock over meanwhile
        if not fenced_update(url, table, sku, price, self.lock.fence):
            # A newer holder has written: this one was preempted. Ends as Skipped("replaced").
            raise LockLost(self.lock.key, "a newer sync has written this price")
        announce(sku, price)  # e.g. to the caches; still under the lock
        return price

    return sync_price
