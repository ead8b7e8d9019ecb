"""End to end on the lock stores besides Redis (``LOCK_STORES`` in conftest.py): real prefork
workers whose locks live in PostgreSQL, MariaDB, ... while the broker is a private Redis.

Each test gets workers and servers of its own (a :class:`~tests.e2e.faults.FaultEnv`) and a
fresh lock store, reached through a :class:`~tests.e2e.proxy.TcpProxy` so that the store can be
taken "down" without touching the machine's shared database server. The test process watches
the locks with a backend of its own, connected to the store directly. Named limits on these
stores (and SQLite): test_stores_units.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from billiard.exceptions import WorkerLostError
from celery import Celery, group

from singletask import ConfigurationError, SingletonTask, Skipped, TaskLocked
from singletask.backends import backend_from_url
from singletask.backends.base import LockBackend
from singletask.protocol.slots import slot_keys

from .conftest import LOCK_STORES
from .faults import BOUND, FaultEnv
from .proxy import TcpProxy
from .tasks_faults import LEASE, LONG_LEASE
from .tasks_faults import PREFIX as FAULTS
from .tasks_limits import PREFIX as LIMITS
from .tasks_policies import PREFIX as POLICIES
from .tasks_policies import TTL, gate_key
from .tasks_replace import PREFIX as REPLACE
from .tasks_replace import TTL as REPLACE_TTL
from .tasks_replace import resource_key
from .test_replace import successor_ends_first

pytestmark = [pytest.mark.e2e, pytest.mark.stores]

DUPLICATES = 60


class StoreEnv:
    """A FaultEnv whose lock store is one of LOCK_STORES, behind a proxy; see the docstring."""

    def __init__(self, env: FaultEnv, proxy: TcpProxy, locks: LockBackend) -> None:
        self.env = env
        self.proxy = proxy
        self.locks = locks

    def task(self, name: str) -> Any:
        return self.env.app.tasks[name]

    def key_of(self, name: str, **kwargs: Any) -> str:
        return str(self.task(name).lock_key_for((), kwargs))

    def wait_free(self, key: str, timeout: float = BOUND) -> None:
        self.env.wait_until(lambda: self.locks.holder(key) is None, f"{key!r} free", timeout)

    def open_gate(self, label: str) -> None:
        self.env.probe.client.rpush(gate_key(label), "open")


@pytest.fixture(params=list(LOCK_STORES))
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreEnv]:
    with LOCK_STORES[request.param]() as url:
        proxy, proxied = TcpProxy.for_url(url)
        proxy.start()
        # A short timeout: a worker notices a store that went away within 2 s.
        env = FaultEnv(tmp_path, lock_store=f"{proxied}&timeout=2")
        locks = backend_from_url(url)
        try:
            yield StoreEnv(env, proxy, locks)
        finally:
            env.close()
            proxy.stop()
            locks.close()


def label_of() -> str:
    return f"store-{time.time_ns()}"


def test_the_three_policies_meet_a_lock_held_in_the_store(store: StoreEnv) -> None:
    """skip returns a Skipped naming the holder, raise fails with TaskLocked, retry waits for
    the holder and then runs: each against a lock held in this store."""
    env = store.env
    env.start_worker()
    for name, duplicate_is in (
        ("skip_none", "skipped"),
        ("raise_locked", "raised"),
        ("retry_patient", "ran after"),
    ):
        # Given a singleton held by one execution (its body waits on a gate)
        label = label_of()
        task = store.task(POLICIES + name)
        holder = task.delay(label, hold=True)
        env.probe.wait_for(label, "start")
        key = store.key_of(POLICIES + name, label=label)
        lock = store.locks.holder(key)
        assert lock is not None
        assert lock.task_id == holder.id

        # When a duplicate runs on the other pool process
        duplicate = task.delay(label)
        if duplicate_is == "skipped":
            # Then skip: it returns at once, naming the holder and its lease
            skipped = duplicate.get(timeout=BOUND)
            assert isinstance(skipped, Skipped), skipped
            assert skipped.holder == holder.id
            assert skipped.ttl is not None
            assert 0 < skipped.ttl <= TTL
        elif duplicate_is == "raised":
            # Then raise: the caller gets TaskLocked naming the holder
            with pytest.raises(TaskLocked) as raised:
                duplicate.get(timeout=BOUND)
            assert raised.value.holder == holder.id
        else:
            # Then retry: it lock-retries while the holder runs ...
            env.wait_until(
                lambda label=label: len(env.probe.events(label, "conflict")) >= 2,
                "two lock retries",
            )
            assert not duplicate.ready()
        store.open_gate(label)
        holder.get(timeout=BOUND)
        if duplicate_is == "ran after":
            # ... and runs once the holder is done
            assert duplicate.get(timeout=BOUND) == {"retries": 0}
            assert [s["task_id"] for s in env.probe.starts(label)] == [holder.id, duplicate.id]
        else:
            assert [s["task_id"] for s in env.probe.starts(label)] == [holder.id]
        assert env.probe.max_overlap(label) == 1
        store.wait_free(key)


def test_sixty_concurrent_duplicates_never_overlap(store: StoreEnv) -> None:
    """60 duplicates published at once to four pool processes on two workers: no two bodies
    ever run together, and every duplicate ran or was skipped in favour of one that ran."""
    env = store.env
    env.start_worker()
    env.start_worker()
    label = label_of()
    task = store.task(POLICIES + "race_skip")

    values = group(task.s(label, 0.3) for _ in range(DUPLICATES)).apply_async().get(timeout=90)

    assert env.probe.max_overlap(label) == 1, env.explain()
    ran = [value for value in values if not isinstance(value, Skipped)]
    skipped = [value for value in values if isinstance(value, Skipped)]
    assert len(values) == DUPLICATES
    assert ran
    assert skipped
    assert {start["task_id"] for start in env.probe.starts(label)} == set(ran)
    assert {s.holder for s in skipped} <= set(ran)
    store.wait_free(store.key_of(POLICIES + "race_skip", label=label, seconds=0.3))


def test_a_renewed_lease_keeps_a_body_four_leases_long_exclusive(store: StoreEnv) -> None:
    """A 2 s lease renewed in the store while a body runs 8 s: the lock never lapses, and a
    duplicate arriving midway is skipped in the holder's favour."""
    env = store.env
    env.start_worker()
    label = label_of()
    task = store.task(FAULTS + "renewed")
    key = store.key_of(FAULTS + "renewed", label=label)

    holder = task.apply_async(kwargs={"label": label, "seconds": 4 * LEASE})
    (start,) = env.wait_starts(label, 1)
    missing: list[float] = []
    duplicate = None
    while time.time() < start["t"] + 3.5 * LEASE:
        if store.locks.holder(key) is None:
            missing.append(time.time() - start["t"])
        if duplicate is None and time.time() > start["t"] + 2.5 * LEASE:
            duplicate = task.apply_async(kwargs={"label": label})
        time.sleep(0.1)

    assert not missing, f"lock missing at {missing} s into the body\n{env.explain()}"
    assert duplicate is not None
    skipped = duplicate.get(timeout=BOUND)
    assert isinstance(skipped, Skipped), skipped
    assert skipped.holder == holder.id
    value = holder.get(timeout=BOUND)
    assert value["lost"] is False, env.explain()
    assert env.probe.max_overlap(label) == 1


