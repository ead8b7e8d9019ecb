"""A Celery app with three singleton tasks, as you would write them in your project.

Start a worker for it from this directory with ``celery -A tasks worker``
(``python quickstart.py`` starts Redis and a worker, runs the tasks and shows what happened).
"""

import os
import time

from celery import Celery

from singletask import SingletonTask

app = Celery(
    "tasks",
    broker=os.environ.get("CELERY_BROKER_URL", "redis://localhost:6379/0"),
    backend=os.environ.get("CELERY_RESULT_BACKEND", "redis://localhost:6379/1"),
)
# Where the locks live. Without this setting, singletask uses the broker's Redis.
app.conf.singletask_backend_url = os.environ.get(
    "SINGLETASK_BACKEND_URL", "redis://localhost:6379/2"
)

# How long each task pretends to work (quickstart.py --quick shortens it).
WORK_SECONDS = float(os.environ.get("EXAMPLE_WORK_SECONDS", "1.5"))


def work() -> dict:
    """Stand-in for real work: report which process did it, and when."""
    started = time.time()
    time.sleep(WORK_SECONDS)
    return {"pid": os.getpid(), "started": started, "finished": time.time()}


# One lock for the whole task: a single nightly_sync runs at a time, on all workers.
# A duplicate that finds it running is skipped (the default lock_policy): it does not run
# its body and returns a singletask.Skipped, naming the holder, at once.
@app.task(base=SingletonTask)
def nightly_sync() -> dict:
    return work()


# One lock per customer: customers 1 and 2 sync in parallel, while a second sync of
# customer 1 waits for the first by retrying every ~0.5 s (on its own retry budget,
# lock_retry_max, not the task's max_retries).
@app.task(
    base=SingletonTask,
    lock_args=("customer_id",),
    lock_policy="retry",
    lock_retry_countdown=0.5,
)
def sync_customer(customer_id: int, full: bool = False) -> dict:
    return {"customer_id": customer_id, "full": full, **work()}


# A class-based task with a readable lock key, "singletask:feeds.import:feed:<url>".
# Importing a feed that is being imported fails at once with singletask.TaskLocked.
class ImportFeed(SingletonTask):
    name = "feeds.import"
    lock_policy = "raise"
    lock_key = "feed:{url}"

    def run(self, url: str) -> dict:
        return {"url": url, **work()}


import_feed = app.register_task(ImportFeed())
