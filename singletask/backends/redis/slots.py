"""Holder slots (``lock_limit``, :mod:`singletask.protocol.slots`) on the Redis stores.

A slot is a lock key of its own, one hash as :mod:`~singletask.backends.redis.scripts` describes;
slot 0 is the key itself. :data:`~singletask.backends.redis.slot_scripts.ACQUIRE_SLOT_SCRIPT` reads
every slot of a key and takes one, in one script: the slots of a key hash to the key's own Redis
Cluster slot (a key with a hash tag, or without ``}``; :meth:`RedisClusterBackend.acquire_slot
<singletask.backends.redis.deploy.RedisClusterBackend>` refuses any other). The key's last
fencing token is the largest the records of its slots hold (held or released), and the server
clock's after that, as for one key; its completion marker is the base key's (field ``d``),
where a slot's release records it (:data:`~singletask.backends.redis.lock_scripts.RELEASE_SCRIPT`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import redis
from redis.cluster import RedisCluster

from ...protocol.slots import base_key, slot_index
from ..base import AcquireResult, Holder
from .slot_scripts import ACQUIRE_SLOT_KEEPING_SCRIPT, ACQUIRE_SLOT_SCRIPT
from .units import LIMIT_ENDS
from .wire import Script, as_text, conflict_holder, glob_escape, read_record

__all__ = [
    "ACQUIRE_SLOT",
    "ACQUIRE_SLOT_KEEPING",
    "COMPANION_ENDS",
    "listed",
    "scan_locks",
    "scan_pattern",
    "slot_result",
]

ACQUIRE_SLOT = Script(ACQUIRE_SLOT_SCRIPT)
ACQUIRE_SLOT_KEEPING = Script(ACQUIRE_SLOT_KEEPING_SCRIPT)


def slot_result(keys: Sequence[str], reply: Sequence[Any]) -> AcquireResult:
    """The AcquireResult of an ACQUIRE_SLOT_SCRIPT (or rated: rates.py) ``reply`` over the
    slot ``keys``."""
    if reply[0] == 2:  # a start within the interval: refused by the rate record
        return AcquireResult(False, retry_after=int(reply[1]) / 1000)
    if reply[0] == 1:
        fence, completed, index = reply[1:4]
        return AcquireResult(
            True,
            fence=int(fence),
            completed=as_text(completed) if completed else None,
            key=keys[int(index)],
        )
    holders = tuple(conflict_holder(*reply[i : i + 6]) for i in range(1, len(reply), 6))
    return AcquireResult(False, holders[0], holders=holders)


#: How the name of every companion record ends: of a lock key (see :mod:`.rates`), and of a
#: named limit's key (its log and units hash, :mod:`.units`).
COMPANION_ENDS = ("}:fence", "}:rate", "}:debounce", *LIMIT_ENDS)


def scan_pattern(prefix: str) -> str:
    """The SCAN MATCH pattern of the locks under ``prefix``: every name that holds ``prefix``,
    so that one pass over the keyspace finds the keys that start with it (a key with ``}`` has
    its slots among them) and the slots ``{<key>}:slot:<i>`` of the others alike; :func:`listed`
    keeps the right ones (a foreign name that holds ``prefix`` elsewhere costs its name only).
    """
    escaped = glob_escape(prefix)
    return f"*{escaped}*" if escaped else "*"


def listed(name: str, prefix: str) -> bool:
    """Whether ``name``, found by :func:`scan_pattern`, is to be listed: a key under ``prefix``
    or a slot of one, and no companion record (a name ending in one of
    :data:`COMPANION_ENDS`)."""
    if name.endswith(COMPANION_ENDS) or not base_key(name).startswith(prefix):
        return False
    return name.startswith(prefix) or slot_index(name) > 0


def scan_locks(client: redis.Redis, prefix: str, page_size: int) -> Iterator[tuple[str, Holder]]:
    """The locks under ``prefix`` on ``client`` (one server): one SCAN MATCH
    :func:`scan_pattern` COUNT ``page_size``, each page of listed keys read in one pipeline.
    Raises redis-py's errors."""
    page: list[bytes | str] = []
    for raw in client.scan_iter(match=scan_pattern(prefix), count=page_size):
        if listed(as_text(raw), prefix):
            page.append(raw)
        if len(page) >= page_size:
            yield from _read_page(client, page)
            page = []
    if page:
        yield from _read_page(client, page)


def _read_page(client: redis.Redis, keys: list[bytes | str]) -> Iterator[tuple[str, Holder]]:
    """The locks among ``keys`` (released records, companion records and foreign keys are left
    out)."""
    # MULTI/EXEC keeps each key's fields and lease consistent; a cluster pipeline splits the page
    # by node instead.
    transaction = not isinstance(client, RedisCluster)
    with client.pipeline(transaction=transaction) as pipe:
        for key in keys:
            pipe.get(key)  # a plain lock's string record, or WRONGTYPE for a hash
            pipe.hgetall(key)  # a hash record, or WRONGTYPE for a string
            pipe.pttl(key)
        replies = pipe.execute(raise_on_error=False)
    for index, key in enumerate(keys):
        value, fields, pttl = replies[3 * index : 3 * index + 3]
        name = as_text(key)
        try:
            found = read_record(name, value, fields, pttl)
        except redis.exceptions.RedisError:
            continue  # neither a hash nor a string record: not one of ours
        if found is not None:
            yield name, found
