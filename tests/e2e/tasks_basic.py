"""Tasks of tests/e2e/test_basic.py."""

from __future__ import annotations

import time

from celery import shared_task

from singletask import SingletonTask

from .probe import probe


@shared_task(base=SingletonTask, name="e2e.basic.sleep", bind=True)
def sleep(self: SingletonTask, label: str, seconds: float) -> str:
    """A global singleton: one run at a time, whatever the arguments."""
    with probe().running(label, self.request.id):
        time.sleep(seconds)
    return "done"
