"""singletask.testing, used the way a user's suite uses it: public helpers and fixtures only.

This module knows nothing of singletask's internals. Its app is configured like production (a
Redis lock store that does not exist); the plugin's ``singletask_locks`` fixture gives its tasks
a fresh in-process store per test, in eager mode and with Celery's in-process worker
(``celery_app`` / ``celery_worker`` from ``celery.contrib.pytest``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import celery
import pytest

from singletask import LockKeyError, SingletonTask, Skipped, TaskLocked
from singletask.backends.memory import MemoryBackend
from singletask.ops.inventory import find_state
from singletask.testing import (
    DEFAULT_HOLDER_ID,
    DEFAULT_LEASE,
    IsolatedLocks,
    hold_lock,
    lock_key_for,
    locks_disabled,
)
from singletask.testing.stores import _AlwaysFree, routed

if TYPE_CHECKING:  # a test module must not import a class named Test*: pytest collects it
    from celery.contrib.testing.worker import TestWorkController

app = celery.Celery("usersuite", set_as_current=False)
app.conf.update(
    # Production settings: no such server exists, and the tests never need one.
    singletask_backend_url="redis://no-such-host.invalid:6379/1",
    broker_url="memory://",
    result_backend="cache+memory://",
    task_default_queue="usersuite",  # kombu's memory queues are shared by the whole process
)

ran: list[tuple[str, Any]] = []
entered = threading.Event()
leave = threading.Event()


def singleton(**options: Any) -> Any:
    return app.task(base=SingletonTask, shared=False, **options)


@singleton(name="usersuite.sync", lock_args=("customer_id",))
def sync(customer_id: int, full: bool = False) -> str:
    ran.append(("sync", customer_id))
    return f"synced {customer_id}"


@singleton(name="usersuite.charge", lock_args=("order_id",), lock_policy="raise")
def charge(order_id: int) -> int:
    ran.append(("charge", order_id))
    return order_id


@singleton(name="usersuite.rebuild", lock_policy="retry", lock_retry_countdown=30)
def rebuild() -> str:
    ran.append(("rebuild", None))
    return "rebuilt"


@singleton(name="usersuite.lease", lock_args=("lease",))
def with_lease(lease: int) -> int:
    return lease


@singleton(name="usersuite.blocking", bind=True)
def blocking(self: Any) -> str:
    entered.set()
    leave.wait(10)
    return str(self.lock.key)


@singleton(name="usersuite.queued", lock_scope="queue")
def queued() -> None: ...


@pytest.fixture
def singletask_app() -> celery.Celery:
    return app


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    ran.clear()
    entered.clear()
    leave.clear()
    yield
    leave.set()


@pytest.fixture
def eager() -> Iterator[None]:
    app.conf.task_always_eager = True
    yield
    app.conf.task_always_eager = False


# -- keys ----------------------------------------------------------------------------------------


def test_lock_key_for_is_the_key_the_task_takes() -> None:
    """lock_key_for(task, *args, **kwargs) is the task's own key; a signature works too."""
    # Given the key of sync(42)
    key = lock_key_for(sync, 42)

    # Then it is the task's key, the same for every spelling of the call and for a signature
    assert key == sync.lock_key_for((42,), {})
    assert key == lock_key_for(sync, customer_id=42) == lock_key_for(sync, 42, full=True)
    assert key == lock_key_for(sync.s(42, full=True))
    # And another customer has another lock
    assert key != lock_key_for(sync, 7)


def test_lock_key_for_rejects_what_is_not_a_singleton_task() -> None:
    """A plain task, or arguments the key cannot be built from, fail at once."""

    @app.task(shared=False, name="usersuite.plain")
    def plain() -> None: ...

    with pytest.raises(TypeError, match="base=SingletonTask"):
        lock_key_for(plain)
    with pytest.raises(LockKeyError):
        lock_key_for(sync)  # customer_id is missing
    with pytest.raises(TypeError, match="from the signature"):
        lock_key_for(sync.s(1), 2)


# -- eager mode ----------------------------------------------------------------------------------


@pytest.mark.usefixtures("eager")
def test_a_held_lock_skips_the_duplicate(singletask_locks: IsolatedLocks) -> None:
    """hold_lock makes the call see the lock held, exactly as another execution would."""
    # Given another execution holding sync(42)'s lock, under a holder id of the test's choice
    with hold_lock(sync, 42, holder_id="sync-in-progress", lease=20) as held:
        # When the task runs for that customer
        value = sync.delay(42).get()
        # Then it was skipped, naming the holder and its lease
        assert isinstance(value, Skipped)
        assert (value.key, value.holder) == (held.key, "sync-in-progress")
        assert value.ttl is not None
        assert 0 < value.ttl <= 20
        assert singletask_locks.holder(held) is not None

    # And the body did not run, the skip was recorded, and the lock is free after the block
    assert ran == []
    conflict = singletask_locks.assert_skipped(held)
    assert (conflict.task, conflict.holder) == ("usersuite.sync", "sync-in-progress")
    singletask_locks.assert_free(held)
    assert sync.delay(42).get() == "synced 42"


