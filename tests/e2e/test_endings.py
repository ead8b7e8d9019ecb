"""Every way an execution can end leaves its lock released once, by its owner, and the next
execution of the same key then runs.

Each test ends a holder in one way on a real prefork worker, then checks that:

* the lock is free again within a generous bound;
* it was ended once: Redis keyspace notifications of the lock key show one deletion (or one
  expiry, where the design lets a lease run out), never a second release;
* no other execution of the key ran meanwhile (the probe's overlap stays 1);
* a new execution of the same key goes ahead (it runs its body instead of being skipped).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import celery
import psutil
import pytest
import redis
from billiard.exceptions import TimeLimitExceeded, WorkerLostError
from celery.exceptions import SoftTimeLimitExceeded

from singletask import Skipped, TaskLocked

from ..backends.redis_lock import lock_token
from .conftest import CONCURRENCY, Cluster

pytestmark = pytest.mark.e2e

#: Seconds; far above what each step needs, so a slow machine does not fail the tests.
BOUND = 15.0


class LockWatch:
    """What happens to one lock key, in order, from Redis keyspace notifications.

    An acquisition shows as ``set`` then ``expire`` (a plain lock: one string, SET PX) or
    ``hset`` then ``expire`` (a hash lock); a lease change (renewal) as ``expire``; a
    release (or a takeover by a retried attempt) as ``del``; a lease that ran out as ``expired``.
    Reading a lock (a skipped or failed duplicate looking at the holder) shows nothing.
    """

    #: Keyspace channel (K) for generic (g: del, expire), string ($), hash (h) and expired (x)
    #: events.
    FLAGS = "Kg$hx"

    def __init__(self, client: redis.Redis, key: str) -> None:
        # Server-wide but additive (flags others set stay), on the session's own server.
        current = str(client.config_get("notify-keyspace-events")["notify-keyspace-events"])
        if not set(self.FLAGS) <= set(current):
            client.config_set("notify-keyspace-events", current + self.FLAGS)
        db = client.connection_pool.connection_kwargs.get("db", 0)
        self.key = key
        self._pubsub = client.pubsub()
        self._pubsub.subscribe(f"__keyspace@{db}__:{key}")
        confirmation = self._pubsub.get_message(timeout=5)
        assert confirmation is not None
        assert confirmation["type"] == "subscribe"
        self._seen: list[str] = []

    def events(self) -> list[str]:
        """Every event on the key so far."""
        while (message := self._pubsub.get_message(timeout=0.3)) is not None:
            if message["type"] == "message":
                self._seen.append(message["data"].decode())
        return list(self._seen)

    def assert_ended_once(self, *, by: tuple[str, ...] = ("del", "expired")) -> str:
        """The lock was taken once, kept (lease changes only), then ended once: released
        (``del``) or run out (``expired``), as ``by`` allows. Returns how it ended."""
        seen = self.events()
        assert seen[:1] in (["set"], ["hset"]), seen
        assert set(seen[1:-1]) <= {"expire"}, seen
        assert seen[-1] in by, seen
        return seen[-1]

    def assert_held(self) -> None:
        """The lock was taken once and is still held: nothing but lease changes since."""
        seen = self.events()
        assert seen[:1] in (["set"], ["hset"]), seen
        assert set(seen[1:]) <= {"expire"}, seen

    def close(self) -> None:
        self._pubsub.close()


@pytest.fixture
def watch(cluster: Cluster) -> Iterator[Any]:
    """``watch(key)`` starts recording the keyspace events of ``key``."""
    watches: list[LockWatch] = []

    def start(key: str) -> LockWatch:
        watches.append(LockWatch(cluster.locks, key))
        return watches[-1]

    yield start
    for lock_watch in watches:
        lock_watch.close()


@pytest.fixture
def stopped(cluster: Cluster) -> Iterator[list[int]]:
    """Pool processes a test stops: after the test, wait until the worker has replaced them, so
    that the next tests find the full pool (even when this one failed half-way)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        wait_pool_restored(cluster, pid)