def test_crashed_holders_free_their_locks(store: StoreEnv) -> None:
    """A SIGKILLed pool process's lock is freed by its worker long before its 60 s lease; a
    SIGKILLed whole worker's lock lapses within a few 2 s leases; the next runs go ahead."""
    env = store.env
    env.start_worker()
    env.start_worker()

    # Given a 60 s lease held by a body, When its pool process is SIGKILLed
    label = label_of()
    long_lease = store.task(FAULTS + "long_lease")
    key = store.key_of(FAULTS + "long_lease", label=label)
    holder = long_lease.apply_async(kwargs={"label": label, "seconds": 30})
    (start,) = env.wait_starts(label, 1)
    env.kill_process(start["pid"])
    # Then the worker frees it far sooner than the lease would
    store.wait_free(key, timeout=LONG_LEASE / 3)
    env.wait_until(lambda: holder.state == "FAILURE", "the killed task to fail")
    assert isinstance(holder.result, WorkerLostError), holder.result

    # Given a renewed 2 s lease held by a body, When its whole worker is SIGKILLed
    label = label_of()
    renewed = store.task(FAULTS + "renewed")
    key = store.key_of(FAULTS + "renewed", label=label)
    renewed.apply_async(kwargs={"label": label, "seconds": 30})
    (start,) = env.wait_starts(label, 1)
    victim = env.worker_running(start["pid"])
    env.kill_worker(victim)
    # Then nobody renews it: it lapses within a few leases, and the next run goes ahead
    store.wait_free(key, timeout=3 * LEASE)
    following = renewed.apply_async(kwargs={"label": label, "seconds": 0.1})
    assert following.get(timeout=BOUND)["lost"] is False
    assert env.probe.max_overlap(label) == 1


