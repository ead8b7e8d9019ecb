"""Redis beyond one server: Sentinel (automatic failover) and Cluster (sharding), TLS on both.

URLs, with the options of ``singletask_backend_transport_options`` beside them:

* ``sentinel://[[user]:password@]host:port[/db];sentinel://host2:port;...`` — the sentinels to
  ask for the master; credentials and database come from the first URL and are the master's.
  Transport options: ``master_name`` (required), ``sentinel_kwargs`` (options of the
  connections to the sentinels themselves: their password, TLS), ``min_other_sentinels``; TLS to
  the master with ``ssl: True`` or any ``ssl_*`` option.
* ``redis+cluster://[[user]:password@]host:port[,host2:port...][/0]`` and
  ``rediss+cluster://...`` (TLS) — any one reachable node; the client discovers the rest.
  Transport option ``dynamic_startup_nodes`` (default True: use the addresses the cluster
  announces; False behind a DNS name or proxy that must stay the entry point).

Both take the TLS (``ssl_cert_reqs``, ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``,
``ssl_check_hostname``) and socket options in the URL query or the transport options, and the
opt-in replica wait (``wait_replicas``, ``wait_timeout``: see :class:`ReplicaWait`).

Acquire, release and renewal touch the lock key alone, and the coalesce follow-up claim and
debounce window their companion record, which hashes to the lock key's slot (see
:mod:`~singletask.backends.redis.rates`), so every script touches one slot; a holder-slot
acquisition touches the key's slots (and its rate record, with ``lock_rate``), which share it.
A take of named limits touches the keys of every limit it names (:mod:`.units`), which must
share one slot: the Cluster store refuses limits of several slots before it sends anything
(:meth:`~singletask.backends.redis.RedisBackend.check_units_together`). The replica wait is
for lock acquisitions only: a take of named limits does not wait for replicas.
Redirections and failovers are the cluster client's to follow; what it cannot follow surfaces
as :class:`~singletask.exceptions.BackendUnavailable`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast
from urllib.parse import SplitResult, urlsplit

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.sentinel import Sentinel

from ...exceptions import BackendError, BackendUnavailable, ConfigurationError, LockKeyError
from ...protocol.slots import base_key
from ..base import Holder, StoreState
from .bookkeeping import scan_state
from .lock_scripts import HOLDER_SCRIPT
from .options import (
    RECORD_OPTION,
    RETENTION_OPTIONS,
    SOCKET_OPTIONS,
    TLS_OPTIONS,
    ReplicaWait,
    check_keys,
    mask,
    record_layout,
    retentions,
    socket_options,
    tls_options,
    to_bool,
    url_address,
    url_credentials,
    url_db,
    url_query,
)
from .rates import ACQUIRE_SLOT_RATED, ACQUIRE_SLOT_RATED_KEEPING
from .replaced import PREEMPT, PREEMPT_KEEPING, PREEMPT_SLOT, PREEMPT_SLOT_KEEPING
from .slots import ACQUIRE_SLOT, ACQUIRE_SLOT_KEEPING, listed, scan_pattern
from .store import DRIVER_ERRORS, FENCE_RETENTION, MARKER_RETENTION, RedisBackend
from .wire import (
    ACQUIRE,
    ACQUIRE_FIRST,
    ACQUIRE_HASH,
    ACQUIRE_KEEPING,
    RESTORE,
    WRONGTYPE,
    Script,
    as_text,
    drop_idle,
    hash_args,
    holder_from_reply,
    holder_from_value,
    not_run,
)

__all__ = ["QUERY_OPTIONS", "RedisClusterBackend", "RedisSentinelBackend"]

#: How many redirections one replica-waiting cluster acquisition follows before giving up.
MAX_REDIRECTS = 5

#: The acquire scripts the replica wait runs instead (they also return what the key was before).
_KEEPING = {
    ACQUIRE: ACQUIRE_KEEPING,
    ACQUIRE_FIRST: ACQUIRE_KEEPING,
    ACQUIRE_HASH: ACQUIRE_KEEPING,
    ACQUIRE_SLOT: ACQUIRE_SLOT_KEEPING,
    ACQUIRE_SLOT_RATED: ACQUIRE_SLOT_RATED_KEEPING,
    PREEMPT: PREEMPT_KEEPING,
    PREEMPT_SLOT: PREEMPT_SLOT_KEEPING,
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
        allowed = {
            *QUERY_OPTIONS,
            *ReplicaWait.OPTIONS,
            *RETENTION_OPTIONS,
            RECORD_OPTION,
            *self.EXTRA_OPTIONS,
        }
        check_keys(self._transport, allowed, where)
        self._wait = ReplicaWait.from_options(self._transport, where)
        fence, marker = retentions(self._transport, where, (FENCE_RETENTION, MARKER_RETENTION))
        options.setdefault("fence_retention", fence)
        options.setdefault("marker_retention", marker)
        options.setdefault("lock_record", record_layout(self._transport, where))
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

    def _units_with_lock(self) -> bool:
        return self._wait is None and super()._units_with_lock()

    def _call(
        self,
        operation: str,
        script: Script,
        keys: Sequence[str],
        args: Sequence[str | int | bytes],
    ) -> Any:
        wait = self._wait
        keeping = _KEEPING.get(script)
        if wait is None or keeping is None:
            return super()._call(operation, script, keys, args)
        if script in (ACQUIRE, ACQUIRE_FIRST):  # the keeping script: a field per argument
            args = hash_args(args)
        try:
            reply, acks = self._acquire_and_wait(keeping, keys, args, wait)
        except DRIVER_ERRORS as exc:
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
        plain = (ACQUIRE, ACQUIRE_FIRST, ACQUIRE_HASH, PREEMPT)
        taken = keys[int(reply[3])] if script not in plain else keys[0]
        try:
            undone = super()._call("acquire", RESTORE, (taken,), (args[0], fence, *before))
            outcome = "the key was put back as it was" if undone else "the key has changed since"
        except BackendError as exc:
            outcome = f"putting the key back failed too, so it is held until its lease ends ({exc})"
        raise BackendUnavailable(
            f"{self!r}: acquire {taken!r}: only {acks} of {wait.replicas} replica(s) "
            f"confirmed the lock within {wait.timeout}s (wait_replicas); {outcome}"
        )

    def _acquire_and_wait(
        self,
        script: Script,
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


class RedisSentinelBackend(_Deployed):
    """Locks on the master a set of Redis Sentinels names; follows failovers.

    Each new connection asks the sentinels where the master is. A connection to a master that
    has been demoted gets READONLY, is dropped, and the call is made again on a new connection
    to the new master. While no master is known the calls raise
    :class:`~singletask.exceptions.BackendUnavailable`.
    """

    EXTRA_OPTIONS = frozenset({"master_name", "sentinel_kwargs", "min_other_sentinels", "ssl"})

    def _target(self, url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
        """The sentinel addresses, and the master's connection options (checked)."""
        where = f"{mask(url)!r}"
        nodes: list[tuple[str, int]] = []
        first: SplitResult | None = None
        for chunk in filter(None, (part.strip() for part in url.split(";"))):
            parts = urlsplit(chunk)
            if parts.scheme.lower() != "sentinel":
                raise ConfigurationError(
                    f"{where}: every URL must be sentinel://, got {mask(chunk)!r}"
                )
            first = first or parts
            nodes.append(url_address(parts.netloc.rpartition("@")[2], 26379, where))
        if first is None:
            raise ConfigurationError(f"{where}: no sentinel address")
        name = self._transport.get("master_name")
        if not isinstance(name, str) or not name:
            raise ConfigurationError(
                f"{where}: set the master's name in singletask_backend_transport_options, "
                "e.g. {'master_name': 'mymaster'}"
            )
        sentinel_kwargs = self._transport.get("sentinel_kwargs", {})
        others = self._transport.get("min_other_sentinels", 0)
        if not isinstance(sentinel_kwargs, Mapping):
            raise ConfigurationError(f"{where}: sentinel_kwargs must be a dict")
        if isinstance(others, bool) or not isinstance(others, int) or others < 0:
            raise ConfigurationError(f"{where}: min_other_sentinels must be a whole number >= 0")
        query = url_query(first, where)
        options = {**url_credentials(first), "db": url_db(first, where)}
        options.update(self._tls_and_sockets(query, where))
        if self._transport.get("ssl") or any(name in options for name in TLS_OPTIONS):
            options["ssl"] = True
        return nodes, options

    def _connect(self, options: dict[str, Any]) -> redis.Redis:
        assert self._url is not None
        nodes, master = self._target(self._url)
        # The master's options: the defaults, overridden by the URL and transport options.
        options = {**options, **master}
        sentinel_kwargs = dict(self._transport.get("sentinel_kwargs", {}))
        if not sentinel_kwargs:  # as redis-py does without it: the socket options only
            sentinel_kwargs = {k: v for k, v in options.items() if k.startswith("socket_")}
        # Bounded waits on the sentinels too, when sentinel_kwargs gives (say) only a password:
        # the master's timeouts unless it names its own.
        for name in ("socket_timeout", "socket_connect_timeout"):
            if name in options:
                sentinel_kwargs.setdefault(name, options[name])
        # The master's retry policy (a dropped connection, twice) rather than redis-py's
        # default, which retries each unreachable sentinel for seconds on every call.
        if options.get("retry") is not None:
            sentinel_kwargs.setdefault("retry", options["retry"])
        make: Any = Sentinel
        self._sentinel: Any = make(
            nodes,
            sentinel_kwargs=sentinel_kwargs,
            min_other_sentinels=self._transport.get("min_other_sentinels", 0),
        )
        name = self._transport["master_name"]
        client = self._sentinel.master_for(name, redis_class=redis.Redis, **options)
        return cast(redis.Redis, client)

    def close(self) -> None:
        sentinel = getattr(self, "_sentinel", None)
        super().close()
        if sentinel is not None and self._client is None:
            for client in sentinel.sentinels:
                client.close()
            self._sentinel = None