def lock_key(cluster: Cluster, task_name: str, label: str) -> str:
    return str(cluster.task(task_name).lock_key_for((), {"label": label}))


def token_at(cluster: Cluster, key: str) -> str | None:
    return lock_token(cluster.locks, key)


def reserved_for(cluster: Cluster, key: str) -> str | None:
    """The task id the lock at ``key`` is held or reserved for (as the store reads it)."""
    return cluster.held_by(key)


def log_lines(cluster: Cluster, task_id: str) -> list[str]:
    """The worker's log lines naming ``task_id``."""
    text = cluster.worker.log.read_text(errors="replace")
    return [line for line in text.splitlines() if task_id in line]


def wait_for_log(cluster: Cluster, task_id: str, text: str, timeout: float = BOUND) -> str:
    deadline = time.monotonic() + timeout
    while True:
        found = [line for line in log_lines(cluster, task_id) if text in line]
        if found:
            return found[0]
        if time.monotonic() > deadline:
            tail = cluster.worker.tail()
            raise AssertionError(f"no log line with {text!r} for {task_id} in {timeout}s:\n{tail}")
        time.sleep(0.1)


def assert_released_by_its_owner_only(cluster: Cluster, task_id: str) -> None:
    """The execution's own ``finally`` released the lock: the worker's main process had nothing
    to release, and the release found the lock still held by this execution."""
    lines = log_lines(cluster, task_id)
    assert not [line for line in lines if "released by the worker" in line], lines
    assert not [line for line in lines if "was no longer held" in line], lines


def worker_hostname(cluster: Cluster) -> str:
    return cluster.worker.nodename.replace("%h", os.uname().nodename)


def count_out_killed_body(cluster: Cluster, label: str, task_id: str) -> None:
    """A body killed before its ``finally`` never left the probe: take it out of the running
    count, so that the next run is compared only with bodies that can still be running."""
    if not [e for e in cluster.probe.events(label, "end") if e["task_id"] == task_id]:
        cluster.probe.client.decr(f"probe:{label}:running")


def assert_body_over(cluster: Cluster, label: str, start: dict[str, Any]) -> None:
    """The body that ``start`` recorded runs no more: it got to the end of its ``finally`` (the
    probe recorded its end), or the process that ran it is gone."""
    if [e for e in cluster.probe.events(label, "end") if e["task_id"] == start["task_id"]]:
        return
    try:
        process = psutil.Process(start["pid"])
        status, created = process.status(), process.create_time()
    except psutil.NoSuchProcess:
        return
    if created > start["t"]:
        return  # the pid was given to a new process (pids wrap around on a busy machine)
    assert status == psutil.STATUS_ZOMBIE, f"process {start['pid']} is still {status}"


def wait_pool_restored(cluster: Cluster, pid: int, timeout: float = BOUND) -> None:
    """Wait until the worker has replaced the stopped pool process ``pid`` (so that the next
    tests find the full pool)."""
    deadline = time.monotonic() + timeout
    while True:
        live = []
        assert cluster.worker.process is not None
        for child in psutil.Process(cluster.worker.process.pid).children():
            with contextlib.suppress(psutil.NoSuchProcess):
                if child.status() != psutil.STATUS_ZOMBIE:
                    live.append(child.pid)
        if pid not in live and len(live) >= CONCURRENCY:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pool process {pid} not replaced in {timeout}s: {live}")
        time.sleep(0.1)


def assert_next_run_goes_ahead(cluster: Cluster, task_name: str, label: str, **kwargs: Any) -> Any:
    """A new execution of the same key runs its body (it is not skipped) and frees the lock."""
    starts = len(cluster.probe.starts(label))
    value = (
        cluster.task(task_name).apply_async(kwargs={"label": label, **kwargs}).get(timeout=BOUND)
    )
    assert not isinstance(value, Skipped), value
    assert len(cluster.probe.starts(label)) == starts + 1
    cluster.wait_free(lock_key(cluster, task_name, label), timeout=BOUND)
    return value


# -- endings inside the executing process ---------------------------------------------------