def test_with_the_store_down_a_task_is_retried_not_run_and_runs_once_it_is_back(
    store: StoreEnv,
) -> None:
    """The store goes away (every connection cut, new ones refused): a singleton is retried,
    never run unlocked; once the store is back it runs, once."""
    env = store.env
    env.start_worker()
    # Warm the workers' pools so that the outage also cuts established connections.
    warm = store.task(FAULTS + "store_retry").apply_async(kwargs={"label": label_of()})
    warm.get(timeout=BOUND)

    # Given the store down
    store.proxy.stop()
    label = label_of()

    # When a singleton is sent, Then it is retried instead of running unlocked
    message = store.task(FAULTS + "store_retry").apply_async(
        kwargs={"label": label, "seconds": 0.1}
    )
    env.wait_until(lambda: env.received(message.id) >= 2, "the task to be retried")
    assert env.starts(label) == []
    assert not message.ready()
    # (the child logs the retry after publishing it: the log line may follow the receipt)
    env.wait_until(
        lambda: env.log_lines("BackendUnavailable") or env.log_lines("unavailable"),
        "the retry to be logged",
    )

    # When the store is back, Then it runs, once, after that
    back = time.time()
    store.proxy.start()
    value = message.get(timeout=BOUND + 20)
    assert value["lost"] is False
    (start,) = env.starts(label)
    assert start["t"] >= back
    assert start["locked"] is True


def test_a_limit_of_two_runs_two_at_once_and_skips_a_third_naming_both(store: StoreEnv) -> None:
    """``lock_limit = 2`` across two workers: two exports of one label run together, the third
    is skipped naming both; memcached refuses such a task when it is bound."""
    if not store.locks.supports_limit:
        app = Celery("limit-on-memcached", set_as_current=False)
        app.conf.update(singletask_backend_url=store.env.app.conf.singletask_backend_url)
        with pytest.raises(ConfigurationError, match="keeps one holder per key"):
            app.task(
                base=SingletonTask, name=LIMITS + "refused", lock_limit=2, lazy=False, shared=False
            )(_refused)
        app.close()
        return
    env = store.env
    env.start_worker()
    env.start_worker()
    label = label_of()
    task = store.task(LIMITS + "export")
    key = str(task.lock_key_for((label,)))

    # Given two exports of one label holding both slots (their bodies wait on the gate)
    holders = [task.apply_async((label,), {"hold": True}) for _ in range(2)]
    env.probe.wait_for(label, "start", count=2)

    # When a third is sent
    third = task.apply_async((label,)).get(timeout=BOUND)

    # Then it is skipped, naming both holders, and never more than two ran at once
    assert isinstance(third, Skipped), third
    assert set(third.holders) == {h.id for h in holders}
    store.env.probe.client.rpush(gate_key(label), "open", "open")
    assert {h.get(timeout=BOUND)["key"] for h in holders} == set(slot_keys(key, 2))
    assert env.probe.max_overlap(label) == 2, env.explain()
    for slot in slot_keys(key, 2):
        store.wait_free(slot)


def _refused() -> None:
    """The body of a task that memcached refuses (see above)."""


