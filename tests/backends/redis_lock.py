"""A Redis lock key read by hand, whatever its layout: the fields of the hash it is, or stands
for (a plain lock's string record, ``scripts.py``'s ``STRING_RECORD``)."""

from __future__ import annotations

from typing import Any

from singletask.backends.redis.wire import as_text, string_record


def lock_fields(client: Any, key: str) -> dict[str, str]:
    """The fields of the lock at ``key`` as text: a hash's, a string record's (token, f, a and
    the compact fields), or {} when there is no key (or a string that is not a lock)."""
    kind = as_text(client.type(key))
    if kind == "string":
        value = client.get(key)  # None when the key was released after TYPE
        return {} if value is None else string_record(value) or {}
    if kind == "hash":
        return {as_text(k): as_text(v) for k, v in client.hgetall(key).items()}
    return {}


def lock_token(client: Any, key: str) -> str | None:
    """The owner token of the lock at ``key``, or None when nothing holds it."""
    return lock_fields(client, key).get("token")
