"""Which lock a call takes, and holding it from a test as another execution would."""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from celery.canvas import Signature

from ..exceptions import TaskLocked
from ..protocol.tokens import execution_token
from ..task import SingletonTask

if TYPE_CHECKING:
    from ..backends.base import LockBackend

__all__ = [
    "DEFAULT_HOLDER_ID",
    "DEFAULT_LEASE",
    "HeldLock",
    "hold_lock",
    "lock_key",
    "lock_key_for",
]

#: The task id :func:`hold_lock` holds a lock under unless told otherwise.
DEFAULT_HOLDER_ID: Final = "test-holder"

#: The lease, in seconds, of a lock taken by :func:`hold_lock` unless told otherwise.
DEFAULT_LEASE: Final = 60.0


def _call(
    task: Any, args: Sequence[Any], kwargs: Mapping[str, Any], caller: str
) -> tuple[SingletonTask, tuple[Any, ...], dict[str, Any]]:
    """The singleton task and arguments of ``caller(task, *args, **kwargs)`` or ``caller(sig)``."""
    if isinstance(task, Signature):
        if args or kwargs:
            raise TypeError(
                f"{caller}() takes the arguments from the signature {task!r}; pass no others"
            )
        task, args, kwargs = task.type, tuple(task.args or ()), dict(task.kwargs or {})
    if not isinstance(task, SingletonTask):
        raise TypeError(
            f"{caller}() needs a task created with base=SingletonTask (or a signature of one), "
            f"got {task!r}"
        )
    return task, tuple(args), dict(kwargs)


def lock_key_for(task: Any, /, *args: Any, **kwargs: Any) -> str:
    """The lock key an execution of ``task(*args, **kwargs)`` takes.

    ``task`` may also be a signature (``my_task.s(42)``), which then brings the arguments. Two
    calls share one lock exactly when their keys are equal. The key is built by the task itself
    (:meth:`SingletonTask.lock_key_for <singletask.SingletonTask.lock_key_for>`), so it is the
    one production uses.

    Raises:
        TypeError: ``task`` is not a SingletonTask.
        LockKeyError: The key cannot be built from these arguments (as when the task runs).
    """
    singleton, args, kwargs = _call(task, args, kwargs, "lock_key_for")
    return singleton.lock_key_for(args, kwargs)


class HeldLock:
    """A lock the test holds as another execution would; made by :func:`hold_lock`.

    Use it as a context manager: the lock is taken on entry and released on exit.

    Attributes:
        task: The task whose lock it is.
        key: The lock key.
        holder_id: The task id the lock is held under (what a locked-out execution reports as
            its holder).
        lease: The lease, in seconds. It is not renewed.
        token: The owner token in the store.
    """

    def __init__(
        self,
        task: SingletonTask,
        key: str,
        *,
        holder_id: str = DEFAULT_HOLDER_ID,
        lease: float = DEFAULT_LEASE,
    ) -> None:
        self.task = task
        self.key = key
        self.holder_id = holder_id
        self.lease = float(lease)
        self.token = execution_token(holder_id, 0)
        self._backend: LockBackend | None = None  # where it was taken

    @property
    def _store(self) -> LockBackend:
        return self._backend if self._backend is not None else self.task.lock_backend

    def __repr__(self) -> str:
        return f"<HeldLock {self.key!r} by {self.holder_id!r}>"

    def acquire(self) -> HeldLock:
        """Take the lock; returns self.

        Raises:
            TaskLocked: Someone else holds it.
            RuntimeError: The app's locks are switched off (:func:`locks_disabled`).
        """
        backend = self._backend = self.task.lock_backend
        meta = {
            "task_id": self.holder_id,
            "task": self.task.name,
            "hostname": "test",
            "pid": str(os.getpid()),
            "since": f"{time.time():.3f}",
        }
        result = backend.acquire(self.key, self.token, self.lease, meta=meta)
        if not result.acquired:
            holder = result.holder
            if holder is None:
                raise TaskLocked(self.key)
            raise TaskLocked(self.key, holder.task_id, holder.ttl)
        holder = backend.holder(self.key)
        if holder is None or holder.token != self.token:
            raise RuntimeError(
                f"cannot hold lock {self.key!r}: locks of task {self.task.name!r} are switched "
                "off (locks_disabled / the singletask_locks_disabled fixture)"
            )
        return self

    def release(self) -> bool:
        """Release the lock, if this hold still has it. Returns whether it did."""
        return self._store.release(self.key, self.token)

    @property
    def held(self) -> bool:
        """Whether this hold still has the lock (its lease has not run out)."""
        holder = self._store.holder(self.key)
        return holder is not None and holder.token == self.token

    def __enter__(self) -> HeldLock:
        return self.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def hold_lock(
    task: Any,
    /,
    *args: Any,
    holder_id: str | None = None,
    lease: float | None = None,
    **kwargs: Any,
) -> HeldLock:
    """Hold the lock ``task(*args, **kwargs)`` would take, as another execution would.

    ::

        with hold_lock(sync_customer, 42, holder_id="other-run"):
            sync_customer.delay(42)      # skipped, retried or raises, as the policy says

    The lock is taken in the store the task uses (the test's one under :func:`isolated_locks`),
    under the task id ``holder_id`` (default :data:`DEFAULT_HOLDER_ID`) by a live process (this
    one), for ``lease`` seconds (default :data:`DEFAULT_LEASE`, not renewed). The
    names ``holder_id`` and ``lease`` belong to ``hold_lock``; for a task that has parameters
    of these names, pass the call as a signature: ``hold_lock(task.s(lease=3), lease=60)``.

    Raises:
        TypeError: ``task`` is not a SingletonTask, or an argument name is ambiguous.
        LockKeyError: The key cannot be built from these arguments.
        TaskLocked: (on entry) someone else holds the lock.
    """
    given = {"holder_id": holder_id, "lease": lease}
    if isinstance(task, SingletonTask):
        try:
            parameters = set(inspect.signature(task.run).parameters)
        except (TypeError, ValueError):
            parameters = set()
        clash = [name for name, value in given.items() if value is not None and name in parameters]
        if clash:
            raise TypeError(
                f"task {task.name!r} has a parameter named {clash[0]!r}, as hold_lock() does: "
                f"pass the call as a signature, hold_lock({task.name.rsplit('.', 1)[-1]}.s(...), "
                f"{clash[0]}=...)"
            )
    singleton, args, kwargs = _call(task, args, kwargs, "hold_lock")
    key = singleton.lock_key_for(args, kwargs)
    return HeldLock(
        singleton,
        key,
        holder_id=DEFAULT_HOLDER_ID if holder_id is None else holder_id,
        lease=DEFAULT_LEASE if lease is None else lease,
    )


def lock_key(lock: Any) -> str:
    """The key of a lock named by its key, a :class:`HeldLock` or a signature."""
    if isinstance(lock, HeldLock):
        return lock.key
    if isinstance(lock, str):
        return lock
    if isinstance(lock, Signature):
        return lock_key_for(lock)
    raise TypeError(f"name a lock by its key, a HeldLock or a signature, not {lock!r}")
