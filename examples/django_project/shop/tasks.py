"""The shop's tasks: syncing one order with the warehouse must never run twice at once."""

import os
import time

from celery import shared_task

from singletask import SingletonTask


@shared_task(base=SingletonTask, lock_args=["order_id"], lock_policy="skip")
def sync_order(order_id: int, seconds: float = 1.0) -> dict[str, object]:
    """Push one order to the warehouse (here: wait ``seconds``). One run per order at a time."""
    time.sleep(seconds)
    return {"order_id": order_id, "pid": os.getpid()}
