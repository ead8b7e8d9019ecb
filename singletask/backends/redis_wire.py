"""The Redis store's wire format: its scripts as EVALSHA commands, and its replies decoded.

:mod:`singletask.backends.redis` sends the Lua scripts of
:mod:`singletask.backends.redis_scripts` over connections of its own, with the RESP command
encoded here once per script (its SHA1 digest computed at import), and turns the lock hashes
that scripts and pipelines return into :class:`~singletask.backends.base.Holder` values.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from .base import Holder, check_lease
from .redis_scripts import (
    ACQUIRE_SCRIPT,
    CLAIM_NEXT_SCRIPT,
    CLEAR_NEXT_SCRIPT,
    EXTEND_MANY_SCRIPT,
    EXTEND_SCRIPT,
    OPERATOR_RELEASE_SCRIPT,
    RELEASE_SCRIPT,
)

__all__: list[str] = []


class _Connection(Protocol):
    """What this module uses of a redis-py connection (whose methods are untyped)."""

    def send_packed_command(self, command: list[bytes], check_health: bool = True) -> None: ...

    def read_response(self) -> Any: ...

    def disconnect(self) -> None: ...


def _ms(seconds: float, operation: str) -> int:
    """``seconds`` in whole milliseconds (at least 1), once :func:`check_lease` accepts it."""
    return max(1, int(check_lease(seconds, operation) * 1000))


def _bulk(data: bytes) -> bytes:
    """``data`` as a RESP bulk string."""
    return b"$%d\r\n%s\r\n" % (len(data), data)


class _Script:
    """A script of :mod:`~singletask.backends.redis_scripts`, called by its SHA1 digest, with
    the command encoded here."""

    __slots__ = ("_eval", "_evalsha", "sha", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()
        self._evalsha = _bulk(b"EVALSHA") + _bulk(self.sha.encode())
        self._eval = _bulk(b"EVAL") + _bulk(text.encode())

    def command(
        self, keys: Sequence[str], args: Sequence[str | int], *, text: bool = False
    ) -> bytes:
        """The RESP-encoded EVALSHA (or, with ``text``, EVAL) of this script; strings as UTF-8."""
        parts = [
            b"*%d\r\n" % (3 + len(keys) + len(args)),
            self._eval if text else self._evalsha,
            _bulk(b"%d" % len(keys)),
        ]
        for value in (*keys, *args):
            parts.append(_bulk(value.encode() if isinstance(value, str) else b"%d" % value))
        return b"".join(parts)


_ACQUIRE = _Script(ACQUIRE_SCRIPT)
_RELEASE = _Script(RELEASE_SCRIPT)
_EXTEND = _Script(EXTEND_SCRIPT)
_EXTEND_MANY = _Script(EXTEND_MANY_SCRIPT)
_CLAIM_NEXT = _Script(CLAIM_NEXT_SCRIPT)
_CLEAR_NEXT = _Script(CLEAR_NEXT_SCRIPT)
_OPERATOR_RELEASE = _Script(OPERATOR_RELEASE_SCRIPT)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _holder(fields: Mapping[bytes | str, bytes | str], pttl: int) -> Holder | None:
    """The Holder of a lock hash's fields and PTTL; None for no lock (or a fence hash)."""
    if not fields or pttl == -2:
        return None
    meta = {_text(k): _text(v) for k, v in fields.items()}
    token = meta.pop("token", None)
    if token is None:
        return None
    fence = meta.pop("fence", None)
    return Holder(
        token,
        meta.get("task_id"),
        pttl / 1000 if pttl >= 0 else None,
        meta,
        int(fence) if fence is not None else None,
    )


def _removed(reply: Sequence[Any]) -> Holder | None:
    """The Holder of an OPERATOR_RELEASE_SCRIPT reply, or None when it removed nothing."""
    if not reply:
        return None
    pttl, flat = int(reply[0]), reply[1:]
    return _holder(dict(zip(flat[::2], flat[1::2], strict=True)), pttl)


def _glob_escape(text: str) -> str:
    """``text`` with the glob characters of SCAN MATCH escaped, to match it literally."""
    return "".join("\\" + char if char in "*?[]\\" else char for char in text)
