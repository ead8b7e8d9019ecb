"""Testing singleton tasks on a real worker, running in the test process.

Celery's ``celery_worker`` fixture (from ``celery.contrib.pytest``) starts a worker for the
``celery_app`` fixture in a thread; here ``celery_app`` is the application under test. The
worker shares the test's in-process lock store. ``singletask_locks`` comes before
``celery_worker`` in each test's arguments, so the worker stops before the store goes away.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import celery.contrib.testing.tasks  # noqa: F401 - registers celery.ping, which celery_worker sends
import pytest
from celery import Celery

from singletask import Skipped
from singletask.testing import IsolatedLocks, hold_lock

import webshop

if TYPE_CHECKING:  # a test module must not import a class named Test*: pytest collects it
    from celery.contrib.testing.worker import TestWorkController


@pytest.fixture
def celery_app() -> Celery:
    """Celery's worker fixture runs the app under test (conftest.py gives it a memory broker)."""
    return webshop.app


def test_a_duplicate_is_skipped_on_the_worker(
    singletask_locks: IsolatedLocks, celery_worker: TestWorkController
) -> None:

    # Given another execution syncing customer 42
    with hold_lock(webshop.sync_customer, 42, holder_id="sync-in-progress") as held:
        # When the worker runs the task for that customer
        value = webshop.sync_customer.delay(42).get(timeout=10)

    # Then it was skipped
    assert isinstance(value, Skipped)
    assert value.holder == "sync-in-progress"
    singletask_locks.assert_skipped(held)


def test_a_duplicate_rebuild_is_retried_in_5_seconds(
    singletask_locks: IsolatedLocks, celery_worker: TestWorkController
) -> None:
    # Given a rebuild in progress
    with hold_lock(webshop.rebuild_search_index) as held:
        # When another rebuild reaches the worker
        webshop.rebuild_search_index.delay()

        # Then the worker sends it again for 5 seconds later (plus up to 25% jitter)
        retry = singletask_locks.assert_retried(held, countdown=5, timeout=10)
    assert retry.holder == held.holder_id
