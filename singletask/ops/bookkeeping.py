"""The lock store's bookkeeping, for operators: pending follow-ups, debounce windows, rate
records, named limits.

Beside the locks and reservations :func:`singletask.ops.inventory.find_locks` lists, a store keeps
per lock key a *pending follow-up* (a coalescing task's follow-up, or a ``lock_coalesce =
"latest"`` one, waiting for the key), a *debounce window* (``lock_debounce``: the key's latest
send, open or closed by that send's run) and a *rate record* (``lock_rate``: when the key's next
start is allowed); under the prefix too, each named limit in use has a record (``take_units``:
:mod:`singletask.ops.limits` reads them as :class:`~singletask.ops.limits.LimitRecord`).
:func:`find_state` streams them from
:meth:`~singletask.backends.base.LockBackend.iter_state`, read-only, in bounded pages; nothing
here is on the execution path. :mod:`singletask.ops.inventory` re-exports both names.

A :class:`StateRecord`'s JSON form (:meth:`StateRecord.as_json`) is a contract: the fields of
:data:`STATE_FIELDS` keep their names and types.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..backends.base import STATE_KINDS, LockBackend, StoreState
from ..protocol.keys import escape_name, unescape_name

__all__ = ["STATE_FIELDS", "STATE_KINDS", "StateRecord", "find_state", "task_of_key"]

#: The fields of :meth:`StateRecord.as_json`, in order.
STATE_FIELDS = (
    "kind",  # str: "follow_up", "window", "rate" or "limit"
    "key",  # str: the lock key the record belongs to (limit: the limit's store key)
    "task",  # str | null: the task name, from the key (limit: null)
    "task_id",  # str | null: follow_up: the waiting task id; window: its latest send; else null
    "ttl",  # float | null: seconds left before the record runs out
    "detail",  # object: kind-specific (see StateRecord.detail)
)


@dataclass(frozen=True)
class StateRecord:
    """One bookkeeping record of a lock key, as an operator sees it.

    Attributes:
        kind: ``"follow_up"``, ``"window"``, ``"rate"`` or ``"limit"`` (``STATE_KINDS``).
        key: The lock key the record belongs to (not the store key it is kept under); limit:
            the limit's store key (``<prefix>%limit:<name>``, ``<prefix>%rate:<name>``).
        task: The task name, read from the key (``<prefix><name>[:<suffix>]``, see
            ``singletask.protocol.keys``); None for a key that is not ``<prefix><name>...``,
            and for a limit (its holds name their tasks).
        task_id: follow_up: the task id waiting for the key; window: the window's latest send;
            rate and limit: None.
        ttl: Seconds left before the record runs out, when the store says. follow_up: the
            claim (``lock_queue_ttl`` from the send, unless the follow-up starts first);
            window: its record, which outlives the latest send's countdown by
            ``lock_queue_ttl`` (a closed window stays until then, naming the send that ran);
            rate: until the key's next start is allowed; limit: until its last hold or start
            stops counting.
        detail: Kind-specific, JSON-serialisable. window: ``open`` (bool: False once its
            latest send started its run, which closed it) and ``age`` (seconds since the
            window opened, by the store's clock; null when closed: with ``lock_debounce_max``
            the window's sends wait at most ``lock_debounce_max - age`` more). rate:
            ``next_start_in`` (seconds until the key may start again). limit: ``size``,
            ``period``, ``used`` and ``holds`` (see
            :class:`~singletask.backends.holders.StoreState`;
            :meth:`LimitRecord.from_store <singletask.ops.limits.LimitRecord.from_store>` reads
            them). follow_up: empty.
    """

    kind: str
    key: str
    task: str | None
    task_id: str | None
    ttl: float | None
    detail: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_store(cls, state: StoreState, prefix: str) -> StateRecord:
        """The record of what a store's ``iter_state(prefix)`` yielded."""
        return cls(
            kind=state.kind,
            key=state.key,
            task=None if state.kind == "limit" else task_of_key(state.key, prefix),
            task_id=state.task_id,
            ttl=state.ttl,
            detail=dict(state.detail),
        )

    def as_json(self) -> dict[str, Any]:
        """The record as a JSON object (the fields of :data:`STATE_FIELDS`; seconds rounded to
        the millisecond)."""
        return {
            "kind": self.kind,
            "key": self.key,
            "task": self.task,
            "task_id": self.task_id,
            "ttl": _seconds(self.ttl),
            "detail": {name: _rounded(value) for name, value in self.detail.items()},
        }


def task_of_key(key: str, prefix: str) -> str | None:
    """The task name of the lock key ``key`` built under the key prefix ``prefix``; None when
    ``key`` does not start with ``prefix`` or names no task after it."""
    if not key.startswith(prefix):
        return None
    return unescape_name(key[len(prefix) :].partition(":")[0]) or None


def find_state(
    backend: LockBackend,
    prefix: str,
    *,
    task: str | None = None,
    kinds: Collection[str] | None = None,
    limit: int | None = None,
    page_size: int = 500,
) -> Iterator[StateRecord]:
    """Stream the bookkeeping records of the lock keys under ``prefix`` (the app's key prefix:
    the task name is read from the key after it), optionally of one task name and of some
    ``kinds`` only, at most ``limit`` records, in the store's order.

    Reads the store in pages (:meth:`~singletask.backends.base.LockBackend.iter_state`), so
    memory stays bounded; with ``task``, only the keys of that task are read. Read-only: a
    store whose lock table is missing has no records. ``kinds`` is checked at the call; the
    store is read as the records are.

    Raises:
        ValueError: ``kinds`` names a kind that is not one of ``STATE_KINDS``.
        UnsupportedOperation: The store cannot list its keys (memcached, the Django cache).
        BackendError: The store failed.
    """
    if isinstance(kinds, str):
        raise ValueError(f"kinds: a collection of kinds ({STATE_KINDS}), not the string {kinds!r}")
    wanted = None if kinds is None else frozenset(kinds)
    if wanted is not None and not wanted <= set(STATE_KINDS):
        unknown = ", ".join(sorted(wanted - set(STATE_KINDS)))
        raise ValueError(f"kinds: unknown kind(s) {unknown}; the kinds are {STATE_KINDS}")
    scan = prefix if task is None else prefix + escape_name(task)
    return _stream(backend, scan, prefix, task, wanted, limit, page_size)


def _stream(
    backend: LockBackend,
    scan: str,
    prefix: str,
    task: str | None,
    wanted: frozenset[str] | None,
    limit: int | None,
    page_size: int,
) -> Iterator[StateRecord]:
    """:func:`find_state`'s records, its arguments checked."""
    if limit is not None and limit <= 0:
        return
    count = 0
    for state in backend.iter_state(scan, page_size=page_size):
        if wanted is not None and state.kind not in wanted:
            continue
        record = StateRecord.from_store(state, prefix)
        if task is not None and record.task != task:
            continue  # a longer task name that starts with this one
        yield record
        count += 1
        if limit is not None and count >= limit:
            return


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _rounded(value: Any) -> Any:
    """A detail's JSON value, every float in it (a limit's holds too) rounded to the
    millisecond."""
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, Mapping):
        return {name: _rounded(item) for name, item in value.items()}
    if isinstance(value, list | tuple):
        return [_rounded(item) for item in value]
    return value
