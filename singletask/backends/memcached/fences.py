"""How the memcached store (:mod:`~singletask.backends.memcached`) issues fencing tokens: from a
counter item per lock key, taken between the ``gets`` of the lock's record and its ``cas``."""

from __future__ import annotations

import time
from typing import Any

from ...exceptions import BackendError
from .items import FENCE_EXPIRY, item_name

__all__ = ["next_fence"]


# Why a fence is never below one issued before it for the key, whatever the interleaving:
#
# * A lock record is created only as a *free* record, with ``add`` (which fails when any item
#   is there). Every acquisition is a ``cas`` over a record its ``gets`` read, and the fence is
#   taken from the key's counter (``incr``) *between* that ``gets`` and that ``cas``.
# * A ``cas`` succeeds only if the item was not changed, deleted, expired or re-created since
#   the ``gets`` (memcached gives every store of an item a new cas value, never reused until it
#   restarts, which loses every lock anyway). So the
#   ``incr`` of a successful acquisition A ran while the record was still in the state A read.
# * Every earlier holder B made that state's past: B's ``cas`` happened before A's ``gets``
#   (had it happened after, A's ``cas`` would fail), and B's ``incr`` before B's ``cas``. So
#   B's ``incr`` came before A's, and the counter only grows: B's fence < A's fence.
# * A paused acquisition cannot issue a stale fence: if a rival acquired (and released, or let
#   its lease expire) meanwhile, the paused ``cas`` fails and the step is decided again, with a
#   new ``incr``. Creating the record with ``add`` (where the old version put the *held*
#   record, with a fence taken before it) is what makes this hold when no item is there: a
#   rival's whole lease could begin and end between the ``incr`` and an ``add``, and ``add``
#   cannot tell (seen: A took N, B took N+1 and expired, A's ``add`` stored N).
# * The counter is kept above the fence in the record (``floor``). A lost counter (evicted,
#   expired after 30 days, or a restart) is seeded again from the host's clock in microseconds:
#   there, and only there, fences rest on the hosts' clocks (see the guarantees page).
def next_fence(client: Any, key: str, floor: int | None, *, fresh: bool, owner: object) -> int:
    """A fencing token greater than every one issued before (and than ``floor``).

    Called between the ``gets`` of the record and its ``cas`` (see the comment above this
    function). A missing counter (new key, or evicted / expired / lost in a restart)
    is seeded with the time, so that the fence keeps growing as long as the hosts' clocks
    do. With ``fresh`` (the record was just created) the counter is most likely missing
    too: seeding is tried first. ``owner`` (the backend) names the store in an error.
    """
    counter = item_name(key, "fence")
    seed = max(int(time.time() * 1_000_000), (floor or 0) + 1)
    if fresh and client.add(counter, str(seed).encode(), expire=FENCE_EXPIRY):
        return seed
    value = client.incr(counter, 1)
    if value is None:
        if client.add(counter, str(seed).encode(), expire=FENCE_EXPIRY):
            return seed
        value = client.incr(counter, 1)
        if value is None:
            raise BackendError(f"{owner!r}: the fence counter of {key!r} vanished twice")
    if floor is not None and int(value) <= floor:
        value = client.incr(counter, floor + 1 - int(value))
        if value is None:
            raise BackendError(f"{owner!r}: the fence counter of {key!r} vanished")
    return int(value)
