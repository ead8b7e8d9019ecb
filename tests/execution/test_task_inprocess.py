"""SingletonTask in one process: eager mode (``task_always_eager``) and direct calls.

Every test runs against the memory backend and the session's private Redis (the ``env``
fixture). Tasks are created with ``shared=False, lazy=False`` so each exists on its own app only.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import celery
import pytest
from celery.exceptions import Ignore, MaxRetriesExceededError, Reject, Retry, SoftTimeLimitExceeded

from singletask import LockHandle, SingletonTask, Skipped, TaskLocked
from singletask.backends.base import LockBackend
from singletask.protocol.tokens import host_id
from singletask.signals import lock_conflict

HOLDER_TOKEN = "other-token"
HOLDER_ID = "holder-id"
HOLDER_LEASE = 30.0


@dataclass
class Env:
    """An eager app whose locks live in one backend, and helpers to define and inspect tasks."""

    app: celery.Celery
    kind: str
    probe: Any = None

    def task(self, **options: Any) -> Callable[[Callable[..., Any]], Any]:
        return self.app.task(base=SingletonTask, shared=False, lazy=False, **options)

    @property
    def backend(self) -> LockBackend:
        """The very backend the app's tasks use (one per app and process)."""
        backend: LockBackend = self.probe.lock_backend
        return backend

    def hold(self, key: str) -> None:
        """Make another execution hold ``key``."""
        acquired = self.backend.acquire(
            key, HOLDER_TOKEN, HOLDER_LEASE, meta={"task_id": HOLDER_ID}
        )
        assert acquired.acquired

    def assert_held_by_other(self, key: str) -> None:
        """The other execution still holds ``key``, with (about) its full lease."""
        holder = self.backend.holder(key)
        assert holder is not None
        assert (holder.token, holder.task_id) == (HOLDER_TOKEN, HOLDER_ID)
        assert holder.ttl is not None
        assert holder.ttl > HOLDER_LEASE / 2

    def assert_free(self, key: str) -> None:
        assert self.backend.holder(key) is None


@pytest.fixture(params=["memory", "redis"])
def env(request: pytest.FixtureRequest, key_prefix: str) -> Iterator[Env]:
    if request.param == "memory":
        url = "memory://"
    else:
        url = request.getfixturevalue("redis_url")
        request.getfixturevalue("redis_client")  # fails / skips when the server is missing
    app = celery.Celery("inprocess", set_as_current=False)
    app.conf.update(
        task_always_eager=True,
        singletask_backend_url=url,
        singletask_key_prefix=key_prefix,
    )
    environment = Env(app, request.param)

    @environment.task(name="inprocess.probe")
    def probe() -> None: ...

    environment.probe = probe
    yield environment
    environment.backend.close()
    app.close()


@pytest.fixture
def conflicts() -> Iterator[list[dict[str, Any]]]:
    """Every lock_conflict signal sent during the test."""
    seen: list[dict[str, Any]] = []

    def receiver(sender: Any = None, **kwargs: Any) -> None:
        seen.append({"sender": sender, **kwargs})

    lock_conflict.connect(receiver, weak=False)
    yield seen
    lock_conflict.disconnect(receiver)


# -- every ending releases the lock ---------------------------------------------------------------


def test_return_releases_the_lock(env: Env) -> None:
    """A body that returns held the lock while it ran and released it at the end."""
    # Given a task that reports who held its lock while it ran
    seen: list[Any] = []

    @env.task(name="inprocess.ret", bind=True)
    def ret(self: Any, value: int) -> int:
        seen.append((self.lock, self.request.id, env.backend.holder(self.lock.key)))
        return value * 2

    key = ret.lock_key_for((21,), {})

    # When it runs eagerly and directly
    eager = ret.delay(21)
    direct = ret(21)

    # Then both returned, held the key while running, and left it free
    assert eager.get() == 42
    assert direct == 42
    (eager_handle, eager_id, eager_holder), (direct_handle, direct_id, direct_holder) = seen
    assert eager_handle.key == key
    assert eager_handle.task_id == eager_id == eager.id
    assert eager_holder.token == eager_handle.token
    assert eager_holder.task_id == eager.id
    assert direct_handle.key == key
    assert direct_handle.task_id is None
    assert direct_id is None
    assert direct_holder.token == direct_handle.token
    assert direct_holder.task_id is None
    env.assert_free(key)


