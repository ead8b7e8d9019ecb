"""The store's other records on the lock page: pending follow-ups, debounce windows, rate
records, and the named limits in use, read through
:func:`singletask.ops.inventory.find_state` in one pass.

A store that cannot list them (memcached, the Django cache, a store of your own without
``iter_state``) gives a note instead, which the page shows in place of those lists.
"""

from __future__ import annotations

from typing import Any

from ...backends.base import LockBackend
from ...exceptions import UnsupportedOperation
from ..bookkeeping import task_of_key
from ..inventory import LimitRecord, StateRecord, find_state

__all__ = ["matches", "state_records"]


def state_records(
    backend: LockBackend,
    prefix: str,
    *,
    task: str = "",
    key: str = "",
    exact: str | None = None,
    limit: int = 1000,
) -> dict[str, Any]:
    """``{"state": [record, ...] | None, "state_note": str | None}`` for the records of the
    keys under ``prefix`` whose task and key contain ``task`` and ``key`` (case-insensitive);
    with ``exact``, the records of that one key only (read under the key itself, the task name
    from ``prefix``). At most ``limit`` of them.

    Without ``exact``, also ``"limits"`` and ``"limits_note"``: the named limits in use under
    ``prefix`` (:meth:`LimitRecord.as_json <singletask.ops.inventory.LimitRecord.as_json>`)
    whose store key contains ``key`` and that a task whose name contains ``task`` holds units
    of; at most ``limit`` of them. A limit's record is never in ``"state"``.

    Raises:
        BackendError: The store failed.
    """
    records: list[dict[str, Any]] = []
    limits: list[dict[str, Any]] | None = None if exact is not None else []
    notes: dict[str, str | None] = {"state_note": None, "limits_note": None}
    try:
        for record in find_state(backend, exact if exact is not None else prefix):
            if record.kind == "limit":
                shown = LimitRecord.from_store(record, prefix)
                if limits is not None and _limit_matches(shown, task, key):
                    _add(limits, shown.as_json(), limit, notes, "limits_note")
            elif _state_matches(record, exact, task, key):
                fields = record.as_json()
                if exact is not None:
                    fields["task"] = task_of_key(record.key, prefix)
                _add(records, fields, limit, notes, "state_note")
            if notes["state_note"] and (limits is None or notes["limits_note"]):
                break
    except UnsupportedOperation as exc:
        found: dict[str, Any] = {"state": None, "state_note": str(exc)}
        return found if limits is None else {**found, "limits": None, "limits_note": str(exc)}
    if limits is None:
        return {"state": records, "state_note": notes["state_note"]}
    return {"state": records, "limits": limits, **notes}


def matches(value: str | None, wanted: str) -> bool:
    """Whether ``value`` contains ``wanted`` (case-insensitive); anything matches ""."""
    return not wanted or (value is not None and wanted.lower() in value.lower())


def _state_matches(record: StateRecord, exact: str | None, task: str, key: str) -> bool:
    """Whether ``record`` is of the key ``exact`` (not a longer key that starts with it), or
    without ``exact`` has the task and key ``task`` and ``key`` ask."""
    if exact is not None:
        return record.key == exact
    return matches(record.task, task) and matches(record.key, key)


def _limit_matches(record: LimitRecord, task: str, key: str) -> bool:
    """Whether ``record`` has the key ``key`` asks and a hold of a task ``task`` names."""
    if not matches(record.key, key):
        return False
    return not task or any(matches(hold.task, task) for hold in record.holds)


def _add(
    found: list[dict[str, Any]],
    fields: dict[str, Any],
    limit: int,
    notes: dict[str, str | None],
    note: str,
) -> None:
    """Add ``fields`` to ``found`` unless it holds ``limit`` already (then say so in
    ``notes[note]``)."""
    if len(found) >= limit:
        notes[note] = f"the first {limit} shown"
    else:
        found.append(fields)
