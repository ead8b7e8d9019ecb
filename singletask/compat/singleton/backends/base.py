"""celery-singleton's backend protocol: subclass :class:`BaseBackend` for a store of your own."""

from __future__ import annotations

from abc import ABC, abstractmethod

__all__ = ["BaseBackend"]


class BaseBackend(ABC):
    @abstractmethod
    def lock(self, lock: str, task_id: str, expiry: float | None = None) -> bool:
        """Store ``task_id`` under ``lock`` unless it is set (for ``expiry`` seconds, or for
        ever); True if it was stored."""

    @abstractmethod
    def unlock(self, lock: str) -> None:
        """Delete ``lock``."""

    @abstractmethod
    def get(self, lock: str) -> str | None:
        """The task id stored under ``lock``, or None."""

    @abstractmethod
    def clear(self, key_prefix: str) -> None:
        """Delete every lock whose key starts with ``key_prefix``."""
