"""An in-process lock store, for eager mode, unit tests and single-process tools.

Locks live in this process only: two worker processes never see each other's locks. Use it
where that is what you want (``task_always_eager`` test suites), never for a real worker fleet.
URL: ``memory://`` (a host name is ignored; a path or query options are refused).

Like the SQL stores, it forgets a key's fence record (last fencing token, completion marker,
pending follow-up) :data:`FENCE_RETENTION` seconds after the key's last acquisition, and every
record it keeps has an expiry.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ...exceptions import ConfigurationError
from ...protocol.slots import base_key, choose_slot, slot_keys
from ..base import (
    AcquireResult,
    Holder,
    LockBackend,
    StoreState,
    Units,
    UnitsResult,
    check_lease,
    check_taken,
    units_meta,
)
from ..urls import mask_url
from .limits import Limits

__all__ = ["MemoryBackend"]

#: How long a key's fence record outlives its last acquisition (as in SQLite).
FENCE_RETENTION = 7 * 24 * 3600.0


@dataclass
class _Entry:
    token: str
    expires_at: float  # time.monotonic() deadline
    meta: dict[str, str]
    fence: int


@dataclass
class _Window:
    """A key's debounce window: its latest send, when it opened (None once closed), when the
    record ends, until when the latest is pending (None: published), and the pending deadline
    of the send it superseded (kept while it is pending, for an undo to put back)."""

    latest: str
    opened: float | None
    until: float
    pending: float | None = None
    before: float | None = None


@dataclass
class _Fence:
    """A key's last fencing token, completion marker and pending follow-up."""

    fence: int
    expires_at: float  # time.monotonic() deadline of the record
    done: str | None = None
    next: str | None = None
    next_until: float = 0.0  # time.monotonic() deadline of the follow-up claim


