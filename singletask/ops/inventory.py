"""What the lock store holds, for operators: list, inspect and release locks on a live fleet.

The ``singletask locks / inspect / release`` commands are thin over this module; it is usable from
Python as well (a dashboard, a health check). Everything shown comes from what an execution's
acquire already stores with its lock (see :data:`FIELDS`); nothing here is on the execution path.

A :class:`LockRecord` is one holder of a lock key: a running execution or a reservation. A key
has one holder, or up to ``lock_limit`` of them, each in its own holder slot (see
:mod:`singletask.protocol.slots`): the record names the lock key and the slot. Its JSON form
(:meth:`LockRecord.as_json`) is a contract: the fields of :data:`FIELDS` keep their names and
types. The store's bookkeeping beside the locks (pending follow-ups, debounce windows, rate
records) is listed by :func:`find_state` (``singletask.ops.bookkeeping``), and the named limits
in use by :func:`find_limits` (``singletask.ops.limits``); both are re-exported here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from ..backends.base import Holder, LockBackend
from ..exceptions import UnsupportedOperation
from ..protocol.slots import slot_key, split_slot
from ..protocol.tokens import parse_token, reservation_token
from ..signals import lock_released_by_operator
from .bookkeeping import STATE_FIELDS, StateRecord, find_state
from .limits import HOLD_FIELDS, LIMIT_FIELDS, LimitHold, LimitRecord, find_limits

__all__ = [
    "FIELDS", "HOLD_FIELDS", "LIMIT_FIELDS", "STATE_FIELDS", "LimitHold", "LimitRecord",
    "LockRecord", "StateRecord", "find_limits", "find_locks", "find_state", "holders_of",
    "inspect_lock", "release_lock",
]  # fmt: skip

logger = logging.getLogger("singletask")

#: The fields of a lock record, in the order they are shown. ``locks --json`` prints an array of
#: objects with exactly these keys, one per holder; ``inspect --json`` one such object for a key
#: with one holder, an array of them for a key with several.
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
    "slot",  # int: the holder slot (0: the key's first or only holder; see protocol.slots)
)


@dataclass(frozen=True)
class LockRecord:
    """One holder of a lock (an execution or a reservation), as an operator sees it.

    Attributes:
        key: The lock key (of a holder in slot 1 or above too: not the slot's store key).
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
        slot: The holder slot: 0 for the key's first or only holder, 1 and above for the other
            holders of a task with ``lock_limit`` above 1 (:attr:`store_key` names its store
            key).
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
    slot: int = 0

    @classmethod
    def from_holder(cls, stored_key: str, holder: Holder) -> LockRecord:
        """The record of the store key ``stored_key`` held by ``holder`` (as a backend returned
        them): a lock key, or the store key of one of its holder slots."""
        key, slot = split_slot(stored_key)
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
            slot=slot,
        )

    @property
    def store_key(self) -> str:
        """The store key of the holder's slot: :attr:`key` itself for slot 0."""
        return slot_key(self.key, self.slot)

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
            "slot": self.slot,
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
    """Stream the holders of the locks under ``prefix``, optionally of one task name, at most
    ``limit`` records.

    One record per holder: a key held in several slots yields one record per slot, in the
    store's order. Reads the store in pages (:meth:`LockBackend.iter_locks`), so memory stays
    bounded.

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
    """The record of the holder of ``key`` in slot 0, or None when that slot is free.

    A key with several holders has the others in slots 1 and above: :func:`holders_of` returns
    them all.

    Raises:
        BackendError: The store failed.
    """
    holder = backend.holder(key)
    if holder is None or not holder.token:
        return None
    return LockRecord.from_holder(key, holder)


def holders_of(backend: LockBackend, key: str) -> list[LockRecord]:
    """The records of every holder of ``key``, in slot order; empty when it is not held.

    Slot 0 comes from :meth:`LockBackend.holder`; the others from
    :meth:`LockBackend.iter_locks` with ``key`` as the prefix, keeping the slot keys of ``key``
    itself (not those of a longer key that starts with it). A store that cannot list its keys
    (:class:`~singletask.exceptions.UnsupportedOperation`: memcached, the Django cache) keeps
    no holder slots, so its answer is slot 0 alone.

    Raises:
        BackendError: The store failed.
    """
    first = inspect_lock(backend, key)
    records = [] if first is None else [first]
    try:
        for stored, holder in backend.iter_locks(key):
            name, slot = split_slot(stored)
            if slot > 0 and name == key and holder.token:
                records.append(LockRecord.from_holder(stored, holder))
    except UnsupportedOperation:
        pass
    return sorted(records, key=lambda record: record.slot)


def release_lock(
    backend: LockBackend, key: str, *, holder: str | None, slot: int = 0
) -> LockRecord | None:
    """Release holder slot ``slot`` of ``key`` if task ``holder`` holds it, or
    (``holder=None``) whoever holds it.

    Slot 0 is ``key`` itself, the key's only holder unless its task has a ``lock_limit`` above
    1 (:attr:`LockRecord.slot` says which slot a holder has). The other slots of the key are
    left as they are.

    Returns the record of the holder released, or None when nothing changed (the slot is free,
    or held by another task id). The key keeps what a release leaves (its last fencing token,
    where the store keeps one), and the removed holder's next renewal finds the lock gone: its
    worker reports the lost lease (log line, ``lock_lost`` signal, ``LockLost`` from
    ``self.lock.check()``). Logs the release and sends
    :data:`~singletask.signals.lock_released_by_operator` in the calling process.

    Raises:
        ValueError: ``slot`` is negative.
        BackendError: The store failed.
    """
    forced = holder is None
    stored = slot_key(key, slot)
    removed = (
        backend.force_release(stored) if holder is None else backend.release_held_by(stored, holder)
    )
    if removed is None:
        return None
    record = LockRecord.from_holder(stored, removed)
    logger.warning(
        "lock %r%s released by an operator%s: it was held by %s (fence %s)",
        record.key, f" (slot {record.slot})" if record.slot else "", " by force" if forced else "",
        record.describe(), record.fence,
    )  # fmt: skip
    lock_released_by_operator.send(
        sender=None, key=record.key, task=record.task, holder=record.holder, forced=forced
    )
    return record


def _reserved(token: str) -> bool:
    """Whether ``token`` is a reservation's (see :mod:`singletask.protocol.tokens`)."""
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
