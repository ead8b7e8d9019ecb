"""The connections a URL-built :class:`~singletask.backends.redis.RedisBackend` keeps itself:
sending a script or function on one (:func:`send`), closing the ones that failed
(:func:`drop`); and a function called through a redis-py client (:func:`call_function`)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, cast

import redis
from redis.cluster import RedisCluster

from .functions import LIBRARY, FunctionLoadError, missing
from .wire import Connection, Script, not_run

__all__ = ["call_function", "drop", "send"]

#: FUNCTION LOAD REPLACE of the library, RESP-encoded.
_LOAD = b"*4\r\n" + b"".join(
    b"$%d\r\n%s\r\n" % (len(part), part)
    for part in (b"FUNCTION", b"LOAD", b"REPLACE", LIBRARY.encode())
)


def send(
    idle: list[Connection],
    client: redis.Redis,
    script: Script,
    keys: Sequence[str],
    args: Sequence[str | int | bytes],
    *,
    fcall: bool = False,
) -> Any:
    """Run ``script`` on one of a backend's own connections (``idle``: those idle now); with
    ``fcall``, as its function (:mod:`~singletask.backends.redis.functions`): a server that
    does not have the library gets it, and the call is made again (it did not run).

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
            command = script.command(keys, args, fcall=fcall)
            connection.send_packed_command([command])
            try:
                reply = connection.read_response()
            except redis.exceptions.NoScriptError:
                # The server's script cache was emptied (a restart, SCRIPT FLUSH): sending
                # the text runs the script and caches it again.
                connection.send_packed_command([script.command(keys, args, text=True)])
                reply = connection.read_response()
            except redis.exceptions.ResponseError as exc:
                if not (fcall and missing(exc)):
                    raise
                connection.send_packed_command([_LOAD])
                try:
                    connection.read_response()
                except redis.exceptions.ResponseError as refused:
                    raise FunctionLoadError(str(refused)) from refused
                connection.send_packed_command([command])
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


def call_function(
    client: redis.Redis, script: Script, keys: Sequence[str], args: Sequence[str | int | bytes]
) -> Any:
    """Call ``script``'s function through ``client`` (a ready client, Sentinel's, a Cluster's,
    which routes it by its key); a server that does not have the library gets it (on a Cluster,
    the primary of the key and every other that answers), and the call is made again (it did
    not run)."""
    assert script.function is not None
    try:
        return client.fcall(script.function, len(keys), *keys, *args)
    except redis.exceptions.ResponseError as exc:
        if not missing(exc):
            raise
    try:
        if isinstance(client, RedisCluster):
            _load_on_primaries(client, keys[0])
        else:
            client.function_load(LIBRARY, replace=True)
    except redis.exceptions.ResponseError as refused:
        raise FunctionLoadError(str(refused)) from refused
    return client.fcall(script.function, len(keys), *keys, *args)


def _load_on_primaries(cluster: Any, key: str) -> None:
    """Load the library on the primary of ``key`` (its errors raised), then on every other
    primary that can be reached: a slot being migrated is served by two, and one that cannot be
    reached (a killed master, until its replica is promoted) is left to its own keys' calls."""
    first = cluster.get_node_from_key(key)
    cluster.execute_command("FUNCTION LOAD", "REPLACE", LIBRARY, target_nodes=first)
    for node in cluster.get_primaries():
        if node.name == first.name:
            continue
        try:
            cluster.execute_command("FUNCTION LOAD", "REPLACE", LIBRARY, target_nodes=node)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            continue
