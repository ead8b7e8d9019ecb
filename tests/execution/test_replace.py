"""``lock_policy = "replace"``: the newer execution wins, the running one is preempted (issue 30).

In one process (eager mode), against the memory store, the session's private Redis and SQLite:
a newer execution takes the key over with a larger fence; the preempted body learns it from
its renewer within one renewal interval, ``check()`` raises ``LockPreempted`` naming the
successor, and the execution ends as a ``Skipped`` with reason "replaced". Definition time
refuses the combinations that cannot work. Real workers: tests/e2e/test_replace.py.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import celery
import pytest

from singletask import ConfigurationError, LockPreempted, SingletonTask, Skipped
from singletask.backends.base import LockBackend
from singletask.conf.runtime import lock_options
from singletask.protocol.slots import slot_keys
from singletask.signals import lock_conflict, lock_lost

LEASE = 30.0


@pytest.fixture
def app(eager_store_app: celery.Celery) -> celery.Celery:
    """An eager app on each store with slots (tests/conftest.py)."""
    return eager_store_app


def backend_of(task: Any) -> LockBackend:
    backend: LockBackend = task.lock_backend
    return backend


def test_a_newer_execution_preempts_the_holder_with_a_larger_fence(app: celery.Celery) -> None:
    """Given a running holder, when a newer execution starts, then it runs at once, with a
    fence above the holder's, records whom it replaced, and reports action "replace"."""
    seen: dict[str, Any] = {}
    actions: list[tuple[str, str | None]] = []

    @app.task(base=SingletonTask, shared=False, lazy=False, bind=True, lock_policy="replace")
    def rebuild(self: Any) -> str:
        seen["fence"] = self.lock.fence
        seen["holder"] = backend_of(rebuild).holder(self.lock.key)
        return "ran"

    def record(sender: Any, action: str, holder: str | None, **kwargs: Any) -> None:
        actions.append((action, holder))

    # Given another execution holding the key
    backend, key = backend_of(rebuild), rebuild.lock_key_for()
    old = backend.acquire(key, "old-token", LEASE, meta={"task_id": "old-id"})
    assert old.acquired
    assert old.fence is not None

    # When a newer execution of the task runs
    lock_conflict.connect(record)
    try:
        assert rebuild.delay().get() == "ran"
    finally:
        lock_conflict.disconnect(record)

    # Then it ran with a larger fence, naming the holder it replaced
    assert seen["fence"] > old.fence
    assert seen["holder"].meta["replaces"] == "old-token"
    assert actions == [("replace", "old-id")]
    # And the preempted holder can no longer renew or release
    assert backend.extend(key, "old-token", LEASE) is False
    assert backend.holder(key) is None


def test_with_every_slot_full_the_oldest_holder_is_preempted(app: celery.Celery) -> None:
    """With lock_limit = 3 full, the newer execution takes the slot of the holder with the
    smallest fence; the two others keep theirs."""
    seen: dict[str, Any] = {}

    @app.task(
        base=SingletonTask, shared=False, lazy=False, bind=True, lock_policy="replace",
        lock_limit=3,
    )  # fmt: skip
    def export(self: Any) -> str:
        seen["key"], seen["fence"] = self.lock.key, self.lock.fence
        return "ran"

    # Given three holders, the one in slot 1 the oldest
    backend, key = backend_of(export), export.lock_key_for()
    slots = slot_keys(key, 3)
    fences = {}
    for n in (1, 0, 2):  # slot 1 first: the smallest fence
        taken = backend.acquire(slots[n], f"other-{n}", LEASE, meta={"task_id": f"t-{n}"})
        assert taken.acquired
        assert taken.fence is not None
        fences[n] = taken.fence

    # When a newer execution runs
    assert export.delay().get() == "ran"

    # Then it ran in the oldest's slot with a larger fence, and the others still hold theirs
    assert seen["key"] == slots[1]
    assert seen["fence"] > max(fences.values())
    assert backend.extend(slots[0], "other-0", LEASE)
    assert backend.extend(slots[2], "other-2", LEASE)
    assert backend.extend(slots[1], "other-1", LEASE) is False