@pytest.mark.parametrize("propagates", [False, True], ids=["stored", "propagated"])
def test_an_exception_releases_the_lock(env: Env, propagates: bool) -> None:
    """A body that raises releases the lock, whether eager errors propagate or not."""
    # Given a failing task
    env.app.conf.task_eager_propagates = propagates

    @env.task(name="inprocess.boom")
    def boom() -> None:
        raise RuntimeError("boom")

    key = boom.lock_key_for()

    # When it runs eagerly
    if propagates:
        with pytest.raises(RuntimeError, match="boom"):
            boom.delay()
    else:
        result = boom.delay()
        assert result.state == "FAILURE"
        assert isinstance(result.result, RuntimeError)

    # Then the lock is free
    env.assert_free(key)

    # And a direct call fails the same way and releases too
    with pytest.raises(RuntimeError, match="boom"):
        boom()
    env.assert_free(key)


def test_body_retry_reruns_eagerly_and_frees_the_lock_at_the_end(env: Env) -> None:
    """self.retry() in eager mode re-runs at once, each attempt holds the lock, none leaks it."""
    # Given a task that retries twice, then succeeds
    attempts: list[tuple[int, str | None, str]] = []

    @env.task(name="inprocess.flaky", bind=True, max_retries=5)
    def flaky(self: Any, customer_id: int) -> str:
        holder = env.backend.holder(self.lock.key)
        assert holder is not None
        attempts.append((self.request.retries, holder.task_id, holder.token))
        if self.request.retries < 2:
            raise self.retry(countdown=0)
        return "done"

    key = flaky.lock_key_for((7,), {})

    # When it runs eagerly
    result = flaky.delay(7)

    # Then it ran three times under the same task id, each holding the lock with its own token
    assert result.get() == "done"
    assert [retries for retries, _, _ in attempts] == [0, 1, 2]
    assert {task_id for _, task_id, _ in attempts} == {result.id}
    assert len({token for _, _, token in attempts}) == 3
    # And the lock is free at the end
    env.assert_free(key)


def test_body_retry_beyond_max_retries_fails_and_frees_the_lock(env: Env) -> None:
    """Once max_retries is spent, the task fails with MaxRetriesExceededError; lock released."""
    runs: list[int] = []

    @env.task(name="inprocess.hopeless", bind=True, max_retries=1)
    def hopeless(self: Any) -> None:
        runs.append(self.request.retries)
        raise self.retry(countdown=0)

    result = hopeless.delay()

    assert runs == [0, 1]
    assert result.state == "FAILURE"
    assert isinstance(result.result, MaxRetriesExceededError)
    env.assert_free(hopeless.lock_key_for())


def test_body_retry_with_eager_propagation_frees_the_lock(env: Env) -> None:
    """With task_eager_propagates, Retry escapes .delay() (no re-run); the lock is released.

    Nothing will ever re-run this attempt, so keeping the lock reserved for a retry (as a
    worker does) would leak it for countdown + lock_ttl.
    """
    # Given a task that always retries, with eager errors propagated
    env.app.conf.task_eager_propagates = True
    runs: list[int] = []

    @env.task(name="inprocess.retry_out", bind=True, max_retries=3)
    def retry_out(self: Any) -> None:
        runs.append(self.request.retries)
        raise self.retry(countdown=60)

    # When it runs eagerly / Then the Retry comes out after one run
    with pytest.raises(Retry):
        retry_out.delay()
    assert runs == [0]

    # And the lock is free
    env.assert_free(retry_out.lock_key_for())


def test_body_retry_past_max_retries_with_eager_propagation_frees_the_lock(env: Env) -> None:
    """Past max_retries, retry(exc=...) raises exc out of .delay(); the lock is released."""
    env.app.conf.task_eager_propagates = True

    @env.task(name="inprocess.retry_exc", bind=True, max_retries=0)
    def retry_exc(self: Any) -> None:
        raise self.retry(exc=ValueError("again"), countdown=0)

    with pytest.raises(ValueError, match="again"):
        retry_exc.delay()
    env.assert_free(retry_exc.lock_key_for())


def test_body_retry_in_a_direct_call_frees_the_lock(env: Env) -> None:
    """A direct call cannot retry: Celery raises, and the lock is released."""

    @env.task(name="inprocess.direct_retry", bind=True)
    def direct_retry(self: Any) -> None:
        raise self.retry(countdown=0)

    with pytest.raises(Retry):
        direct_retry()
    env.assert_free(direct_retry.lock_key_for())


