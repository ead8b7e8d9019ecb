"""The Redis store's wire format: its scripts as EVALSHA commands, and its replies decoded.

:mod:`singletask.backends.redis` sends the Lua scripts of
:mod:`singletask.backends.redis.scripts` over connections of its own, with the RESP command
encoded here once per script (its SHA1 digest computed at import), and turns the lock hashes
that scripts and pipelines return into :class:`~singletask.backends.base.Holder` values, and
redis-py's errors into singletask's (:func:`driver_error`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import redis

from ...exceptions import BackendError, BackendTimeout, BackendUnavailable
from ..base import Holder, check_lease
from .functions import NAMES
from .lock_scripts import (
    ACQUIRE_HASH_SCRIPT,
    ACQUIRE_KEEPING_SCRIPT,
    ACQUIRE_SCRIPT,
    CLAIM_NEXT_SCRIPT,
    CLEAR_NEXT_SCRIPT,
    EXTEND_MANY_SCRIPT,
    EXTEND_SCRIPT,
    OPERATOR_RELEASE_SCRIPT,
    RELEASE_SCRIPT,
    RELEASE_STRING_SCRIPT,
    RESTORE_SCRIPT,
)

__all__ = [
    "ACQUIRE",
    "ACQUIRE_FIRST",
    "ACQUIRE_HASH",
    "ACQUIRE_KEEPING",
    "CLAIM_NEXT",
    "CLEAR_NEXT",
    "EXTEND",
    "EXTEND_MANY",
    "NOT_RUN_CODES",
    "OPERATOR_RELEASE",
    "RELEASE",
    "RELEASE_STRING",
    "RESTORE",
    "WRONGTYPE",
    "Connection",
    "Script",
    "as_text",
    "conflict_holder",
    "driver_error",
    "drop_idle",
    "encode_meta",
    "glob_escape",
    "holder_from_reply",
    "holder_from_value",
    "keep_ms",
    "lease_ms",
    "not_run",
    "pack_fields",
    "read_record",
    "removed_holder",
    "string_conflict",
    "string_record",
]


class Connection(Protocol):
    """What this module uses of a redis-py connection (whose methods are untyped)."""

    def send_packed_command(self, command: list[bytes], check_health: bool = True) -> None: ...

    def read_response(self) -> Any: ...

    def disconnect(self) -> None: ...


def lease_ms(seconds: float, operation: str) -> int:
    """``seconds`` in whole milliseconds (at least 1), once :func:`check_lease` accepts it."""
    return max(1, int(check_lease(seconds, operation) * 1000))


def keep_ms(seconds: float) -> int:
    """A retention in whole milliseconds: 0 stays 0 (nothing kept), anything else at least 1."""
    return 0 if seconds == 0 else max(1, int(seconds * 1000))


def _bulk(data: bytes) -> bytes:
    """``data`` as a RESP bulk string."""
    return b"$%d\r\n%s\r\n" % (len(data), data)


class Script:
    """A script of :mod:`~singletask.backends.redis.scripts`, called by its SHA1 digest, with
    the command encoded here; or, when it is also a function of
    :data:`~singletask.backends.redis.functions.LIBRARY` (``function``: its name there), by
    ``FCALL`` on the servers that have functions."""

    __slots__ = ("_eval", "_evalsha", "_fcall", "_heads", "function", "sha", "text")

    def __init__(self, text: str, *, function: str | None = None) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()
        self.function = function
        self._evalsha = _bulk(b"EVALSHA") + _bulk(self.sha.encode())
        self._fcall = _bulk(b"FCALL") + _bulk(function.encode()) if function else b""
        self._eval = _bulk(b"EVAL") + _bulk(text.encode())
        # The command's head (length, EVALSHA and digest or FCALL and name, number of keys) by
        # (number of keys, number of arguments, FCALL): the same on every call of the lock's
        # scripts.
        self._heads: dict[tuple[int, int, bool], bytes] = {}

    def command(
        self,
        keys: Sequence[str],
        args: Sequence[str | int | bytes],
        *,
        text: bool = False,
        fcall: bool = False,
    ) -> bytes:
        """The RESP-encoded EVALSHA (or, with ``text``, EVAL; with ``fcall``, the FCALL of its
        function) of this script; strings as UTF-8, bytes as they are."""
        if text:
            head = b"*%d\r\n%s%s" % (
                3 + len(keys) + len(args),
                self._eval,
                _bulk(b"%d" % len(keys)),
            )
        else:
            shape = (len(keys), len(args), fcall)
            found = self._heads.get(shape)
            if found is None:
                if len(self._heads) >= 64:  # scripts over many keys (extend_many): few kept
                    self._heads.clear()
                name = self._fcall if fcall else self._evalsha
                found = b"*%d\r\n%s%s" % (3 + len(keys) + len(args), name, _bulk(b"%d" % len(keys)))
                self._heads[shape] = found
            head = found
        parts = [head]
        for value in (*keys, *args):
            data = (
                value.encode()
                if isinstance(value, str)
                else value
                if isinstance(value, bytes)
                else b"%d" % value
            )
            parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
        return b"".join(parts)


ACQUIRE = Script(ACQUIRE_SCRIPT, function=NAMES["acquire"])
# The same acquire, writing first where it is a function (where it is not: ACQUIRE_SCRIPT).
ACQUIRE_FIRST = Script(ACQUIRE_SCRIPT, function=NAMES["acquire_first"])
ACQUIRE_HASH = Script(ACQUIRE_HASH_SCRIPT)
RELEASE = Script(RELEASE_SCRIPT)
RELEASE_STRING = Script(RELEASE_STRING_SCRIPT, function=NAMES["release"])
EXTEND = Script(EXTEND_SCRIPT)
EXTEND_MANY = Script(EXTEND_MANY_SCRIPT)
CLAIM_NEXT = Script(CLAIM_NEXT_SCRIPT)
CLEAR_NEXT = Script(CLEAR_NEXT_SCRIPT)
OPERATOR_RELEASE = Script(OPERATOR_RELEASE_SCRIPT)
ACQUIRE_KEEPING = Script(ACQUIRE_KEEPING_SCRIPT)
RESTORE = Script(RESTORE_SCRIPT)


def as_text(value: bytes | str) -> str:
    """A reply's ``value`` as text: bytes decoded as UTF-8, any byte that is not UTF-8 written
    as a backslash escape (``b"a\\xff"`` is ``"a\\\\xff"``), so that another application's key
    or field is shown, never fails a listing; singletask's own are always UTF-8."""
    return value.decode(errors="backslashreplace") if isinstance(value, bytes) else value