ENDINGS = {
    # ending: (task, its kwargs, final state, type of the exception stored as the result)
    "return": ("e2e.endings.end", {"how": "return", "seconds": 1.0}, "SUCCESS", None),
    "exception": ("e2e.endings.end", {"how": "raise", "seconds": 1.0}, "FAILURE", ValueError),
    "soft-time-limit": ("e2e.endings.soft", {"seconds": 10.0}, "FAILURE", SoftTimeLimitExceeded),
    "Ignore": ("e2e.endings.end", {"how": "ignore", "seconds": 1.0}, "PENDING", None),
    # Celery 5.7 stores a rejected message's result as FAILURE; before 5.7 it stores nothing.
    "Reject-no-requeue": (
        "e2e.endings.end",
        {"how": "reject", "seconds": 1.0},
        "FAILURE" if celery.VERSION[:2] >= (5, 7) else "PENDING",
        None,
    ),
}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_an_ending_in_the_body_releases_the_lock_once_and_the_next_run_goes_ahead(
    cluster: Cluster, watch: Any, ending: str
) -> None:
    task_name, kwargs, state, error = ENDINGS[ending]
    task = cluster.task(task_name)
    label = cluster.label()
    key = lock_key(cluster, task_name, label)
    events = watch(key)

    # Given a holder running with the lock (its own token is stored at the key)
    holder = task.apply_async(kwargs={"label": label, **kwargs})
    (start,) = cluster.probe.wait_for(label, "start", timeout=BOUND)
    assert token_at(cluster, key) == start["token"]
    assert start["token"].startswith(f"{holder.id}:0:")
    # and a duplicate arriving meanwhile is skipped in its favour
    duplicate = task.apply_async(kwargs={"label": label, "seconds": 0.0})
    skipped = duplicate.get(timeout=BOUND)
    assert isinstance(skipped, Skipped)
    assert skipped.holder == holder.id

    # When the holder ends that way
    cluster.probe.wait_for(label, "end", timeout=BOUND)

    # Then the lock is free, released once (one DEL, no expiry)
    cluster.wait_free(key, timeout=BOUND)
    events.assert_ended_once(by=("del",))
    # by the execution itself, the worker's main process having nothing left to release
    if state != "PENDING":
        outcome = holder.get(timeout=BOUND, propagate=False)
        assert holder.state == state, (holder.state, outcome)
        if error is not None:
            assert isinstance(outcome, error), outcome
    else:
        assert holder.state == "PENDING"  # Ignore (and Reject before Celery 5.7) stores nothing
    assert_released_by_its_owner_only(cluster, holder.id)
    # And the next execution of the key goes ahead, with no overlap at any time
    assert assert_next_run_goes_ahead(cluster, task_name, label) == "done"
    assert cluster.probe.max_overlap(label) == 1


# -- endings the worker's main process handles ----------------------------------------------