class MemoryBackend(LockBackend):
    """Locks in a dict guarded by a mutex; leases use the monotonic clock."""

    in_process = True
    supports_limit = True
    supports_rate = True
    supports_debounce = True
    supports_replace = True
    supports_units = True
    supports_turns = True

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._fences: dict[str, _Fence] = {}
        self._rates: dict[str, float] = {}  # key -> monotonic time its next start is allowed
        self._windows: dict[str, _Window] = {}
        # (key, preempted token) -> the preemptor's task id, when the record ends
        self._replaced: dict[tuple[str, str], tuple[str, float]] = {}
        self._limits = Limits()  # the named limits' records
        self._writes = 0
        self._mutex = threading.RLock()  # preempt() takes the key and leaves its record at once

    @classmethod
    def from_url(cls, url: str, **options: Any) -> MemoryBackend:
        cls.check_url(url)
        return cls()

    @classmethod
    def check_url(cls, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme.lower() != "memory" or parts.path.strip("/") or parts.query:
            raise ConfigurationError(
                f"{mask_url(url)!r}: the in-process lock store takes no path or query "
                "options; write 'memory://'"
            )

    def _live(self, key: str, now: float) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is not None and entry.expires_at <= now:
            del self._entries[key]
            return None
        return entry

    def _fence(self, key: str, now: float) -> _Fence | None:
        record = self._fences.get(key)
        if record is not None and record.expires_at <= now:
            del self._fences[key]
            return None
        return record

    def acquire(
        self,
        key: str,
        token: str,
        ttl: float,
        *,
        meta: Mapping[str, str] | None = None,
        takeover_prefix: str | None = None,
        units: Sequence[Units] = (),
    ) -> AcquireResult:
        ttl = check_lease(ttl, "acquire")
        now = time.monotonic()
        with self._mutex:  # the key and the units in one hold of the mutex (an RLock)
            entry = self._live(key, now)
            if (
                entry is not None
                and entry.token != token
                and not (takeover_prefix and entry.token.startswith(takeover_prefix))
            ):
                return AcquireResult(False, self._holder(entry, now, brief=True))
            refused = self._units_refused(token, ttl, units, meta)
            if refused is not None:
                return refused
            return self._take(key, entry, token, ttl, meta, now)

    def acquire_slot(
        self,
        key: str,
        limit: int,
        token: str,
        ttl: float,
        *,
        meta: Mapping[str, str] | None = None,
        takeover_prefix: str | None = None,
        interval: float | None = None,
        units: Sequence[Units] = (),
    ) -> AcquireResult:
        ttl = check_lease(ttl, "acquire")
        if interval is not None:
            interval = check_lease(interval, "acquire_slot interval")
        now = time.monotonic()
        with self._mutex:
            slots = [(name, self._live(name, now)) for name in slot_keys(key, limit)]
            chosen = choose_slot([e.token if e else None for _, e in slots], token, takeover_prefix)
            if chosen is None:
                holders = tuple(self._holder(e, now, brief=True) for _, e in slots if e)
                return AcquireResult(False, holders[0], holders=holders)
            name, entry = slots[chosen]
            start = interval is not None and (entry is None or entry.token != token)
            if start:
                allowed = self._rates.get(key, now)
                if allowed > now:  # too soon after the key's last start
                    return AcquireResult(False, retry_after=allowed - now)
            refused = self._units_refused(token, ttl, units, meta)
            if refused is not None:
                return refused
            if start:
                self._rates[key] = now + float(interval or 0)
                self._prune(now)
            return self._take(name, entry, token, ttl, meta, now)

    def _take(
        self,
        name: str,
        entry: _Entry | None,
        token: str,
        ttl: float,
        meta: Mapping[str, str] | None,
        now: float,
    ) -> AcquireResult:
        """Give ``name`` (a key or a holder slot) to ``token``; the mutex is held."""
        key = base_key(name)  # a slot shares its key's fence record
        record = self._fence(key, now)
        if entry is not None and entry.token == token:
            fence = entry.fence
        else:
            # Like Redis: grows while the record is kept, and with the clock after that.
            last = record.fence if record is not None else 0
            fence = max(last + 1, time.time_ns() // 1000)
        if record is None:
            record = self._fences[key] = _Fence(fence, now + FENCE_RETENTION)
        record.fence, record.expires_at = max(record.fence, fence), now + FENCE_RETENTION
        self._entries[name] = _Entry(token, now + ttl, dict(meta or {}), fence)
        return AcquireResult(True, fence=fence, completed=record.done, key=name)

    def _units_refused(
        self,
        token: str,
        ttl: float,
        units: Sequence[Units],
        meta: Mapping[str, str] | None,
    ) -> AcquireResult | None:
        """Take ``units`` with a key (the mutex is held); the refusal, or None when taken."""
        if not units:
            return None
        taken = self.take_units(token, ttl, units, meta=units_meta(meta))
        if taken.taken:
            return None
        return AcquireResult(False, retry_after=taken.retry_after, limit=taken.limit,
                             used=taken.used)  # fmt: skip

    def take_units(
        self,
        token: str,
        ttl: float,
        units: Sequence[Units],
        *,
        meta: Mapping[str, str] | None = None,
    ) -> UnitsResult:
        ttl = check_lease(ttl, "take_units")
        check_taken(units, "take_units")
        now = time.monotonic()
        with self._mutex:
            result = self._limits.take(token, ttl, units, meta, now)
            if result.taken:
                self._prune(now)
            return result

    def give_units(self, token: str, units: Sequence[Units]) -> list[bool]:
        check_taken(units, "give_units", give=True)
        with self._mutex:
            return self._limits.give(token, units, time.monotonic())

    def _prune(self, now: float) -> None:
        """Forget rate records and debounce windows that ran out, once every 1,024 writes (so
        that keys seen once do not stay for ever); the mutex is held."""
        self._writes += 1
        if self._writes % 1024 == 0:
            self._rates = {k: at for k, at in self._rates.items() if at > now}
            self._windows = {k: w for k, w in self._windows.items() if w.until > now}
            self._replaced = {k: r for k, r in self._replaced.items() if r[1] > now}
            self._limits.prune(now)

    def debounce(
        self, key: str, task_id: str, ttl: float, *, pending: float = 0.0
    ) -> tuple[str | None, float, str | None]:
        ttl = check_lease(ttl, "debounce")
        now = time.monotonic()
        with self._mutex:
            window = self._windows.get(key)
            if window is None or window.until <= now or window.opened is None:
                # no window, it ran out, or it is closed: this send opens one
                closed = window.latest if window and window.until > now else None
                latest, opened, until, before = None, now, now, None
            else:
                closed, latest, opened, until = None, window.latest, window.opened, window.until
                before = window.pending
            # Never shorter than an earlier send asked: it may start later than this one.
            mark = now + pending if pending > 0 else None
            self._windows[key] = _Window(
                task_id, opened, max(until, now + ttl), mark, before if mark else None
            )
            self._prune(now)
            return latest, now - opened, closed

    def debounce_published(self, key: str, task_id: str) -> bool:
        now = time.monotonic()
        with self._mutex:
            window = self._open_window(key, now)
            if window is None or window.latest != task_id or window.pending is None:
                return False
            window.pending = window.before = None
            return True

    def debounce_take(
        self, key: str, task_id: str, *, overdue: bool = False
    ) -> tuple[str | None, float]:
        now = time.monotonic()
        with self._mutex:
            window = self._windows.get(key)
            if window is None or window.until <= now:
                self._windows.pop(key, None)
                return None, 0.0
            if window.opened is None:
                return window.latest, 0.0
            if window.latest != task_id and window.pending is not None:
                if window.pending > now and not overdue:
                    return window.latest, window.pending - now
                window.latest = task_id  # pending past its deadline (or overdue): taken back
            if window.latest == task_id:  # closed: opened is None
                window.opened = window.pending = window.before = None
            return window.latest, 0.0

    def debounce_undo(
        self, key: str, task_id: str, previous: str | None, *, closed: str | None = None
    ) -> bool:
        now = time.monotonic()
        with self._mutex:
            window = self._open_window(key, now)
            if window is None or window.latest != task_id:
                return False
            if previous is not None:
                self._windows[key] = _Window(previous, window.opened, window.until, window.before)
            elif closed is not None:  # task_id opened it over this closed one: closed again
                self._windows[key] = _Window(closed, None, window.until)
            else:
                del self._windows[key]  # task_id opened it
            return True

    def _open_window(self, key: str, now: float) -> _Window | None:
        """The open debounce window of ``key``, if any; the mutex is held."""
        window = self._windows.get(key)
        if window is None or window.opened is None or window.until <= now:
            return None
        return window

    def release(
        self, key: str, token: str, *, completed: str | None = None, units: Sequence[Units] = ()
    ) -> bool:
        with self._mutex:
            self._give_units_before(token, units)
            entry = self._live(key, time.monotonic())
            if entry is None or entry.token != token:
                return False
            del self._entries[key]
            record = self._fence(base_key(key), time.monotonic())
            if completed is not None and record is not None:
                record.done = completed
            return True

    def extend(self, key: str, token: str, ttl: float) -> bool:
        ttl = check_lease(ttl, "extend")
        now = time.monotonic()
        with self._mutex:
            entry = self._live(key, now)
            if entry is None or entry.token != token:
                return False
            entry.expires_at = now + ttl
            return True

    def claim_next(self, key: str, task_id: str, ttl: float) -> str:
        ttl = check_lease(ttl, "claim_next")
        now = time.monotonic()
        with self._mutex:
            record = self._fence(key, now)
            if record is not None and record.next is not None and record.next_until > now:
                return record.next
            if record is None:
                record = self._fences[key] = _Fence(0, now + FENCE_RETENTION)
            record.next, record.next_until = task_id, now + ttl
            record.expires_at = max(record.expires_at, now + ttl)
            return task_id

    def clear_next(self, key: str, task_id: str) -> bool:
        now = time.monotonic()
        with self._mutex:
            record = self._fence(key, now)
            if record is None or record.next != task_id:
                return False
            record.next = None
            return record.next_until > now

    def preempt(
        self,
        key: str,
        limit: int,
        token: str,
        ttl: float,
        victim: str,
        *,
        meta: Mapping[str, str] | None = None,
    ) -> AcquireResult:
        """The takeover and its preemption record under one hold of the mutex."""
        check_lease(ttl, "preempt")
        now = time.monotonic()
        with self._mutex:
            names = [key] if limit == 1 else slot_keys(key, limit)
            held = {name: entry.token for name in names if (entry := self._live(name, now))}
            if limit == 1:
                taken = self.acquire(key, token, ttl, meta=meta, takeover_prefix=victim)
            else:
                taken = self.acquire_slot(key, limit, token, ttl, meta=meta, takeover_prefix=victim)
            cur = held.get(taken.key or key) if taken.acquired else None
            if cur is not None and cur != token and cur.startswith(victim):
                successor = (meta or {}).get("task_id") or ""
                self._replaced[base_key(key), victim] = (successor, now + ttl)
                self._prune(now)
        return taken

    def replaced_by(self, key: str, token: str) -> str | None:
        now = time.monotonic()
        with self._mutex:
            record = self._replaced.get((base_key(key), token))
        if record is not None and record[1] > now:
            return record[0]
        return super().replaced_by(key, token)  # no record: a preemptor that still holds, if any

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

    def iter_locks(self, prefix: str, *, page_size: int = 500) -> Iterator[tuple[str, Holder]]:
        """Pages of ``page_size`` keys in key order; the mutex is held while a page is read."""
        page_size = max(1, page_size)
        after: str | None = None
        while True:
            now = time.monotonic()
            with self._mutex:
                keys = heapq.nsmallest(
                    page_size,
                    (
                        key
                        for key in self._entries
                        if base_key(key).startswith(prefix) and (after is None or key > after)
                    ),
                )
                page = [(key, self._entries[key]) for key in keys]
            for key, entry in page:
                if entry.expires_at > now:
                    yield key, self._holder(entry, now)
            if len(keys) < page_size:
                return
            after = keys[-1]

    def iter_state(self, prefix: str, *, page_size: int = 500) -> Iterator[StoreState]:
        """Pages of ``page_size`` keys in key order, as :meth:`iter_locks`."""
        page_size = max(1, page_size)
        after: str | None = None
        while True:
            now = time.monotonic()
            with self._mutex:
                names = {*self._fences, *self._windows, *self._rates, *self._limits.records}
                keys = heapq.nsmallest(
                    page_size,
                    (k for k in names if k.startswith(prefix) and (after is None or k > after)),
                )
                page = [self._state(key, now) for key in keys]
            for records in page:
                yield from records
            if len(keys) < page_size:
                return
            after = keys[-1]

    def _state(self, key: str, now: float) -> list[StoreState]:
        """The live bookkeeping records of ``key``; the mutex is held."""
        found = []
        record = self._fences.get(key)
        if record is not None and record.next is not None and record.next_until > now:
            found.append(StoreState("follow_up", key, record.next, record.next_until - now))
        window = self._windows.get(key)
        if window is not None and window.until > now:
            age = None if window.opened is None else now - window.opened
            detail = {"open": window.opened is not None, "age": age}
            found.append(StoreState("window", key, window.latest, window.until - now, detail))
        allowed = self._rates.get(key)
        if allowed is not None and allowed > now:
            found.append(
                StoreState("rate", key, None, allowed - now, {"next_start_in": allowed - now})
            )
        limit = self._limits.state(key, now)
        if limit is not None:
            found.append(limit)
        return found

    def _operator_release(self, key: str, task_id: str | None) -> Holder | None:
        now = time.monotonic()
        with self._mutex:
            entry = self._live(key, now)
            if entry is None or (task_id is not None and entry.meta.get("task_id") != task_id):
                return None
            del self._entries[key]  # the fence counter stays: the next one is still larger
            return self._holder(entry, now)

    def release_held_by(self, key: str, task_id: str) -> Holder | None:
        return self._operator_release(key, task_id)

    def force_release(self, key: str) -> Holder | None:
        return self._operator_release(key, None)

    @staticmethod
    def _holder(entry: _Entry, now: float, *, brief: bool = False) -> Holder:
        """The holder of ``entry``; ``brief``: without the metadata, as a conflict reports it."""
        return Holder(
            entry.token, entry.meta.get("task_id"), entry.expires_at - now,
            {} if brief else dict(entry.meta), entry.fence,
        )  # fmt: skip