# The held record's compact fields (see scripts.py): what an execution's metadata says that the
# lock key, the owner token or the fencing token already say is left out, and the rest is
# written under one-letter names, so that a held lock costs about a third less Redis memory
# (``bench/suites/layouts.py``). The encoding is lossless: a record reads back as exactly the
# metadata given. When the owner token is an execution's
# (``<task id>:<retries>:<host>:<pid>:<nonce>``), its task id and pid are the record's unless i
# or p says otherwise; the scope is "execution" unless s says otherwise; x lists the fields among
# these that the metadata did not have.
#
#   i  task_id, when it is not the token's       p  pid, when it is not the token's
#   s  scope, when not "execution": q (queue), c (coalesce), or = and the scope written out
#   x  the letters of i, p, s whose field the metadata does not have at all
#   w  hostname after "celery@" (Celery's default node names); h  any other hostname
#   n  task: the offset in the lock key where the task name stands (``<prefix><task>[:...]``),
#      when it stands there unescaped; t  the task name written out otherwise
#   a  since (``<seconds>.<milliseconds>``), as milliseconds before the fencing token's time
#      (``f``, server time in microseconds): written by the acquire script
#   _<name>  any other metadata field (since, when not spelled with milliseconds)
_SCOPES = {"queue": "q", "coalesce": "c"}
_SCOPE_NAMES = {code: name for name, code in _SCOPES.items()}
_NODE_PREFIX = "celery@"