@pytest.mark.parametrize("defer_sigterm", [False, True], ids=["cleans-up", "sigterm-deferred"])
def test_a_hard_time_limit_frees_the_lock_soon_and_the_next_run_goes_ahead(
    cluster: Cluster, watch: Any, stopped: list[int], defer_sigterm: bool
) -> None:
    """The pool stops the process (SIGTERM, then SIGKILL 0.1 s later). Its own ``finally``
    releases when it gets to run; when it cannot (SIGTERM deferred, as inside C code), the
    worker's main process releases for it once the process is gone."""
    task_name = "e2e.endings.hard"
    label = cluster.label()
    key = lock_key(cluster, task_name, label)
    events = watch(key)

    # Given a holder (lease 60 s) whose body outlasts its 1 s hard time limit
    holder = cluster.task(task_name).apply_async(
        kwargs={"label": label, "seconds": 10.0, "defer_sigterm": defer_sigterm}
    )
    (start,) = cluster.probe.wait_for(label, "start", timeout=BOUND)
    stopped.append(start["pid"])
    assert token_at(cluster, key) == start["token"]

    # When the pool kills the process running it
    outcome = holder.get(timeout=BOUND, propagate=False)
    assert isinstance(outcome, TimeLimitExceeded), outcome

    # Then the lock is free long before its 60 s lease would have run out
    cluster.wait_free(key, timeout=BOUND)
    freed_after = time.time() - start["t"]
    print(
        f"\n[{cluster.broker}] hard time limit (1 s), defer_sigterm={defer_sigterm}: "
        f"lock free {freed_after:.2f}s after start"
    )
    # with the body over, and ended once
    assert_body_over(cluster, label, start)
    events.assert_ended_once()
    if defer_sigterm:
        # by the worker's main process: the killed process could not release
        line = wait_for_log(cluster, holder.id, "released by the worker after a hard time limit")
        assert repr(key) in line

    # And the next execution goes ahead
    count_out_killed_body(cluster, label, holder.id)
    assert assert_next_run_goes_ahead(cluster, task_name, label) == "done"
    assert cluster.probe.max_overlap(label) == 1


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGKILL"])
def test_revoke_with_terminate_frees_the_lock_and_the_next_run_goes_ahead(
    cluster: Cluster, watch: Any, stopped: list[int], signame: str
) -> None:
    task_name = "e2e.endings.long"
    label = cluster.label()
    key = lock_key(cluster, task_name, label)
    events = watch(key)

    # Given a running holder
    holder = cluster.task(task_name).apply_async(kwargs={"label": label, "seconds": 30.0})
    (start,) = cluster.probe.wait_for(label, "start", timeout=BOUND)
    stopped.append(start["pid"])
    assert token_at(cluster, key) == start["token"]

    # When it is revoked with terminate=True (SIGTERM is the default signal)
    revoked_at = time.time()
    cluster.app.control.revoke(
        holder.id, terminate=True, signal=signame, destination=[worker_hostname(cluster)]
    )

    # Then the lock is free within a generous bound (its lease is 10 minutes)
    cluster.wait_free(key, timeout=BOUND)
    freed_after = time.time() - revoked_at
    print(f"\n[{cluster.broker}] revoke {signame}: lock free {freed_after:.2f}s after revoke")
    assert_body_over(cluster, label, start)
    # ended once, and the task is REVOKED
    events.assert_ended_once()
    deadline = time.monotonic() + BOUND
    while holder.state != "REVOKED" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert holder.state == "REVOKED"

    # And the next execution goes ahead
    count_out_killed_body(cluster, label, holder.id)
    assert assert_next_run_goes_ahead(cluster, task_name, label, seconds=0.0) == "done"
    assert cluster.probe.max_overlap(label) == 1


def test_revoke_with_terminate_keeps_the_lock_while_a_body_deferring_sigterm_still_runs(
    cluster: Cluster, watch: Any, stopped: list[int]
) -> None:
    """SIGTERM does not stop a process at once: Python runs its handler only once the process
    is back from C code (a database driver call, say). Until the body has really ended, the
    lock must stay held, so no other execution of the key starts beside it."""
    task_name = "e2e.endings.long"
    label = cluster.label()
    key = lock_key(cluster, task_name, label)
    events = watch(key)
    body = 5.0

    # Given a running holder that will only see SIGTERM when its 5 s body is over
    holder = cluster.task(task_name).apply_async(
        kwargs={"label": label, "seconds": body, "defer_sigterm": True}
    )
    (start,) = cluster.probe.wait_for(label, "start", timeout=BOUND)
    stopped.append(start["pid"])
    token = token_at(cluster, key)
    assert token == start["token"]

    # When it is revoked with terminate=True, and a duplicate arrives 3 s later (past any short
    # grace a worker could give a stopping process)
    cluster.app.control.revoke(holder.id, terminate=True, destination=[worker_hostname(cluster)])
    time.sleep(3.0)
    assert not cluster.probe.events(label, "end"), "precondition: the holder's body still runs"
    assert start["pid"] in cluster.worker.children(), "precondition: the holder's process lives"
    duplicate = cluster.task(task_name).apply_async(kwargs={"label": label, "seconds": 0.0})
    value = duplicate.get(timeout=BOUND)

    # Then the duplicate is skipped: the holder's body still ran, so it still held the lock
    assert isinstance(value, Skipped), f"ran beside the revoked holder's body: {value!r}"
    assert value.holder == holder.id
    assert cluster.probe.max_overlap(label) == 1
    # And once the body is over (its SIGTERM handler ran), the lock is free, released once
    cluster.probe.wait_for(label, "end", timeout=BOUND)
    cluster.wait_free(key, timeout=BOUND)
    events.assert_ended_once()
    # and the next execution goes ahead
    assert assert_next_run_goes_ahead(cluster, task_name, label, seconds=0.0) == "done"
    assert cluster.probe.max_overlap(label) == 1


