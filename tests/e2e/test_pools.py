"""The lock on every execution pool but prefork: real ``celery worker -P POOL`` processes.

Prefork is what the rest of the e2e suite runs. Here one worker per pool (threads, solo, gevent,
eventlet; Redis broker) runs the same singletons, and each test checks one property for each
pool: mutual exclusion under 60 simultaneous duplicates, the release on every ending the pool
has, lease renewal while a body outlives its lease several times, and the lease as the only
recovery when the whole worker is killed (none of these pools has a main process that could
release for a dead executor).

What the pools honour differs, and the tests state it per pool (see :data:`POOLS`); the docs'
pool matrix (docs/pools.rst) says the same.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import celery
import pytest
from billiard.exceptions import TimeLimitExceeded
from celery import group
from celery.exceptions import TaskRevokedError
from celery.exceptions import TimeoutError as CeleryTimeout

from singletask import Skipped, TaskLocked

from ..backends.redis_lock import lock_token
from ..servers import unavailable
from .conftest import Cluster, Worker, start_cluster
from .tasks_pools import KILL_TTL, PREFIX, RENEW_TTL

pytestmark = [pytest.mark.e2e, pytest.mark.pools]

#: Seconds; far above what each step needs, so a slow machine does not fail the tests.
BOUND = 20.0

DUPLICATES = 60

CELERY = tuple(celery.VERSION[:2])


@dataclass(frozen=True)
class Pool:
    """What a pool is expected to do; the pool matrix of docs/pools.rst."""

    name: str
    concurrency: int
    hard_time_limit: bool
    soft_time_limit: bool
    terminate: bool
    green: bool

    def unsupported(self) -> str | None:
        """Why this pool cannot run here, or None."""
        module = {"gevent": "gevent", "eventlet": "eventlet"}.get(self.name)
        if module is not None and importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
        return None


POOLS = [
    Pool("threads", 4, hard_time_limit=False, soft_time_limit=False, terminate=False, green=False),
    Pool("solo", 1, hard_time_limit=False, soft_time_limit=False, terminate=False, green=False),
    # gevent kills a greenlet on revoke(terminate=True) since Celery 5.5.
    Pool(
        "gevent",
        20,
        hard_time_limit=True,
        soft_time_limit=False,
        terminate=CELERY >= (5, 5),
        green=True,
    ),
    Pool("eventlet", 20, hard_time_limit=False, soft_time_limit=False, terminate=True, green=True),
]


@pytest.fixture(scope="module", params=POOLS, ids=[pool.name for pool in POOLS])
def pool(request: pytest.FixtureRequest) -> Pool:
    spec: Pool = request.param
    reason = spec.unsupported()
    if reason is not None:
        unavailable(f"-P {spec.name}: {reason}")
    return spec


@pytest.fixture(scope="module")
def pooled(
    pool: Pool,
    redis_base_url: str,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[Cluster]:
    """A ``celery worker -P <pool>`` on the Redis broker, locks in Redis, for this module."""
    with start_cluster(
        "redis",
        redis_base_url,
        tmp_path_factory,
        request,
        pool=pool.name,
        concurrency=pool.concurrency,
    ) as cluster:
        yield cluster


def wait_until(condition: Callable[[], Any], what: str, timeout: float = BOUND) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def gather(batch: Any, cluster: Cluster, timeout: float) -> list[Any]:
    """The values of a group's results; on a timeout, fail naming the results still missing,
    their states and the worker's log (rather than leaving pytest-timeout to stop the test)."""
    try:
        return list(batch.get(timeout=timeout))
    except CeleryTimeout:
        missing = [(r.id, r.state) for r in batch.results if not r.ready()]
        raise AssertionError(
            f"{len(missing)} of {len(batch.results)} results missing after {timeout}s: "
            f"{missing[:10]}\nworker log:\n{cluster.worker.tail(200)}"
        ) from None


def lock_of(label: str, task: str = "end") -> str:
    """The lock key of a task with ``lock_key="{label}"``."""
    return f"singletask:{PREFIX}{task}:{label}"


def runs_next(cluster: Cluster, task: str, *args: Any) -> None:
    """A new execution of the same key runs its body (it is not skipped)."""
    value = cluster.task(PREFIX + task).delay(*args).get(timeout=BOUND)
    assert not isinstance(value, Skipped), value
    assert cluster.probe.max_overlap(str(args[0])) == 1


