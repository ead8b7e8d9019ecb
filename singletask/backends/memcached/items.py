"""The memcached store's items: their names, their records and expiries, and the store's URLs.

Used by :mod:`singletask.backends.memcached` (the store itself); see there for how the items are
read and written.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from ...exceptions import BackendError, ConfigurationError
from ..base import Holder, check_lease
from ..urls import mask_url

__all__ = [
    "CLIENT_DEFAULTS",
    "EXPIRY_SLACK",
    "FENCE_EXPIRY",
    "MAX_RELATIVE_EXPIRY",
    "OPTION_TYPES",
    "RECORD_RETENTION",
    "decode",
    "encode",
    "expiry",
    "holder_of",
    "item_name",
    "parse_servers",
]

#: memcached reads an expiry above 30 days as an absolute Unix time, not as seconds from now.
MAX_RELATIVE_EXPIRY = 30 * 24 * 3600

#: Seconds an item is kept beyond its lease, for memcached's clock (see :func:`expiry`).
EXPIRY_SLACK = 2

#: How long a free record (last fence, last completion marker) outlives the release.
RECORD_RETENTION = 7 * 24 * 3600

#: How long a fence counter lives; ``incr`` does not renew it, the time seed covers its end.
FENCE_EXPIRY = MAX_RELATIVE_EXPIRY

#: Client defaults; URL query options and ``from_url`` options win.
CLIENT_DEFAULTS: dict[str, Any] = {"connect_timeout": 5.0, "timeout": 5.0}

OPTION_TYPES: dict[str, type] = {"connect_timeout": float, "timeout": float, "max_pool_size": int}

#: memcached's key limit is 250 bytes of printable, non-space ASCII.
_MAX_KEY = 250

#: Where a lock key's item name is a digest of the key: ``singletask:sha256:<64 hex digits>``.
_DIGESTED = b"singletask:sha256:"

#: Where the store's own items live (fence counters, follow-up slots): no lock item's name starts
#: with it (see :func:`item_name`). The default key prefix never makes a key starting with it
#: either: a task name cannot be empty, and its ``:`` are escaped.
_COMPANIONS = b"singletask::"


def parse_servers(url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """The ``(host, port)`` servers and the client options of a ``memcached://`` URL.

    Raises:
        ConfigurationError: The URL is not a memcached URL or an option is invalid.
    """
    shown = mask_url(url)  # memcached has no passwords; any user info is masked all the same
    parts = urlsplit(url)
    if parts.scheme != "memcached":
        raise ConfigurationError(f"{shown!r} is not a memcached:// URL")
    where = parts.netloc.replace(",", ";") + parts.path.rstrip("/").replace(",", ";")
    servers: list[tuple[str, int]] = []
    for item in filter(None, (part.strip() for part in where.split(";"))):
        item = item.removeprefix("memcached://").rsplit("@", 1)[-1]
        host, _, port = item.rpartition(":") if item.count(":") == 1 else (item, "", "")
        port = port or "11211"
        if not port.isascii() or not port.isdigit():
            # Neither the item nor the port is shown: a '#' in a password ends the netloc early,
            # so the item can be a piece of user info.
            raise ConfigurationError(
                f"{shown!r}: a server address is not host[:port]; percent-encode any '#', '@' or "
                "'/' in a user name or password"
            )
        servers.append((unquote(host or item), int(port)))
    if not servers:
        raise ConfigurationError(
            f"{shown!r}: no server; expected memcached://host:11211 or memcached://h1:11211;h2:11211"
        )
    options: dict[str, Any] = {}
    for name, value in parse_qsl(parts.query):
        if name not in OPTION_TYPES:
            raise ConfigurationError(
                f"{shown!r}: unknown option {name!r}; known: {', '.join(sorted(OPTION_TYPES))}"
            )
        try:
            options[name] = OPTION_TYPES[name](value)
        except ValueError as exc:
            raise ConfigurationError(f"{shown!r}: option {name}={value!r} is invalid") from exc
    return servers, options


def expiry(seconds: float, operation: str = "lease") -> int:
    """memcached's expiry for an item that must live at least ``seconds`` from now.

    memcached's clock (``current_time``) is the whole seconds of the server's monotonic clock,
    read by a timer that fires a second after it last ran. An item expires once that clock has
    moved ``expiry`` seconds past its value at the write. At the write it can be almost a second
    stale (the timer has not fired yet) and have lost almost a second more to the rounding down.
    The rounding loses the same at the expiry, unless the timer's phase has crossed a whole
    second meanwhile: it fires a little late each time (about a millisecond), so it does now and
    then, and the clock then moves by two at one tick. An item can so end almost two seconds
    before ``expiry`` seconds have passed (seen in the fault campaign: an item written for 4 s
    gone after 2.4 s): :data:`EXPIRY_SLACK` more seconds make up for it. A timer that fires later
    still, because the server's main thread did not run, can end an item early by that delay.

    Raises:
        ConfigurationError: ``seconds`` is not a lease :func:`check_lease` accepts, or is over
            :attr:`~singletask.backends.memcached.MemcachedBackend.max_lease` (memcached reads
            an expiry over 30 days as an absolute Unix time: the item would expire at once). The
            message names the store and ``operation``.
    """
    exptime = math.ceil(check_lease(seconds, f"memcached:// {operation}")) + EXPIRY_SLACK
    if exptime > MAX_RELATIVE_EXPIRY:
        raise ConfigurationError(
            f"memcached:// {operation}: the memcached lock store cannot keep a lease of "
            f"{seconds:.0f}s; its longest is {MAX_RELATIVE_EXPIRY - EXPIRY_SLACK}s (30 days, "
            f"memcached's longest relative expiry, less the {EXPIRY_SLACK} seconds an item is "
            "kept longer); use a shorter one"
        )
    return exptime


def _plain(raw: bytes) -> bool:
    """Whether memcached can take ``raw`` as a key as it is (length, printable ASCII)."""
    return len(raw) <= _MAX_KEY and all(32 < byte < 127 for byte in raw)


def item_name(key: str, kind: str = "") -> bytes:
    """The name of the item of lock ``key`` (``kind`` ""), or of its ``"fence"`` counter or
    ``"next"`` follow-up slot.

    A lock item is named by the key itself when memcached can take it and it does not start with
    a name of the store's own (``singletask:sha256:``, ``singletask::``); otherwise by
    ``singletask:sha256:<digest>``. A companion item is ``singletask::<kind>:<key>`` when that
    fits, else ``singletask::<kind>#<digest>``. So no lock key, whatever its text, names another
    lock's item or any companion item, and companions of two keys differ.
    """
    raw = key.encode()
    if not kind:
        if _plain(raw) and not raw.startswith((_DIGESTED, _COMPANIONS)):
            return raw
        return _DIGESTED + hashlib.sha256(raw).hexdigest().encode()
    named = _COMPANIONS + kind.encode() + b":" + raw
    if _plain(named):
        return named
    return _COMPANIONS + kind.encode() + b"#" + hashlib.sha256(raw).hexdigest().encode()


def encode(record: Mapping[str, Any]) -> bytes:
    return json.dumps(record, separators=(",", ":")).encode()


def decode(value: bytes | str | None, key: str) -> dict[str, Any] | None:
    """The lock record in an item's value; None for no item.

    Raises:
        BackendError: The item is not a singletask lock record (another program wrote it).
    """
    if value is None:
        return None
    try:
        record = json.loads(value)
    except ValueError:
        record = None
    if not (
        isinstance(record, dict)
        and isinstance(record.get("f", 0), int)
        and (
            record.get("t") is None
            or (
                isinstance(record["t"], str)
                and isinstance(record.get("f"), int)
                and isinstance(record.get("d"), int | float)
                and isinstance(record.get("m") or {}, dict)
            )
        )
    ):
        raise BackendError(f"memcached item {key!r} is not a singletask lock record: {value!r}")
    return record


def holder_of(record: Mapping[str, Any], *, full: bool = True) -> Holder:
    meta: dict[str, str] = dict(record.get("m") or {})
    left = float(record["d"]) - time.time()
    return Holder(
        str(record["t"]),
        meta.get("task_id"),
        left if left > 0 else None,
        meta if full else {},
        int(record["f"]),
    )
