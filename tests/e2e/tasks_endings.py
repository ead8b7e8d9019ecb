"""Tasks of tests/e2e/test_endings.py: one singleton per way an execution can end.

Every task takes the lock ``singletask:<task name>:<label>`` (``lock_key="{label}"``), so each
test has locks of its own. Bodies run inside the probe, which records the lock token they hold
and the attempt number (``retries``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

from celery import shared_task
from celery.exceptions import Ignore, Reject

from singletask import SingletonTask

from .probe import probe


def _token(task: SingletonTask) -> str | None:
    return task.lock.token if task.lock is not None else None


@contextlib.contextmanager
def _sigterm_deferred(defer: bool) -> Iterator[None]:
    """With ``defer``, SIGTERM waits until the block ends, as it does while a process is inside
    C code (a database driver call, a long computation in an extension): a handler of our own
    notes it, and it is sent again once the block is over, to the handler it found.

    Not a blocked signal mask: that blocks the main thread alone, and a process with another
    thread (the lock renewer) gets the signal there, so Python ran the pool's handler at the
    main thread's next line. Enter it before the probe records the start: a test signals as
    soon as it sees the start (a SIGTERM that came between the two once stopped the body at
    once, and a duplicate rightly ran: CI, Python 3.10, a loaded machine)."""
    if not defer:
        yield
        return
    received: list[int] = []
    found = signal.signal(signal.SIGTERM, lambda signum, _frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if found is None else found)
        if received:
            os.kill(os.getpid(), signal.SIGTERM)


@shared_task(base=SingletonTask, name="e2e.endings.end", bind=True, lock_key="{label}")
def end(self: SingletonTask, label: str, how: str = "return", seconds: float = 0.0) -> str:
    """Run ``seconds``, then end as ``how`` says: return, raise, ignore or reject."""
    with probe().running(label, self.request.id, token=_token(self)):
        time.sleep(seconds)
        if how == "raise":
            raise ValueError(f"boom from {label}")
        if how == "ignore":
            raise Ignore()
        if how == "reject":
            raise Reject("rejected by the body", requeue=False)
    return "done"


@shared_task(
    base=SingletonTask,
    name="e2e.endings.strict",
    bind=True,
    lock_key="{label}",
    lock_policy="raise",
)
def strict(self: SingletonTask, label: str, seconds: float = 0.0) -> str:
    """Like ``end`` with policy "raise": a duplicate fails with TaskLocked."""
    with probe().running(label, self.request.id, token=_token(self)):
        time.sleep(seconds)
    return "done"


@shared_task(
    base=SingletonTask, name="e2e.endings.soft", bind=True, lock_key="{label}", soft_time_limit=1
)
def soft(self: SingletonTask, label: str, seconds: float = 0.0) -> str:
    """Sleeps ``seconds``; past 1 s the soft time limit raises SoftTimeLimitExceeded in it."""
    with probe().running(label, self.request.id, token=_token(self)):
        time.sleep(seconds)
    return "done"


@shared_task(
    base=SingletonTask,
    name="e2e.endings.hard",
    bind=True,
    lock_key="{label}",
    time_limit=1,
    lock_ttl=60,
)
def hard(self: SingletonTask, label: str, seconds: float = 0.0, defer_sigterm: bool = False) -> str:
    """Sleeps ``seconds``; past 1 s the pool kills the process running it (hard time limit)."""
    with (
        _sigterm_deferred(defer_sigterm),
        probe().running(label, self.request.id, token=_token(self)),
    ):
        time.sleep(seconds)
    return "done"


@shared_task(
    base=SingletonTask,
    name="e2e.endings.retrying",
    bind=True,
    lock_key="{label}",
    lock_ttl=3,
    max_retries=5,
)
def retrying(
    self: SingletonTask,
    label: str,
    times: int = 1,
    countdown: float = 2.0,
    expires: float = 0,
    cleanup: float = 0,
) -> str:
    """Retries itself ``times`` times with ``self.retry(countdown=...)``, then returns.

    With ``expires`` > 0 the retry message expires after that many seconds. With ``cleanup`` > 0
    the body spends that many seconds in a ``finally`` after asking for the retry (closing
    connections, removing temporary files...).
    """
    retries = self.request.retries
    with probe().running(label, self.request.id, token=_token(self), retries=retries):
        try:
            time.sleep(0.2)
            if retries < times:
                options = {"expires": expires} if expires else {}
                raise self.retry(countdown=countdown, **options)
        finally:
            time.sleep(cleanup)
    return f"done after {retries} retries"


@shared_task(base=SingletonTask, name="e2e.endings.goes_on", bind=True, lock_key="{label}")
def goes_on(self: SingletonTask, label: str, how: str = "throw=False", seconds: float = 8.0) -> str:
    """On its first attempt, asks for a retry (countdown 0) and goes on running ``seconds``:
    with ``self.retry(throw=False)``, or with ``raise self.retry()`` inside ``except
    Exception`` (which catches Celery's ``Retry``). Its retried attempt returns at once."""
    retries = self.request.retries
    with probe().running(label, self.request.id, token=_token(self), retries=retries):
        if retries == 0:
            if how == "throw=False":
                self.retry(countdown=0, throw=False)
            else:
                try:
                    raise self.retry(countdown=0)
                except Exception:  # the Retry is swallowed: what the test is about
                    pass
            time.sleep(seconds)
    return f"done after {retries} retries"


@shared_task(
    base=SingletonTask,
    name="e2e.endings.flaky",
    bind=True,
    lock_key="{label}",
    lock_ttl=30,
    autoretry_for=(ConnectionError,),
    retry_kwargs={"countdown": 1.5},
    retry_backoff=False,
    max_retries=3,
)
def flaky(self: SingletonTask, label: str, failures: int = 1) -> str:
    """Raises ConnectionError on its first ``failures`` attempts; ``autoretry_for`` retries it."""
    retries = self.request.retries
    with probe().running(label, self.request.id, token=_token(self), retries=retries):
        time.sleep(0.2)
        if retries < failures:
            raise ConnectionError(f"attempt {retries} of {label} failed")
    return f"done after {retries} retries"


@shared_task(base=SingletonTask, name="e2e.endings.replaced", bind=True, lock_key="{label}")
def replaced(self: SingletonTask, label: str) -> str:
    """Replaces itself with ``e2e.endings.replacement`` (Task.replace raises Ignore)."""
    with probe().running(label, self.request.id, token=_token(self), task="replaced"):
        time.sleep(0.3)
    raise self.replace(replacement.s(label))


@shared_task(base=SingletonTask, name="e2e.endings.replacement", bind=True, lock_key="{label}")
def replacement(self: SingletonTask, label: str) -> str:
    """What ``e2e.endings.replaced`` becomes."""
    with probe().running(label, self.request.id, token=_token(self), task="replacement"):
        time.sleep(0.3)
    return "replaced"


@shared_task(
    base=SingletonTask, name="e2e.endings.long", bind=True, lock_key="{label}", lock_ttl=600
)
def long(
    self: SingletonTask, label: str, seconds: float = 10.0, defer_sigterm: bool = False
) -> str:
    """Sleeps long enough to be stopped from outside (revoke with terminate, SIGKILL). Its
    10-minute lease makes any release within the tests' bounds a real release, not an expiry."""
    with (
        _sigterm_deferred(defer_sigterm),
        probe().running(label, self.request.id, token=_token(self)),
    ):
        time.sleep(seconds)
    return "done"