def stopped_early(cluster: Cluster, label: str) -> bool:
    """Whether the (4-second) body of ``label`` ended well before its time."""
    start, end = cluster.probe.wait_for(label, "start")[0], cluster.probe.wait_for(label, "end")[0]
    return bool(end["t"] - start["t"] < 3.5)


# -- mutual exclusion ------------------------------------------------------------------------


def test_sixty_duplicates_with_skip_never_overlap(pool: Pool, pooled: Cluster) -> None:
    # Given a skip-policy singleton with a short body
    label = pooled.label()
    task = pooled.task(PREFIX + "race_skip")

    # When 60 duplicates are published at once
    values = gather(group(task.s(label, 0.2) for _ in range(DUPLICATES)).apply_async(), pooled, 60)

    # Then no two bodies ever ran at once
    assert pooled.probe.max_overlap(label) == 1
    # And each duplicate either ran (returning its id) or was skipped in favour of one that ran
    ran = [value for value in values if not isinstance(value, Skipped)]
    skipped = [value for value in values if isinstance(value, Skipped)]
    assert len(ran) + len(skipped) == DUPLICATES
    assert {start["task_id"] for start in pooled.probe.starts(label)} == set(ran)
    assert {s.holder for s in skipped} <= set(ran)
    if pool.concurrency > 1:
        assert skipped  # they did meet the lock held
    pooled.wait_free(f"singletask:{PREFIX}race_skip")


def test_sixty_duplicates_with_retry_all_run_one_at_a_time(pool: Pool, pooled: Cluster) -> None:
    # Given a retry-policy singleton with a short body and a short lock retry countdown
    label = pooled.label()
    task = pooled.task(PREFIX + "race_retry")

    # When 60 duplicates are published at once
    batch = group(task.s(label, index, 0.02) for index in range(DUPLICATES)).apply_async()
    values = gather(batch, pooled, 100)

    # Then every one of them ran, once, and never two at the same time
    assert sorted(values) == list(range(DUPLICATES))
    starts = pooled.probe.starts(label)
    assert len(starts) == DUPLICATES
    assert len({start["task_id"] for start in starts}) == DUPLICATES
    assert pooled.probe.max_overlap(label) == 1
    pooled.wait_free(f"singletask:{PREFIX}race_retry")


def test_sixty_duplicates_with_raise_never_overlap(pool: Pool, pooled: Cluster) -> None:
    # Given a raise-policy singleton with a short body
    label = pooled.label()
    task = pooled.task(PREFIX + "race_raise")

    # When 60 duplicates are published at once
    results = group(task.s(label, 0.2) for _ in range(DUPLICATES)).apply_async()
    results.join(timeout=60, propagate=False)

    # Then no two bodies ever ran at once
    assert pooled.probe.max_overlap(label) == 1
    # And each one either ran or failed with TaskLocked, naming a holder that ran
    ran = [r.id for r in results.results if r.state == "SUCCESS"]
    locked = [r.result for r in results.results if r.state == "FAILURE"]
    assert len(ran) + len(locked) == DUPLICATES
    assert all(isinstance(exc, TaskLocked) for exc in locked), locked
    assert {exc.holder for exc in locked} <= set(ran)
    assert {start["task_id"] for start in pooled.probe.starts(label)} == set(ran)
    if pool.concurrency > 1:
        assert locked
    pooled.wait_free(f"singletask:{PREFIX}race_raise")


# -- endings ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("how", "state"),
    [
        ("return", "SUCCESS"),
        ("raise", "FAILURE"),
        ("retry", "SUCCESS"),
        ("ignore", "PENDING"),
        ("reject", "FAILURE" if CELERY >= (5, 7) else "PENDING"),
    ],
)
def test_every_ending_of_the_body_releases_the_lock(
    pool: Pool, pooled: Cluster, how: str, state: str
) -> None:
    # Given a singleton that ends as ``how`` says (retry: once, then it returns)
    label = pooled.label()

    # When it runs to that end
    result = pooled.task(PREFIX + "end").delay(label, how)
    pooled.probe.wait_for(label, "end", count=2 if how == "retry" else 1, timeout=BOUND)
    wait_until(lambda: result.state == state, f"state {state}, not {result.state}")

    # Then the lock is free, and the next execution of the key runs
    pooled.wait_free(lock_of(label), timeout=BOUND)
    runs_next(pooled, "end", label)