def test_a_killed_pool_process_has_its_lock_released_by_the_worker(
    cluster: Cluster, watch: Any, stopped: list[int]
) -> None:
    task_name = "e2e.endings.long"
    label = cluster.label()
    key = lock_key(cluster, task_name, label)
    events = watch(key)

    # Given a holder running in a pool process of our worker
    holder = cluster.task(task_name).apply_async(kwargs={"label": label, "seconds": 30.0})
    (start,) = cluster.probe.wait_for(label, "start", timeout=BOUND)
    stopped.append(start["pid"])
    assert token_at(cluster, key) == start["token"]
    assert start["pid"] in cluster.worker.children()

    # When that process is SIGKILLed (no finally, no hook runs in it)
    killed_at = time.time()
    os.kill(start["pid"], signal.SIGKILL)

    # Then the worker's main process releases the lock on WorkerLostError, long before the
    # 10-minute lease would run out
    cluster.wait_free(key, timeout=BOUND)
    freed_after = time.time() - killed_at
    print(f"\n[{cluster.broker}] SIGKILL of the pool process: lock free {freed_after:.2f}s after")
    events.assert_ended_once(by=("del",))
    outcome = holder.get(timeout=BOUND, propagate=False)
    assert isinstance(outcome, WorkerLostError), outcome
    wait_for_log(cluster, holder.id, "released by the worker after its worker process was lost")

    # And the next execution goes ahead
    count_out_killed_body(cluster, label, holder.id)
    assert assert_next_run_goes_ahead(cluster, task_name, label, seconds=0.0) == "done"
    assert cluster.probe.max_overlap(label) == 1


# -- the body's own retry -------------------------------------------------------------------


def test_the_lock_stays_reserved_for_the_bodys_retry_and_the_retried_attempt_frees_it(
    cluster: Cluster, watch: Any
) -> None:
    task_name = "e2e.endings.retrying"
    task = cluster.task(task_name)
    label = cluster.label()
    key = lock_key(cluster, task_name, label)
    events = watch(key)

    # Given an attempt that ended with self.retry(countdown=2)
    attempt = task.apply_async(kwargs={"label": label, "times": 1, "countdown": 2.0})
    (first,) = cluster.probe.wait_for(label, "end", timeout=BOUND)
    assert first["retries"] == 0

    # When a duplicate of the same key arrives during the countdown
    assert reserved_for(cluster, key) == attempt.id
    duplicate = task.apply_async(kwargs={"label": label, "times": 0})
    skipped = duplicate.get(timeout=BOUND)
    assert len(cluster.probe.starts(label)) == 1, "precondition: still within the countdown"

    # Then the duplicate is skipped in favour of the retrying task
    assert isinstance(skipped, Skipped)
    assert skipped.holder == attempt.id
    # And the retried attempt (same task id, retries + 1) runs and takes the lock over
    assert attempt.get(timeout=BOUND) == "done after 1 retries"
    starts = cluster.probe.starts(label)
    assert [(s["task_id"], s["retries"]) for s in starts] == [(attempt.id, 0), (attempt.id, 1)]
    assert starts[1]["token"].startswith(f"{attempt.id}:1:")
    # and frees it when it ends: the lock never expired in between, and no other body ran
    cluster.wait_free(key, timeout=BOUND)
    seen = events.events()
    assert seen[-1] == "del", seen
    assert "expired" not in seen, seen
    assert_released_by_its_owner_only(cluster, attempt.id)
    assert cluster.probe.max_overlap(label) == 1
    # And the next execution goes ahead
    assert assert_next_run_goes_ahead(cluster, task_name, label, times=0) == "done after 0 retries"


