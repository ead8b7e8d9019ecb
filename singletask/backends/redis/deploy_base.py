"""What the Sentinel and Cluster backends (:mod:`~singletask.backends.redis.deploy`) share:
their transport options, the errors of a topology change, and the opt-in replica wait
(``wait_replicas``, ``wait_timeout``: see :class:`~singletask.backends.redis.options.ReplicaWait`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import redis

from ...exceptions import BackendError, BackendUnavailable, ConfigurationError
from .options import (
    RETENTION_OPTIONS,
    SOCKET_OPTIONS,
    TLS_OPTIONS,
    ReplicaWait,
    check_keys,
    mask,
    retentions,
    socket_options,
    tls_options,
)
from .rates import _ACQUIRE_SLOT_RATED, _ACQUIRE_SLOT_RATED_KEEPING
from .slots import _ACQUIRE_SLOT, _ACQUIRE_SLOT_KEEPING
from .store import _DRIVER_ERRORS, FENCE_RETENTION, MARKER_RETENTION, RedisBackend
from .wire import _ACQUIRE, _ACQUIRE_KEEPING, _RESTORE, _Script, drop_idle, not_run

__all__ = ["QUERY_OPTIONS"]

#: The acquire scripts the replica wait runs instead (they also return what the key was before).
_KEEPING = {
    _ACQUIRE: _ACQUIRE_KEEPING,
    _ACQUIRE_SLOT: _ACQUIRE_SLOT_KEEPING,
    _ACQUIRE_SLOT_RATED: _ACQUIRE_SLOT_RATED_KEEPING,
}

#: Options a URL's query string may carry (the transport options may carry them too).
QUERY_OPTIONS = frozenset({*TLS_OPTIONS, *SOCKET_OPTIONS})

#: Errors of a topology change in progress (failover, resharding): reported as unavailable.
_TRANSIENT = (
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.ClusterError,
    redis.exceptions.ReadOnlyError,
)


class _Deployed(RedisBackend):
    """What Sentinel and Cluster share: transport options and the replica wait."""

    #: Transport options this kind of deployment takes besides TLS, sockets and the wait.
    EXTRA_OPTIONS: frozenset[str] = frozenset()

    def __init__(
        self,
        *,
        url: str,
        transport_options: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> None:
        self._transport = dict(transport_options or {})
        where = f"setting singletask_backend_transport_options for {mask(url)!r}"
        allowed = {*QUERY_OPTIONS, *ReplicaWait.OPTIONS, *RETENTION_OPTIONS, *self.EXTRA_OPTIONS}
        check_keys(self._transport, allowed, where)
        self._wait = ReplicaWait.from_options(self._transport, where)
        fence, marker = retentions(self._transport, where, (FENCE_RETENTION, MARKER_RETENTION))
        options.setdefault("fence_retention", fence)
        options.setdefault("marker_retention", marker)
        super().__init__(url=url, **options)
        # Through the client's methods: its pool asks the sentinels where the master is (a
        # bare connection would not), and a cluster client routes each key to its node.
        self._own_connections = False
        timeout = {**self._options, **self._target(url)[1]}.get("socket_timeout")
        if self._wait is not None and timeout is not None and self._wait.timeout >= timeout:
            # WAIT answers after up to wait_timeout: the read would time out first, leaving an
            # acquisition whose outcome is unknown.
            raise ConfigurationError(
                f"{where}: option wait_timeout ({self._wait.timeout}s) must be less than "
                f"socket_timeout ({timeout}s)"
            )

    @classmethod
    def from_url(
        cls, url: str, *, transport_options: Mapping[str, Any] | None = None, **options: Any
    ) -> RedisBackend:
        return cls(url=url, transport_options=transport_options, **options)

    @classmethod
    def check_url(cls, url: str) -> None:
        """Nothing without the transport options: the URL is checked with them, when the
        backend is built (see :meth:`_check_url`)."""

    def _check_url(self, url: str) -> None:
        self._target(url)

    def _target(self, url: str) -> tuple[list[Any], dict[str, Any]]:
        """The nodes to connect to, and the client options (checked)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {mask(self._url or '')}>"

    def _error(self, exc: Exception, operation: str, key: str) -> BackendError:
        """As for one server; besides, what a topology change answers for a moment (the
        cluster down, a slot being migrated: TRYAGAIN) means the store is unavailable."""
        cause = exc.__cause__
        if isinstance(exc, redis.exceptions.RedisClusterException) and isinstance(
            cause, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError
        ):
            # No node could be reached ("Redis Cluster cannot be connected"): as its cause.
            return super()._error(cause, operation, key)
        if isinstance(exc, _TRANSIENT):
            return BackendUnavailable(
                f"{self!r}: {operation} {key!r} failed while the deployment changes "
                f"(failover or slot migration): {exc}"
            )
        return super()._error(exc, operation, key)

    def _tls_and_sockets(self, query: Mapping[str, str], where: str) -> dict[str, Any]:
        """Client options from the transport options overridden by the URL query."""
        merged = {**self._transport, **query}
        return {**tls_options(merged, where), **socket_options(merged, where)}

    def _call(
        self,
        operation: str,
        script: _Script,
        keys: Sequence[str],
        args: Sequence[str | int | bytes],
    ) -> Any:
        wait = self._wait
        keeping = _KEEPING.get(script)
        if wait is None or keeping is None:
            return super()._call(operation, script, keys, args)
        try:
            reply, acks = self._acquire_and_wait(keeping, keys, args, wait)
        except _DRIVER_ERRORS as exc:
            if not_run(exc):
                # The pipeline's connection went back to the pool, still to the demoted
                # master: close the idle ones, so that the next call asks where the master is.
                drop_idle(self.client)
            raise self._error(exc, operation, keys[0]) from exc
        if reply[0] != 1:
            return reply
        if acks >= wait.replicas:
            return reply[:-1]
        # Not on enough replicas: a failover now could lose it. Put the key back as it was
        # before (free, a released record, a queue reservation this acquisition took over, the
        # caller's own earlier acquisition), if it is still this acquisition's; best effort: if
        # that fails too, the acquisition ends with its lease. The caller's store-error policy
        # then decides.
        # The keeping scripts add what the key was before last; a slot's reply names the slot.
        # A rated acquisition's start stays spent: only the slot is put back.
        fence, before = reply[1], reply[-1]
        taken = keys[int(reply[3])] if script is not _ACQUIRE else keys[0]
        try:
            undone = super()._call("acquire", _RESTORE, (taken,), (args[0], fence, *before))
            outcome = "the key was put back as it was" if undone else "the key has changed since"
        except BackendError as exc:
            outcome = f"putting the key back failed too, so it is held until its lease ends ({exc})"
        raise BackendUnavailable(
            f"{self!r}: acquire {taken!r}: only {acks} of {wait.replicas} replica(s) "
            f"confirmed the lock within {wait.timeout}s (wait_replicas); {outcome}"
        )

    def _acquire_and_wait(
        self,
        script: _Script,
        keys: Sequence[str],
        args: Sequence[str | int | bytes],
        wait: ReplicaWait,
    ) -> tuple[Any, int]:
        """Run the acquire script then WAIT on one connection, pipelined: one round trip."""
        client: Any = self.client
        for _ in range(2):
            with client.pipeline(transaction=False) as pipe:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
                pipe.execute_command(*wait.command)
                reply, acks = pipe.execute(raise_on_error=False)
            if isinstance(reply, redis.exceptions.NoScriptError):
                client.script_load(script.text)
                continue
            return _raised(reply), _raised(acks)
        raise redis.exceptions.NoScriptError("the acquire script is not cached after loading")


def _raised(value: Any) -> Any:
    """``value``, or raise it when a pipeline returned an error in its place."""
    if isinstance(value, Exception):
        raise value
    return value
