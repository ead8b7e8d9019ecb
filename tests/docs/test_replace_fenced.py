"""The worked example of docs/guarantees.rst ("Latest wins"), run for real on PostgreSQL.

examples/replace_fenced.py: a price sync with ``lock_policy = "replace"`` whose UPDATE is
conditional on the fencing token. A newer sync preempts a slow one and writes; the preempted one
then tries its late UPDATE with its older token, and PostgreSQL refuses it (0 rows). The locks
live in PostgreSQL too. Tables are ``st_test_*`` of the test's own, dropped after.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import celery
import pytest

from singletask import Skipped

from ..servers import SQL_URLS, sql_test_table

ROOT = Path(__file__).resolve().parents[2]


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "replace_fenced", ROOT / "examples/replace_fenced.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def tables() -> Iterator[tuple[str, str]]:
    """``(prices table, locks table)`` on the test PostgreSQL, both dropped after."""
    with sql_test_table("postgresql") as prices, sql_test_table("postgresql") as locks:
        yield prices, locks


def test_a_preempted_writers_late_update_is_refused_by_its_fencing_token(
    tables: tuple[str, str],
) -> None:
    """Given a slow sync of one SKU holding its lock, when a newer sync of the same SKU starts,
    then it preempts the slow one and writes its price with a larger token; and when the slow
    one's late UPDATE comes, PostgreSQL changes 0 rows, so the newer price stays, and the slow
    execution ends as a Skipped "replaced" naming the newer one."""
    import psycopg

    example = load_example()
    prices, locks = tables
    url = SQL_URLS["postgresql"]
    with psycopg.connect(url) as conn:
        conn.execute(
            f"CREATE TABLE {prices} (sku TEXT PRIMARY KEY, price NUMERIC NOT NULL, "
            "fence BIGINT NOT NULL)"
        )
        conn.execute(f"INSERT INTO {prices} VALUES ('sku-1', 1, 0)")
    app = celery.Celery("replace-fenced", set_as_current=False)
    app.conf.update(
        task_always_eager=True, singletask_backend_url=url, singletask_backend_table=locks
    )
    fetching, go_on = threading.Event(), threading.Event()
    calls: list[str] = []

    def fetch_price(sku: str) -> float:
        calls.append(sku)
        if len(calls) == 1:  # the first (older) sync is slow
            fetching.set()
            assert go_on.wait(30)
            return 10.0
        return 20.0

    def announce(sku: str, price: float) -> None:
        if price == 20.0:  # the newer sync is still running when the older one writes late
            written.set()
            assert older_done.wait(30)

    written, older_done = threading.Event(), threading.Event()
    sync_price = example.define(app, url, prices, fetch_price, announce)
    outcome: dict[str, Any] = {}

    def run(name: str, task_id: str) -> None:
        outcome[name] = sync_price.apply(("sku-1",), task_id=task_id).get()

    # Given the older sync running, inside its slow fetch
    older = threading.Thread(target=run, args=("old", "old-sync"))
    older.start()
    assert fetching.wait(30)

    # When a newer sync of the same SKU runs, it preempts the older one and writes at once
    newer = threading.Thread(target=run, args=("new", "new-sync"))
    newer.start()
    assert written.wait(30)
    with psycopg.connect(url) as conn:
        row = conn.execute(f"SELECT price, fence FROM {prices} WHERE sku = 'sku-1'").fetchone()
    assert row is not None
    assert float(row[0]) == 20.0
    newer_fence = int(row[1])

    # And when the older one's late UPDATE comes, PostgreSQL refuses it
    go_on.set()
    older.join(30)
    older_done.set()
    newer.join(30)
    with psycopg.connect(url) as conn:
        row = conn.execute(f"SELECT price, fence FROM {prices} WHERE sku = 'sku-1'").fetchone()
    assert row is not None
    assert (float(row[0]), int(row[1])) == (20.0, newer_fence)
    assert example.fenced_update(url, prices, "sku-1", 10.0, newer_fence - 1) is False
    assert outcome["new"] == 20.0
    # And the older execution ended as replaced by the newer one
    assert isinstance(outcome["old"], Skipped)
    assert (outcome["old"].reason, outcome["old"].holder) == ("replaced", "new-sync")
    app.close()
