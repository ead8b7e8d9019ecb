"""Testing singleton tasks in eager mode: each task runs in the test, at the call."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from singletask import Skipped, TaskLocked
from singletask.testing import IsolatedLocks, hold_lock, lock_key_for

import webshop


@pytest.fixture(autouse=True)
def eager() -> Iterator[None]:
    webshop.app.conf.task_always_eager = True
    yield
    webshop.app.conf.task_always_eager = False


def test_a_duplicate_sync_is_skipped(singletask_locks: IsolatedLocks) -> None:
    # Given another execution syncing customer 42
    with hold_lock(webshop.sync_customer, 42, holder_id="sync-in-progress") as held:
        # When the task is called again for that customer
        value = webshop.sync_customer.delay(42).get()

    # Then it was skipped without running, and says who held the lock
    assert isinstance(value, Skipped)
    assert value.holder == "sync-in-progress"
    assert webshop.synced == []
    singletask_locks.assert_skipped(held)
    singletask_locks.assert_free(held)


def test_other_customers_are_not_blocked(singletask_locks: IsolatedLocks) -> None:
    # Given a sync of customer 42 in progress
    with hold_lock(webshop.sync_customer, 42):
        # When customer 7 is synced
        value = webshop.sync_customer.delay(7).get()

    # Then it ran
    assert value == "synced 7"
    assert singletask_locks.conflicts == []


def test_which_calls_share_a_lock() -> None:
    # The lock is per customer: `full` is not part of the key
    assert lock_key_for(webshop.sync_customer, 42) == lock_key_for(
        webshop.sync_customer, 42, full=True
    )
    assert lock_key_for(webshop.sync_customer, 42) != lock_key_for(webshop.sync_customer, 7)
    # ... and a signature names the same call
    same_call = webshop.sync_customer.s(customer_id=42)
    assert lock_key_for(same_call) == lock_key_for(webshop.sync_customer, 42)


def test_a_second_charge_of_an_order_fails(singletask_locks: IsolatedLocks) -> None:
    # Given a charge of order 1001 in progress
    with hold_lock(webshop.charge, 1001, 500):
        # When the order is charged again
        result = webshop.charge.delay(1001, 500)

    # Then that execution failed with TaskLocked, and nothing was charged twice
    assert isinstance(result.result, TaskLocked)
    assert webshop.charged == []
    singletask_locks.assert_raised(webshop.charge.s(1001, 500))


def test_in_eager_mode_a_retry_policy_raises(singletask_locks: IsolatedLocks) -> None:
    # Eager mode cannot wait for a countdown: a "retry" policy raises TaskLocked there
    # (see test_worker.py for the retry itself)
    webshop.app.conf.task_eager_propagates = True
    try:
        with hold_lock(webshop.rebuild_search_index), pytest.raises(TaskLocked):
            webshop.rebuild_search_index.delay()
    finally:
        webshop.app.conf.task_eager_propagates = False
    singletask_locks.assert_raised(webshop.rebuild_search_index.s())


@pytest.mark.usefixtures("singletask_locks_disabled")
def test_without_locks_every_duplicate_runs() -> None:
    # With locking switched off, nothing is held: both calls run
    webshop.sync_customer.delay(42).get()
    webshop.sync_customer.delay(42).get()
    assert webshop.synced == [42, 42]
