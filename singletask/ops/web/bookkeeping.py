"""The store's other records on the lock page: pending follow-ups, debounce windows and rate
records, read through :func:`singletask.ops.inventory.find_state`.

A store that cannot list them (memcached, the Django cache, a store of your own without
``iter_state``) gives a note instead, which the page shows in place of those lists.
"""

from __future__ import annotations

from typing import Any

from ...backends.base import LockBackend
from ...exceptions import UnsupportedOperation
from ..bookkeeping import task_of_key
from ..inventory import find_state

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

    Raises:
        BackendError: The store failed.
    """
    records: list[dict[str, Any]] = []
    try:
        for record in find_state(backend, exact if exact is not None else prefix):
            if exact is not None and record.key != exact:
                continue  # a longer key that starts with it
            if not (matches(record.task, task) and matches(record.key, key)):
                continue
            if len(records) >= limit:
                return {"state": records, "state_note": f"the first {limit} shown"}
            fields = record.as_json()
            if exact is not None:
                fields["task"] = task_of_key(record.key, prefix)
            records.append(fields)
    except UnsupportedOperation as exc:
        return {"state": None, "state_note": str(exc)}
    return {"state": records, "state_note": None}


def matches(value: str | None, wanted: str) -> bool:
    """Whether ``value`` contains ``wanted`` (case-insensitive); anything matches ""."""
    return not wanted or (value is not None and wanted.lower() in value.lower())
