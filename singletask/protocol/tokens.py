"""Owner tokens: which execution holds a lock, and whether its process still exists.

An execution's token is ``<task id>:<retries>:<host id>:<pid>:<nonce>``: the task id lets the
worker's main process act for a pool process that cannot, ``retries`` tells the attempts of one
message apart (a redelivered copy has the same, the body's own retry the next), and host id plus
pid let a process on the same host tell whether the holder is still alive. A lock reserved for an
attempt that has not started yet (sent with ``lock_scope`` "queue", or left by a body retry) has
the token ``<task id>:<retries>:-:0:reserved``; a direct call's token is ``direct:<nonce>``.
"""

from __future__ import annotations

import binascii
import functools
import hashlib
import math
import os
import random
import secrets
import time
from pathlib import Path
from typing import Final

__all__ = [
    "ALIVE_FOR",
    "direct_token",
    "execution_token",
    "holder_gone",
    "host_id",
    "parse_token",
    "process_state",
    "reservation_token",
    "this_pid",
    "this_pid_text",
]

#: How long, in seconds, a holder's process found alive is taken to be alive by
#: :func:`holder_gone` before the kernel is asked again: a burst of refused duplicates costs
#: no system call, and a holder that dies is still found gone this much later at most.
ALIVE_FOR: Final = 1.0

#: This process's pid, read again in a forked child (``os.getpid()`` is a system call).
_pid = os.getpid()

#: owner token -> ``time.monotonic()`` until which :func:`holder_gone` takes its process not to
#: be gone: for a while if found alive, for good if it is not another process of this host.
_not_gone_until: dict[str, float] = {}

#: ``<host id>:<pid>:``, the part of this process's tokens before the nonce (once per process).
_tail = ""

#: This process's pid as text (once per process).
_pid_text = ""


def _forked() -> None:
    global _pid, _tail, _pid_text
    _pid = os.getpid()
    _tail = _pid_text = ""
    _not_gone_until.clear()


os.register_at_fork(after_in_child=_forked)


def this_pid() -> int:
    """This process's pid, without a system call (kept up to date across ``fork()``)."""
    return _pid


def this_pid_text() -> str:
    """:func:`this_pid` as text (the ``pid`` of a lock's metadata), made once per process."""
    global _pid_text
    if not _pid_text:
        _pid_text = str(_pid)
    return _pid_text


def execution_token(task_id: str, retries: int) -> str:
    """A new owner token for attempt ``retries`` of message ``task_id``, in this process.

    The nonce tells apart two executions of one attempt in one process (a redelivered copy);
    it needs to be unique, not secret, so it comes from :mod:`random` (reseeded in every forked
    child) rather than from a system call. Host id and nonce are written in unpadded base64url
    (8 and 6 characters for 48 and 32 bits), so that a token with a UUID task id stays within
    64 bytes: Redis keeps a hash whose values are all that short in its compact encoding, which
    about halves the memory of a lock's hash (see ``bench/suites/layouts.py``).
    """
    global _tail
    if not _tail:
        _tail = f"{host_id()}:{_pid}:"
    return f"{task_id}:{retries}:{_tail}{_b64(random.getrandbits(32).to_bytes(4, 'big'))}"


def _b64(data: bytes) -> str:
    """``data`` in unpadded base64url: letters, digits, ``-`` and ``_``, never ``:``."""
    return binascii.b2a_base64(data, newline=False).rstrip(b"=").translate(_URLSAFE).decode()


#: base64 to base64url.
_URLSAFE: Final = bytes.maketrans(b"+/", b"-_")


def direct_token() -> str:
    """A new owner token for a direct call ``task(...)``, which has no task id."""
    return f"direct:{secrets.token_hex(8)}"


@functools.cache
def host_id() -> str:
    """Who "this host" is for pid liveness checks: boot id and pid namespace, or "-" if unknown.

    Two processes see each other's pids only on the same kernel boot and in the same pid
    namespace (containers on one host share the boot id but not the namespace).
    """
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return "-"
    return _b64(hashlib.sha256(f"{boot}|{namespace}".encode()).digest()[:6])


def reservation_token(task_id: str, retries: int) -> str:
    """The owner token of a lock reserved for attempt ``retries`` of message ``task_id``."""
    return f"{task_id}:{retries}:-:0:reserved"


def parse_token(token: str) -> tuple[str, int, str, int] | None:
    """``(task id, retries, host id, pid)`` of an execution's owner token, or None."""
    parts = token.rsplit(":", 4)
    if len(parts) != 5:
        return None
    try:
        return parts[0], int(parts[1]), parts[2], int(parts[3])
    except ValueError:
        return None


def process_state(token: str) -> str:
    """``"gone"``, ``"alive"`` or ``"unknown"``: the state of the process an owner token names.

    Known only for processes of this host (same boot and pid namespace); a zombie counts as gone.
    """
    parsed = parse_token(token)
    if parsed is None or parsed[2] == "-" or parsed[2] != host_id():
        return "unknown"
    pid = parsed[3]
    if pid == _pid:
        return "alive"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "gone"
    except OSError:
        return "unknown"
    try:  # a killed pool process may linger as a zombie until the worker reaps it
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "alive"
    return "gone" if state in ("Z", "X") else "alive"


def holder_gone(token: str) -> bool:
    """Whether the process an owner token names, on this host, is gone (:func:`process_state`),
    asking the kernel at most once per :data:`ALIVE_FOR` seconds about a process found alive:
    what a refused execution checks of its key's holder."""
    now = time.monotonic()
    if _not_gone_until.get(token, 0.0) > now:
        return False  # the common case: the holder of the last refusals, alive
    parsed = parse_token(token)
    if parsed is None or parsed[2] == "-" or parsed[2] != host_id() or parsed[3] == _pid:
        _not_gone(token, math.inf)  # not another process of this host: never gone
        return False
    state = process_state(token)
    if state == "alive":
        _not_gone(token, now + ALIVE_FOR)
    return state == "gone"


def _not_gone(token: str, until: float) -> None:
    if len(_not_gone_until) >= 4096:  # many holders seen: forget them all, ask again
        _not_gone_until.clear()
    _not_gone_until[token] = until