def test_a_retried_attempt_does_not_start_while_the_attempt_that_asked_for_it_still_runs(
    cluster: Cluster, watch: Any
) -> None:
    """Celery publishes the retry before the attempt has ended: with a short countdown the retry
    can reach the other pool process while the body still runs its ``finally`` blocks. The
    retried attempt must wait for that, like any other execution of the key."""
    task_name = "e2e.endings.retrying"
    label = cluster.label()
    key = lock_key(cluster, task_name, label)
    events = watch(key)

    # Given a body that asks for self.retry(countdown=0), then spends 0.5 s in its finally
    attempt = cluster.task(task_name).apply_async(
        kwargs={"label": label, "times": 1, "countdown": 0.0, "cleanup": 0.5}
    )

    # When the retried attempt reaches the other pool process meanwhile
    assert attempt.get(timeout=BOUND) == "done after 1 retries"

    # Then it ran only once the first attempt was over: no overlap, same task id, retries + 1
    starts = cluster.probe.starts(label)
    assert [(s["task_id"], s["retries"]) for s in starts] == [(attempt.id, 0), (attempt.id, 1)]
    assert cluster.probe.max_overlap(label) == 1
    # and the lock ends free, released by the last attempt, never expired
    cluster.wait_free(key, timeout=BOUND)
    seen = events.events()
    assert seen[-1] == "del", seen
    assert "expired" not in seen, seen
    assert_released_by_its_owner_only(cluster, attempt.id)


@pytest.mark.parametrize("how", ["throw=False", "swallowed"])
def test_a_body_that_goes_on_after_its_retry_has_its_retry_run_after_it_with_few_sends(
    cluster: Cluster, how: str
) -> None:
    """A body that asks for a retry and goes on (``self.retry(throw=False)``, or ``Retry``
    caught by ``except Exception``): as with Celery, the retried message runs later, here once
    the attempt that asked for it has ended, never beside it. With ``throw=False`` the retry is
    published at once and waits: its message is sent again with growing countdowns (0.5 s,
    then doubling up to the holder's lease), not every 0.5 s for as long as the body runs. A
    caught ``Retry`` is published when the body ends (once the lock is its reservation), so it
    never waits."""
    task_name = "e2e.endings.goes_on"
    label = cluster.label()
    key = lock_key(cluster, task_name, label)
    seconds = 8.0

    # Given a body that asks for a retry with countdown 0, then runs 8 s more (lock_ttl 30 s)
    attempt = cluster.task(task_name).apply_async(
        kwargs={"label": label, "how": how, "seconds": seconds}
    )

    # When the retried attempt reaches the other pool process while the body still runs
    ends = cluster.probe.wait_for(label, "end", count=2, timeout=seconds + BOUND)

    # Then it ran once, after the first attempt had ended: no overlap, same task id
    starts = cluster.probe.starts(label)
    assert [(s["task_id"], s["retries"]) for s in starts] == [(attempt.id, 0), (attempt.id, 1)]
    assert starts[1]["t"] >= ends[0]["t"]
    assert cluster.probe.max_overlap(label) == 1
    # And its caller sees an outcome: SUCCESS (the first attempt's, which Celery's result store
    # keeps: it does not overwrite a SUCCESS)
    assert attempt.get(timeout=BOUND) in ("done after 0 retries", "done after 1 retries")
    # And it waited with few sends: 0.5 s, then 1, 2, 4 (8 s in all), plus one for a slow start;
    # none if it was published when the body ended
    waits = [line for line in log_lines(cluster, attempt.id) if "previous attempt" in line]
    assert (1 <= len(waits) <= 5) if how == "throw=False" else waits == [], "\n".join(waits)
    cluster.wait_free(key, timeout=BOUND)