@pytest.mark.usefixtures("eager")
def test_the_raise_policy_fails_with_task_locked(singletask_locks: IsolatedLocks) -> None:
    """A "raise" task fails with TaskLocked; assert_raised finds it."""
    with hold_lock(charge, 1001) as held:
        result = charge.delay(1001)
    assert isinstance(result.result, TaskLocked)
    assert result.result.holder == DEFAULT_HOLDER_ID
    singletask_locks.assert_raised(charge.s(1001))
    singletask_locks.assert_free(held)
    assert ran == []


@pytest.mark.usefixtures("eager")
def test_in_eager_mode_the_retry_policy_raises_and_the_message_says_why(
    singletask_locks: IsolatedLocks,
) -> None:
    """Eager mode cannot wait a countdown: a failed assert_retried explains it."""
    # Given a "retry" task locked out in eager mode
    with hold_lock(rebuild) as held:
        rebuild.delay()

    # Then it raised TaskLocked, and expecting a retry fails with a readable message
    singletask_locks.assert_raised(held)
    with pytest.raises(AssertionError) as failed:
        singletask_locks.assert_retried(held)
    message = str(failed.value)
    assert f"expected an execution locked out of {held.key!r} to be retried" in message
    assert "raised TaskLocked" in message
    assert DEFAULT_HOLDER_ID in message
    assert "in eager mode and direct calls a 'retry' policy cannot wait" in message
    assert "now: the lock is free" in message


@pytest.mark.usefixtures("eager")
def test_a_failed_assertion_names_the_key_what_happened_and_the_holder(
    singletask_locks: IsolatedLocks,
) -> None:
    """assert_skipped on a lock whose duplicate raised instead: every fact is in the message."""
    # Given a charge held by "other" whose duplicate raised
    with hold_lock(charge, 5, holder_id="other") as held:
        charge.delay(5)

        # When the test expects a skip instead
        with pytest.raises(AssertionError) as failed:
            singletask_locks.assert_skipped(held)

    # Then the message says what was expected, what happened, and who holds the lock
    message = str(failed.value)
    assert f"expected an execution locked out of {held.key!r} to be skipped, but" in message
    assert "what happened on that lock:" in message
    assert f"raised TaskLocked: lock {held.key!r} held by other" in message
    assert "now: the lock is held by other" in message


@pytest.mark.usefixtures("eager")
def test_nothing_recorded_is_said_as_such(singletask_locks: IsolatedLocks) -> None:
    """A lock nobody found held: the message says so, and lists the other locks' conflicts."""
    with hold_lock(sync, 1):
        sync.delay(1)
    with pytest.raises(AssertionError) as failed:
        singletask_locks.assert_skipped(sync.s(2))
    message = str(failed.value)
    assert "no execution found that lock held" in message
    assert "conflicts on other locks:" in message
    assert "skipped: lock" in message


@pytest.mark.usefixtures("eager")
def test_calls_with_other_arguments_do_not_share_the_lock(
    singletask_locks: IsolatedLocks,
) -> None:
    """Holding one customer's lock leaves the others free."""
    with hold_lock(sync, 42):
        assert sync.delay(7).get() == "synced 7"
    assert singletask_locks.conflicts == []
    assert ran == [("sync", 7)]


def test_holding_a_held_lock_fails_naming_the_holder(singletask_locks: IsolatedLocks) -> None:
    """A second hold of one lock is refused with TaskLocked, as an execution would be."""
    with hold_lock(sync, 3, holder_id="first"), pytest.raises(TaskLocked) as refused:
        hold_lock(sync, 3, holder_id="second").acquire()
    assert refused.value.holder == "first"
    singletask_locks.assert_free(sync.s(3))


def test_a_hold_ends_early_on_release_or_by_its_lease(singletask_locks: IsolatedLocks) -> None:
    """release() frees the lock at once; a short lease lets it go by itself."""
    with hold_lock(sync, 4) as held:
        assert held.held
        assert held.lease == DEFAULT_LEASE
        assert held.release()
        assert not held.held
    short = hold_lock(sync, 5, lease=0.2).acquire()
    assert short.held
    threading.Event().wait(0.5)
    assert not short.held
    singletask_locks.assert_free(short)


