"""``lock_limit = N``: up to N executions per lock key at a time (issue 24).

In one process (eager mode), against the memory store and the session's private Redis: an
execution takes a free holder slot of its key, runs, and frees that slot; with every slot held,
the lock policy decides and names every holder. Definition time refuses a bad limit, a scope
that cannot go with it and a store without holder slots. Real workers: tests/e2e/test_limit.py.
"""

from __future__ import annotations

from typing import Any

import celery
import pytest

from singletask import ConfigurationError, SingletonTask, Skipped, TaskLocked
from singletask.backends.base import LockBackend
from singletask.protocol.slots import slot_key, slot_keys

LEASE = 30.0


@pytest.fixture
def app(eager_store_app: celery.Celery) -> celery.Celery:
    """An eager app on each store with limits, rates and debounce (tests/conftest.py)."""
    return eager_store_app


def backend_of(task: Any) -> LockBackend:
    backend: LockBackend = task.lock_backend
    return backend


def hold(backend: LockBackend, key: str, limit: int, n: int) -> list[int]:
    """``n`` other executions take slots of ``key``; their fences."""
    fences = []
    for i in range(n):
        taken = backend.acquire_slot(key, limit, f"other-{i}", LEASE, meta={"task_id": f"t-{i}"})
        assert taken.acquired
        assert taken.fence is not None
        fences.append(taken.fence)
    return fences


def test_an_execution_takes_a_free_slot_and_frees_only_that_one(app: celery.Celery) -> None:
    """With 2 of 3 slots held, an execution runs in the third, with a larger fence, and its
    end frees that slot only."""
    seen: dict[str, Any] = {}

    @app.task(base=SingletonTask, shared=False, lazy=False, lock_limit=3, bind=True)
    def export(self: Any) -> str:
        seen["key"], seen["fence"] = self.lock.key, self.lock.fence
        return "ran"

    # Given two other holders of the task's key
    backend, key = backend_of(export), export.lock_key_for()
    fences = hold(backend, key, 3, 2)

    # When the task runs
    assert export.delay().get() == "ran"

    # Then it held slot 2, with a fence above the others', and freed it
    assert seen["key"] == slot_key(key, 2)
    assert seen["fence"] > max(fences)
    assert backend.holder(slot_key(key, 2)) is None
    assert backend.holder(key) is not None
    assert backend.holder(slot_key(key, 1)) is not None


def test_with_every_slot_held_a_skip_names_every_holder(app: celery.Celery) -> None:
    @app.task(base=SingletonTask, shared=False, lazy=False, lock_limit=2, lock_policy="skip")
    def export() -> str:
        return "ran"

    key = export.lock_key_for()
    hold(backend_of(export), key, 2, 2)

    value = export.delay().get()

    assert isinstance(value, Skipped)
    assert value.holders == ("t-0", "t-1")
    assert value.holder == "t-0"
    assert "2 holders" in str(value)


def test_with_every_slot_held_raise_fails_naming_every_holder(app: celery.Celery) -> None:
    @app.task(base=SingletonTask, shared=False, lazy=False, lock_limit=2, lock_policy="raise")
    def export() -> str:
        return "ran"

    hold(backend_of(export), export.lock_key_for(), 2, 2)

    with pytest.raises(TaskLocked) as raised:
        export.apply(throw=True)
    assert raised.value.holders == ("t-0", "t-1")
    assert "task t-0, task t-1" in str(raised.value)


def test_per_argument_keys_have_slots_of_their_own(app: celery.Celery) -> None:
    """``lock_args`` with a limit: N per customer, other customers unaffected."""

    @app.task(base=SingletonTask, shared=False, lazy=False, lock_limit=2, lock_args=("customer",))
    def export(customer: int) -> str:
        return f"ran {customer}"

    backend = backend_of(export)
    hold(backend, export.lock_key_for((1,)), 2, 2)

    assert isinstance(export.delay(1).get(), Skipped)
    assert export.delay(customer=2).get() == "ran 2"


# -- definition time ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, 1001, 2.0, "3", True, None.__class__])
def test_a_bad_limit_is_refused_naming_task_and_attribute(value: object) -> None:
    app = celery.Celery("limit-bad", set_as_current=False)
    with pytest.raises(ConfigurationError, match=r"task 'limit\.bad' attribute lock_limit"):

        @app.task(base=SingletonTask, shared=False, lazy=False, name="limit.bad", lock_limit=value)
        def bad() -> None: ...


@pytest.mark.parametrize("scope", ["queue", "coalesce"])
def test_a_limit_with_a_queueing_scope_is_refused(scope: str) -> None:
    app = celery.Celery("limit-scope", set_as_current=False)
    with pytest.raises(ConfigurationError, match=r"attribute lock_scope: .* lock_limit = 2"):

        @app.task(
            base=SingletonTask, shared=False, lazy=False, name="limit.scope", lock_limit=2,
            lock_scope=scope,
        )  # fmt: skip
        def bad() -> None: ...


