"""The Lua scripts of preemptions (``lock_policy = "replace"``,
:mod:`~singletask.backends.redis.replaced`) on the Redis stores, each under a comment giving its
KEYS, ARGV and reply: a takeover of the key (:data:`PREEMPT_SCRIPT`) or of a holder slot
(:data:`PREEMPT_SLOT_SCRIPT`) that writes the preemption record in the same script, each also
keeping what the key was (the opt-in replica wait), and the record's read
(:data:`REPLACED_BY_SCRIPT`). They run the lock's ``acquire()`` and the slots'
``acquire_slot()`` (:mod:`~singletask.backends.redis.slot_scripts`), under the rules of
:mod:`singletask.backends.redis.scripts`.
"""

from __future__ import annotations

from typing import Final

from .scripts import ACQUIRE_FUNCTION, CHECK_MS, KEPT_READ, KEPT_REPLY
from .slot_scripts import ACQUIRE_SLOT_FUNCTION

__all__ = [
    "PREEMPT_KEEPING_SCRIPT",
    "PREEMPT_SCRIPT",
    "PREEMPT_SLOT_KEEPING_SCRIPT",
    "PREEMPT_SLOT_SCRIPT",
    "REPLACED_BY_SCRIPT",
]

# Lua, after CHECK_MS and before the functions of the acquire or slot script: takes the
# preemption record's key and the preemptor's task id off the end of KEYS and ARGV (the locals
# shadow them for everything after, as slot_scripts.py's _RATE_PRELUDE does), and defines
# replaced(cur): when the store key just taken was held by cur, a token starting with ARGV[3]
# (the victim's), it writes the record, expiring with the preemptor's lease (ARGV[2], checked by
# acquire() before any write). A key taken free (its victim gone meanwhile) leaves no record.
_PREEMPT_PRELUDE = """
local record, successor = KEYS[#KEYS], ARGV[#ARGV]
local KEYS, ARGV = {unpack(KEYS, 1, #KEYS - 1)}, {unpack(ARGV, 1, #ARGV - 1)}
local function replaced(cur)
  if cur and cur ~= ARGV[1] and string.sub(cur, 1, #ARGV[3]) == ARGV[3] then
    redis.call('SET', record, successor, 'PX', ms(ARGV[2]))
  end
end
"""

# KEYS[1]  lock key
# KEYS[2]  the victim's preemption record (replaced.record_key: same cluster slot as KEYS[1])
# ARGV     as ACQUIRE_SCRIPT's (ARGV[3], the takeover prefix, is the victim's owner token),
#          then the preemptor's task id ('' for none) (the last one)
# Returns ACQUIRE_SCRIPT's reply. A takeover of lock_policy "replace" in one atomic step: when
# the caller takes the key from a holder whose token starts with ARGV[3], the record KEYS[2]
# is written in the same script (SET PX the lease: the preemptor's task id), so the victim can
# read who preempted it the moment its lock is gone. Errors (before any write) as
# ACQUIRE_SCRIPT.
PREEMPT_SCRIPT: Final = (
    CHECK_MS + _PREEMPT_PRELUDE + ACQUIRE_FUNCTION
    + """
ms(ARGV[2])
hashed(KEYS[1])
local cur = redis.call('HGET', KEYS[1], 'token')
local reply = acquire()
if reply[1] == 1 then replaced(cur) end
return reply
"""
)  # fmt: skip

# KEYS, ARGV as PREEMPT_SCRIPT's
# Returns ACQUIRE_KEEPING_SCRIPT's reply, with PREEMPT_SCRIPT's record: the preemption of the
# opt-in replica wait (RESTORE_SCRIPT puts the key back; the record stays until it expires,
# read only by a holder whose renewal failed).
PREEMPT_KEEPING_SCRIPT: Final = (
    CHECK_MS + _PREEMPT_PRELUDE + ACQUIRE_FUNCTION
    + """
ms(ARGV[2])
hashed(KEYS[1])
local cur = redis.call('HGET', KEYS[1], 'token')
"""
    + KEPT_READ
    + """local reply = acquire()
if reply[1] == 1 then
  replaced(cur)
"""
    + KEPT_REPLY
    + """end
return reply
"""
)  # fmt: skip

# Lua: the slot preemption's body, for acquire_slot(keeping): every slot's holder read first,
# then the record written for the slot taken if its holder was the victim.
_PREEMPT_SLOT_BODY = """
ms(ARGV[2])
for i = 1, #KEYS do hashed(KEYS[i]) end
local held = {}
for i = 1, #KEYS do held[i] = redis.call('HGET', KEYS[i], 'token') end
local reply = acquire_slot(%s)
if reply[1] == 1 then replaced(held[reply[4] + 1]) end
return reply
"""

# KEYS[1…n]  the holder slots of a lock key, as ACQUIRE_SLOT_SCRIPT's
# KEYS[n+1]  the victim's preemption record (replaced.record_key: the key's cluster slot)
# ARGV       as ACQUIRE_SLOT_SCRIPT's (ARGV[3] the victim's owner token), then the preemptor's
#            task id ('' for none) (the last one)
# Returns ACQUIRE_SLOT_SCRIPT's reply; the slot the victim held is taken first, else a free one
# (no record then), in one atomic step with the record as PREEMPT_SCRIPT's. Errors as
# ACQUIRE_SLOT_SCRIPT.
PREEMPT_SLOT_SCRIPT: Final = (
    CHECK_MS + _PREEMPT_PRELUDE + ACQUIRE_FUNCTION + ACQUIRE_SLOT_FUNCTION
    + _PREEMPT_SLOT_BODY % "false"
)  # fmt: skip

# KEYS, ARGV as PREEMPT_SLOT_SCRIPT's
# Returns ACQUIRE_SLOT_KEEPING_SCRIPT's reply, with the record: the slot preemption of the
# opt-in replica wait.
PREEMPT_SLOT_KEEPING_SCRIPT: Final = (
    CHECK_MS + _PREEMPT_PRELUDE + ACQUIRE_FUNCTION + ACQUIRE_SLOT_FUNCTION
    + _PREEMPT_SLOT_BODY % "true"
)  # fmt: skip

# KEYS[1]  the preemption record (replaced.record_key)
# Returns the preemptor's task id ('' for none), or false when there is no such record.
REPLACED_BY_SCRIPT: Final = "return redis.call('GET', KEYS[1])\n"