_HOLDER = Script(HOLDER_SCRIPT)


def _holder(key: str, record: Any, pttl: Any) -> Holder | None:
    """The Holder of HOLDER_SCRIPT's reply: a string record, or a hash's fields. Raises
    ``WRONGTYPE`` for a string that is not a lock (as HGETALL would)."""
    if isinstance(record, bytes | str):
        found = holder_from_value(key, record, int(pttl))
        if found is None:
            raise redis.exceptions.ResponseError(WRONGTYPE)
        return found
    return holder_from_reply(key, dict(zip(record[::2], record[1::2], strict=True)), int(pttl))


class RedisClusterBackend(_Deployed):
    """Locks in a Redis Cluster; the client routes each script to the master of its slot.

    Scripts go through the cluster client (which follows MOVED and ASK redirections and
    re-reads the topology after a failover), one round trip each as on a single server.
    """

    EXTRA_OPTIONS = frozenset({"dynamic_startup_nodes"})
    CLUSTER = True

    def _target(self, url: str) -> tuple[list[Any], dict[str, Any]]:
        where = f"{mask(url)!r}"
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("redis+cluster", "rediss+cluster"):
            raise ConfigurationError(f"{where}: expected redis+cluster:// or rediss+cluster://")
        hosts = [h for h in parts.netloc.rpartition("@")[2].split(",") if h.strip()]
        if not hosts:
            raise ConfigurationError(f"{where}: no node address")
        node: Any = ClusterNode
        nodes = [node(*url_address(h.strip(), 6379, where)) for h in hosts]
        if url_db(parts, where) != 0:
            raise ConfigurationError(f"{where}: Redis Cluster has database 0 only")
        options: dict[str, Any] = {**url_credentials(parts)}
        options.update(self._tls_and_sockets(url_query(parts, where), where))
        if scheme == "rediss+cluster":
            options["ssl"] = True
        elif any(name in options for name in TLS_OPTIONS):
            raise ConfigurationError(f"{where}: TLS options need a rediss+cluster:// URL")
        if "dynamic_startup_nodes" in self._transport:
            options["dynamic_startup_nodes"] = to_bool(
                self._transport["dynamic_startup_nodes"], f"{where}: option dynamic_startup_nodes"
            )
        return nodes, options

    def _connect(self, options: dict[str, Any]) -> redis.Redis:
        assert self._url is not None
        nodes, cluster = self._target(self._url)
        options = {k: v for k, v in options.items() if k != "retry"}  # the cluster's own
        client = RedisCluster(startup_nodes=nodes, **{**options, **cluster})
        return cast(redis.Redis, client)

    @property
    def cluster(self) -> Any:
        """The cluster client (typed Any: redis-py's cluster API is untyped)."""
        return self.client

    def _acquire_and_wait(
        self,
        script: Script,
        keys: Sequence[str],
        args: Sequence[str | int | bytes],
        wait: ReplicaWait,
    ) -> tuple[Any, int]:
        """Run the acquire script and WAIT pipelined on the connection of the key's master.

        WAIT counts the writes of its own connection, so it cannot go through the cluster
        client (which would send it to some other node). Redirections are followed here: MOVED
        updates the client's slot map, ASK goes to the importing node after ASKING.
        """
        cluster = self.cluster
        node = cluster.get_node_from_key(keys[0])
        asking = False
        for _ in range(MAX_REDIRECTS):
            connection = cluster.get_redis_connection(node)
            try:
                with connection.pipeline(transaction=False) as pipe:
                    if asking:
                        pipe.execute_command("ASKING")
                    pipe.evalsha(script.sha, len(keys), *keys, *args)
                    pipe.execute_command(*wait.command)
                    reply, acks = pipe.execute(raise_on_error=False)[-2:]
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                # The node may be gone (a failover): re-read the topology for the next call,
                # as the cluster client does on its own path.
                with contextlib.suppress(*DRIVER_ERRORS):
                    cluster.nodes_manager.initialize()
                raise
            asking = False
            if isinstance(reply, redis.exceptions.MovedError):
                cluster.nodes_manager.move_slot(reply)
                node = cluster.get_node_from_key(keys[0])
            elif isinstance(reply, redis.exceptions.AskError):
                target = cluster.get_node(host=reply.host, port=reply.port)
                if target is None:
                    raise reply
                node, asking = target, True
            elif isinstance(reply, redis.exceptions.NoScriptError):
                connection.script_load(script.text)
            elif isinstance(reply, redis.exceptions.TryAgainError):
                time.sleep(0.05)  # keys of the slot in the middle of a migration
            else:
                return _raised(reply), _raised(acks)
        raise redis.exceptions.ClusterError(f"more than {MAX_REDIRECTS} redirections")

    def _check_slots(self, keys: Sequence[str]) -> None:
        """Refuse the slots (and rate record) of a key with a ``}`` but no hash tag: they hash
        to other slots."""
        if len({self.cluster.keyslot(key) for key in keys}) > 1:
            raise LockKeyError(
                f"{self!r}: acquire {keys[0]!r}: the holder slots and rate record of a key with "
                "a '}' but no hash tag are in other cluster slots; give the key prefix a hash tag"
            )

    def _clustered(self) -> bool:
        return True

    def _release_keys(self, key: str) -> tuple[str, ...]:
        base = base_key(key)
        if base == key or self.cluster.keyslot(base) != self.cluster.keyslot(key):
            return (key,)  # a slot's marker stays on the slot when its key is elsewhere
        return (key, base)

    def holder(self, key: str) -> Holder | None:
        """Who holds ``key``: one script (the cluster client follows redirections for scripts,
        not for the MULTI the single-server backend reads with)."""
        reply = self._call("inspect", _HOLDER, (key,), ())
        with self._translate("inspect", key):
            return _holder(key, *reply)

    def _holder_at(self, stored: bytes | str, key: str) -> Holder | None:
        """:meth:`holder` of the store key ``stored`` as SCAN gave it, shown as ``key``: a name
        that is not UTF-8 is read by its bytes (its escaped text names no key)."""
        if isinstance(stored, str) or key.encode() == stored:
            return self.holder(key)
        with self._translate("inspect", key):
            return _holder(key, *self.cluster.eval(_HOLDER.text, 1, stored))

    def iter_state(self, prefix: str, *, page_size: int = 500) -> Iterator[StoreState]:
        """Every master in turn, as :meth:`iter_locks`; each page read from its own node."""
        cluster = self.cluster
        with self._translate("list state", prefix):
            nodes = [cluster.get_redis_connection(node) for node in cluster.get_primaries()]
        for node in nodes:
            with self._translate("list state", prefix):
                yield from scan_state(node, prefix, max(1, page_size), transaction=False)

    def iter_locks(self, prefix: str, *, page_size: int = 500) -> Iterator[tuple[str, Holder]]:
        """Yield ``(key, holder)`` for every live lock whose key starts with ``prefix``.

        SCANs every master in turn (the keys are spread over them), ``page_size`` keys a page;
        a reshard or failover during the listing can skip or repeat a key.
        """
        cluster = self.cluster
        with self._translate("list", prefix):
            primaries = cluster.get_primaries()
        pattern = scan_pattern(prefix)
        for node in primaries:
            with self._translate("list", prefix):
                scan = cluster.get_redis_connection(node).scan_iter(match=pattern, count=page_size)
            while True:
                with self._translate("list", prefix):
                    raw = next(scan, None)
                if raw is None:
                    break
                key = as_text(raw)  # a name that is not UTF-8: shown escaped
                if not listed(key, prefix):
                    continue
                holder = self._holder_at(raw, key)
                if holder is not None and holder.token:  # a released record has no token
                    yield key, holder
