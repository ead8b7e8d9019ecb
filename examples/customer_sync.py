"""One sync per customer at a time; a second sync of the same customer waits for its turn.

    python examples/customer_sync.py                  # nothing to install or start
    python examples/customer_sync.py --redis-url redis://localhost:6379/0

The lock is per ``customer_id``: customers sync side by side, but a customer is never synced
twice at once. With ``lock_policy="retry"`` a duplicate is not dropped: it is sent again every
half second (plus jitter) until the lock is free, on a retry budget of its own
(``lock_retry_max``), so the task's ``max_retries`` stays free for real errors.
"""

from __future__ import annotations

import time

from celery import Celery

from singletask import SingletonTask
from singletask.demo.example import configure, run_example

app = Celery("customer_sync")
configure(app)  # broker, results and locks: the embedded ones, or the --redis-url database


@app.task(
    base=SingletonTask, lock_args=("customer_id",), lock_policy="retry", lock_retry_countdown=0.5
)
def sync_customer(customer_id: int) -> dict[str, float]:
    started = time.time()
    time.sleep(1)  # stand-in for pulling the customer's records from the CRM
    return {"started": started, "finished": time.time()}


def main() -> None:
    t0 = time.time()
    calls = [(customer, sync_customer.delay(customer)) for customer in (1, 1, 2)]
    for customer, result in calls:
        run = result.get(timeout=60)
        print(
            f"sync_customer({customer}) [{result.id[:8]}]: ran from +{run['started'] - t0:.1f}s "
            f"to +{run['finished'] - t0:.1f}s"
        )


if __name__ == "__main__":
    run_example(__file__, app, main)