def test_hold_lock_options_that_clash_with_task_parameters_need_a_signature(
    singletask_locks: IsolatedLocks,
) -> None:
    """A task with a ``lease`` parameter: hold_lock(task, lease=...) is refused as ambiguous."""
    with pytest.raises(TypeError, match=r"parameter named 'lease'.*signature"):
        hold_lock(with_lease, lease=3)
    with hold_lock(with_lease.s(lease=3), lease=30) as held:
        assert held.key == lock_key_for(with_lease, 3)
        assert held.lease == 30


# -- locking switched off ------------------------------------------------------------------------


@pytest.mark.usefixtures("eager", "singletask_locks_disabled")
def test_with_locks_disabled_every_duplicate_runs() -> None:
    """singletask_locks_disabled: nothing is ever held, so nothing is skipped."""
    # When sync(1) runs twice
    assert sync.delay(1).get() == "synced 1"
    assert sync(1) == "synced 1"
    # Then hold_lock refuses to pretend, and keys are still checked
    with pytest.raises(RuntimeError, match="switched off"):
        hold_lock(sync, 1).acquire()
    with pytest.raises(LockKeyError):
        sync(object())  # no key can be built from an arbitrary object
    assert ran == [("sync", 1), ("sync", 1)]


def test_locks_disabled_also_stops_send_time_deduplication() -> None:
    """lock_scope "queue" sends every duplicate when locks are off."""
    with locks_disabled(app):
        first = queued.apply_async()
        second = queued.apply_async()
    assert first.id != second.id


# -- on Celery's in-process worker --------------------------------------------------------------


@pytest.fixture
def celery_app() -> celery.Celery:
    return app


@pytest.fixture
def celery_worker_pool() -> str:
    return "threads"  # two tasks at once: a duplicate runs while the first one waits


@pytest.fixture
def celery_worker_parameters() -> Mapping[str, Any]:
    # The ping check sends celery.ping through the *current* app, which is not this one.
    return {"perform_ping_check": False, "concurrency": 2}


def test_the_worker_shares_the_tests_store(
    singletask_locks: IsolatedLocks, celery_worker: TestWorkController
) -> None:
    """A task running on the in-process worker (a thread pool here) holds its lock in the
    test's store, and the test sees it."""
    # Given the worker running a task that waits
    result = blocking.delay()
    try:
        assert entered.wait(10)

        # Then the test sees its lock held, by its task id; a duplicate is skipped
        holder = singletask_locks.holder(blocking.s())
        assert holder is not None
        assert holder.task_id == result.id
        duplicate = blocking.delay()
        assert isinstance(duplicate.get(timeout=10), Skipped)
        singletask_locks.assert_skipped(blocking.s())
    finally:
        leave.set()

    # And once the task ends, the lock is free
    assert result.get(timeout=10) == lock_key_for(blocking)
    singletask_locks.assert_free(blocking.s())


def test_on_the_worker_skip_raise_and_retry_are_recorded(
    singletask_locks: IsolatedLocks, celery_worker: TestWorkController
) -> None:
    """The worker skips, raises, and retries with the task's countdown (plus jitter)."""
    with hold_lock(sync, 8), hold_lock(charge, 9), hold_lock(rebuild) as held:
        assert isinstance(sync.delay(8).get(timeout=10), Skipped)
        with pytest.raises(TaskLocked):
            charge.delay(9).get(timeout=10)
        rebuild.delay()
        retry = singletask_locks.assert_retried(held, countdown=30, timeout=10)

    assert retry.countdown is not None
    assert 30 <= retry.countdown <= 37.5
    singletask_locks.assert_skipped(sync.s(8))
    singletask_locks.assert_raised(charge.s(9))
    with pytest.raises(AssertionError, match=r"in 10s to 12\.5s .* but it was sent for 3\d\.\d\ds"):
        singletask_locks.assert_retried(held, countdown=10)
    assert ran == []


def test_the_stores_a_test_installs_list_their_bookkeeping_under_the_apps_keys() -> None:
    """find_state over a routed store (namespaced, as on a shared server) names the app's keys,
    not the namespaced ones; with locks switched off there is nothing to list."""
    app = celery.Celery("state-routed", set_as_current=False)
    store = MemoryBackend()
    with routed(app, store, namespace="ns:") as router:
        assert router.claim_next("singletask:proj.sync", "next-id", 30) == "next-id"
        found = list(find_state(router, "singletask:"))
    assert [(r.kind, r.key, r.task, r.task_id) for r in found] == [
        ("follow_up", "singletask:proj.sync", "proj.sync", "next-id")
    ]
    assert [r.key for r in find_state(store, "ns:")] == ["ns:singletask:proj.sync"]
    with routed(app, _AlwaysFree()) as free:
        assert list(find_state(free, "singletask:")) == []
