"""What the lock store holds, for operators: list, inspect and release locks on a live fleet.

The ``singletask locks / inspect / release`` commands are thin over this module; it is usable from
Python as well (a dashboard, a health check). Everything shown comes from what an execution's
acquire already stores with its lock (see :data:`FIELDS`); nothing here is on the execution path.

A :class:`LockRecord` is one held lock or reservation. Its JSON form (:meth:`LockRecord.as_json`)
is a contract: the fields of :data:`FIELDS` keep their names and types.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from .backends.base import Holder, LockBackend
from .signals import lock_released_by_operator
from .tokens import parse_token, reservation_token

__all__ = ["FIELDS", "LockRecord", "find_locks", "inspect_lock", "release_lock"]

logger = logging.getLogger("singletask")

#: The fields of a lock record, in the order they are shown. ``locks --json`` prints an array of
#: objects with exactly these keys; ``inspect --json`` one such object.
FIELDS = (
    "key",  # str: the lock key
    "task",  # str | null: the task name
    "scope",  # str | null: "execution", "queue" or "coalesce" (null: an older version wrote it)
    "state",  # str: "running" (an execution holds it) or "reserved" (kept for a message)
    "holder",  # str | null: the holder's task id (null for a direct call task(...))
    "hostname",  # str | null: the holder's worker node name (null: a reservation made by a send)
    "pid",  # int | null: the holder's process id (null as hostname)
    "acquired_at",  # str | null: ISO 8601, UTC, milliseconds: when the lock was acquired
    "lease_left",  # float | null: seconds left on the lease
    "fence",  # int | null: the acquisition's fencing token
    "token",  # str: the owner token
)


@dataclass(frozen=True)
class LockRecord:
    """One held lock or reservation, as an operator sees it.

    Attributes:
        key: The lock key.
        task: The task name, from the lock's metadata.
        scope: The task's ``lock_scope`` when it took the lock: ``"execution"``, ``"queue"`` or
            ``"coalesce"``; None for a lock written by a singletask version that did not store it.
        state: ``"running"`` when an execution holds the lock, ``"reserved"`` when it is kept for
            a message that has not started yet (sent with scope "queue" / "coalesce", or a retry).
        holder: The holder's task id; None for a direct call ``task(...)``.
        hostname: The holder's worker node name (``celery@host``); None for a reservation made
            when the message was sent.
        pid: The holder's process id; None when unknown (as hostname).
        acquired_at: When the lock was acquired (UTC); None when unknown.
        lease_left: Seconds left on the lease; None when the store does not say.
        fence: The fencing token of the acquisition.
        token: The owner token.
    """

    key: str
    task: str | None
    scope: str | None
    state: str
    holder: str | None
    hostname: str | None
    pid: int | None
    acquired_at: datetime | None
    lease_left: float | None
    fence: int | None
    token: str

    @classmethod
    def from_holder(cls, key: str, holder: Holder) -> LockRecord:
        """The record of ``key`` held by ``holder`` (as a backend returned it)."""
        meta = holder.meta
        return cls(
            key=key,
            task=meta.get("task"),
            scope=meta.get("scope"),
            state="reserved" if _reserved(holder.token) else "running",
            holder=holder.task_id,
            hostname=meta.get("hostname"),
            pid=_int(meta.get("pid")) or None,
            acquired_at=_timestamp(meta.get("since")),
            lease_left=holder.ttl,
            fence=holder.fence,
            token=holder.token,
        )

    def as_json(self) -> dict[str, Any]:
        """The record as a JSON object (the documented ``--json`` schema)."""
        return {
            "key": self.key,
            "task": self.task,
            "scope": self.scope,
            "state": self.state,
            "holder": self.holder,
            "hostname": self.hostname,
            "pid": self.pid,
            "acquired_at": (
                self.acquired_at.isoformat(timespec="milliseconds") if self.acquired_at else None
            ),
            "lease_left": round(self.lease_left, 3) if self.lease_left is not None else None,
            "fence": self.fence,
            "token": self.token,
        }

    def describe(self) -> str:
        """Who holds it, in a few words: ``task <id> on <host> (pid <n>)``."""
        who = f"task {self.holder}" if self.holder else "a direct call (no task id)"
        if self.state == "reserved":
            who = f"a reservation for {who}"
        if self.hostname:
            who += f" on {self.hostname}"
        if self.pid:
            who += f" (pid {self.pid})"
        return who


def find_locks(
    backend: LockBackend,
    prefix: str,
    *,
    task: str | None = None,
    limit: int | None = None,
    page_size: int = 500,
) -> Iterator[LockRecord]:
    """Stream the locks held under ``prefix``, optionally of one task name, at most ``limit``.

    Reads the store in pages (:meth:`LockBackend.iter_locks`), so memory stays bounded.

    Raises:
        UnsupportedOperation: The store cannot list its keys.
        BackendError: The store failed.
    """
    if limit is not None and limit <= 0:
        return
    count = 0
    for key, holder in backend.iter_locks(prefix, page_size=page_size):
        record = LockRecord.from_holder(key, holder)
        if task is not None and record.task != task:
            continue
        yield record
        count += 1
        if limit is not None and count >= limit:
            return


def inspect_lock(backend: LockBackend, key: str) -> LockRecord | None:
    """The record of ``key``, or None when it is not held.

    Raises:
        BackendError: The store failed.
    """
    holder = backend.holder(key)
    if holder is None or not holder.token:
        return None
    return LockRecord.from_holder(key, holder)


def release_lock(backend: LockBackend, key: str, *, holder: str | None) -> LockRecord | None:
    """Release ``key`` if task ``holder`` holds it, or (``holder=None``) whoever holds it.

    Returns the record of the lock released, or None when nothing changed (the key is free, or
    held by another task id). The key keeps what a release leaves (its last fencing token, where
    the store keeps one), and the removed holder's next renewal finds the lock gone: its worker
    reports the lost lease (log line, ``lock_lost`` signal, ``LockLost`` from
    ``self.lock.check()``). Logs the release and sends
    :data:`~singletask.signals.lock_released_by_operator` in the calling process.

    Raises:
        BackendError: The store failed.
    """
    forced = holder is None
    removed = backend.force_release(key) if holder is None else backend.release_held_by(key, holder)
    if removed is None:
        return None
    record = LockRecord.from_holder(key, removed)
    logger.warning(
        "lock %r released by an operator%s: it was held by %s (fence %s)",
        key, " by force" if forced else "", record.describe(), record.fence,
    )  # fmt: skip
    lock_released_by_operator.send(
        sender=None, key=key, task=record.task, holder=record.holder, forced=forced
    )
    return record


def _reserved(token: str) -> bool:
    """Whether ``token`` is a reservation's (see :mod:`singletask.tokens`)."""
    parsed = parse_token(token)
    return parsed is not None and token == reservation_token(parsed[0], parsed[1])


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _timestamp(value: str | None) -> datetime | None:
    try:
        return datetime.fromtimestamp(float(value), timezone.utc) if value else None
    except (ValueError, OverflowError, OSError):
        return None
