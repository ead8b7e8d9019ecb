"""Holder slots: how ``lock_limit = N`` stores up to N holders of one lock key.

Slot 0 of a key is the key itself, so a limit of 1 is exactly the singleton, and a task whose
limit changes from 1 to N keeps excluding the holder it already has. Slot ``i`` (1 <= i < N) is
the store key :func:`slot_key` names, shaped like the Redis companion of a key:

* ``{<key>}:slot:<i>`` for a key without ``}``: its Redis Cluster hash tag is the key's own
  text, so every slot of a key hashes to the key's own cluster slot;
* ``<key>}:slot:<i>`` for a key with ``}`` (its prefix carries a hash tag, the one the slot
  key keeps).

A key singletask builds never holds ``{`` or ``}`` after the app's key prefix
(:mod:`singletask.protocol.keys`), so no built key is another key's slot. Every store keeps one
fence record per *key*: a slot's fencing tokens, completion marker and follow-up are those of
:func:`base_key` of its store key, so fences grow across all the slots of a key.

A store that keeps other per-key records beside the lock (the Redis stores: the rate record of
``lock_rate``, the debounce window of ``lock_debounce``, the follow-up claim) names them the same
way, with :func:`companion_key`.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..exceptions import ConfigurationError

__all__ = [
    "MAX_LIMIT", "SLOT_MARK", "base_key", "check_limit", "choose_slot", "companion_key",
    "slot_index",
    "slot_key", "slot_keys", "split_companion", "split_slot",
]  # fmt: skip

#: What a slot key has between its key (and the closing brace) and its index.
SLOT_MARK = "}:slot:"

#: The largest ``lock_limit``: a limit names a handful of holders, not a pool of thousands.
MAX_LIMIT = 1000


def check_limit(value: object, where: str) -> int:
    """Return ``value`` if it is a whole number of holders from 1 to :data:`MAX_LIMIT`.

    Raises:
        ConfigurationError: It is not; the message names ``where`` and the bounds.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LIMIT:
        raise ConfigurationError(
            f"{where}: expected a whole number of holders from 1 to {MAX_LIMIT}, got {value!r}"
        )
    return value


def companion_key(key: str, name: str) -> str:
    """The store key of ``key``'s companion record ``name``: ``{<key>}:<name>``, or
    ``<key>}:<name>`` for a key with a ``}`` (it hashes to the key's Redis Cluster slot when the
    key has a hash tag or no ``}`` at all)."""
    return f"{key}}}:{name}" if "}" in key else f"{{{key}}}:{name}"


def split_companion(stored: str) -> tuple[str, str] | None:
    """``(key, name)`` of a companion store key: the inverse of :func:`companion_key` for a
    ``name`` without ``}:``; None for a store key that is no companion's."""
    head, mark, name = stored.rpartition("}:")
    if not mark or not name:
        return None
    if "}" in head:
        return head, name
    return (head[1:], name) if head.startswith("{") else None


def slot_key(key: str, index: int) -> str:
    """The store key of holder slot ``index`` of ``key`` (slot 0 is ``key`` itself)."""
    if index == 0:
        return key
    if index < 0:
        raise ValueError(f"a slot index is at least 0, got {index}")
    return companion_key(key, f"slot:{index}")


def slot_keys(key: str, limit: int) -> list[str]:
    """The store keys of the ``limit`` holder slots of ``key``, slot 0 (``key``) first.

    Raises:
        ConfigurationError: ``limit`` is no number of holders (see :func:`check_limit`).
    """
    return [slot_key(key, index) for index in range(check_limit(limit, f"slots of {key!r}"))]


def split_slot(stored: str) -> tuple[str, int]:
    """``(key, index)`` of a store key: the inverse of :func:`slot_key`; ``(stored, 0)`` for a
    key that is no slot key."""
    head, mark, tail = stored.rpartition(SLOT_MARK)
    if not mark or not tail.isascii() or not tail.isdigit() or tail != str(int(tail)):
        return stored, 0
    index = int(tail)
    if index == 0:
        return stored, 0
    if "}" in head:
        return head, index
    if head.startswith("{"):
        return head[1:], index
    return stored, 0


def base_key(stored: str) -> str:
    """The lock key a store key belongs to: the key of a slot key, else the key itself."""
    return split_slot(stored)[0]


def slot_index(stored: str) -> int:
    """The holder slot a store key is: 0 for a plain key."""
    return split_slot(stored)[1]


def choose_slot(
    holders: Sequence[str | None], token: str, takeover_prefix: str | None
) -> int | None:
    """The slot an ``acquire_slot`` takes, given the owner token of each slot's live holder
    (None: free), slot 0 first: the slot ``token`` holds, else one whose holder's token starts
    with ``takeover_prefix``, else the lowest free one; None when every slot is held. For the
    stores that choose in Python (the Redis and SQL stores choose in their script)."""
    if token in holders:
        return holders.index(token)
    if takeover_prefix:
        for index, held in enumerate(holders):
            if held is not None and held.startswith(takeover_prefix):
                return index
    return holders.index(None) if None in holders else None