def test_autoretry_for_reruns_and_frees_the_lock(env: Env) -> None:
    """autoretry_for retries through the same path; the lock is free once it succeeds."""
    # Given a task that fails twice with an auto-retried error
    runs: list[int] = []

    @env.task(
        name="inprocess.auto",
        bind=True,
        autoretry_for=(ConnectionError,),
        max_retries=3,
        default_retry_delay=0,
    )
    def auto(self: Any) -> str:
        runs.append(self.request.retries)
        assert env.backend.holder(self.lock.key) is not None
        if len(runs) < 3:
            raise ConnectionError("flaky network")
        return "ok"

    # When it runs eagerly
    result = auto.delay()

    # Then it succeeded on the third run and left the lock free
    assert result.get() == "ok"
    assert runs == [0, 1, 2]
    env.assert_free(auto.lock_key_for())

    # And a direct call, which cannot retry, lets the error out and releases too
    runs.clear()
    with pytest.raises(ConnectionError, match="flaky network"):
        auto()
    assert runs == [0]
    env.assert_free(auto.lock_key_for())


@pytest.mark.parametrize(
    ("raised", "state"),
    [
        (Ignore(), "IGNORED"),
        (Reject("bad message", requeue=False), "REJECTED"),
        (SoftTimeLimitExceeded(), "FAILURE"),
    ],
    ids=["ignore", "reject", "soft-time-limit"],
)
def test_ignore_reject_and_soft_time_limit_free_the_lock(
    env: Env, raised: BaseException, state: str
) -> None:
    """Endings where Celery runs no after_return (Ignore, Reject) or fails (soft limit) release."""
    # Given a task whose body ends with one of these exceptions
    ran: list[bool] = []

    @env.task(name="inprocess.special")
    def special() -> None:
        ran.append(True)
        raise raised

    key = special.lock_key_for()

    # When it runs eagerly / Then Celery records the ending and the lock is free
    result = special.delay()
    assert result.state == state
    env.assert_free(key)

    # And a direct call lets the exception out and releases too
    with pytest.raises(type(raised)):
        special()
    env.assert_free(key)
    assert len(ran) == 2


# -- locked out -----------------------------------------------------------------------------------


def test_skip_returns_skipped_and_leaves_the_lock_alone(
    env: Env, conflicts: list[dict[str, Any]]
) -> None:
    """Policy "skip": the body does not run, the result is Skipped(key, holder, ttl)."""
    # Given a task whose key another execution holds
    ran: list[bool] = []

    @env.task(name="inprocess.skipper", lock_policy="skip", lock_args=("customer_id",))
    def skipper(customer_id: int) -> str:
        ran.append(True)
        return "ran"

    key = skipper.lock_key_for((5,), {})
    env.hold(key)

    # When it runs eagerly and directly
    eager = skipper.delay(5)
    direct = skipper(5)

    # Then both were skipped, naming the holder, without running the body
    for value in (eager.get(), direct):
        assert isinstance(value, Skipped)
        assert (value.key, value.holder) == (key, HOLDER_ID)
        assert value.ttl is not None
        assert 0 < value.ttl <= HOLDER_LEASE
    assert eager.state == "SUCCESS"
    assert ran == []
    # And the lock is untouched
    env.assert_held_by_other(key)
    # And lock_conflict fired for each, with the action taken
    assert [(c["key"], c["holder"], c["action"]) for c in conflicts] == [
        (key, HOLDER_ID, "skip"),
        (key, HOLDER_ID, "skip"),
    ]
    assert conflicts[0]["sender"] is skipper
    assert conflicts[0]["task_id"] == eager.id
    assert conflicts[1]["task_id"] is None


def test_raise_fails_with_task_locked_and_leaves_the_lock_alone(
    env: Env, conflicts: list[dict[str, Any]]
) -> None:
    """Policy "raise": the execution fails with TaskLocked(key, holder, ttl)."""
    # Given a task whose key another execution holds
    ran: list[bool] = []

    @env.task(name="inprocess.raiser", lock_policy="raise")
    def raiser() -> str:
        ran.append(True)
        return "ran"

    key = raiser.lock_key_for()
    env.hold(key)

    # When it runs eagerly / Then the result is a failure with TaskLocked
    eager = raiser.delay()
    assert eager.state == "FAILURE"
    with pytest.raises(TaskLocked) as from_eager:
        eager.get()

    # And a direct call raises it
    with pytest.raises(TaskLocked) as from_direct:
        raiser()

    for caught in (from_eager, from_direct):
        assert (caught.value.key, caught.value.holder) == (key, HOLDER_ID)
        assert caught.value.ttl is not None
        assert 0 < caught.value.ttl <= HOLDER_LEASE
    assert ran == []
    env.assert_held_by_other(key)
    assert [c["action"] for c in conflicts] == ["raise", "raise"]


