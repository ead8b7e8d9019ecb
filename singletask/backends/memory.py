"""An in-process lock store, for eager mode, unit tests and single-process tools.

Locks live in this process only: two worker processes never see each other's locks. Use it
where that is what you want (``task_always_eager`` test suites), never for a real worker fleet.
URL: ``memory://``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .base import AcquireResult, Holder, LockBackend

__all__ = ["MemoryBackend"]


@dataclass
class _Entry:
    token: str
    expires_at: float  # time.monotonic() deadline
    meta: dict[str, str]
    fence: int


class MemoryBackend(LockBackend):
    """Locks in a dict guarded by a mutex; leases use the monotonic clock."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._fences: dict[str, int] = {}  # last fencing token per key; kept for the process's life
        self._completed: dict[str, str] = {}
        self._next: dict[str, tuple[str, float]] = {}  # key -> (task id, monotonic deadline)
        self._mutex = threading.Lock()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> MemoryBackend:
        return cls()

    def _live(self, key: str, now: float) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is not None and entry.expires_at <= now:
            del self._entries[key]
            return None
        return entry

    def acquire(
        self,
        key: str,
        token: str,
        ttl: float,
        *,
        meta: Mapping[str, str] | None = None,
        takeover_prefix: str | None = None,
    ) -> AcquireResult:
        now = time.monotonic()
        with self._mutex:
            entry = self._live(key, now)
            if (
                entry is not None
                and entry.token != token
                and not (takeover_prefix and entry.token.startswith(takeover_prefix))
            ):
                holder = Holder(
                    entry.token, entry.meta.get("task_id"), entry.expires_at - now, {}, entry.fence
                )
                return AcquireResult(False, holder)
            if entry is not None and entry.token == token:
                fence = entry.fence
            else:
                fence = self._fences[key] = self._fences.get(key, 0) + 1
            self._entries[key] = _Entry(token, now + ttl, dict(meta or {}), fence)
            return AcquireResult(True, fence=fence, completed=self._completed.get(key))

    def release(self, key: str, token: str, *, completed: str | None = None) -> bool:
        with self._mutex:
            entry = self._live(key, time.monotonic())
            if entry is None or entry.token != token:
                return False
            del self._entries[key]
            if completed is not None:
                self._completed[key] = completed
            return True

    def extend(self, key: str, token: str, ttl: float) -> bool:
        now = time.monotonic()
        with self._mutex:
            entry = self._live(key, now)
            if entry is None or entry.token != token:
                return False
            entry.expires_at = now + ttl
            return True

    def claim_next(self, key: str, task_id: str, ttl: float) -> str:
        now = time.monotonic()
        with self._mutex:
            pending = self._next.get(key)
            if pending is not None and pending[1] > now:
                return pending[0]
            self._next[key] = (task_id, now + ttl)
            return task_id

    def clear_next(self, key: str, task_id: str) -> bool:
        with self._mutex:
            pending = self._next.get(key)
            if pending is None or pending[0] != task_id:
                return False
            del self._next[key]
            return pending[1] > time.monotonic()

    def holder(self, key: str) -> Holder | None:
        now = time.monotonic()
        with self._mutex:
            entry = self._live(key, now)
            if entry is None:
                return None
            return Holder(
                entry.token,
                entry.meta.get("task_id"),
                entry.expires_at - now,
                dict(entry.meta),
                entry.fence,
            )
