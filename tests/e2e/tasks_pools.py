"""Tasks of tests/e2e/test_pools.py: the same singletons run on every execution pool.

Each body runs inside ``probe().running(label, ...)``. ``busy`` burns CPU without giving up
control: under gevent or eventlet no other green thread runs meanwhile (time.sleep is patched
to yield; time.monotonic is not), and under threads it holds the GIL as much as Python lets it.
"""

from __future__ import annotations

import time

from celery import shared_task
from celery.exceptions import Ignore, Reject

from singletask import SingletonTask

from .probe import probe

PREFIX = "e2e.pools."

#: Lease of the race and ending tasks: far above any body here.
TTL = 30

#: Lease of the renewal task: its body runs three times as long. 4 s, not 2: the renewer's OS
#: thread must renew within two thirds of it while this 2-core machine runs four test workers
#: and their Celery workers (with 2 s, a gevent worker on Python 3.10 lost the lease twice in
#: three loaded runs of the e2e step and never alone or with CPU burners; not root-caused).
RENEW_TTL = 4

#: Lease of the task whose worker is killed: a new execution must start within it.
KILL_TTL = 5


def busy(seconds: float) -> None:
    """Run Python code for ``seconds`` without yielding to other green threads."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(200))


# -- mutual exclusion ------------------------------------------------------------------------


@shared_task(base=SingletonTask, name=PREFIX + "race_skip", bind=True, lock_ttl=TTL)
def race_skip(self: SingletonTask, label: str, seconds: float) -> str:
    """A global singleton (skip) with a short body; returns its own task id when it ran."""
    with probe().running(label, self.request.id):
        time.sleep(seconds)
    return str(self.request.id)


@shared_task(
    base=SingletonTask,
    name=PREFIX + "race_retry",
    bind=True,
    lock_policy="retry",
    lock_retry_countdown=0.2,
    lock_retry_max=200,
    lock_ttl=TTL,
)
def race_retry(self: SingletonTask, label: str, index: int, seconds: float) -> int:
    """A global singleton (retry) with a short body; returns its index once it ran."""
    with probe().running(label, self.request.id):
        time.sleep(seconds)
    return index


@shared_task(base=SingletonTask, name=PREFIX + "race_raise", bind=True, lock_policy="raise")
def race_raise(self: SingletonTask, label: str, seconds: float) -> str:
    """A global singleton (raise) with a short body; returns its own task id when it ran."""
    with probe().running(label, self.request.id):
        time.sleep(seconds)
    return str(self.request.id)


# -- endings ---------------------------------------------------------------------------------


@shared_task(base=SingletonTask, name=PREFIX + "end", bind=True, lock_key="{label}", lock_ttl=TTL)
def end(self: SingletonTask, label: str, how: str = "return", seconds: float = 0.2) -> str:
    """Run ``seconds``, then end as ``how`` says: return, raise, retry (once), ignore, reject."""
    retries = self.request.retries
    with probe().running(label, self.request.id, retries=retries):
        time.sleep(seconds)
        if how == "raise":
            raise ValueError(f"boom from {label}")
        if how == "retry" and retries == 0:
            raise self.retry(countdown=0.5, max_retries=1)
        if how == "ignore":
            raise Ignore()
        if how == "reject":
            raise Reject("rejected by the body", requeue=False)
    return f"done after {retries} retries"


@shared_task(
    base=SingletonTask,
    name=PREFIX + "soft",
    bind=True,
    lock_key="{label}",
    lock_ttl=TTL,
    soft_time_limit=1,
)
def soft(self: SingletonTask, label: str, seconds: float) -> str:
    """Sleeps ``seconds``, past its 1-second soft time limit where the pool enforces one."""
    with probe().running(label, self.request.id):
        time.sleep(seconds)
    return "done"


@shared_task(
    base=SingletonTask,
    name=PREFIX + "hard",
    bind=True,
    lock_key="{label}",
    lock_ttl=TTL,
    time_limit=1,
)
def hard(self: SingletonTask, label: str, seconds: float) -> str:
    """Sleeps ``seconds``, past its 1-second hard time limit where the pool enforces one."""
    with probe().running(label, self.request.id):
        time.sleep(seconds)
    return "done"


@shared_task(base=SingletonTask, name=PREFIX + "long", bind=True, lock_key="{label}", lock_ttl=TTL)
def long(self: SingletonTask, label: str, seconds: float) -> str:
    """Sleeps ``seconds``: long enough to be revoked with terminate."""
    with probe().running(label, self.request.id):
        time.sleep(seconds)
    return "done"


# -- lease renewal and worker death ----------------------------------------------------------


@shared_task(
    base=SingletonTask, name=PREFIX + "renew", bind=True, lock_key="{label}", lock_ttl=RENEW_TTL
)
def renew(self: SingletonTask, label: str, seconds: float, chunk: float) -> dict[str, object]:
    """Runs ``seconds`` (several leases) in slices of ``chunk`` seconds of CPU work, yielding
    only between slices (a short sleep: under gevent/eventlet the hub then polls for I/O);
    reports whether its lock was ever lost."""
    assert self.lock is not None
    with probe().running(label, self.request.id, token=self.lock.token):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            busy(min(chunk, deadline - time.monotonic()))
            time.sleep(0.01)
    return {"lost": self.lock.lost_reason}


@shared_task(
    base=SingletonTask, name=PREFIX + "victim", bind=True, lock_key="{label}", lock_ttl=KILL_TTL
)
def victim(self: SingletonTask, label: str, seconds: float) -> str:
    """Sleeps ``seconds``: its worker is killed meanwhile."""
    with probe().running(label, self.request.id):
        time.sleep(seconds)
    return "done"
