"""What singletask.testing promises about the stores it installs: isolation and clean restoring.

These tests look at the app's lock store before, during and after an isolation, through the
public ``SingletonTask.lock_backend``; the real-server option runs against the session's private
Redis.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from typing import Any

import celery
import pytest
import redis

from singletask import BackendUnavailable, ConfigurationError, SingletonTask, Skipped
from singletask.testing import hold_lock, isolated_locks, lock_key_for, locks_disabled


def make_app(**conf: Any) -> celery.Celery:
    app = celery.Celery("plugin", set_as_current=False)
    app.conf.update(task_always_eager=True, **conf)
    return app


def singleton(app: celery.Celery, name: str = "plugin.work", **options: Any) -> Any:
    @app.task(base=SingletonTask, shared=False, name=name, lock_args=("n",), **options)
    def work(n: int) -> int:
        return n

    return work


@pytest.fixture
def bare() -> Iterator[celery.Celery]:
    """An app with no lock store configured at all (a memory broker, no singletask_backend_url)."""
    app = make_app(broker_url="memory://")
    yield app
    app.close()


def test_an_app_without_a_lock_store_works_inside_and_not_outside(bare: celery.Celery) -> None:
    """The isolation needs no backend URL; once it ends the app's own settings apply again."""
    # Given an app whose settings name no lock store
    work = singleton(bare)
    with pytest.raises(ConfigurationError, match="singletask_backend_url is not set"):
        work.lock_backend  # noqa: B018

    # When it runs inside an isolation / Then it works
    with isolated_locks(bare):
        assert work.delay(1).get() == 1

    # And afterwards the missing setting is reported again
    assert isinstance(work.delay(1).result, ConfigurationError)


def test_the_configured_store_is_left_alone_and_restored() -> None:
    """Locks taken during an isolation never reach the configured store, which comes back."""
    # Given an app with its own (in-memory) store, holding a lock
    app = make_app(singletask_backend_url="memory://")
    work = singleton(app)
    configured = work.lock_backend
    key = lock_key_for(work, 1)
    assert configured.acquire(key, "outside", 30).acquired

    # When an isolation is in effect
    with isolated_locks(app) as locks:
        # Then the task sees a store without that lock, and holds its locks there
        assert work.lock_backend is not configured
        assert work.delay(1).get() == 1
        with hold_lock(work, 2) as held:
            assert configured.holder(held.key) is None
            assert locks.holder(held) is not None

    # And afterwards the configured store, unchanged, is the task's again
    assert work.lock_backend is configured
    holder = configured.holder(key)
    assert holder is not None
    assert holder.token == "outside"
    assert isinstance(work.delay(1).get(), Skipped)
    app.close()


def test_each_isolation_starts_empty(bare: celery.Celery) -> None:
    """A lock left held at the end of one isolation is not in the next one."""
    work = singleton(bare)
    with isolated_locks(bare):
        left = hold_lock(work, 1).acquire()  # never released
        assert left.held
    with isolated_locks(bare) as locks:
        locks.assert_free(left)
        assert work.delay(1).get() == 1


def test_a_hold_outliving_its_isolation_never_reaches_the_configured_store() -> None:
    """A hold released after its isolation ended is not released in the app's own store."""
    # Given a hold taken inside an isolation, and the app's own store holding the same key
    app = make_app(singletask_backend_url="memory://")
    work = singleton(app)
    with isolated_locks(app):
        held = hold_lock(work, 1).acquire()
    assert work.lock_backend.acquire(held.key, held.token, 30).acquired  # same token, even

    # When it is released afterwards / Then that fails, naming why, and the lock stays
    with pytest.raises(BackendUnavailable, match="the test's lock store is gone"):
        held.release()
    assert work.lock_backend.holder(held.key) is not None
    app.close()


def test_isolations_do_not_nest_and_tell_why(bare: celery.Celery) -> None:
    """A second isolation of the same app inside the first is refused, clearly."""
    with isolated_locks(bare), pytest.raises(RuntimeError, match="already isolated"):  # noqa: SIM117
        with locks_disabled(bare):
            pass


def test_many_isolations_start_one_renewer_thread(bare: celery.Celery) -> None:
    """Fresh stores per test do not leave a renewer thread behind per test."""

    def renewers() -> int:
        return sum(t.name == "singletask-renewer" for t in threading.enumerate())

    work = singleton(bare)
    before = renewers()
    for n in range(20):
        with isolated_locks(bare):
            assert work.delay(n).get() == n
    assert renewers() <= before + 1


def test_a_lock_is_renewed_while_the_body_runs(bare: celery.Celery) -> None:
    """The isolated store renews leases like any store: a body outliving lock_ttl keeps its lock."""
    seen: list[bool] = []

    @bare.task(base=SingletonTask, shared=False, name="plugin.slow", bind=True, lock_ttl=0.3)
    def slow(self: Any) -> None:
        threading.Event().wait(1.0)
        seen.append(self.lock.lost)

    with isolated_locks(bare):
        slow.delay()
    assert seen == [False]


def test_locks_disabled_restores_locking(bare: celery.Celery) -> None:
    """After locks_disabled, the next isolation locks again."""
    work = singleton(bare)
    with locks_disabled(bare):
        assert work.delay(1).get() == 1
    with isolated_locks(bare) as locks, hold_lock(work, 1) as held:
        assert isinstance(work.delay(1).get(), Skipped)
        locks.assert_skipped(held)


# -- a real server ------------------------------------------------------------------------------


def test_a_real_store_keeps_each_isolation_under_its_own_namespace(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """With a URL, locks live on that server under a namespace per isolation, never shared."""
    # Given two apps isolated on the same Redis at once (as two pytest-xdist workers would be)
    first, second = make_app(broker_url="memory://"), make_app(broker_url="memory://")
    work_first, work_second = singleton(first), singleton(second)
    with (
        isolated_locks(first, url=redis_url) as one,
        isolated_locks(second, url=redis_url) as two,
        hold_lock(work_first, 1) as held,
    ):
        # Then the lock is on the server, under a namespace, and only the first app sees it
        pattern = "*" + re.sub(r"([*?\[\]\\])", r"\\\1", held.key)  # the key, glob-escaped
        stored = [k.decode() for k in redis_client.scan_iter(match=pattern)]
        assert len(stored) == 1
        assert stored[0].startswith("singletask-test:")
        assert stored[0].endswith(held.key)
        assert one.holder(held) is not None
        assert two.holder(held) is None
        assert isinstance(work_first.delay(1).get(), Skipped)
        assert work_second.delay(1).get() == 1
        one.assert_skipped(held)
        assert two.conflicts == []
    # And released locks leave nothing behind
    assert redis_client.exists(stored[0]) == 0
    first.close()
    second.close()
