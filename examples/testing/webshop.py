"""The application under test: a Celery app with three singleton tasks.

Its configuration is the production one: a Redis broker and a Redis lock store. The tests in this
folder never reach either (the ``singletask_locks`` fixture gives the tasks an in-process store).
"""

from __future__ import annotations

from celery import Celery

from singletask import SingletonTask

app = Celery("webshop", broker="redis://redis.internal:6379/0")
app.conf.singletask_backend_url = "redis://redis.internal:6379/1"

synced: list[int] = []  # what the tasks did, for the tests to look at
charged: list[int] = []


@app.task(base=SingletonTask, lock_args=("customer_id",))
def sync_customer(customer_id: int, full: bool = False) -> str:
    """One sync per customer at a time; a duplicate is skipped (the default policy)."""
    synced.append(customer_id)
    return f"synced {customer_id}"


@app.task(base=SingletonTask, lock_args=("order_id",), lock_policy="raise")
def charge(order_id: int, amount: int) -> int:
    """Never charge one order twice at once: a duplicate fails with TaskLocked."""
    charged.append(order_id)
    return amount


@app.task(base=SingletonTask, lock_policy="retry", lock_retry_countdown=5, lock_retry_max=3)
def rebuild_search_index() -> str:
    """One rebuild at a time; a duplicate tries again in 5 seconds (plus jitter), 3 times."""
    return "rebuilt"
