"""Rate records (``lock_rate``) and debounce windows (``lock_debounce``) on the Redis stores,
and the names of every companion record a lock key has there.

A key's companions are named by :func:`singletask.protocol.slots.companion_key`: ``{<key>}:<name>``,
or ``<key>}:<name>`` for a key with a ``}``. They hash to the key's Redis Cluster slot when the key
has a hash tag or no ``}`` at all:

* ``}:fence`` — a hash holding a coalescing task's pending follow-up claim (:func:`fence_key`);
* ``}:rate`` — the rate record: a string, the server time (microseconds since the epoch) of
  the key's next allowed start, expiring then (``PX`` interval).
  :data:`~singletask.backends.redis.slot_scripts.ACQUIRE_SLOT_RATED_SCRIPT` checks and writes it in
  the script that takes the slot, so it must share the slots' cluster slot (the Cluster store
  refuses a key whose rate record would not);
* ``}:debounce`` — the debounce window: a hash ``{l: latest task id, o: server ms it opened}``,
  with ``p`` (server ms until which the latest is pending: its message being published) and
  ``b`` (the superseded send's ``p``, while the latest is pending), kept ``ttl`` from each
  send. A window closed by its latest send's take has no ``o``: it keeps naming that send until
  it expires, and the next send opens a new window. Its scripts touch it alone.

A lock key built by singletask never ends in one of :data:`COMPANION_ENDS` (a ``}`` in its text
is escaped, :mod:`singletask.protocol.keys`); a raw key that does is refused (:func:`check_key`),
since it may be another lock's companion, and the listing of locks leaves such names out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ...exceptions import LockKeyError
from ...protocol.slots import companion_key, slot_keys
from ..base import check_lease
from .debounce_scripts import (
    DEBOUNCE_PUBLISHED_SCRIPT,
    DEBOUNCE_SCRIPT,
    DEBOUNCE_TAKE_SCRIPT,
    DEBOUNCE_UNDO_SCRIPT,
)
from .slot_scripts import ACQUIRE_SLOT_RATED_KEEPING_SCRIPT, ACQUIRE_SLOT_RATED_SCRIPT
from .slots import ACQUIRE_SLOT, COMPANION_ENDS
from .wire import Script, as_text, encode_meta, lease_ms

__all__ = [
    "ACQUIRE_SLOT_RATED",
    "ACQUIRE_SLOT_RATED_KEEPING",
    "COMPANION_ENDS",
    "DEBOUNCE",
    "DEBOUNCE_PUBLISHED",
    "DEBOUNCE_TAKE",
    "DEBOUNCE_UNDO",
    "check_key",
    "debounce_args",
    "debounce_result",
    "fence_key",
    "rate_key",
    "slot_request",
    "window_key",
]


def fence_key(key: str) -> str:
    """The key of ``key``'s companion hash, which holds a coalescing task's pending follow-up
    claim: ``{<key>}:fence``, or ``<key>}:fence`` when ``key`` has a ``}`` already.

    The name is out of reach of every lock key: it has a ``}`` after the key's prefix, which a
    lock key built by singletask never has there (the task name and the key's suffix are
    escaped, :mod:`singletask.protocol.keys`), so a ``lock_key`` whose text ends in ``:fence``
    cannot name another lock's companion. It is in the lock key's Redis Cluster slot whenever the
    key has a hash tag or no ``}`` at all (``{<key>}`` then is the tag; a tag already in the key
    stays the first one). A key with a ``}`` but no hash tag has its companion in another slot,
    which does no harm: no script uses the two keys together.

    Earlier versions named the companion of a key with a ``}`` ``<key>:fence``, which a lock key
    under a hash-tagged prefix could be as well (the companions' names: docs/architecture.rst,
    "store-encodings");
    0.1.0 named this hash the fence hash and kept fences and completion markers in it.
    """
    return companion_key(key, "fence")


def rate_key(key: str) -> str:
    """The key of ``key``'s rate record (``lock_rate``)."""
    return companion_key(key, "rate")


def window_key(key: str) -> str:
    """The key of ``key``'s debounce window (``lock_debounce``). A key with a ``}`` but no hash
    tag has it in another cluster slot, which does no harm: its scripts touch it alone."""
    return companion_key(key, "debounce")


def check_key(where: str, key: str, operation: str) -> None:
    """Refuse a raw lock key that may be another lock's companion record."""
    if key.endswith(COMPANION_ENDS):
        raise LockKeyError(
            f"{where}: {operation} {key!r}: a lock key ending in one of {COMPANION_ENDS} may "
            "name another lock's companion record; singletask never builds one (it escapes '}')"
        )


ACQUIRE_SLOT_RATED = Script(ACQUIRE_SLOT_RATED_SCRIPT)
ACQUIRE_SLOT_RATED_KEEPING = Script(ACQUIRE_SLOT_RATED_KEEPING_SCRIPT)

DEBOUNCE = Script(DEBOUNCE_SCRIPT)
DEBOUNCE_PUBLISHED = Script(DEBOUNCE_PUBLISHED_SCRIPT)
DEBOUNCE_TAKE = Script(DEBOUNCE_TAKE_SCRIPT)
DEBOUNCE_UNDO = Script(DEBOUNCE_UNDO_SCRIPT)


def slot_request(
    key: str,
    limit: int,
    token: str,
    ttl: float,
    meta: Mapping[str, str] | None,
    takeover_prefix: str | None,
    interval: float | None,
) -> tuple[Script, list[str], list[str | int]]:
    """The script, keys and arguments of an acquire_slot: the slot script, or with
    ``interval`` the rated one (its rate record the last key, the interval the last argument).

    Raises:
        ConfigurationError: ``limit``, ``ttl`` or ``interval`` is out of range.
    """
    keys = slot_keys(key, limit)
    since, fields = encode_meta(key, token, meta or {})
    args: list[str | int] = [token, lease_ms(ttl, "acquire"), takeover_prefix or "", since, *fields]
    if interval is None:
        return ACQUIRE_SLOT, keys, args
    # Rounded up to the millisecond (the script's unit): a shorter interval would let a start
    # through early (a third of a second truncated to 333 ms: 4 starts in a second for "3/s").
    micros = round(check_lease(interval, "acquire_slot interval") * 1_000_000)
    args.append(max(1, -(-micros // 1000)))
    return ACQUIRE_SLOT_RATED, [*keys, rate_key(key)], args


def debounce_args(task_id: str, ttl: float, pending: float) -> tuple[str, int, int]:
    """DEBOUNCE_SCRIPT's arguments (the lease checked; a pending time of at least 1 ms)."""
    return task_id, lease_ms(ttl, "debounce"), max(1, round(pending * 1000)) if pending > 0 else 0


def debounce_result(reply: Sequence[Any]) -> tuple[str | None, float, str | None]:
    """What :meth:`~singletask.backends.base.LockBackend.debounce` returns for DEBOUNCE_SCRIPT's
    reply."""
    previous, age, closed = reply
    return (
        as_text(previous) if previous else None,
        int(age) / 1000,
        as_text(closed) if closed else None,
    )