def _token_parts(token: str) -> tuple[str, str] | None:
    """The task id and pid an execution's owner token starts and ends with (see tokens.py)."""
    parts = token.rsplit(":", 4)
    return (parts[0], parts[3]) if len(parts) == 5 else None


#: A character that a task name is escaped for in a key (see protocol/keys.py).
_ESCAPED = re.compile("[%:{}]")


@functools.lru_cache(maxsize=256)
def _unescaped(task: str) -> bool:
    """Whether a task name stands in a key as it is (a property of the name alone: kept for the
    few names a process locks)."""
    return _ESCAPED.search(task) is None


def _task_offset(key: str, task: str) -> int | None:
    """Where ``task`` stands in ``key`` followed by ``:`` or the end, if it does unescaped."""
    if not task or not _unescaped(task):
        return None
    start = key.find(task)
    while start != -1:
        end = start + len(task)
        if end == len(key) or key[end] == ":":
            return start
        start = key.find(task, start + 1)
    return None


def _millis(since: str) -> int | None:
    """``since`` (``1700000000.123``) as whole milliseconds, when that reads back the same:
    ASCII digits, a dot and three digits, no leading zero (but ``0.xxx``)."""
    whole, dot, frac = since.partition(".")
    if (
        dot
        and len(frac) == 3
        and since.isascii()
        and frac.isdigit()
        and whole.isdigit()
        and (whole[0] != "0" or whole == "0")
    ):
        return int(whole + frac)
    return None


def encode_meta(key: str, token: str, meta: Mapping[str, str]) -> tuple[str, list[str]]:
    """The held record's fields for ``meta``: the since in milliseconds (or '') for the acquire
    script, and the other fields as field, value, field, value, ..."""
    parts = _token_parts(token)
    task_id, pid = parts if parts is not None else (None, None)
    out: list[str] = []
    since = ""
    absent = "" if "scope" in meta else "s"
    if parts is not None:
        if "task_id" not in meta:
            absent += "i"
        if "pid" not in meta:
            absent += "p"
    for name, value in meta.items():
        if name == "task_id":
            if value != task_id:
                out += ("i", value)
        elif name == "pid":
            if value != pid:
                out += ("p", value)
        elif name == "scope":
            if value != "execution":
                out += ("s", _SCOPES.get(value, "=" + value))
        elif name == "hostname":
            if value.startswith(_NODE_PREFIX):
                out += ("w", value[len(_NODE_PREFIX) :])
            else:
                out += ("h", value)
        elif name == "task":
            offset = _task_offset(key, value)
            out += ("t", value) if offset is None else ("n", str(offset))
        elif name == "since" and (millis := _millis(value)) is not None:
            since = str(millis)
        else:
            out += ("_" + name, value)
    if absent:
        out += ("x", absent)
    return since, out


def _from_token(letter: str, token: str, fields: Mapping[str, str]) -> str | None:
    """The task id (``i``) or pid (``p``) of a compact record: its field, else the owner
    token's unless ``x`` says the metadata had none."""
    if letter in fields:
        return fields[letter]
    parts = _token_parts(token)
    if parts is None or letter in fields.get("x", ""):
        return None
    return parts[0 if letter == "i" else 1]