def test_the_preempted_body_learns_it_within_one_renewal_interval(app: celery.Celery) -> None:
    """Given a running body that checks its lock, when a newer execution preempts it, then
    within a third of lock_ttl its renewer reports the loss as a preemption naming the
    successor (lock_lost, check() raises LockPreempted), and the execution ends as Skipped
    with reason "replaced" naming it, sent as lock_conflict action "replaced"."""
    ttl = 0.9  # renewed every 0.3 s
    started, learned = threading.Event(), {}
    signals: list[tuple[str, Any]] = []

    @app.task(
        base=SingletonTask, shared=False, lazy=False, bind=True, lock_policy="replace",
        lock_ttl=ttl,
    )  # fmt: skip
    def rebuild(self: Any) -> str:
        started.set()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                self.lock.check()
            except LockPreempted as exc:
                learned["at"], learned["successor"] = time.monotonic(), exc.successor
                raise
            time.sleep(0.01)
        return "not preempted"

    def on_lost(sender: Any, reason: str, **kwargs: Any) -> None:
        signals.append(("lost", reason))

    def on_conflict(sender: Any, action: str, holder: str | None, **kwargs: Any) -> None:
        signals.append((action, holder))

    backend, key = backend_of(rebuild), rebuild.lock_key_for()
    outcome: dict[str, Any] = {}
    lock_lost.connect(on_lost)
    lock_conflict.connect(on_conflict)
    try:
        runner = threading.Thread(target=lambda: outcome.update(v=rebuild.apply().get()))
        runner.start()
        assert started.wait(10)
        holder = backend.holder(key)
        assert holder is not None

        # When a newer execution takes the key over
        preempted_at = time.monotonic()
        taken = backend.preempt(
            key, 1, "newer-token", LEASE, holder.token,
            meta={"task_id": "newer-id", "replaces": holder.token},
        )  # fmt: skip
        assert taken.acquired
        runner.join(15)
    finally:
        lock_lost.disconnect(on_lost)
        lock_conflict.disconnect(on_conflict)

    # Then the body learned it within one renewal interval (plus scheduling slack)
    assert learned["successor"] == "newer-id"
    assert learned["at"] - preempted_at < ttl / 3 + 0.5
    # And the execution ended as replaced, naming its successor
    value = outcome["v"]
    assert isinstance(value, Skipped)
    assert (value.reason, value.holder) == ("replaced", "newer-id")
    assert ("replaced", "newer-id") in signals
    assert any(kind == "lost" and "preempted by a newer execution (newer-id)" in str(reason)
               for kind, reason in signals)  # fmt: skip
    backend.release(key, "newer-token")


@pytest.mark.parametrize(
    "successor_ended", [False, True], ids=["successor-holds", "successor-ended"]
)
def test_a_body_that_ends_before_its_renewer_noticed_still_ends_as_replaced(
    app: celery.Celery, successor_ended: bool
) -> None:
    """A body preempted and returning before any renewal: its release finds the lock gone,
    one read of the takeover's record names the successor, whether it still holds the key or
    has released it already, and it ends as replaced rather than with its value."""

    @app.task(base=SingletonTask, shared=False, lazy=False, bind=True, lock_policy="replace")
    def rebuild(self: Any) -> str:
        backend = backend_of(rebuild)
        taken = backend.preempt(
            self.lock.key, 1, "newer-token", LEASE, self.lock.token,
            meta={"task_id": "newer-id", "replaces": self.lock.token},
        )  # fmt: skip
        assert taken.acquired
        if successor_ended:
            assert backend.release(self.lock.key, "newer-token")
        return "late value"

    value = rebuild.delay().get()

    assert isinstance(value, Skipped)
    assert (value.reason, value.holder) == ("replaced", "newer-id")
    backend_of(rebuild).release(rebuild.lock_key_for(), "newer-token")