def test_a_limit_with_an_app_wide_queueing_scope_is_refused_at_definition() -> None:
    app = celery.Celery("limit-app-scope", set_as_current=False)
    app.conf.update(singletask_backend_url="memory://", singletask_lock_scope="queue")
    with pytest.raises(ConfigurationError, match=r"lock_limit: .*singletask_lock_scope 'queue'"):

        @app.task(base=SingletonTask, shared=False, lazy=False, name="limit.s", lock_limit=2)
        def bad() -> None: ...


@pytest.mark.parametrize("url", ["memcached://127.0.0.1:1", "django://default"])
def test_a_store_without_holder_slots_refuses_a_limit_at_definition(url: str) -> None:
    """memcached and Django caches keep one holder per key: the task is refused, not
    silently run as a singleton."""
    app = celery.Celery("limit-store", set_as_current=False)
    app.conf.update(singletask_backend_url=url)
    scheme = url.split(":", 1)[0]
    with pytest.raises(ConfigurationError, match=rf"lock_limit: the {scheme}:// lock store"):

        @app.task(base=SingletonTask, shared=False, lazy=False, name="limit.m", lock_limit=2)
        def bad() -> None: ...


def test_a_limit_of_one_is_the_singleton(app: celery.Celery) -> None:
    """``lock_limit = 1`` takes the key itself, as a task without the option does."""
    seen: dict[str, Any] = {}

    @app.task(base=SingletonTask, shared=False, lazy=False, lock_limit=1, bind=True)
    def sync(self: Any) -> None:
        seen["key"] = self.lock.key

    sync.delay().get()
    assert seen["key"] == sync.lock_key_for()


def test_a_redelivered_copy_of_a_running_message_waits_for_it_instead_of_taking_a_slot(
    app: celery.Celery,
) -> None:
    """A singleton sees a copy of a running message as a conflict on its one key; with free
    slots the copy must still not run beside the original: it defers until the original ends."""
    from singletask.protocol.headers import REDELIVERED_HEADER
    from singletask.signals import lock_conflict

    ran: list[str] = []
    actions: list[str | None] = []

    @app.task(base=SingletonTask, shared=False, lazy=False, lock_limit=3, lock_policy="skip")
    def export() -> None:
        ran.append("body")

    # Given the original execution of message "msg-1" holding slot 0
    backend, key = backend_of(export), export.lock_key_for()
    assert backend.acquire_slot(key, 3, "msg-1:0:x", LEASE, meta={"task_id": "msg-1"}).acquired

    def original_ends(sender: Any = None, action: str | None = None, **_: Any) -> None:
        actions.append(action)
        assert ran == []  # the copy's body has not run beside the original
        assert backend.holder(slot_key(key, 1)) is None  # nor kept a slot
        backend.release(key, "msg-1:0:x")

    lock_conflict.connect(original_ends, weak=False)
    try:
        # When a redelivered copy of it starts (eager mode sends the deferred copy again at once)
        export.apply(task_id="msg-1", headers={REDELIVERED_HEADER: 1})
    finally:
        lock_conflict.disconnect(original_ends)

    # Then it deferred once, and ran once the original had ended
    assert actions == ["defer"]
    assert ran == ["body"]


def test_a_lowered_limit_takes_effect_once_the_holders_of_the_dropped_slots_end(
    app: celery.Celery,
) -> None:
    """``lock_limit`` lowered from 3 to 1 in a deploy, while executions of the old setting
    still hold slots 1 and 2: the new setting takes slot 0 only (the singleton's one request,
    no more), so until those holders end the key has up to 3 holders, the old limit, and never
    more; once they have ended, 1 (docs/limits.rst, "Changing the limit")."""
    inside: list[int] = []

    @app.task(base=SingletonTask, shared=False, lazy=False, lock_limit=1, bind=True)
    def export(self: Any) -> str:
        key = export.lock_key_for()
        inside.append(sum(backend.holder(slot) is not None for slot in slot_keys(key, 3)))
        return str(self.lock.key)

    backend, key = backend_of(export), export.lock_key_for()
    # Given two executions of the old setting (lock_limit = 3) holding slots 1 and 2
    old = [
        backend.acquire_slot(key, 3, f"old-{i}", LEASE, meta={"task_id": f"old-{i}"})
        for i in range(3)
    ]
    assert [taken.key for taken in old] == [key, slot_key(key, 1), slot_key(key, 2)]
    backend.release(key, "old-0")

    # When an execution of the new setting (lock_limit = 1) runs
    # Then it takes the key itself beside them: 3 holders, the old limit
    assert export.delay().get() == key
    assert inside == [3]

    # And while the key itself is held, another one is refused, whatever slots are free
    assert backend.acquire(key, "new-holder", LEASE, meta={"task_id": "new-holder"}).acquired
    assert isinstance(export.delay().get(), Skipped)
    backend.release(key, "new-holder")

    # When the old holders have ended / Then an execution runs alone
    backend.release(slot_key(key, 1), "old-1")
    backend.release(slot_key(key, 2), "old-2")
    assert export.delay().get() == key
    assert inside == [3, 1]
