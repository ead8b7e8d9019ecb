"""The plain lock's two calls as Redis functions (Redis 7 and later): what every execution and
every refused duplicate sends.

A function costs the server less than the same script run by ``EVALSHA`` (about 2,000
instructions a call: no digest to look up, no script environment to set up; ``python -m bench
cost``), so on a server that has functions the plain acquire (reading the key first,
:data:`~singletask.backends.redis.lock_scripts.ACQUIRE_FUNCTION_BODY`, or writing first,
:data:`~singletask.backends.redis.lock_scripts.ACQUIRE_FIRST_BODY`) and the release that keeps
nothing (:data:`~singletask.backends.redis.lock_scripts.RELEASE_STRING_SCRIPT`) are called with
``FCALL``; every other script stays a script. Their library, :data:`LIBRARY`, is named
after a digest of its code (``singletask_<12 hex digits>``), as are its functions, so that two
versions of singletask on one server never call each other's code; it is loaded with
``FUNCTION LOAD REPLACE`` by the first call that finds it missing (:func:`missing`), then
called again: the call did not run. Redis keeps a library across restarts (in its RDB and AOF
files) and copies it to its replicas; a Cluster client loads it on every primary that answers.

A server without functions (Redis 6 and earlier: ``unknown command``), a user whose ACL does
not allow ``FCALL`` or ``FUNCTION LOAD``, or a load that fails (:func:`unavailable`) makes the
backend call the scripts instead, for the rest of its process.
"""

from __future__ import annotations

import hashlib

import redis

from .lock_scripts import ACQUIRE_FIRST_BODY, ACQUIRE_FUNCTION_BODY, RELEASE_STRING_SCRIPT

__all__ = ["LIBRARY", "LIBRARY_NAME", "NAMES", "FunctionLoadError", "missing", "unavailable"]

#: Each function's body (KEYS and ARGV its parameters), by its short name.
_BODIES = {
    "acquire": ACQUIRE_FUNCTION_BODY,
    "acquire_first": ACQUIRE_FIRST_BODY,
    "release": RELEASE_STRING_SCRIPT,
}

_DIGEST = hashlib.sha1(
    "\0".join(f"{name}\0{body}" for name, body in _BODIES.items()).encode(),
    usedforsecurity=False,
).hexdigest()[:12]

#: The library's name on the server.
LIBRARY_NAME = f"singletask_{_DIGEST}"

#: Each function's name on the server, by its short name (``acquire``, ``acquire_first``,
#: ``release``).
NAMES = {name: f"{LIBRARY_NAME}_{name}" for name in _BODIES}

#: The library's code, as ``FUNCTION LOAD`` takes it.
LIBRARY = f"#!lua name={LIBRARY_NAME}\n" + "".join(
    f"redis.register_function('{NAMES[name]}', function(KEYS, ARGV)\n{body}\nend)\n"
    for name, body in _BODIES.items()
)


class FunctionLoadError(redis.exceptions.ResponseError):
    """The server refused ``FUNCTION LOAD`` of :data:`LIBRARY` (its message is the server's)."""


def missing(exc: BaseException) -> bool:
    """Whether ``exc`` is the server's reply to an ``FCALL`` of a function it does not have (a
    new server, ``FUNCTION FLUSH``, a Cluster node that has not had it yet)."""
    return isinstance(exc, redis.exceptions.ResponseError) and str(exc).startswith(
        "Function not found"
    )


def unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says that functions cannot be used on this server: no ``FCALL`` or
    ``FUNCTION`` command, not allowed by the user's ACL, or the library not loaded."""
    if isinstance(exc, FunctionLoadError | redis.exceptions.NoPermissionError):
        return True
    if "doesn't exist in Redis commands" in str(exc):  # a cluster client's own lookup of
        return True  # FCALL's keys, on a server without it
    return isinstance(exc, redis.exceptions.ResponseError) and str(exc).lower().startswith(
        "unknown command"
    )
