"""What the PostgreSQL and MySQL stores share for holder slots: the arguments of a slot
acquisition's script, and the decoding of the rows it returns."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..base import AcquireResult
from .core import dump_meta, load_holder

__all__ = ["slot_args", "slot_outcome"]


def slot_outcome(
    names: Sequence[str],
    token: str,
    rows: Sequence[tuple[int, str | None, str | None, int | None, float | None, str | None]],
) -> AcquireResult:
    """The result of a slot acquisition from the rows its script returned: ``(ordinal,
    token, meta, fence, seconds left, done)`` of the live holders of the slots ``names``
    (ordinal 1 is ``names[0]``), by ordinal. A row of ordinal 0 says the key's rate refused a
    start (its seconds left: until one is allowed). Else the caller took the first slot its
    token holds; else every slot is held, and the rows are its holders."""
    if rows and rows[0][0] == 0:
        return AcquireResult(False, retry_after=max(0.0, rows[0][4] or 0.0))
    for index, holder, _, fence, _, done in rows:
        if holder == token:
            return AcquireResult(True, fence=fence, completed=done, key=names[index - 1])
    holders = tuple(
        load_holder(holder or "", meta, left, fence) for _, holder, meta, fence, left, _ in rows
    )
    return AcquireResult(False, holders[0], holders=holders)


def slot_args(
    keys: Callable[[str], dict[str, str | None]], key: str, names: Sequence[str], token: str,
    meta: Mapping[str, str] | None, takeover_prefix: str | None,
) -> dict[str, Any]:  # fmt: skip
    """The arguments every slot acquisition's script takes: ``base`` and ``base_full`` (the
    key's row), ``keys`` and ``fulls`` (the slots' rows; ``keys`` gives the stored and full
    key of a lock key), the holder's ``token``, ``task_id``, ``meta``, and ``prefix``."""
    stored, task_id = dump_meta(meta)
    base = keys(key)
    slots = [keys(name) for name in names]
    return {
        "base": base["key"], "base_full": base["full_key"], "token": token,
        "keys": [s["key"] for s in slots], "fulls": [s["full_key"] for s in slots],
        "task_id": task_id, "meta": stored, "prefix": takeover_prefix or "",
    }  # fmt: skip
