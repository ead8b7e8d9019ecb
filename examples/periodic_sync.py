"""A periodic sync that must not overlap: beat sends it every second, a run takes 2.5 seconds.

    python examples/periodic_sync.py                  # nothing to install or start
    python examples/periodic_sync.py --redis-url redis://localhost:6379/0

Celery beat keeps sending a periodic task on time, whether or not the previous run is over. With
one lock for the task and the default policy, a run that starts while another one still runs is
skipped at once: runs never overlap, and skipped ticks do not pile up in the queue. The example
runs a real beat inside the worker (``celery worker -B``) and shows the worker's log for a few
seconds.
"""

from __future__ import annotations

import time

from celery import Celery

from singletask import SingletonTask
from singletask.demo.example import configure, run_example

app = Celery("periodic_sync")
configure(app)  # broker, results and locks: the embedded ones, or the --redis-url database
app.conf.beat_schedule = {
    "sync-inventory": {"task": "periodic_sync.sync_inventory", "schedule": 1.0},
}


@app.task(base=SingletonTask)
def sync_inventory() -> str:
    time.sleep(2.5)  # stand-in for a sync that sometimes outlasts its period
    return "inventory synced"


def worth_showing(line: str) -> bool:
    """Worker log lines about the sync: the runs that finished, and the skipped ticks."""
    if "sync_inventory" not in line:
        return False
    return "skipped: lock" in line or ("succeeded in" in line and "Skipped(" not in line)


def main() -> None:
    time.sleep(6)  # while beat sends the sync every second and the worker logs what it does


if __name__ == "__main__":
    run_example(__file__, app, main, beat=True, show_worker_log=worth_showing)