def test_raise_policy_with_eager_propagation_raises_from_delay(env: Env) -> None:
    """With task_eager_propagates, TaskLocked comes straight out of .delay()."""
    env.app.conf.task_eager_propagates = True

    @env.task(name="inprocess.raiser_out", lock_policy="raise")
    def raiser_out() -> None: ...

    key = raiser_out.lock_key_for()
    env.hold(key)

    with pytest.raises(TaskLocked):
        raiser_out.delay()
    env.assert_held_by_other(key)


def test_retry_policy_raises_task_locked_at_once_in_eager_mode_and_direct_calls(
    env: Env, conflicts: list[dict[str, Any]]
) -> None:
    """Policy "retry" cannot wait in eager mode or a direct call: TaskLocked, once, at once.

    (An eager retry would re-run synchronously, immediately and recursively, against a lock
    that cannot be freed meanwhile.)
    """
    # Given a retry-policy task whose key another execution holds
    ran: list[bool] = []

    @env.task(name="inprocess.retrier", lock_policy="retry", lock_retry_countdown=0)
    def retrier() -> str:
        ran.append(True)
        return "ran"

    key = retrier.lock_key_for()
    env.hold(key)

    # When it runs eagerly and directly
    eager = retrier.delay()
    with pytest.raises(TaskLocked) as from_direct:
        retrier()

    # Then both failed with TaskLocked after exactly one attempt each
    assert eager.state == "FAILURE"
    assert isinstance(eager.result, TaskLocked)
    assert (eager.result.key, eager.result.holder) == (key, HOLDER_ID)
    assert (from_direct.value.key, from_direct.value.holder) == (key, HOLDER_ID)
    assert ran == []
    assert [c["action"] for c in conflicts] == ["raise", "raise"]
    # And the held lock is untouched
    env.assert_held_by_other(key)