@pytest.mark.parametrize("lost", ["revoked", "expired"])
def test_a_retry_that_never_runs_does_not_keep_its_reservation(
    cluster: Cluster, watch: Any, lost: str
) -> None:
    """A retry revoked or expired before it starts will never run: the worker that discards it
    releases the reservation its attempt left (at the latest it ends with countdown + ttl)."""
    task_name = "e2e.endings.retrying"
    task = cluster.task(task_name)
    label = cluster.label()
    key = lock_key(cluster, task_name, label)
    events = watch(key)
    # the task's lock_ttl is 3 s; a revoke gets 3 s to reach the worker before the retry is due
    # (on a loaded machine 2 s was once not enough, and the retry ran)
    countdown, lease = (3.0 if lost == "revoked" else 1.0), 3.0
    expires = 0.5 if lost == "expired" else 0.0

    # Given an attempt that ended with self.retry(countdown=...) and left the lock reserved
    attempt = task.apply_async(
        kwargs={"label": label, "times": 1, "countdown": countdown, "expires": expires}
    )
    (first,) = cluster.probe.wait_for(label, "end", timeout=BOUND)
    assert reserved_for(cluster, key) == attempt.id
    # ... and has ended: its worker wrote RETRY (a revoke that reaches the worker before that
    # write is recorded as REVOKED and then overwritten by it, Celery's own race)
    deadline = time.monotonic() + BOUND
    while attempt.state != "RETRY":
        assert time.monotonic() < deadline, f"the attempt is still {attempt.state}"
        time.sleep(0.05)

    # When the retry never runs (revoked during the countdown, or expired before it)
    if lost == "revoked":
        cluster.app.control.revoke(attempt.id, destination=[worker_hostname(cluster)])

    # Then the reservation is gone within countdown + lock_ttl (plus slack)
    left = countdown + lease + 3.0 - (time.time() - first["t"])
    cluster.wait_free(key, timeout=max(left, 0.0))
    print(f"\n[{cluster.broker}] retry {lost}: lock free {time.time() - first['t']:.2f}s after it")
    seen = events.events()
    # released by the worker that discarded the retry, once (or, had it missed it, expired)
    last_set = max(i for i, event in enumerate(seen) if event in ("set", "hset"))
    assert seen[last_set + 1 :] in (["expire", "del"], ["expire", "expired"]), seen
    if seen[-1] == "del":
        wait_for_log(cluster, attempt.id, "reservation of")
    # the retried attempt never ran, and the task is REVOKED
    assert len(cluster.probe.starts(label)) == 1
    assert attempt.state == "REVOKED"

    # And the next execution goes ahead
    assert assert_next_run_goes_ahead(cluster, task_name, label, times=0) == "done after 0 retries"
    assert cluster.probe.max_overlap(label) == 1


def test_autoretry_for_keeps_the_lock_across_attempts_and_the_last_attempt_frees_it(
    cluster: Cluster, watch: Any
) -> None:
    task_name = "e2e.endings.flaky"
    task = cluster.task(task_name)
    label = cluster.label()
    key = lock_key(cluster, task_name, label)
    events = watch(key)

    # Given an attempt that raised an exception listed in autoretry_for (countdown 1.5 s)
    attempt = task.apply_async(kwargs={"label": label, "failures": 1})
    (first,) = cluster.probe.wait_for(label, "end", timeout=BOUND)
    assert first["retries"] == 0

    # When a duplicate arrives before the retry runs
    assert reserved_for(cluster, key) == attempt.id
    skipped = task.apply_async(kwargs={"label": label, "failures": 0}).get(timeout=BOUND)
    assert len(cluster.probe.starts(label)) == 1, "precondition: still within the countdown"

    # Then it is skipped in favour of the retrying task
    assert isinstance(skipped, Skipped)
    assert skipped.holder == attempt.id
    # And the later attempt succeeds, and frees the lock
    assert attempt.get(timeout=BOUND) == "done after 1 retries"
    starts = cluster.probe.starts(label)
    assert [(s["task_id"], s["retries"]) for s in starts] == [(attempt.id, 0), (attempt.id, 1)]
    cluster.wait_free(key, timeout=BOUND)
    seen = events.events()
    assert seen[-1] == "del", seen
    assert "expired" not in seen, seen
    assert_released_by_its_owner_only(cluster, attempt.id)
    assert cluster.probe.max_overlap(label) == 1
    # And the next execution goes ahead
    assert (
        assert_next_run_goes_ahead(cluster, task_name, label, failures=0) == "done after 0 retries"
    )