def test_soft_time_limit(pool: Pool, pooled: Cluster) -> None:
    # Given a singleton with a 1-second soft time limit whose body sleeps 3 seconds
    label = pooled.label()
    result = pooled.task(PREFIX + "soft").delay(label, 3)

    if pool.soft_time_limit:  # pragma: no cover - none of these pools has one
        # Then the body is interrupted and the lock released
        with pytest.raises(Exception, match="SoftTimeLimitExceeded"):
            result.get(timeout=BOUND)
    else:
        # Then the pool does not enforce it: the body runs to its end, and releases then
        assert result.get(timeout=BOUND) == "done"
        assert pooled.probe.events(label, "end")
    pooled.wait_free(lock_of(label, "soft"), timeout=BOUND)
    runs_next(pooled, "soft", label, 0)


def test_hard_time_limit(pool: Pool, pooled: Cluster) -> None:
    # Given a singleton with a 1-second hard time limit whose body sleeps 4 seconds
    label = pooled.label()
    result = pooled.task(PREFIX + "hard").delay(label, 4)
    pooled.probe.wait_for(label, "start")
    started = time.monotonic()

    if pool.hard_time_limit:
        # Then the pool stops the body at the limit, and the lock is released with it
        with pytest.raises(TimeLimitExceeded):
            result.get(timeout=BOUND)
        pooled.wait_free(lock_of(label, "hard"), timeout=BOUND)
        assert time.monotonic() - started < 4, "released before the body would have ended"
        assert stopped_early(pooled, label)
    else:
        # Then the pool does not enforce it: the body runs to its end, and releases then
        assert result.get(timeout=BOUND) == "done"
        pooled.wait_free(lock_of(label, "hard"), timeout=BOUND)
    runs_next(pooled, "hard", label, 0)


def test_revoke_with_terminate(pool: Pool, pooled: Cluster) -> None:
    # Given a singleton whose body sleeps 4 seconds, running
    label = pooled.label()
    result = pooled.task(PREFIX + "long").delay(label, 4)
    pooled.probe.wait_for(label, "start")
    started = time.monotonic()

    # When it is revoked with terminate
    result.revoke(terminate=True)

    if pool.terminate:
        # Then the pool stops the body, and the lock is released with it
        with pytest.raises(TaskRevokedError):
            result.get(timeout=BOUND)
        pooled.wait_free(lock_of(label, "long"), timeout=BOUND)
        assert time.monotonic() - started < 4, "released before the body would have ended"
        assert stopped_early(pooled, label)
    else:
        # Then the pool cannot stop it: the body runs to its end, and releases then; until
        # then no other execution of the key starts
        pooled.probe.wait_for(label, "end", timeout=BOUND)
        pooled.wait_free(lock_of(label, "long"), timeout=BOUND)
    runs_next(pooled, "long", label, 0)


# -- lease renewal ---------------------------------------------------------------------------


