"""The Redis store's preemptions (``lock_policy = "replace"``) and their records.

A preemption takes the key (or the holder slot) and leaves its record in one script
(:data:`~singletask.backends.redis.preempt_scripts.PREEMPT_SCRIPT`, ``PREEMPT_SLOT_SCRIPT``): a
string at ``{<key>}:replaced:<preempted token>`` (the companion naming of
:func:`singletask.protocol.slots.companion_key` of the lock key, never of a slot, so it is known
before the script chooses the slot and shares the cluster slot of the key and of every holder
slot), holding the preemptor's task id, expiring with the preemptor's first lease. The
preempted holder reads it once, after its renewal or release failed. It is a string, not a
hash: the listings of locks and bookkeeping leave it out.
"""

from __future__ import annotations

from collections.abc import Mapping

from ...protocol.slots import base_key, companion_key, slot_keys
from .preempt_scripts import (
    PREEMPT_KEEPING_SCRIPT,
    PREEMPT_SCRIPT,
    PREEMPT_SLOT_KEEPING_SCRIPT,
    PREEMPT_SLOT_SCRIPT,
    REPLACED_BY_SCRIPT,
)
from .wire import Script, encode_meta, lease_ms

__all__ = [
    "PREEMPT", "PREEMPT_KEEPING", "PREEMPT_SLOT", "PREEMPT_SLOT_KEEPING", "REPLACED_BY",
    "preempt_request", "record_key",
]  # fmt: skip

PREEMPT = Script(PREEMPT_SCRIPT)
PREEMPT_KEEPING = Script(PREEMPT_KEEPING_SCRIPT)
PREEMPT_SLOT = Script(PREEMPT_SLOT_SCRIPT)
PREEMPT_SLOT_KEEPING = Script(PREEMPT_SLOT_KEEPING_SCRIPT)
REPLACED_BY = Script(REPLACED_BY_SCRIPT)


def record_key(key: str, token: str) -> str:
    """The store key of the record of ``token``'s preemption on ``key`` (a key or one of its
    slots: the record is the lock key's companion either way)."""
    return companion_key(base_key(key), f"replaced:{token}")


def preempt_request(
    key: str, limit: int, token: str, ttl: float, victim: str, meta: Mapping[str, str] | None
) -> tuple[Script, list[str], list[str | int]]:
    """The script, keys and arguments of a preemption of ``victim`` on ``key`` for ``token``.

    Raises:
        ConfigurationError: ``limit`` or ``ttl`` is out of range.
    """
    keys = [key] if limit == 1 else slot_keys(key, limit)
    since, fields = encode_meta(key, token, meta or {})
    successor = (meta or {}).get("task_id") or ""
    args: list[str | int] = [token, lease_ms(ttl, "preempt"), victim, since, *fields, successor]
    script = PREEMPT if limit == 1 else PREEMPT_SLOT
    return script, [*keys, record_key(key, victim)], args
