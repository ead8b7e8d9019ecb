"""Every error singletask raises, under one root.

::

    SingletaskError(Exception)
    ├── ConfigurationError(ValueError)   bad or conflicting settings / task attributes
    │   └── UnknownBackendError          no backend for that URL scheme
    ├── LockKeyError(TypeError)          a lock key cannot be built from the arguments
    ├── TaskLocked                       the lock is held by another execution
    │   └── RateLimited                  the key's rate allows no start yet
    ├── LockLost                         a running execution's lock expired or was taken
    │   └── LockPreempted                a newer execution took it over (policy "replace")
    ├── BackendError                     the lock store failed (driver error chained)
    │   ├── BackendUnavailable           cannot connect / connection lost
    │   └── BackendTimeout               a socket or command timed out
    └── UnsupportedOperation             the lock store cannot do this (e.g. list its keys)

Exceptions that travel through Celery's result backend (:class:`TaskLocked`) keep all of
their fields in ``args``, so they survive pickling and the JSON result serializer.
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "BackendTimeout",
    "BackendUnavailable",
    "ConfigurationError",
    "LockKeyError",
    "LockLost",
    "LockPreempted",
    "RateLimited",
    "SingletaskError",
    "TaskLocked",
    "UnknownBackendError",
    "UnsupportedOperation",
]


class SingletaskError(Exception):
    """Root of every exception raised by singletask."""


class ConfigurationError(SingletaskError, ValueError):
    """A setting or a task attribute is invalid, or settings conflict."""


class UnknownBackendError(ConfigurationError):
    """No lock backend is registered for a URL scheme."""


class LockKeyError(SingletaskError, TypeError):
    """The lock key cannot be built from a call's arguments (e.g. an unserialisable value)."""


class TaskLocked(SingletaskError):
    """The task's lock is held by another execution, or a limit it names has no room.

    Raised by the ``"raise"`` policy, and by the ``"retry"`` policy once its budget is spent.

    Attributes:
        key: The lock key.
        holder: Task id of the execution holding the lock, when known.
        ttl: Seconds left on the holder's lease, when known.
        holders: With ``lock_limit`` above 1, the task id of every holder (``holder`` is the
            first); empty for a singleton task.
        limit: When a limit had no room for the execution's units (``lock_limits``; the
            key's own ``lock_limit`` counted by ``lock_cost`` is ``"lock_limit"``): its name.
            None when the key is held.
        retry_after: With ``limit``, a rate's: seconds until it has room.
    """

    def __init__(
        self,
        key: str,
        holder: str | None = None,
        ttl: float | None = None,
        holders: tuple[str | None, ...] = (),
        limit: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(key, holder, ttl, tuple(holders), limit, retry_after)
        self.key = key
        self.holder = holder
        self.ttl = ttl
        self.holders = tuple(holders)
        self.limit = limit
        self.retry_after = retry_after

    def __str__(self) -> str:
        if self.limit is not None:
            when = f"; room in {self.retry_after:.1f}s" if self.retry_after is not None else ""
            return f"limit {self.limit!r} has no room for this execution of {self.key!r}{when}"
        if self.holders:
            names = ", ".join(f"task {h}" if h else "a direct call" for h in self.holders)
            return f"lock {self.key!r} is held by its {len(self.holders)} holders: {names}"
        who = f"task {self.holder}" if self.holder else "another execution"
        left = f" ({self.ttl:.1f}s left on its lease)" if self.ttl is not None else ""
        return f"lock {self.key!r} is held by {who}{left}"


class RateLimited(TaskLocked):
    """The task's lock key started too recently for its ``lock_rate``.

    Raised by the ``"raise"`` policy, and by the ``"retry"`` policy once its budget is spent,
    when a start would exceed the rate (a :class:`TaskLocked`, so code that handles a held
    lock handles this too).

    Attributes:
        key: The lock key.
        retry_after: Seconds until the key may start again.
        rate: The task's ``lock_rate`` (``"10/m"``).
    """

    retry_after: float

    def __init__(self, key: str, retry_after: float, rate: str | None = None) -> None:
        super().__init__(key)
        self.args = (key, retry_after, rate)
        self.retry_after = retry_after
        self.rate = rate

    def __str__(self) -> str:
        rate = f" ({self.rate})" if self.rate else ""
        return (
            f"lock {self.key!r} started too recently for its lock_rate{rate}; the next start "
            f"is allowed in {self.retry_after:.1f}s"
        )


class LockLost(SingletaskError):
    """A running execution's lock is no longer its own (the lease ran out or another took it).

    Raised by :meth:`LockHandle.check() <singletask.LockHandle.check>`.

    Attributes:
        key: The lock key.
        reason: What happened.
    """

    def __init__(self, key: str, reason: str = "") -> None:
        super().__init__(key, reason)
        self.key = key
        self.reason = reason

    def __str__(self) -> str:
        return (
            f"lock {self.key!r} was lost: {self.reason}"
            if self.reason
            else f"lock {self.key!r} was lost"
        )


class LockPreempted(LockLost):
    """A running execution's lock was taken by a newer execution (``lock_policy = "replace"``).

    Raised by :meth:`LockHandle.check() <singletask.LockHandle.check>` once the renewer has
    seen the preemption. An execution whose body lets it propagate ends as a
    :class:`~singletask.Skipped` with ``reason == "replaced"`` naming the successor.

    Attributes:
        key: The lock key (of the holder slot, with ``lock_limit`` above 1).
        reason: What happened.
        successor: The task id of the execution that replaced it (None for a direct call).
    """

    def __init__(self, key: str, reason: str = "", successor: str | None = None) -> None:
        super().__init__(key, reason)
        self.args = (key, reason, successor)
        self.successor = successor


class BackendError(SingletaskError):
    """The lock backend failed. The driver's exception is chained as ``__cause__``."""


class BackendUnavailable(BackendError):
    """The lock backend cannot be reached (connection refused, reset or lost)."""


class BackendTimeout(BackendError):
    """A lock backend operation timed out."""


class UnsupportedOperation(SingletaskError):
    """The lock store cannot do this operation (for example, memcached cannot list its keys)."""
