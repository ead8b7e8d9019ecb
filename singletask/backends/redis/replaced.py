"""The Redis store's preemption records (``lock_policy = "replace"``).

A preemption leaves a string at ``{<key>}:replaced:<preempted token>`` (the companion naming of
:func:`singletask.protocol.slots.companion_key`, so it shares the cluster slot of the key or holder
slot taken), holding the preemptor's task id, expiring with the preemptor's first lease. The
preempted holder reads it once, after its renewal or release failed. It is a string, not a hash:
the listings of locks and bookkeeping leave it out.
"""

from __future__ import annotations

from typing import Final

from ...protocol.slots import companion_key
from .scripts import _CHECK_MS
from .wire import _Script

__all__ = ["LEAVE_REPLACED_SCRIPT", "REPLACED_BY_SCRIPT", "record_key"]

# KEYS[1]  the preemption record (record_key)
# ARGV[1]  the preemptor's task id, '' for none
# ARGV[2]  how long the record is kept, in milliseconds (the preemptor's lease)
# Returns 1. Errors (before any write) when ARGV[2] is out of range.
LEAVE_REPLACED_SCRIPT: Final = (
    _CHECK_MS + "redis.call('SET', KEYS[1], ARGV[1], 'PX', ms(ARGV[2]))\nreturn 1\n"
)

# KEYS[1]  the preemption record (record_key)
# Returns the preemptor's task id ('' for none), or false when there is no such record.
REPLACED_BY_SCRIPT: Final = "return redis.call('GET', KEYS[1])\n"

_LEAVE_REPLACED = _Script(LEAVE_REPLACED_SCRIPT)
_REPLACED_BY = _Script(REPLACED_BY_SCRIPT)


def record_key(key: str, token: str) -> str:
    """The store key of the record of ``token``'s preemption on ``key`` (a key or a slot)."""
    return companion_key(key, f"replaced:{token}")
