"""Named limits in the lock store: the store key of each, and the name it came from.

A named limit (a name of ``singletask_limits``, taken by a task's ``lock_limits``) is one
record per kind in the lock store, under the app's key prefix:

* ``<prefix>%limit:<name>``: its concurrency (units held at once);
* ``<prefix>%rate:<name>``: its rate (units started in a sliding window).

A lock key never has ``%l`` or ``%r`` right after the prefix (a task name in a key escapes
``%`` as ``%25``, :mod:`singletask.protocol.keys`), so no limit's key is a lock key, and an
operator's listing under the prefix finds them beside the locks. The name is kept as written,
braces included: in Redis Cluster, limits that one task takes together must share a hash slot,
which names with one hash tag do (``"{openai}-requests"``, ``"{openai}-tokens"``) when the
prefix has none.
"""

from __future__ import annotations

from typing import Final

from ..exceptions import ConfigurationError

__all__ = ["LIMIT_MARK", "MAX_NAME", "RATE_MARK", "check_name", "limit_key", "split_limit_key"]

#: What follows the prefix in a concurrency limit's key, and in a rate's.
LIMIT_MARK: Final = "%limit:"
RATE_MARK: Final = "%rate:"

#: The longest limit name, in characters.
MAX_NAME: Final = 200


def check_name(value: object, where: str) -> str:
    """Return ``value`` if it can name a limit: non-empty text of at most :data:`MAX_NAME`
    characters, valid UTF-8, without control characters.

    Raises:
        ConfigurationError: It cannot; the message names ``where``.
    """
    if not isinstance(value, str) or not value or len(value) > MAX_NAME:
        raise ConfigurationError(
            f"{where}: a limit's name is text of 1 to {MAX_NAME} characters, got {value!r}"
        )
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ConfigurationError(f"{where}: a limit's name has no control characters: {value!r}")
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise ConfigurationError(f"{where}: {value!r} is not valid text ({exc.reason})") from exc
    return value


def limit_key(prefix: str, name: str, *, rate: bool = False) -> str:
    """The store key of limit ``name``'s concurrency, or with ``rate`` of its rate."""
    return f"{prefix}{RATE_MARK if rate else LIMIT_MARK}{name}"


def split_limit_key(key: str) -> tuple[str, str, bool] | None:
    """``(prefix, name, rate)`` of a limit's store key, or None for any other key."""
    for mark, rate in ((LIMIT_MARK, False), (RATE_MARK, True)):
        prefix, found, name = key.partition(mark)
        if found and name:
            return prefix, name, rate
    return None
