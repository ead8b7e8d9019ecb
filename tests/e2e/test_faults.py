"""Fault injection: leases, renewal, fencing, crashes, redelivery and lock store faults, on real
prefork workers.

Each test gets processes of its own (:class:`~tests.e2e.faults.FaultEnv`): a Redis server for
broker, results and probe, a lock store Redis server it may stop, restart or freeze, and workers
it may SIGKILL. Every test asserts both halves of the promise:

* mutual exclusion: the probe's overlap detector (which stays right when a body is killed) never
  saw two bodies of one key at once, unless the test is about the documented way to give that up
  (``lock_renew=False``, ``lock_max_hold``);
* nothing lost: every message that should run ran its body exactly once (probe ``start`` events
  per task id), and a message whose body was killed ran once more.

These tests run on the Redis broker only: the faults are in the lock store and in the workers,
and the visibility-timeout redelivery they check is a Redis transport behaviour; RabbitMQ is not
needed. Leases are short (2 s) so recovery is fast; bounds are generous (several leases), and no
test asserts how fast something happened beyond such a bound. Hard time limits and
``revoke(terminate=True)`` are covered in test_endings.py.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from billiard.exceptions import WorkerLostError

from singletask import BackendUnavailable, Skipped

from .faults import BOUND, SHORT_VISIBILITY, FaultEnv, needs_short_visibility
from .tasks_faults import LEASE, LONG_LEASE, MAX_HOLD, PREFIX, SHORT_BACKEND_BUDGET

pytestmark = pytest.mark.e2e

#: The lock store's password in the tests that check it never leaks.
PASSWORD = "s3cret-lock-pw"

#: Makes every lock store operation of the workers give up after 1 s.
SOCKET_TIMEOUT = "socket_timeout=1"


@pytest.fixture
def faults(tmp_path: Path) -> Iterator[Callable[..., FaultEnv]]:
    """``faults(**options)`` builds a :class:`FaultEnv`; all of it is torn down after the test."""
    envs: list[FaultEnv] = []

    def make(**options: Any) -> FaultEnv:
        envs.append(FaultEnv(tmp_path / f"env-{len(envs)}", **options))
        return envs[-1]

    yield make
    for env in envs:
        env.close()


def new_label() -> str:
    return uuid.uuid4().hex[:12]


def task(env: FaultEnv, name: str) -> Any:
    return env.app.tasks[PREFIX + name]


def key_of(env: FaultEnv, name: str, label: str) -> str:
    return str(task(env, name).lock_key_for((), {"label": label}))


def ran(value: Any, env: FaultEnv) -> dict[str, Any]:
    """``value`` is what a body returned (not a skip); return it."""
    assert not isinstance(value, Skipped), f"skipped: {value!r}\n{env.explain()}"
    assert isinstance(value, dict), value
    return value


def assert_exclusive_and_once(env: FaultEnv, label: str, runs: dict[str, int]) -> None:
    """No two bodies of ``label`` overlapped, and each task id ran its body ``runs[id]`` times."""
    starts = env.starts(label)
    counted = {task_id: sum(1 for s in starts if s["task_id"] == task_id) for task_id in runs}
    assert counted == runs, f"body starts per task id: {starts}\n{env.explain()}"
    assert len(starts) == sum(runs.values()), f"unexpected starts: {starts}"
    assert env.probe.max_overlap(label) == 1, f"bodies overlapped: {starts}\n{env.explain()}"


def sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.time()))


# -- renewal and fencing tokens ------------------------------------------------------------


def test_a_renewed_lease_keeps_a_body_four_leases_long_exclusive(
    faults: Callable[..., FaultEnv],
) -> None:
    # Given a worker and a singleton with a 2 s lease that is renewed while its body runs
    env = faults()
    env.start_worker()
    renewed = task(env, "renewed")
    label = new_label()
    key = key_of(env, "renewed", label)

    # When its body runs for four leases
    holder = renewed.apply_async(kwargs={"label": label, "seconds": 4 * LEASE})
    (start,) = env.wait_starts(label, 1)

    # Then its lock stays stored all along (watched until shortly before the body ends)
    duplicate = None
    missing: list[float] = []
    while time.time() < start["t"] + 3.5 * LEASE:
        if not env.key_exists(key):
            missing.append(time.time() - start["t"])
        # and a duplicate arriving after 2.5 leases is still skipped in its favour
        if duplicate is None and time.time() > start["t"] + 2.5 * LEASE:
            duplicate = renewed.apply_async(kwargs={"label": label})
        time.sleep(0.1)
    assert not missing, f"lock missing at {missing} s into the body\n{env.explain()}"
    assert duplicate is not None
    skipped = duplicate.get(timeout=BOUND)
    assert isinstance(skipped, Skipped), skipped
    assert skipped.holder == holder.id

    # And the body never saw its lock lost, and held an integer fencing token
    value = ran(holder.get(timeout=BOUND), env)
    assert value["lost"] is False, env.explain()
    assert isinstance(value["fence"], int), value
    assert not isinstance(value["fence"], bool)
    assert_exclusive_and_once(env, label, {holder.id: 1, duplicate.id: 0})


def test_fencing_tokens_of_a_key_increase_across_an_expired_lock_and_a_store_restart(
    faults: Callable[..., FaultEnv],
) -> None:
    # Given a lock store that keeps its data across a restart, and released keys their last
    # fencing token (fence_retention), and a singleton whose 2 s lease is not renewed (so a lock
    # can be made to expire)
    env = faults(persistent=True, lock_options={"fence_retention": 600})
    env.start_worker()
    fixed = task(env, "fixed")
    label = new_label()
    key = key_of(env, "fixed", label)
    runs: list[Any] = []
    fences: list[Any] = []

    def run(seconds: float = 0.1) -> None:
        runs.append(fixed.apply_async(kwargs={"label": label, "seconds": seconds}))
        fences.append(ran(runs[-1].get(timeout=BOUND), env)["fence"])

    # When runs of one key follow each other
    run()
    run()
    # and one outlives its lease, so that its lock expires while it runs
    outliving = fixed.apply_async(kwargs={"label": label, "seconds": LEASE + 1.5})
    env.wait_starts(label, 3)
    env.wait_free(key, timeout=2 * LEASE)
    assert not outliving.ready()
    runs.append(outliving)
    fences.append(ran(outliving.get(timeout=BOUND), env)["fence"])
    run()
    # and the lock store is restarted with its data
    env.lock_server.restart()
    client = env.lock_client()
    try:
        assert client.dbsize() > 0, "the lock store came back without its data"
    finally:
        client.close()
    run()

    # Then every run got an integer fencing token greater than every earlier one
    assert all(isinstance(f, int) and not isinstance(f, bool) for f in fences), fences
    assert fences == sorted(set(fences)), fences  # strictly increasing
    assert_exclusive_and_once(env, label, {r.id: 1 for r in runs})


# -- the switches: lock_renew=False and lock_max_hold --------------------------------------


def test_without_renewal_a_body_longer_than_its_lease_loses_exclusivity(
    faults: Callable[..., FaultEnv],
) -> None:
    # Given a singleton with lock_renew=False and a 2 s lease, running a body of three leases
    env = faults()
    env.start_worker()
    fixed = task(env, "fixed")
    label = new_label()
    holder = fixed.apply_async(kwargs={"label": label, "seconds": 3 * LEASE})
    env.wait_starts(label, 1)

    # When its lease runs out while the body still runs
    env.wait_free(key_of(env, "fixed", label), timeout=2 * LEASE)
    assert not holder.ready()

    # Then a late duplicate is not skipped: it runs alongside (the documented fixed lease)
    duplicate = fixed.apply_async(kwargs={"label": label, "seconds": 0.1})
    ran(duplicate.get(timeout=BOUND), env)
    assert not holder.ready()
    assert env.probe.max_overlap(label) == 2, env.starts(label)
    assert [s["task_id"] for s in env.starts(label)] == [holder.id, duplicate.id]


def test_renewal_stops_after_lock_max_hold_and_the_lease_then_runs_out(
    faults: Callable[..., FaultEnv],
) -> None:
    # Given a singleton with a 2 s lease renewed for 4 s at most (lock_max_hold), whose body
    # runs far longer
    env = faults()
    env.start_worker()
    capped = task(env, "capped")
    label = new_label()
    key = key_of(env, "capped", label)
    holder = capped.apply_async(kwargs={"label": label, "seconds": MAX_HOLD + 4 * LEASE})
    (start,) = env.wait_starts(label, 1)

    # When a duplicate arrives after the first lease but before lock_max_hold
    sleep_until(start["t"] + (LEASE + MAX_HOLD) / 2)
    early = capped.apply_async(kwargs={"label": label})

    # Then it is skipped: the lease was renewed
    skipped = early.get(timeout=BOUND)
    assert isinstance(skipped, Skipped), skipped
    assert skipped.holder == holder.id

    # When lock_max_hold has passed, the lease runs out within about one more lease
    env.wait_free(key, timeout=start["t"] + MAX_HOLD + 3 * LEASE - time.time())
    assert not holder.ready()

    # Then a late duplicate runs, while the capped holder still runs
    late = capped.apply_async(kwargs={"label": label, "seconds": 0.1})
    ran(late.get(timeout=BOUND), env)
    assert not holder.ready()
    assert env.probe.max_overlap(label) == 2, env.starts(label)
    assert [s["task_id"] for s in env.starts(label)] == [holder.id, late.id]


# -- a killed pool process, a killed worker ------------------------------------------------


def test_a_killed_pool_process_frees_its_lock_within_seconds_not_after_its_lease(
    faults: Callable[..., FaultEnv],
) -> None:
    # Given a singleton with a 60 s lease running on a worker
    env = faults()
    env.start_worker()
    long_lease = task(env, "long_lease")
    label = new_label()
    key = key_of(env, "long_lease", label)
    holder = long_lease.apply_async(kwargs={"label": label, "seconds": 30})
    (start,) = env.wait_starts(label, 1)

    # When the pool process running it is SIGKILLed
    env.kill_process(start["pid"])

    # Then the worker frees the lock far sooner than the lease would have
    env.wait_free(key, timeout=min(BOUND, LONG_LEASE / 3))
    env.wait_until(lambda: holder.state == "FAILURE", "the killed task to fail")
    assert isinstance(holder.result, WorkerLostError), holder.result

    # And the next run goes ahead
    following = long_lease.apply_async(kwargs={"label": label, "seconds": 0.1})
    ran(following.get(timeout=BOUND), env)
    assert_exclusive_and_once(env, label, {holder.id: 1, following.id: 1})


def test_a_killed_worker_frees_its_locks_within_one_lease(
    faults: Callable[..., FaultEnv],
) -> None:
    # Given two workers, one running a singleton with a 2 s renewed lease
    env = faults()
    env.start_worker()
    env.start_worker()
    renewed = task(env, "renewed")
    label = new_label()
    key = key_of(env, "renewed", label)
    holder = renewed.apply_async(kwargs={"label": label, "seconds": 30})
    (start,) = env.wait_starts(label, 1)
    victim = env.worker_running(start["pid"])
    (survivor,) = [w for w in env.workers if w is not victim]

    # When that whole worker is SIGKILLed (main process and pool processes)
    env.kill_worker(victim)

    # Then nobody renews the lease any more: the lock is free within a few leases at most
    env.wait_free(key, timeout=3 * LEASE)

    # And a new run goes ahead on the other worker
    following = renewed.apply_async(kwargs={"label": label, "seconds": 0.1})
    assert ran(following.get(timeout=BOUND), env)["pid"] in survivor.children()
    assert_exclusive_and_once(env, label, {holder.id: 1, following.id: 1})


# -- redelivered messages ------------------------------------------------------------------


def test_acks_late_message_of_a_killed_pool_process_runs_once_more(
    faults: Callable[..., FaultEnv],
) -> None:
    # Given an acks_late + reject_on_worker_lost singleton whose first delivery runs long
    env = faults()
    env.start_worker()
    late = task(env, "late")
    label = new_label()
    message = late.apply_async(kwargs={"label": label, "seconds": 0.2, "first_seconds": 30})
    (first,) = env.wait_starts(label, 1)

    # When the pool process running it is SIGKILLed (the worker requeues the message)
    env.kill_process(first["pid"])

    # Then the redelivered message, same task id, runs its body once more, never alongside
    value = ran(message.get(timeout=BOUND + 3 * LEASE), env)
    assert value["pid"] != first["pid"]
    env.wait_quiet()
    starts = env.starts(label, message.id)
    assert [s["first"] for s in starts] == [True, False], starts
    assert_exclusive_and_once(env, label, {message.id: 2})


def test_a_redelivered_copy_refused_by_the_rate_releases_what_its_killed_delivery_held(
    faults: Callable[..., FaultEnv],
) -> None:
    """Issue 37 (seed 103562083): the copy's takeover of the hold its killed delivery left is a
    start, which the rate refused; the copy ended ``Skipped(reason="rate")`` and left that hold
    for the rest of its lease, so sends of ``lock_scope = "queue"`` were deduplicated onto a
    message that had ended, and never ran."""
    # Given an acks_late + reject_on_worker_lost singleton with one start a minute, whose first
    # delivery runs long
    env = faults()
    env.start_worker()
    rated = task(env, "late_rated")
    label = new_label()
    message = rated.apply_async(kwargs={"label": label, "seconds": 0.2, "first_seconds": 30})
    (first,) = env.wait_starts(label, 1)

    # When the pool process running it is SIGKILLed (the worker requeues the message)
    env.kill_process(first["pid"])

    # Then the redelivered copy is refused by the rate: the body has started once this minute
    skipped = message.get(timeout=BOUND)
    assert isinstance(skipped, Skipped), skipped
    assert skipped.reason == "rate", skipped
    # And the message, ended, holds nothing: a later send is published, not deduplicated onto it
    later = rated.apply_async(kwargs={"label": label, "seconds": 0.1})
    assert later.id != message.id, env.explain()
    refused = later.get(timeout=BOUND)
    assert isinstance(refused, Skipped), refused
    assert refused.reason == "rate", refused
    assert [s["task_id"] for s in env.starts(label)] == [message.id]


@needs_short_visibility
def test_visibility_timeout_restores_the_message_of_a_killed_worker_and_it_runs_once_more(
    faults: Callable[..., FaultEnv],
) -> None:
    # Given two workers on a Redis broker that redelivers unacknowledged messages after 3 s,
    # one running an acks_late singleton whose first delivery runs long
    env = faults(transport=SHORT_VISIBILITY)
    env.start_worker()
    env.start_worker()
    late = task(env, "late")
    label = new_label()
    message = late.apply_async(kwargs={"label": label, "seconds": 0.2, "first_seconds": 30})
    (first,) = env.wait_starts(label, 1)
    victim = env.worker_running(first["pid"])
    (survivor,) = [w for w in env.workers if w is not victim]

    # When that whole worker is SIGKILLed before acknowledging it
    env.kill_worker(victim)

    # Then the broker restores the message, and it runs on the other worker once its dead
    # holder's lease is over; it runs once, never alongside
    value = ran(message.get(timeout=BOUND + 3 * LEASE), env)
    assert value["pid"] in survivor.children()
    env.wait_quiet()
    assert_exclusive_and_once(env, label, {message.id: 2})


@needs_short_visibility
def test_a_visibility_timeout_duplicate_of_a_running_task_never_runs_its_body(
    faults: Callable[..., FaultEnv],
) -> None:
    # Given a Redis broker that redelivers unacknowledged messages after 3 s, and an acks_late
    # singleton running far longer than that
    env = faults(transport=SHORT_VISIBILITY)
    worker = env.start_worker()
    late = task(env, "late")
    label = new_label()
    running_for = 2.5 * SHORT_VISIBILITY["visibility_timeout"]
    message = late.apply_async(
        kwargs={"label": label, "seconds": 0.2, "first_seconds": running_for}
    )
    (first,) = env.wait_starts(label, 1)

    # When the broker delivers the message again while its first delivery still runs
    env.wait_until(
        lambda: env.received(message.id) >= 2, "a second delivery of the message", running_for
    )
    assert not message.ready()

    # Then the holder completes with its own result
    value = ran(message.get(timeout=BOUND + running_for), env)
    assert value["pid"] == first["pid"]
    assert value["pid"] in worker.children()
    # And once every copy of the message is gone from the broker, its body ran that once
    env.wait_quiet()
    assert_exclusive_and_once(env, label, {message.id: 1})


# -- lease loss ----------------------------------------------------------------------------


def assert_loss_reported(env: FaultEnv, label: str, key: str, task_id: str) -> None:
    """The worker logged an ERROR about the lost lock, and sent one ``lock_lost`` signal."""
    env.wait_until(
        lambda: [line for line in env.log_lines("ERROR", "lost") if key in line or task_id in line],
        f"an ERROR log line about the loss of {key!r}",
        timeout=5,
    )
    signals = env.wait_until(
        lambda: [e for e in env.probe.events(label, "lock_lost") if e["task_id"] == task_id],
        f"the lock_lost signal of {task_id}",
        timeout=5,
    )
    assert len(signals) == 1, signals
    assert signals[0]["key"] == key


def test_a_holder_whose_lock_vanishes_from_the_store_learns_it_from_its_renewal(
    faults: Callable[..., FaultEnv],
) -> None:
    # Given a singleton with a 2 s renewed lease running
    env = faults()
    env.start_worker()
    stalled = task(env, "stalled")
    label = new_label()
    key = key_of(env, "stalled", label)
    holder = stalled.apply_async(kwargs={"label": label, "wait": 15.0})
    env.wait_starts(label, 1)

    # When its lock disappears from the store (evicted, or lost in a failover)
    client = env.lock_client()
    try:
        assert client.delete(key) == 1
    finally:
        client.close()

    # Then the body learns it: lock.lost, and lock.check() raises LockLost
    (observed,) = env.probe.wait_for(label, "observed", timeout=BOUND)
    assert observed["lost"] is True, f"{observed}\n{env.explain()}"
    assert observed["raised"] == "LockLost", observed
    assert observed["singletask_error"] is True
    assert holder.get(timeout=BOUND) == {"lost": True, "raised": "LockLost"}
    # And the worker logged an ERROR, and sent the lock_lost signal
    assert_loss_reported(env, label, key, holder.id)
    assert_exclusive_and_once(env, label, {holder.id: 1})


# -- lock store faults ---------------------------------------------------------------------


def test_with_the_lock_store_down_a_task_is_retried_not_run_and_runs_once_it_is_back(
    faults: Callable[..., FaultEnv],
) -> None:
    # Given a worker whose lock store is down, and a singleton with the default
    # lock_on_backend_error="retry"
    env = faults(lock_query=SOCKET_TIMEOUT)
    env.start_worker()
    env.lock_server.stop()
    label = new_label()

    # When it is sent
    message = task(env, "store_retry").apply_async(kwargs={"label": label, "seconds": 0.1})

    # Then it is retried instead of running unlocked
    env.wait_until(lambda: env.received(message.id) >= 2, "the task to be retried")
    assert env.starts(label) == []
    assert not message.ready()

    # When the lock store is back
    back = time.time()
    env.lock_server.start()

    # Then it runs, once, and only with the store back
    ran(message.get(timeout=BOUND + 10), env)
    (start,) = env.starts(label)
    assert start["t"] >= back
    assert start["locked"] is True
    assert_exclusive_and_once(env, label, {message.id: 1})


def test_when_the_lock_store_stays_down_the_retry_budget_ends_in_backend_unavailable(
    faults: Callable[..., FaultEnv],
) -> None:
    # Given a password-protected lock store that is down, and a singleton allowed two retries
    env = faults(password=PASSWORD, lock_query=SOCKET_TIMEOUT)
    env.start_worker()
    env.lock_server.stop()
    label = new_label()

    # When it is sent
    message = task(env, "store_retry_short").apply_async(kwargs={"label": label})

    # Then after its retries it fails with BackendUnavailable, naming the store, not the password
    with pytest.raises(BackendUnavailable) as failure:
        message.get(timeout=BOUND + 10)
    text = f"{failure.value} {failure.value!r}"
    assert f"127.0.0.1:{env.lock_server.port}" in text, text
    assert PASSWORD not in text
    assert env.received(message.id) == 1 + SHORT_BACKEND_BUDGET, env.explain()
    # And its body never ran, and no worker log line shows the password
    assert env.starts(label) == []
    assert env.log_lines(PASSWORD) == []


def test_lock_on_backend_error_run_runs_the_body_unlocked_with_a_warning(
    faults: Callable[..., FaultEnv],
) -> None:
    # Given a worker whose lock store is down, and a singleton with lock_on_backend_error="run"
    env = faults(lock_query=SOCKET_TIMEOUT)
    env.start_worker()
    env.lock_server.stop()
    label = new_label()

    # When it is sent
    message = task(env, "store_run").apply_async(kwargs={"label": label, "seconds": 0.1})

    # Then its body runs, once, without a lock, and the worker logs a WARNING about it
    ran(message.get(timeout=BOUND), env)
    (start,) = env.starts(label)
    assert start["locked"] is False, start
    assert env.log_lines("WARNING", message.id), env.explain()
    assert_exclusive_and_once(env, label, {message.id: 1})


def test_a_lock_store_restarted_empty_mid_task_makes_the_holder_lose_its_lock(
    faults: Callable[..., FaultEnv],
) -> None:
    # Given a singleton with a 2 s renewed lease running, on a lock store that keeps no data
    env = faults(lock_query=SOCKET_TIMEOUT)
    env.start_worker()
    stalled = task(env, "stalled")
    label = new_label()
    key = key_of(env, "stalled", label)
    holder = stalled.apply_async(kwargs={"label": label, "wait": 15.0})
    env.wait_starts(label, 1)

    # When the store is stopped and started again while the task runs, without its data
    env.lock_server.restart()

    # Then the holder learns that its lock is lost: lock.lost, and lock.check() raises LockLost
    (observed,) = env.probe.wait_for(label, "observed", timeout=BOUND)
    assert observed["lost"] is True, f"{observed}\n{env.explain()}"
    assert observed["raised"] == "LockLost", observed
    assert holder.get(timeout=BOUND) == {"lost": True, "raised": "LockLost"}
    # And the worker logged an ERROR, and sent the lock_lost signal
    assert_loss_reported(env, label, key, holder.id)

    # And the next run goes ahead on the restarted store
    following = stalled.apply_async(kwargs={"label": label, "wait": 0.1})
    assert following.get(timeout=BOUND) == {"lost": False, "raised": None}
    assert_exclusive_and_once(env, label, {holder.id: 1, following.id: 1})


def test_a_frozen_lock_store_makes_the_holder_lose_its_lock_without_hanging_the_worker(
    faults: Callable[..., FaultEnv],
) -> None:
    # Given a singleton with a 2 s lease running, its lock store answering within 1 s or never
    env = faults(lock_query=SOCKET_TIMEOUT)
    env.start_worker()
    stalled = task(env, "stalled")
    label = new_label()
    key = key_of(env, "stalled", label)
    holder = stalled.apply_async(kwargs={"label": label, "wait": 15.0})
    env.wait_starts(label, 1)

    # When the lock store freezes (SIGSTOP) for longer than the lease
    env.lock_server.pause()
    try:
        # Then the body learns that its lock is lost: lock.lost, and lock.check() raises LockLost
        (observed,) = env.probe.wait_for(label, "observed", timeout=BOUND)
        # And the task still ends while the store is frozen: nothing waits on it for ever
        value = holder.get(timeout=BOUND)
        assert env.lock_server.paused
    finally:
        env.lock_server.resume()
    assert observed["lost"] is True, f"{observed}\n{env.explain()}"
    assert observed["raised"] == "LockLost", observed
    assert observed["singletask_error"] is True
    assert value == {"lost": True, "raised": "LockLost"}
    # And the worker logged an ERROR, and sent the lock_lost signal
    assert_loss_reported(env, label, key, holder.id)

    # When the store answers again, the next run goes ahead
    following = stalled.apply_async(kwargs={"label": label, "wait": 0.1})
    assert following.get(timeout=BOUND) == {"lost": False, "raised": None}
    assert_exclusive_and_once(env, label, {holder.id: 1, following.id: 1})
