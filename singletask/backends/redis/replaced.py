"""The Redis store's preemption records (``lock_policy = "replace"``).

A preemption leaves a string at ``{<key>}:replaced:<preempted token>`` (the companion naming of
:func:`singletask.protocol.slots.companion_key`, so it shares the cluster slot of the key or holder
slot taken), holding the preemptor's task id, expiring with the preemptor's first lease. The
preempted holder reads it once, after its renewal or release failed. It is a string, not a hash:
the listings of locks and bookkeeping leave it out.
"""

from __future__ import annotations

from ...protocol.slots import companion_key
from .scripts import LEAVE_REPLACED_SCRIPT, REPLACED_BY_SCRIPT
from .wire import Script

__all__ = ["LEAVE_REPLACED", "REPLACED_BY", "record_key"]

LEAVE_REPLACED = Script(LEAVE_REPLACED_SCRIPT)
REPLACED_BY = Script(REPLACED_BY_SCRIPT)


def record_key(key: str, token: str) -> str:
    """The store key of the record of ``token``'s preemption on ``key`` (a key or a slot)."""
    return companion_key(key, f"replaced:{token}")
