"""The contract every lock backend implements: a few atomic primitives, nothing more.

Policy (which key, which token, what to do when a lock is held, when to release) lives in
:mod:`singletask.task`. A backend only stores leases:

* a lock is a *key* with an owner *token*, a lease (seconds) and a few metadata fields;
* every operation is atomic, and release / extend only act for the owner token;
* a lease always expires: there are no permanent locks;
* every acquisition gets a fencing token, strictly increasing per key;
* a release can leave a completion marker that later acquisitions of the key see;
* a key can have one pending follow-up task id, claimed and cleared atomically.

A new backend subclasses :class:`LockBackend`, implements the abstract methods, passes
``tests/backends/test_contract.py``, and registers a URL scheme (see :mod:`singletask.backends`).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AcquireResult", "Holder", "LockBackend"]


@dataclass(frozen=True)
class Holder:
    """Who holds a lock, as the backend saw it.

    Attributes:
        token: The holder's owner token.
        task_id: The holder's task id, when it stored one.
        ttl: Seconds left on the lease, when known.
        meta: Every metadata field stored with the lock (``task_id``, ``task``, ``hostname``,
            ``pid``, ``since``), as strings. Empty when the backend returned only the essentials.
        fence: The holder's fencing token, when known.
    """

    token: str
    task_id: str | None = None
    ttl: float | None = None
    meta: Mapping[str, str] = field(default_factory=dict)
    fence: int | None = None


@dataclass(frozen=True)
class AcquireResult:
    """The outcome of :meth:`LockBackend.acquire`.

    Attributes:
        acquired: True when the caller holds the lock now.
        holder: When not acquired, who holds it (from the same atomic step).
        fence: When acquired, the fencing token of this acquisition: strictly greater than every
            token issued earlier for the key (see :meth:`LockBackend.acquire`).
        completed: When acquired, the marker the key's last normal release recorded (see
            :meth:`LockBackend.release`), if the store still remembers one.
    """

    acquired: bool
    holder: Holder | None = None
    fence: int | None = None
    completed: str | None = None


class LockBackend(abc.ABC):
    """Abstract base of lock stores. All durations are float seconds."""

    @classmethod
    @abc.abstractmethod
    def from_url(cls, url: str, **options: Any) -> LockBackend:
        """Build a backend from its URL.

        Raises:
            ConfigurationError: The URL or an option is invalid.
        """

    @abc.abstractmethod
    def acquire(
        self,
        key: str,
        token: str,
        ttl: float,
        *,
        meta: Mapping[str, str] | None = None,
        takeover_prefix: str | None = None,
    ) -> AcquireResult:
        """Take ``key`` for ``token`` with a lease of ``ttl`` seconds, in one atomic step.

        It succeeds when the key is free (or its lease ran out), when it is already held by
        ``token`` itself (so a retried call is harmless), or when the current holder's token
        starts with ``takeover_prefix``. On success the metadata is replaced by ``meta``, the
        lease restarts, and the result carries a fencing token and the key's last completion
        marker. Otherwise nothing changes and the result names the holder.

        Fencing tokens of one key strictly increase: a new acquisition gets more than every
        token issued before for that key, even after the lock expired; re-acquiring by the same
        token keeps its token.

        Raises:
            BackendError: The store failed.
        """

    @abc.abstractmethod
    def release(self, key: str, token: str, *, completed: str | None = None) -> bool:
        """Delete ``key`` if ``token`` holds it. Returns whether it did.

        With ``completed``, a successful release also records that marker for the key, in the
        same atomic step; the next acquisitions report it in :attr:`AcquireResult.completed`.

        Raises:
            BackendError: The store failed.
        """

    @abc.abstractmethod
    def extend(self, key: str, token: str, ttl: float) -> bool:
        """Set the lease of ``key`` to ``ttl`` seconds from now if ``token`` holds it.

        Returns whether it did. Shortening a lease is allowed.

        Raises:
            BackendError: The store failed.
        """

    def extend_many(self, leases: Sequence[tuple[str, str, float]]) -> list[bool]:
        """:meth:`extend` each ``(key, token, ttl)``; backends override it to use one round trip.

        Returns one result per lease, in order.

        Raises:
            BackendError: The store failed.
        """
        return [self.extend(key, token, ttl) for key, token, ttl in leases]

    @abc.abstractmethod
    def claim_next(self, key: str, task_id: str, ttl: float) -> str:
        """Make ``task_id`` the key's pending follow-up unless one is pending; return the one.

        A key has at most one pending follow-up (coalescing: one run plus one follow-up). The
        claim lasts ``ttl`` seconds unless :meth:`clear_next` ends it first. Returns ``task_id``
        when the caller's claim took, else the task id that was already pending.

        Raises:
            BackendError: The store failed.
        """

    @abc.abstractmethod
    def clear_next(self, key: str, task_id: str) -> bool:
        """End ``task_id``'s pending follow-up claim on ``key``; returns whether it was pending.

        Raises:
            BackendError: The store failed.
        """

    @abc.abstractmethod
    def holder(self, key: str) -> Holder | None:
        """Return who holds ``key`` (with all metadata), or None when it is free.

        Raises:
            BackendError: The store failed.
        """

    def close(self) -> None:  # noqa: B027 - optional hook, most backends have nothing to close
        """Release the backend's resources (connections). The backend may be used again after."""

    def __enter__(self) -> LockBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
