"""The quickstart's app module: a Celery app on Redis, its settings and one singleton task.

Run it from the folder that holds this file, with a Redis server on localhost:6379 (or set
QUICKSTART_REDIS to another one, e.g. redis://:password@redis.example:6379):

1. Start a worker (two pool processes), and leave it running:

       celery -A quickstart worker -l INFO -c 2

2. In another terminal, send the task twice for the same customer:

       python quickstart.py

   It prints ``synced customer 42`` for the first call, and for the duplicate, sent while the
   first one runs, ``skipped: lock 'singletask:quickstart.sync_customer:<hash>' is held by
   <task id of the first call>``: its result is a ``singletask.Skipped``.
"""

from __future__ import annotations

import os
import time

from celery import Celery

from singletask import SingletonTask

# Where Redis runs. The broker, the results and the locks each get a database of their own.
REDIS = os.environ.get("QUICKSTART_REDIS", "redis://localhost:6379")

app = Celery("quickstart", broker=f"{REDIS}/0", backend=f"{REDIS}/1")
app.conf.update(
    # Where the locks live (see docs/configuration.rst for every setting).
    singletask_backend_url=f"{REDIS}/2",
    # A duplicate that finds the lock held is skipped: its result is a Skipped (the default).
    singletask_lock_policy="skip",
    broker_connection_retry_on_startup=True,
)


@app.task(base=SingletonTask, name="quickstart.sync_customer", lock_args=("customer_id",))
def sync_customer(customer_id: int, seconds: float = 2.0) -> str:
    """One sync per customer at a time; different customers run side by side."""
    time.sleep(seconds)
    return f"synced customer {customer_id}"


if __name__ == "__main__":
    first = sync_customer.delay(42)
    time.sleep(0.5)  # the first one is running now
    duplicate = sync_customer.delay(42)
    print(first.get(timeout=60))
    print(duplicate.get(timeout=60))