def _decode_meta(key: str, token: str, fields: Mapping[str, str]) -> dict[str, str]:
    """The metadata of a held record's compact fields (see :func:`encode_meta`)."""
    absent = fields.get("x", "")
    meta: dict[str, str] = {}
    for letter, name in (("i", "task_id"), ("p", "pid")):
        value = _from_token(letter, token, fields)
        if value is not None:
            meta[name] = value
    if "s" in fields:
        scope = fields["s"]
        meta["scope"] = scope[1:] if scope.startswith("=") else _SCOPE_NAMES.get(scope, scope)
    elif "s" not in absent:
        meta["scope"] = "execution"
    for name, value in fields.items():
        if name == "w":
            meta["hostname"] = _NODE_PREFIX + value
        elif name == "h":
            meta["hostname"] = value
        elif name == "n" and value.isdigit():
            meta["task"] = key[int(value) :].split(":", 1)[0]
        elif name == "t":
            meta["task"] = value
        elif name == "a" and "f" in fields:
            seconds, millis = divmod(int(fields["f"]) // 1000 - int(value), 1000)
            meta["since"] = f"{seconds}.{millis:03d}"
        elif name.startswith("_"):
            meta[name[1:]] = value
    return meta


#: Fields of a lock hash that are not metadata: the owner token, the fencing token (``f``, and
#: 0.1.0's ``fence``) and the carried completion marker.
_NOT_META = frozenset({"token", "f", "fence", "d"})


def holder_from_reply(key: str, fields: Mapping[Any, bytes | str], pttl: int) -> Holder | None:
    """The Holder of a lock hash's fields and PTTL; None for no lock (a released record, or a
    companion hash). Reads the compact record and 0.1.0's (long field names, ``fence``)."""
    if not fields or pttl == -2:
        return None
    record = {as_text(k): as_text(v) for k, v in fields.items()}
    token = record.get("token")
    if token is None:
        return None
    if "fence" in record:  # written by 0.1.0: its fields are the metadata as given
        fence: str | None = record["fence"]
        meta = {name: value for name, value in record.items() if name not in _NOT_META}
    else:
        fence = record.get("f")
        meta = _decode_meta(key, token, record)
    return Holder(
        token,
        meta.get("task_id"),
        pttl / 1000 if pttl >= 0 else None,
        meta,
        int(fence) if fence is not None else None,
    )


#: How near this host's present a holder's start must be for the record to say "the fence's
#: time" instead (ms): the start of an execution is read as it takes its lock.
_AT_TAKE_MS = 1000


def pack_fields(
    token: str, prefix: str, lease: int, since: str, fields: Sequence[str]
) -> str | None:
    """The lease (ms), ``since`` and ``fields`` (:func:`encode_meta`'s) as ACQUIRE_SCRIPT's
    ARGV[2], joined by NUL bytes (``lease NUL since NUL field NUL value ...``); ``since`` is
    ``=`` when it is this host's present (the holder starts as it takes the lock: the record
    then says the fence's time, by the server's clock, 12 bytes shorter); None when the token,
    the takeover prefix or a field holds a NUL byte itself (then ACQUIRE_HASH_SCRIPT takes them
    as they are)."""
    if since and abs(time.time() * 1000 - int(since)) < _AT_TAKE_MS:
        since = "="  # the holder starts as it takes the lock: the fence's time says when
    packed = "\0".join((str(lease), since, *fields))
    if "\0" in token or "\0" in prefix or packed.count("\0") != len(fields) + 1:
        return None
    return packed


def hash_args(args: Sequence[str | int | bytes]) -> tuple[str | int | bytes, ...]:
    """ACQUIRE_SCRIPT's arguments as ACQUIRE_HASH_SCRIPT's (token, lease, takeover prefix,
    since, field, value, ...), which the scripts of the replica wait take."""
    token, packed = args[0], str(args[1])
    prefix = args[2] if len(args) > 2 else ""
    lease, since, *fields = packed.split("\0")
    if since == "=":  # the fence's time: field a, ms before it, is 0
        since, fields = "", [*fields, "a", "0"]
    return (token, lease, prefix, since, *fields)


def _string_parts(value: bytes | str) -> list[str] | None:
    """A held string record's parts (scripts.py's ``STRING_RECORD``): token, fence, the time
    its lease runs from (µs, or '': the fence's), lease (ms), since (ms, '=': the fence's time,
    or ''), then the compact fields by pairs; None when ``value`` is not one (not
    singletask's)."""
    parts = as_text(value).split("\0")
    if len(parts) < 4 or len(parts) % 2 or not parts[0]:  # a NUL first: not a record
        return None
    fence, _, written = parts[1].partition("@")
    if not (fence.isdigit() and parts[2].isdigit() and (not written or written.isdigit())):
        return None
    if parts[3] and not (parts[3].isdigit() or parts[3] == "="):
        return None
    return [parts[0], fence, written, *parts[2:]]


def _lease_left(fence: str, written: str, lease: str) -> float:
    """What is left of a string record's lease, in seconds, by this host's clock: from the
    server's time the record's lease runs from (its ``@`` time, else its fence's) and the
    lease; never below 0 nor above the lease (a clock that differs from the server's by more
    than that says nothing of it)."""
    total = int(lease) / 1000
    left = int(written or fence) / 1e6 + total - time.time()
    return min(total, max(0.0, left))


def string_record(value: bytes | str) -> dict[str, str] | None:
    """The hash fields a held string record stands for (scripts.py's ``STRING_RECORD``, read
    by :func:`_string_parts`: token, fence, since, then the compact fields; ``a`` computed from
    since as the acquire script computes it), or None when ``value`` is not one (not
    singletask's)."""
    parts = _string_parts(value)
    if parts is None:
        return None
    token, fence, since, rest = parts[0], parts[1], parts[4], parts[5:]
    record = {"token": token, "f": fence}
    if since:
        record["a"] = "0" if since == "=" else str(int(fence) // 1000 - int(since))
    record.update(zip(rest[::2], rest[1::2], strict=True))
    return record


def holder_from_value(key: str, value: bytes | str, pttl: int) -> Holder | None:
    """The Holder of a held string record and its PTTL; None when the value is not one."""
    record = string_record(value)
    return None if record is None else holder_from_reply(key, record, pttl)


def read_record(key: str, value: Any, fields: Any, pttl: Any) -> Holder | None:
    """The Holder of a key read as GET, HGETALL and PTTL (``execute(raise_on_error=False)``:
    one of the first two fails with WRONGTYPE): a string record, or a hash. Raises the error
    of a key that is neither a hash nor a string record (not singletask's)."""
    if isinstance(pttl, Exception):
        raise pttl
    if isinstance(value, bytes | str):
        found = holder_from_value(key, value, int(pttl))
        if found is not None:
            return found
    if isinstance(fields, Exception):
        raise fields
    return holder_from_reply(key, fields, int(pttl))


def string_conflict(value: bytes | str) -> Holder | None:
    """The Holder of ACQUIRE_SCRIPT's refusal by a string record (brief, as
    :func:`conflict_holder`'s), its lease left read from the record (:func:`_lease_left`);
    None when the key holds a string that is not a lock. Reads only what a refusal needs (the
    token, the fence, the lease, the task id): this is every refused duplicate's path."""
    parts = _string_parts(value)
    if parts is None:
        return None
    token, fence, written, lease = parts[0], parts[1], parts[2], parts[3]
    fields = dict(zip(parts[5::2], parts[6::2], strict=True)) if len(parts) > 5 else {}
    left = _lease_left(fence, written, lease)
    return Holder(token, _from_token("i", token, fields), left, {}, int(fence))


#: What the server says of a command on a key of another type (a string record's refusal by a
#: string that is not a lock is reported so as well).
WRONGTYPE = "WRONGTYPE Operation against a key holding the wrong kind of value"


def _conflict_task_id(token: str, old: Any, compact: Any, absent: Any) -> str | None:
    """The holder's task id in an acquire's conflict reply: 0.1.0's task_id field, or the
    compact record's (its i and x fields, see :func:`_from_token`)."""
    if old is not None:
        return as_text(old)
    fields = {name: as_text(v) for name, v in (("i", compact), ("x", absent)) if v is not None}
    return _from_token("i", token, fields)


def conflict_holder(
    raw_token: bytes | str, old: Any, compact: Any, absent: Any, pttl: int, fence: Any
) -> Holder:
    """The Holder of an acquire's conflict reply (token, its 0.1.0 task_id field, its i and x
    fields, lease left in ms, fence): brief, without the metadata."""
    token = as_text(raw_token)
    return Holder(
        token,
        _conflict_task_id(token, old, compact, absent),
        pttl / 1000 if pttl >= 0 else None,
        {},
        int(fence) if fence is not None else None,
    )


def removed_holder(key: str, reply: Sequence[Any]) -> Holder | None:
    """The Holder of an OPERATOR_RELEASE_SCRIPT reply, or None when it removed nothing."""
    if not reply:
        return None
    pttl, flat = int(reply[0]), reply[1:]
    return holder_from_reply(key, dict(zip(flat[::2], flat[1::2], strict=True)), pttl)


def glob_escape(text: str) -> str:
    """``text`` with the glob characters of SCAN MATCH escaped, to match it literally."""
    return "".join("\\" + char if char in "*?[]\\" else char for char in text)


#: The error codes of a reply saying the server did not run the command because it cannot take
#: writes now: a primary demoted by a failover (READONLY: the name or address that used to lead
#: to the primary now leads to a replica), a server loading its data set (LOADING), a replica
#: whose primary is down (MASTERDOWN), a cluster that is down or a slot being migrated
#: (CLUSTERDOWN, TRYAGAIN). Nothing was written: every script fails at its first write.
NOT_RUN_CODES = ("READONLY", "LOADING", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN")

_NOT_RUN_TYPES = (
    redis.exceptions.ReadOnlyError,
    redis.exceptions.BusyLoadingError,
    redis.exceptions.ClusterDownError,  # and MasterDownError, its subclass
    redis.exceptions.TryAgainError,
)


#: The reply of a replica to the replica wait's ``WAIT``: the connection leads to a demoted
#: master, where the acquire script before it could not write (a write gets READONLY).
_WAIT_ON_A_REPLICA = "WAIT cannot be used with replica instances"


def not_run(exc: BaseException) -> bool:
    """Whether ``exc`` is a reply of :data:`NOT_RUN_CODES`: by its class, or by its text (a
    redis-py that does not map the code, or a server that wraps a script's error in ``ERR``);
    or a replica's refusal of ``WAIT``."""
    if isinstance(exc, _NOT_RUN_TYPES):
        return True
    if not isinstance(exc, redis.exceptions.ResponseError):
        return False
    text = str(exc)
    return text.startswith((*NOT_RUN_CODES, _WAIT_ON_A_REPLICA)) or any(
        f"-{code} " in text for code in NOT_RUN_CODES
    )


def drop_idle(client: Any) -> None:
    """Close the idle connections of a client's pool (after a :func:`not_run` reply: they may
    all lead to a demoted primary); those in use are closed by their users' next errors."""
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        with contextlib.suppress(Exception):
            pool.disconnect(inuse_connections=False)


def driver_error(exc: BaseException, where: str) -> BackendError:
    """singletask's error for redis-py's ``exc``, its message starting with ``where``.

    A timeout is :class:`BackendTimeout` (the command may have run); a lost connection and a
    reply of :data:`NOT_RUN_CODES` (the command did not run: the server cannot take writes now)
    are :class:`BackendUnavailable`, so the task's store-error policy applies; any other reply
    is a :class:`BackendError` that says what to look at.
    """
    if isinstance(exc, redis.exceptions.TimeoutError):
        return BackendTimeout(f"{where} timed out: {exc}")
    if not_run(exc):
        return BackendUnavailable(
            f"{where} failed: the server cannot take writes now (a failover, a restart or a "
            f"slot migration in progress); the connection was dropped and the next call "
            f"connects again: {exc}"
        )
    if isinstance(exc, redis.exceptions.ConnectionError):
        return BackendUnavailable(f"{where} failed: {exc}")
    if "WRONGTYPE" in str(exc):  # also within a script's error, as some servers word it
        return BackendError(
            f"{where} failed: the key holds a value that is not a singletask lock (another "
            f"application's key? give singletask a key prefix of its own): {exc}"
        )
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return BackendError(
            f"{where} failed: the server's ACL does not let this user run a command the lock "
            f"store needs (scripts, and for listings SCAN, GET, HGETALL and PTTL): {exc}"
        )
    return BackendError(f"{where} failed: {exc}")