def test_a_skip_is_logged_at_info_with_key_and_holder(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """A skipped execution is visible in the logs: one INFO line naming the key and the holder
    (a duplicate turned away is the lock working, as Celery logs the messages it discards)."""

    @env.task(name="inprocess.logged")
    def logged() -> None: ...

    key = logged.lock_key_for()
    env.hold(key)

    with caplog.at_level(logging.INFO, logger="singletask"):
        logged()

    lines = [r for r in caplog.records if r.name == "singletask"]
    assert [r.levelname for r in lines] == ["INFO"]
    assert key in lines[0].getMessage()
    assert HOLDER_ID in lines[0].getMessage()


def test_a_skip_writes_nothing_at_the_default_warning_level(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """At a worker's default level (WARNING) a skip logs nothing; a raise still warns."""

    @env.task(name="inprocess.quiet")
    def quiet() -> None: ...

    @env.task(name="inprocess.loud", lock_policy="raise")
    def loud() -> None: ...

    env.hold(quiet.lock_key_for())
    env.hold(loud.lock_key_for())

    with caplog.at_level(logging.WARNING, logger="singletask"):
        assert isinstance(quiet(), Skipped)
        with pytest.raises(TaskLocked):
            loud()

    lines = [r for r in caplog.records if r.name == "singletask"]
    assert [(r.levelname, "raises TaskLocked" in r.getMessage()) for r in lines] == [
        ("WARNING", True)
    ]


def test_the_lock_is_free_for_the_next_run_once_the_holder_releases(env: Env) -> None:
    """After the other execution releases, the task runs again."""

    @env.task(name="inprocess.after")
    def after() -> str:
        return "ran"

    key = after.lock_key_for()
    env.hold(key)
    assert isinstance(after(), Skipped)

    assert env.backend.release(key, HOLDER_TOKEN)

    assert after() == "ran"
    assert after.delay().get() == "ran"
    env.assert_free(key)


# -- self.lock and nesting ------------------------------------------------------------------------


def test_self_lock_is_the_handle_inside_the_body_and_none_outside(env: Env) -> None:
    """``self.lock`` is a LockHandle with the key while the body runs, None otherwise."""
    handles: list[Any] = []

    @env.task(name="inprocess.handle", bind=True, lock_args=("n",), lock_ttl=123)
    def handle(self: Any, n: int) -> None:
        handles.append(self.lock)

    key = handle.lock_key_for((1,), {})

    assert handle.lock is None
    handle.delay(1)
    handle(1)
    assert handle.lock is None

    for lock in handles:
        assert isinstance(lock, LockHandle)
        assert lock.key == key
        assert lock.ttl == 123
        assert lock.token


def test_a_reentrant_direct_call_with_the_same_key_runs(env: Env) -> None:
    """The body calling its own task directly, for the same key, runs (no self-deadlock)."""
    # Given a task whose body calls itself directly for the same key
    depths: list[int] = []

    @env.task(name="inprocess.recursive", bind=True, lock_policy="raise")
    def recursive(self: Any, depth: int) -> int:
        depths.append(depth)
        if depth == 0:
            return 0
        return 1 + self(depth - 1)

    key = recursive.lock_key_for((3,), {})

    # When it runs eagerly and directly
    assert recursive.delay(3).get() == 3
    assert recursive(2) == 2

    # Then every level ran and the lock is free
    assert depths == [3, 2, 1, 0, 2, 1, 0]
    env.assert_free(key)


def test_a_nested_direct_call_for_another_key_takes_its_own_lock(env: Env) -> None:
    """Inside the body, a direct call for a different key locks that key, then releases it."""
    # Given a task whose body (for n=1) calls itself directly for n=2
    seen: dict[int, Any] = {}
    outer_key = ""

    @env.task(name="inprocess.pair", bind=True, lock_args=("n",))
    def pair(self: Any, n: int) -> None:
        seen[n] = (self.lock, env.backend.holder(self.lock.key), env.backend.holder(outer_key))
        if n == 1:
            pair(2)
            seen[3] = self.lock  # the outer handle again, after the inner call

    outer_key = pair.lock_key_for((1,), {})

    # When it runs eagerly
    pair.delay(1)

    # Then the inner call held its own key while the outer lock stayed held
    outer, inner = seen[1][0], seen[2][0]
    assert outer.key == outer_key
    assert inner.key == pair.lock_key_for((2,), {})
    assert inner.token != outer.token
    assert seen[2][1].token == inner.token
    assert seen[2][2].token == outer.token
    assert seen[3] is outer
    # And both are free at the end
    env.assert_free(outer.key)
    env.assert_free(inner.key)


def test_the_hooks_celery_calls_after_an_execution_are_its_own_even_after_a_nested_one(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """on_success and after_return, called by Celery in the executing thread, find the lock
    already released by ``__call__``: they release nothing for it, even when the body ran
    another task eagerly (whose own hooks ran in between)."""
    # Given an outer task whose body runs an inner task eagerly, and release_for watched
    released: list[str] = []
    monkeypatch.setattr(
        SingletonTask, "release_for", lambda self, task_id, *a, **k: released.append(task_id)
    )

    @env.task(name="inprocess.inner")
    def inner() -> str:
        return "inner"

    @env.task(name="inprocess.outer")
    def outer() -> str:
        return str(inner.apply().result)

    # When the outer task runs eagerly
    assert outer.delay().get() == "inner"

    # Then no hook took itself for the worker's main process
    assert released == []
    env.assert_free(outer.lock_key_for())
    env.assert_free(inner.lock_key_for())


def test_a_hook_called_for_an_execution_that_did_not_run_here_releases_for_it(
    env: Env,
) -> None:
    """Celery's worker main process calls on_failure for an execution it lost (a hard time
    limit): the hook, finding that execution did not run in this thread, releases its lock."""

    # Given a task whose lock an execution of task id "lost-id" holds, from a process of this
    # host that is gone, after another execution ran in this thread
    @env.task(name="inprocess.lost", lock_args=("n",))
    def lost(n: int) -> int:
        return n

    assert lost.delay(1).get() == 1
    gone = subprocess.Popen(["true"])
    gone.wait()
    token = f"lost-id:0:{host_id()}:{gone.pid}:nonce"
    key = lost.lock_key_for((2,), {})
    assert env.backend.acquire(key, token, HOLDER_LEASE, meta={"task_id": "lost-id"}).acquired

    # When on_failure is called for it, as the main process does
    lost.on_failure(RuntimeError("hard time limit"), "lost-id", (2,), {}, None)

    # Then its lock is released
    env.assert_free(key)
