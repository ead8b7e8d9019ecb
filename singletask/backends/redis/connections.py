"""The connections a URL-built :class:`~singletask.backends.redis.RedisBackend` keeps itself:
sending a script on one (:func:`send`), closing the ones that failed (:func:`drop`)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, cast

import redis

from .wire import Connection, Script, not_run

__all__ = ["drop", "send"]


def send(
    idle: list[Connection],
    client: redis.Redis,
    script: Script,
    keys: Sequence[str],
    args: Sequence[str | int | bytes],
) -> Any:
    """Run ``script`` on one of a backend's own connections (``idle``: those idle now).

    A connection serves one call at a time: it is taken from the idle list (or made with the
    client's connection settings) and put back once the reply is read. One that fails, or
    whose reply says the server did not run the script and cannot take writes now
    (:data:`~.wire.NOT_RUN_CODES`: a failover moved the primary away from the address the
    connection was made to), is closed; if it had been idle, the others may be stale as well
    (a server restart drops them all, a failover leaves them on the demoted primary), so
    they are closed too and the call is made once more, on a new connection. That retry is
    safe: the script did not run (or its connection was found broken before its reply came,
    as before sending). A new connection that fails is not tried again here: connecting
    already retries as the client's ``retry`` says, a timeout is never retried (the script
    may have run), and a new connection that gets one of those replies raises
    :class:`~singletask.exceptions.BackendUnavailable` (the next call connects again).
    """
    while True:
        try:
            connection, fresh = idle.pop(), False
        except IndexError:
            pool = client.connection_pool
            connection = cast(Connection, pool.connection_class(**pool.connection_kwargs))
            fresh = True
        try:
            connection.send_packed_command([script.command(keys, args)])
            try:
                reply = connection.read_response()
            except redis.exceptions.NoScriptError:
                # The server's script cache was emptied (a restart, SCRIPT FLUSH): sending
                # the text runs the script and caches it again.
                connection.send_packed_command([script.command(keys, args, text=True)])
                reply = connection.read_response()
        except redis.exceptions.ResponseError as exc:
            if not not_run(exc):
                idle.append(connection)  # the reply was read: the connection is sound
                raise
            drop(idle, connection, fresh)
            if fresh:
                raise
            continue
        except redis.exceptions.ConnectionError:
            drop(idle, connection, fresh)
            if fresh:
                raise
            continue
        except BaseException:
            connection.disconnect()  # a reply may still be on its way: never reuse it
            raise
        idle.append(connection)
        return reply


def drop(idle: list[Connection], connection: Connection, fresh: bool) -> None:
    """Close ``connection``, which failed; and every idle one too, if it had been idle."""
    connection.disconnect()
    if fresh:
        return
    while idle:
        with contextlib.suppress(IndexError):
            idle.pop().disconnect()