# -- replaced ---------------------------------------------------------------------------------


def test_a_task_replaced_by_another_frees_its_lock_and_the_replacement_frees_its_own(
    cluster: Cluster, watch: Any
) -> None:
    label = cluster.label()
    key = lock_key(cluster, "e2e.endings.replaced", label)
    replacement_key = lock_key(cluster, "e2e.endings.replacement", label)
    events, replacement_events = watch(key), watch(replacement_key)

    # Given a singleton whose body calls self.replace() with another singleton
    replaced = cluster.task("e2e.endings.replaced").apply_async(kwargs={"label": label})

    # When it has been replaced and the replacement has run
    assert replaced.get(timeout=BOUND) == "replaced"

    # Then both ran once, one after the other, each under its own lock
    starts = cluster.probe.starts(label)
    assert [s["task"] for s in starts] == ["replaced", "replacement"]
    assert starts[0]["token"].startswith(f"{replaced.id}:0:")
    assert starts[1]["token"].startswith(f"{replaced.id}:0:")  # the replacement keeps the id
    # and each lock was released once
    cluster.wait_free(key, timeout=BOUND)
    cluster.wait_free(replacement_key, timeout=BOUND)
    events.assert_ended_once(by=("del",))
    replacement_events.assert_ended_once(by=("del",))
    assert_released_by_its_owner_only(cluster, replaced.id)
    assert cluster.probe.max_overlap(label) == 1

    # And the next execution goes ahead (and is replaced again)
    assert cluster.task("e2e.endings.replaced").delay(label).get(timeout=BOUND) == "replaced"
    assert len(cluster.probe.starts(label)) == 4
    cluster.wait_free(key, timeout=BOUND)
    cluster.wait_free(replacement_key, timeout=BOUND)


# -- a locked-out execution -----------------------------------------------------------------

LOCKED_OUT = {
    # policy: task with that policy
    "raise": "e2e.endings.strict",
    "skip": "e2e.endings.end",
}


@pytest.mark.parametrize("policy", list(LOCKED_OUT))
def test_a_locked_out_execution_never_releases_anything(
    cluster: Cluster, watch: Any, policy: str
) -> None:
    task_name = LOCKED_OUT[policy]
    task = cluster.task(task_name)
    label = cluster.label()
    key = lock_key(cluster, task_name, label)
    events = watch(key)

    # Given a holder running with its token at the key
    holder = task.apply_async(kwargs={"label": label, "seconds": 1.5})
    (start,) = cluster.probe.wait_for(label, "start", timeout=BOUND)
    token = token_at(cluster, key)
    assert token == start["token"]

    # When a duplicate arrives and is locked out (fails with TaskLocked / is skipped)
    duplicate = task.apply_async(kwargs={"label": label})
    if policy == "raise":
        with pytest.raises(TaskLocked) as locked:
            duplicate.get(timeout=BOUND)
        assert locked.value.holder == holder.id
        assert locked.value.key == key
    else:
        skipped = duplicate.get(timeout=BOUND)
        assert isinstance(skipped, Skipped)
        assert skipped.holder == holder.id

    # Then the holder's lock is untouched: same token, nothing but its own acquisition
    assert len(cluster.probe.starts(label)) == 1, "precondition: the holder still runs"
    assert token_at(cluster, key) == token
    events.assert_held()
    # and the holder ends normally and releases it itself, once
    assert holder.get(timeout=BOUND) == "done"
    cluster.wait_free(key, timeout=BOUND)
    events.assert_ended_once(by=("del",))
    assert_released_by_its_owner_only(cluster, holder.id)
    assert_released_by_its_owner_only(cluster, duplicate.id)
    assert cluster.probe.max_overlap(label) == 1
    # And the next execution goes ahead
    assert assert_next_run_goes_ahead(cluster, task_name, label) == "done"
