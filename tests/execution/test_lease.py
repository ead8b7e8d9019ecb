"""Leases in one process, against the private Redis: renewal, loss, max_hold, fencing.

The task bodies run eagerly (``task.apply``) so the lease machinery is exercised without a
worker; tests/e2e/test_faults.py covers the same rules with real worker processes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import celery
import pytest
import redis

from singletask import LockLost, SingletonTask
from singletask.signals import lock_lost

SHORT_LEASE = 0.6  # renewed every 0.2 s


@pytest.fixture
def app(redis_url: str, key_prefix: str, redis_client: redis.Redis) -> Iterator[celery.Celery]:
    app = celery.Celery("lease", set_as_current=False)
    app.conf.update(
        singletask_backend_url=redis_url,
        singletask_key_prefix=key_prefix,
        task_always_eager=True,
        task_eager_propagates=True,
    )
    yield app
    app.close()


def singleton(app: celery.Celery, **options: Any) -> Callable[[Callable[..., Any]], Any]:
    return app.task(base=SingletonTask, bind=True, shared=False, lazy=False, **options)


def test_a_renewed_lease_outlives_its_ttl_while_the_body_runs(
    app: celery.Celery, redis_client: redis.Redis
) -> None:
    """The holder keeps the lock for 5 leases: nobody else can take it meanwhile."""
    seen: dict[str, Any] = {}

    @singleton(app, name="lease.long", lock_ttl=SHORT_LEASE)
    def long(self: SingletonTask) -> None:
        seen["key"], seen["fence"] = self.lock.key, self.lock.fence
        deadline = time.monotonic() + 5 * SHORT_LEASE
        while time.monotonic() < deadline:
            # Then the key stays in Redis with a fresh lease the whole time
            assert redis_client.exists(self.lock.key)
            assert not self.lock.lost
            time.sleep(0.05)
        self.lock.check()  # does not raise

    # When a body runs five times longer than its lease
    long.apply()

    # Then it was never lost, it had a fencing token, and the lock is gone afterwards
    assert isinstance(seen["fence"], int)
    assert not redis_client.exists(seen["key"])


def test_a_lease_shorter_than_all_before_it_is_renewed_in_time(
    app: celery.Celery, redis_client: redis.Redis
) -> None:
    """The renewer sleeps a third of the shortest lease it knows; a shorter one wakes it."""

    @singleton(app, name="lease.usual", lock_ttl=30)
    def usual(self: SingletonTask) -> None:
        pass

    @singleton(app, name="lease.short", lock_ttl=SHORT_LEASE)
    def short(self: SingletonTask) -> None:
        deadline = time.monotonic() + 5 * SHORT_LEASE
        while time.monotonic() < deadline:
            assert not self.lock.lost
            time.sleep(0.05)
        self.lock.check()

    # Given a renewer that only knows 30 s leases, asleep for 10 s with nothing to renew
    usual.apply()

    # When an execution with a 0.6 s lease runs for five of its leases
    # Then its lease is renewed in time all along (the body's asserts)
    short.apply().get()


def test_renewal_costs_one_round_trip_per_interval_for_all_locks(
    app: celery.Celery, redis_client: redis.Redis
) -> None:
    """Three locks held in one process are renewed together, not one round trip each."""
    started = threading.Barrier(4)

    @singleton(app, name="lease.many", lock_ttl=SHORT_LEASE, lock_args=("n",))
    def hold(self: SingletonTask, n: int) -> None:
        started.wait(5)
        time.sleep(6 * SHORT_LEASE / 3 + 0.05)  # outlasts the counting window below

    def calls() -> int:
        stats = redis_client.info("commandstats")
        return sum(v["calls"] for k, v in stats.items() if k.startswith("cmdstat_eval"))

    # Given three executions holding three locks in three threads of this process
    threads = [threading.Thread(target=hold.apply, args=((n,),)) for n in range(3)]
    for thread in threads:
        thread.start()
    started.wait(5)
    before = calls()
    time.sleep(4 * SHORT_LEASE / 3)  # four renewal intervals

    # When we count script calls over four renewal intervals
    during = calls() - before
    for thread in threads:
        thread.join(10)

    # Then there was about one renewal call per interval (per-lock renewal would make 12)
    assert 2 <= during <= 6, during


def test_a_lock_taken_away_is_noticed_by_the_next_renewal(
    app: celery.Celery, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """If the lock disappears, the holder learns it: lost, check() raises, signal, ERROR log."""
    signals: list[dict[str, Any]] = []

    def on_lost(sender: Any, **kwargs: Any) -> None:
        signals.append(kwargs)

    lock_lost.connect(on_lost, weak=False)
    outcome: dict[str, Any] = {}

    @singleton(app, name="lease.stolen", lock_ttl=SHORT_LEASE)
    def stolen(self: SingletonTask) -> None:
        # Given the lock deleted behind the holder's back (e.g. by an operator or eviction)
        redis_client.delete(self.lock.key)
        deadline = time.monotonic() + 3 * SHORT_LEASE
        while not self.lock.lost and time.monotonic() < deadline:
            time.sleep(0.02)
        outcome["lost"] = self.lock.lost
        with pytest.raises(LockLost) as caught:
            self.lock.check()
        outcome["error"] = caught.value

    try:
        with caplog.at_level("ERROR", logger="singletask"):
            stolen.apply()
    finally:
        lock_lost.disconnect(on_lost)

    # Then the renewal noticed it within the lease
    assert outcome["lost"] is True
    assert outcome["error"].key.endswith("lease.stolen")
    assert signals
    assert signals[0]["key"].endswith("lease.stolen")
    assert any("lost while the task runs" in r.getMessage() for r in caplog.records)


def test_without_renewal_the_lease_is_lost_when_its_ttl_has_passed(app: celery.Celery) -> None:
    outcome: dict[str, bool] = {}

    @singleton(app, name="lease.fixed", lock_ttl=SHORT_LEASE, lock_renew=False)
    def fixed(self: SingletonTask) -> None:
        outcome["at_start"] = self.lock.lost
        time.sleep(SHORT_LEASE + 0.2)
        outcome["after_ttl"] = self.lock.lost

    fixed.apply()

    assert outcome == {"at_start": False, "after_ttl": True}


def test_renewal_stops_at_max_hold(app: celery.Celery, redis_client: redis.Redis) -> None:
    """After lock_max_hold the lease is no longer renewed and runs out within one ttl."""
    outcome: dict[str, Any] = {}

    @singleton(app, name="lease.capped", lock_ttl=SHORT_LEASE, lock_max_hold=SHORT_LEASE)
    def capped(self: SingletonTask) -> None:
        deadline = time.monotonic() + 4 * SHORT_LEASE
        while redis_client.exists(self.lock.key) and time.monotonic() < deadline:
            time.sleep(0.02)
        outcome["gone_after"] = time.monotonic() - (deadline - 4 * SHORT_LEASE)
        outcome["lost"] = self.lock.lost

    capped.apply()

    # Then the key expired between max_hold and max_hold + ttl (+ scheduling slack)
    assert SHORT_LEASE <= outcome["gone_after"] <= 2 * SHORT_LEASE + 0.5
    assert outcome["lost"] is True


def test_fences_of_successive_runs_increase(app: celery.Celery) -> None:
    fences: list[int] = []

    @singleton(app, name="lease.fenced")
    def fenced(self: SingletonTask) -> None:
        assert self.lock.fence is not None
        fences.append(self.lock.fence)

    for _ in range(3):
        fenced.apply()

    assert fences == sorted(set(fences))
    assert len(fences) == 3