def test_the_lease_is_renewed_while_a_body_runs_three_leases(pool: Pool, pooled: Cluster) -> None:
    # Given a singleton with a 4-second lease whose body runs 12 seconds of CPU work: green
    # pools yield between slices of 2.4 s (over a half lease; renewal is due every third),
    # the others never yield
    label = pooled.label()
    key = lock_of(label, "renew")
    chunk = 0.6 * RENEW_TTL if pool.green else 3 * RENEW_TTL
    result = pooled.task(PREFIX + "renew").delay(label, 3 * RENEW_TTL, chunk)
    token = pooled.probe.wait_for(label, "start")[0]["token"]

    # When, in its first two seconds, duplicates and executions of another key are sent
    others = []
    while not result.ready():
        # Then the lock stays held by the same execution the whole time
        assert lock_token(pooled.locks, key) in (token, None)
        if pool.concurrency > 1 and len(others) < 8:
            others.append(pooled.task(PREFIX + "renew").delay(label, 0, 0))
            other = f"{label}-other{len(others)}"
            others.append(pooled.task(PREFIX + "renew").delay(other, 0, 0))
        time.sleep(0.5)

    # And the body never saw it lost
    assert result.get(timeout=BOUND) == {"lost": None}
    # And the duplicates the worker took while it ran were skipped (a green worker takes
    # messages only when the body yields: later ones ran after it, never beside it)
    values = [other.get(timeout=BOUND) for other in others]
    ended = pooled.probe.wait_for(label, "end")[0]["t"]
    assert pooled.probe.max_overlap(label) == 1
    assert all(start["t"] >= ended for start in pooled.probe.starts(label)[1:])
    if others:
        assert isinstance(values[0], Skipped), values
        assert {value.holder for value in values[0::2] if isinstance(value, Skipped)} == {result.id}
        # And other keys ran meanwhile: renewal does not hold up the worker
        assert not any(isinstance(value, Skipped) for value in values[1::2]), values
        other_starts = [pooled.probe.starts(f"{label}-other{n}") for n in range(1, 8, 2)]
        assert min(starts[0]["t"] for starts in other_starts) < ended
    pooled.wait_free(key, timeout=BOUND)


# -- worker death ----------------------------------------------------------------------------


def kill_holder(pool: Pool, pooled: Cluster, label: str, tmp_path: Path) -> float:
    """Start a second worker of ``pool`` on a queue of its own, have it run ``victim`` (5-second
    lease) for ``label``, SIGKILL the whole worker; return when (``time.time()``)."""
    queue = f"victim-{os.getpid()}-{label}"
    env = {**pooled.worker.env, "SINGLETASK_E2E_QUEUE": queue}
    victim = Worker(env, tmp_path / "victim.log", pooled.app, ["-Q", queue], pool=pool.name)
    victim.start()
    try:
        pooled.task(PREFIX + "victim").apply_async((label, 60), queue=queue)
        pooled.probe.wait_for(label, "start")
        victim.kill()
        return time.time()
    finally:
        victim.stop()


def test_a_killed_worker_leaves_its_lock_to_its_lease(
    pool: Pool, pooled: Cluster, tmp_path: Path
) -> None:
    # Given a singleton with a 5-second lease running on a worker of this pool
    label = pooled.label()
    key = lock_of(label, "victim")

    # When the whole worker is killed with SIGKILL
    killed_at = kill_holder(pool, pooled, label, tmp_path)

    # Then nothing released the lock: it is left to its lease, which nobody renews any more,
    # and it ends within that lease
    ttl = pooled.locks.pttl(key)
    assert 0 < ttl <= KILL_TTL * 1000
    pooled.wait_free(key, timeout=KILL_TTL + 5)
    assert time.time() - killed_at < KILL_TTL + 2, "ended later than one lease after the kill"
    # And a new execution of the key then runs, on the other worker
    value = pooled.task(PREFIX + "victim").delay(label, 0.1).get(timeout=BOUND)
    assert not isinstance(value, Skipped), value
    starts = pooled.probe.starts(label)
    assert len(starts) == 2
    assert starts[1]["pid"] == pooled.worker.process.pid  # type: ignore[union-attr]
    pooled.wait_free(key, timeout=BOUND)


def test_on_the_same_host_a_new_execution_takes_a_dead_workers_lock_at_once(
    pool: Pool, pooled: Cluster, tmp_path: Path
) -> None:
    # Given a singleton with a 5-second lease running on a worker of this pool
    label = pooled.label()
    key = lock_of(label, "victim")

    # When the whole worker is killed with SIGKILL, and a new execution of the key is sent at
    # once to another worker of the same host
    killed_at = kill_holder(pool, pooled, label, tmp_path)
    lease_ends = killed_at + pooled.locks.pttl(key) / 1000
    value = pooled.task(PREFIX + "victim").delay(label, 0.1).get(timeout=BOUND)

    # Then it runs without waiting for the lease: it sees that the holder's process is gone
    assert not isinstance(value, Skipped), value
    starts = pooled.probe.starts(label)
    assert len(starts) == 2
    assert starts[1]["t"] < lease_ends
    assert f"took over lock {key!r}" in pooled.worker.log.read_text(errors="replace")
    pooled.wait_free(key, timeout=BOUND)