def test_a_rate_and_a_debounce_are_kept_in_the_store(store: StoreEnv) -> None:
    """On a real worker: a start over ``lock_rate`` is skipped saying it was the rate, and a
    burst of debounced sends runs once, the last; memcached refuses both when bound."""
    if not store.locks.supports_rate:
        app = Celery("rate-on-memcached", set_as_current=False)
        app.conf.update(singletask_backend_url=store.env.app.conf.singletask_backend_url)
        for option, value in (("lock_rate", "1/s"), ("lock_debounce", 1.0)):
            with pytest.raises(ConfigurationError, match=rf"{option}: the memcached://"):
                app.task(
                    base=SingletonTask,
                    name=LIMITS + option,
                    lazy=False,
                    shared=False,
                    **{option: value},
                )(_refused)
        app.close()
        return
    env = store.env
    env.start_worker()

    # Given a task allowed one start a minute per label: three calls, one runs
    label = label_of()
    rated = store.task(LIMITS + "call_partner_skip")
    outcomes = [r.get(timeout=BOUND) for r in [rated.delay(label) for _ in range(3)]]
    skipped = [o for o in outcomes if isinstance(o, Skipped)]
    assert len(skipped) == 2, outcomes
    assert {s.reason for s in skipped} == {"rate"}

    # And a task debounced by 1 s: four sends at once, only the last runs
    label = label_of()
    debounced = store.task(LIMITS + "rebuild")
    sends = [debounced.delay(label, version) for version in range(4)]
    outcomes = [s.get(timeout=BOUND) for s in sends]
    assert outcomes[-1] == 3
    assert all(isinstance(o, Skipped) and o.reason == "debounced" for o in outcomes[:-1])
    assert [s["version"] for s in env.probe.starts(label)] == [3]


def test_a_newer_execution_preempts_the_running_one_in_the_store(store: StoreEnv) -> None:
    """``lock_policy = "replace"`` on a real prefork worker: the newer execution of a key runs
    at once with a larger fence, the running one learns it within one renewal interval, its
    late fenced write is refused and it ends replaced; memcached refuses the policy when bound."""
    if not store.locks.supports_replace:
        app = Celery("replace-on-memcached", set_as_current=False)
        app.conf.update(singletask_backend_url=store.env.app.conf.singletask_backend_url)
        with pytest.raises(ConfigurationError, match="lock_policy: the memcached:// lock store"):
            app.task(
                base=SingletonTask, name=REPLACE + "refused", lock_policy="replace", lazy=False,
                shared=False,
            )(_refused)  # fmt: skip
        app.close()
        return
    env = store.env
    env.start_worker()
    label = label_of()
    task = store.task(REPLACE + "rebuild")

    # Given version 1 running
    older = task.apply_async((label, 1))
    first = env.probe.wait_for(label, "start")[0]

    # When version 2 of the same key is sent
    newer = task.apply_async((label, 2))

    # Then it runs at once, with a larger fence
    second = next(s for s in env.probe.wait_for(label, "start", count=2) if s["version"] == 2)
    assert second["fence"] > first["fence"]
    # And the older one learned it within one renewal interval, and its late write was refused
    preempted = env.probe.wait_for(label, "preempted")[0]
    assert (preempted["task_id"], preempted["successor"]) == (older.id, newer.id)
    assert preempted["t"] - second["t"] < REPLACE_TTL / 3 + 1.0
    assert preempted["late_write"] is False
    assert env.probe.client.hget(resource_key(label), "value") == "2"
    # And it ended replaced, naming the newer one, which finishes when let go
    value = older.get(timeout=BOUND)
    assert isinstance(value, Skipped)
    assert (value.reason, value.holder) == ("replaced", newer.id)
    store.open_gate(label)
    assert newer.get(timeout=BOUND) == 2
    store.wait_free(str(task.lock_key_for((label, 0))))

    # And a run whose newer execution has ended before its next renewal still ends replaced
    label = label_of()
    try:
        successor_ends_first(store.task(REPLACE + "rebuild_long"), env.probe, label)
    finally:
        store.open_gate(label)
