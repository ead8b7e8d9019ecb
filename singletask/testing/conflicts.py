"""What a test's tasks did when they found a lock held, and assertions on it."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final

from celery.signals import task_retry

from ..backends import backend_from_url
from ..exceptions import TaskLocked
from ..signals import lock_conflict
from .locks import lock_key
from .stores import routed

if TYPE_CHECKING:
    from celery import Celery

    from ..backends.base import Holder, LockBackend

__all__ = ["IsolatedLocks", "LockConflict", "isolated_locks"]

#: The jitter singletask adds to ``lock_retry_countdown`` (up to a quarter of it).
_RETRY_JITTER: Final = 0.25

#: How long an assertion waits for an execution when the app does not run tasks eagerly.
_WORKER_WAIT: Final = 5.0


@dataclass(frozen=True)
class LockConflict:
    """An execution (or a send) that found its lock held, and what it did.

    Attributes:
        task: The task's name.
        key: The lock key.
        action: ``"skip"``, ``"retry"`` or ``"raise"`` (the policy's), or another action of
            :data:`singletask.signals.lock_conflict` (``"defer"``, ``"drop"``, ``"dedupe"``,
            ``"follow"``, ``"join"``).
        holder: Task id of the execution holding the lock, when known.
        ttl: Seconds that were left on the holder's lease, when known.
        task_id: Task id of the locked-out execution (None for a direct call).
        countdown: For ``"retry"``, the seconds until the retry, once the worker has sent it.
    """

    task: str
    key: str
    action: str
    holder: str | None
    ttl: float | None
    task_id: str | None
    countdown: float | None = None

    def __str__(self) -> str:
        did = {"skip": "skipped", "raise": "raised TaskLocked", "retry": "retried"}.get(
            self.action, self.action
        )
        if self.countdown is not None:
            did += f" in {self.countdown:.2f}s"
        left = f", {self.ttl:.1f}s left on its lease" if self.ttl is not None else ""
        return (
            f"task {self.task}[{self.task_id}] {did}: lock {self.key!r} held by {self.holder}{left}"
        )


class IsolatedLocks:
    """The lock store of one test, and what the app's tasks did when they found a lock held.

    Made by :func:`isolated_locks` (and the ``singletask_locks`` fixture). Every assertion names
    the lock by its key, a :class:`HeldLock` or a signature (``my_task.s(42)``), returns the
    :class:`LockConflict` it found, and fails with an :class:`AssertionError` that says what was
    expected, what happened on that key, and who holds it now.

    Attributes:
        app: The app whose tasks use this store.
        backend: The store (keys are stored under a per-test namespace on a real server).
        conflicts: Every :class:`LockConflict` of the app's tasks so far, in order.
    """

    def __init__(self, app: Celery, backend: LockBackend) -> None:
        self.app = app
        self.backend = backend
        self.conflicts: list[LockConflict] = []
        self._changed = threading.Condition()

    # Receivers of singletask's lock_conflict and Celery's task_retry signals.

    def _on_conflict(self, sender: Any = None, **fields: Any) -> None:
        if getattr(sender, "app", None) is not self.app:
            return
        conflict = LockConflict(
            getattr(sender, "name", str(sender)),
            fields["key"],
            fields["action"],
            fields.get("holder"),
            fields.get("ttl"),
            fields.get("task_id"),
        )
        with self._changed:
            self.conflicts.append(conflict)
            self._changed.notify_all()

    def _on_retry(
        self, sender: Any = None, request: Any = None, reason: Any = None, **_: Any
    ) -> None:
        locked = getattr(reason, "exc", None)
        when = getattr(reason, "when", None)
        if not isinstance(locked, TaskLocked) or not isinstance(when, int | float):
            return
        task_id = getattr(request, "id", None)
        with self._changed:
            for at in range(len(self.conflicts) - 1, -1, -1):
                seen = self.conflicts[at]
                if seen.action == "retry" and seen.task_id == task_id and seen.key == locked.key:
                    self.conflicts[at] = replace(seen, countdown=float(when))
                    self._changed.notify_all()
                    break

    # Looking.

    def holder(self, lock: Any) -> Holder | None:
        """Who holds the lock now (None when it is free)."""
        return self.backend.holder(lock_key(lock))

    def conflicts_on(self, lock: Any) -> list[LockConflict]:
        """The conflicts recorded on one lock, in order."""
        key = lock_key(lock)
        with self._changed:
            return [seen for seen in self.conflicts if seen.key == key]

    # Asserting.

    def assert_skipped(self, lock: Any, *, timeout: float | None = None) -> LockConflict:
        """Assert that an execution found the lock held and was skipped (returned Skipped)."""
        return self._expect(lock, "skip", timeout)

    def assert_raised(self, lock: Any, *, timeout: float | None = None) -> LockConflict:
        """Assert that an execution found the lock held and failed with TaskLocked.

        This is the ``"raise"`` policy, and also a ``"retry"`` policy whose retries are spent or
        that cannot wait (eager mode, a direct call).
        """
        return self._expect(lock, "raise", timeout)

    def assert_retried(
        self, lock: Any, *, countdown: float | None = None, timeout: float | None = None
    ) -> LockConflict:
        """Assert that an execution found the lock held and was sent again for later.

        Only a worker retries: in eager mode and direct calls a ``"retry"`` policy raises
        TaskLocked instead (see :meth:`assert_raised`). With ``countdown``, also assert the
        retry's delay: the task's ``lock_retry_countdown``, plus the up to 25% jitter
        singletask adds.
        """
        return self._expect(lock, "retry", timeout, countdown=countdown)

    def assert_free(self, lock: Any) -> None:
        """Assert that nobody holds the lock now."""
        key = lock_key(lock)
        holder = self.backend.holder(key)
        if holder is not None:
            raise AssertionError(f"expected lock {key!r} to be free; {_describe(holder)}")

    def _expect(
        self, lock: Any, action: str, timeout: float | None, *, countdown: float | None = None
    ) -> LockConflict:
        key = lock_key(lock)
        if timeout is None:
            timeout = 0.0 if self.app.conf.task_always_eager else _WORKER_WAIT

        def found() -> LockConflict | None:
            for seen in self.conflicts:
                # A retry counts once the worker has sent it (its countdown known).
                ready = action != "retry" or seen.countdown is not None
                if seen.key == key and seen.action == action and ready:
                    return seen
            return None

        with self._changed:
            match = self._changed.wait_for(found, timeout=timeout)
        if match is not None and countdown is not None:
            assert match.countdown is not None
            low, high = countdown, countdown * (1 + _RETRY_JITTER)
            if not low - 1e-6 <= match.countdown <= high + 1e-6:
                raise AssertionError(
                    f"expected a retry on lock {key!r} in {low:g}s to {high:g}s "
                    f"(lock_retry_countdown {countdown:g}s plus up to 25% jitter), but it was "
                    f"sent for {match.countdown:.2f}s: {match}"
                )
        if match is not None:
            return match
        raise AssertionError(self._missing(key, action, timeout))

    def _missing(self, key: str, action: str, timeout: float) -> str:
        wanted = {"skip": "be skipped", "raise": "raise TaskLocked", "retry": "be retried"}[action]
        lines = [f"expected an execution locked out of {key!r} to {wanted}, but"]
        on_key = self.conflicts_on(key)
        if on_key:
            lines.append("  what happened on that lock:")
            lines += [f"    - {seen}" for seen in on_key]
        else:
            waited = f" (waited {timeout:g}s)" if timeout else ""
            lines.append(f"  no execution found that lock held{waited}")
        if action == "retry" and any(seen.action == "raise" for seen in on_key):
            lines.append(
                "  note: in eager mode and direct calls a 'retry' policy cannot wait, so it "
                "raises TaskLocked; run the task on a worker (celery_worker) to see the retry"
            )
        if action == "retry" and any(s.action == "retry" for s in on_key):
            lines.append("  note: a retry was decided but the worker has not sent it yet")
        holder = self.backend.holder(key)
        lines.append(f"  now: {_describe(holder)}" if holder else "  now: the lock is free")
        others = [seen for seen in self.conflicts if seen.key != key]
        if others:
            lines.append("  conflicts on other locks:")
            lines += [f"    - {seen}" for seen in others]
        return "\n".join(lines)


def _describe(holder: Holder) -> str:
    left = f", {holder.ttl:.1f}s left on its lease" if holder.ttl is not None else ""
    return f"the lock is held by {holder.task_id or 'a direct call'} (token {holder.token}{left})"


@contextlib.contextmanager
def isolated_locks(app: Celery, *, url: str | None = None) -> Iterator[IsolatedLocks]:
    """Give ``app``'s tasks a fresh lock store of their own until the block ends.

    By default the store is in this process (:class:`~singletask.backends.memory.MemoryBackend`):
    no server, nothing shared with other tests or other pytest-xdist workers, and shared with a
    worker running in this process (Celery's ``celery_worker`` fixture runs it in a thread).
    With ``url`` (``redis://...``), the store is that server, with every key under a namespace
    of its own; keys left behind by a failed test end with their leases.

    Yields:
        An :class:`IsolatedLocks` that records what the app's tasks did on a held lock.
    """
    if url is None:
        store: LockBackend = backend_from_url("memory://")
        namespace = ""
    else:
        store = backend_from_url(url)
        namespace = f"singletask-test:{uuid.uuid4().hex[:12]}:"
    locks: IsolatedLocks | None = None
    try:
        with routed(app, store, namespace) as router:
            locks = IsolatedLocks(app, router)
            lock_conflict.connect(locks._on_conflict, weak=False)
            task_retry.connect(locks._on_retry, weak=False)
            yield locks
    finally:
        if locks is not None:
            lock_conflict.disconnect(locks._on_conflict)
            task_retry.disconnect(locks._on_retry)
        store.close()
