"""The contract every lock backend implements: a few atomic primitives, nothing more.

Policy (which key, which token, what to do when a lock is held, when to release) lives in
:mod:`singletask.task`. A backend only stores leases:

* a lock is a *key* with an owner *token*, a lease (seconds) and a few metadata fields;
* every operation is atomic, and release / extend only act for the owner token;
* a lease always expires: there are no permanent locks.

A new backend subclasses :class:`LockBackend`, implements the abstract methods, passes
``tests/backends/test_contract.py``, and registers a URL scheme (see :mod:`singletask.backends`).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
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
    """

    token: str
    task_id: str | None = None
    ttl: float | None = None
    meta: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class AcquireResult:
    """The outcome of :meth:`LockBackend.acquire`.

    Attributes:
        acquired: True when the caller holds the lock now.
        holder: When not acquired, who holds it (from the same atomic step).
    """

    acquired: bool
    holder: Holder | None = None


class LockBackend(abc.ABC):
    """Abstract base of lock stores. All durations are float seconds."""

    #: URL schemes this backend serves (informational; the registry maps schemes to classes).
    schemes: tuple[str, ...] = ()

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
        starts with ``takeover_prefix``. On success the metadata is replaced by ``meta`` and the
        lease restarts. Otherwise nothing changes and the result names the holder.

        Raises:
            BackendError: The store failed.
        """

    @abc.abstractmethod
    def release(self, key: str, token: str) -> bool:
        """Delete ``key`` if ``token`` holds it. Returns whether it did.

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