def test_a_retried_attempt_does_not_preempt_a_newer_holder(app: celery.Celery) -> None:
    """An attempt with retries > 0 is older than a holder that started after its first
    attempt: it stands aside, ending as replaced by the holder."""
    ran: list[bool] = []

    @app.task(base=SingletonTask, shared=False, lazy=False, lock_policy="replace")
    def rebuild() -> None:
        ran.append(True)

    backend, key = backend_of(rebuild), rebuild.lock_key_for()
    backend.acquire(key, "newer-token", LEASE, meta={"task_id": "newer-id"})

    value = rebuild.apply(retries=1).get()

    assert ran == []
    assert isinstance(value, Skipped)
    assert (value.reason, value.holder) == ("replaced", "newer-id")
    assert backend.holder(key) is not None
    backend.release(key, "newer-token")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lock_scope": "queue"}, r"attribute lock_policy: 'replace' .* lock_scope 'queue'"),
        ({"lock_scope": "coalesce"}, r"attribute lock_policy: 'replace' .* 'coalesce'"),
        ({"lock_rate": "1/s"}, r"attribute lock_policy: 'replace' .* lock_rate"),
        ({"lock_renew": False}, r"attribute lock_policy: 'replace' needs lock_renew"),
    ],
)
def test_replace_with_an_option_it_cannot_go_with_is_refused(
    options: dict[str, Any], message: str
) -> None:
    """Definition time refuses the combination, naming the task and the attribute."""
    app = celery.Celery("replace-bad", set_as_current=False)
    with pytest.raises(ConfigurationError, match=rf"task 'replace\.bad' {message}"):

        @app.task(
            base=SingletonTask, shared=False, lazy=False, name="replace.bad",
            lock_policy="replace", **options,
        )  # fmt: skip
        def bad() -> None: ...


def test_terminate_without_replace_is_refused() -> None:
    app = celery.Celery("replace-terminate", set_as_current=False)
    with pytest.raises(ConfigurationError, match=r"'replace\.t' attribute lock_replace_terminate"):

        @app.task(
            base=SingletonTask, shared=False, lazy=False, name="replace.t", lock_policy="skip",
            lock_replace_terminate=True,
        )  # fmt: skip
        def bad() -> None: ...


def test_terminate_with_the_app_s_default_policy_other_than_replace_is_refused_when_bound() -> None:
    """lock_replace_terminate on a task whose policy comes from the app's setting: refused
    when the task is bound (the earliest the setting is known) unless that policy is
    "replace", naming the task, the attribute and the setting; with "replace" it is kept."""
    app = celery.Celery("replace-terminate-app", set_as_current=False)
    app.conf.update(singletask_backend_url="memory://", singletask_lock_policy="skip")
    with pytest.raises(
        ConfigurationError,
        match=r"'r\.t' attribute lock_replace_terminate.*'skip'.*singletask_lock_policy",
    ):

        @app.task(base=SingletonTask, shared=False, lazy=False, name="r.t",
                  lock_replace_terminate=True)  # fmt: skip
        def bad() -> None: ...

    replacing = celery.Celery("replace-terminate-ok", set_as_current=False)
    replacing.conf.update(singletask_backend_url="memory://", singletask_lock_policy="replace")

    @replacing.task(base=SingletonTask, shared=False, lazy=False, name="r.ok",
                    lock_replace_terminate=True)  # fmt: skip
    def ok() -> None: ...

    resolved = lock_options(ok)
    assert resolved.replace_terminate
    assert resolved.policy == "replace"


def test_an_app_wide_replace_policy_with_a_queueing_task_is_refused_when_bound() -> None:
    app = celery.Celery("replace-app", set_as_current=False)
    app.conf.update(singletask_backend_url="memory://", singletask_lock_policy="replace")
    with pytest.raises(ConfigurationError, match=r"singletask_lock_policy.*lock_scope 'queue'"):

        @app.task(base=SingletonTask, shared=False, lazy=False, name="r.q", lock_scope="queue")
        def bad() -> None: ...


@pytest.mark.parametrize("url", ["memcached://127.0.0.1:1", "django://default"])
def test_a_store_that_cannot_preempt_refuses_replace_when_the_task_is_bound(url: str) -> None:
    """memcached and Django caches cannot preempt: the task is refused naming the option and
    the store."""
    app = celery.Celery("replace-store", set_as_current=False)
    app.conf.update(singletask_backend_url=url)
    scheme = url.split(":", 1)[0]
    with pytest.raises(ConfigurationError, match=rf"lock_policy: the {scheme}:// lock store"):

        @app.task(base=SingletonTask, shared=False, lazy=False, name="r.m", lock_policy="replace")
        def bad() -> None: ...
