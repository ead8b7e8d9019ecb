"""The Redis lock store: one hash per lock, every operation one round trip (a takeover of
``lock_policy = "replace"`` too: it leaves its record in the same script, :mod:`.replaced`).

A lock is one Redis hash at the lock key: owner token, fencing token and compact holder
metadata (:mod:`~singletask.backends.redis.wire`); its lease is the key's expiry. A release
deletes the key, or leaves a small released record (last fencing token, completion marker) as
long as the transport options ``fence_retention`` and ``marker_retention`` say. Acquire,
release and extend are Lua scripts over the lock key alone, run with EVALSHA: each is atomic
and costs one round trip once the script is cached on the server.

URLs: ``redis://[[user]:password@]host[:port][/db]``, ``rediss://...`` (TLS) and
``unix:///path/to/socket?db=0``, with redis-py's query options (``socket_timeout``, ...),
checked strictly when the backend is built
(:func:`singletask.backends.redis.options.parse_redis_url`). The scripts, and how they keep
every key with an expiry, are in :mod:`singletask.backends.redis.scripts`.

A backend built from a URL sends its scripts over redis-py connections it keeps itself, one
per thread that uses it at once, with the command encoded here: the lock costs its two round
trips and little else (redis-py's command path adds a pool checkout, retry and metrics
bookkeeping to every command). A backend given a ready client uses that client's own methods.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from ...exceptions import BackendError, ConfigurationError
from ...protocol.slots import base_key
from ...protocol.tokens import this_pid
from ..base import (
    AcquireResult,
    Holder,
    LockBackend,
    StoreState,
    Units,
    UnitsResult,
    units_meta,
)
from ..urls import mask_url
from .bookkeeping import scan_state
from .connections import call_function, send
from .functions import unavailable
from .lock_scripts import DEFAULT_MARKER_KEEP_MS
from .options import connection_options, parse_redis_url, record_layout, retentions
from .rates import (
    COMPANION_ENDS,
    DEBOUNCE,
    DEBOUNCE_PUBLISHED,
    DEBOUNCE_TAKE,
    DEBOUNCE_UNDO,
    check_key,
    debounce_args,
    debounce_result,
    fence_key,
    slot_request,
    window_key,
)
from .replaced import PREEMPT, REPLACED_BY, preempt_request, record_key
from .slots import scan_locks, slot_result
from .units import (
    ACQUIRE_UNITS,
    GIVE_UNITS,
    RELEASE_UNITS,
    TAKE_UNITS,
    check_limit_keys,
    give_request,
    take_request,
    take_result,
    with_lock,
)
from .wire import (
    ACQUIRE,
    ACQUIRE_FIRST,
    ACQUIRE_HASH,
    CLAIM_NEXT,
    CLEAR_NEXT,
    EXTEND,
    EXTEND_MANY,
    NOT_RUN_CODES,
    OPERATOR_RELEASE,
    RELEASE,
    RELEASE_STRING,
    WRONGTYPE,
    Connection,
    Script,
    as_text,
    conflict_holder,
    driver_error,
    drop_idle,
    encode_meta,
    keep_ms,
    lease_ms,
    not_run,
    pack_fields,
    read_record,
    removed_holder,
    string_conflict,
)

__all__ = ["DRIVER_ERRORS", "NOT_RUN_CODES", "RedisBackend", "fence_key", "not_run"]

#: What redis-py raises; translated to singletask's errors at this module's boundary.
DRIVER_ERRORS = (redis.exceptions.RedisError, redis.exceptions.RedisClusterException)

#: How long a released key keeps its last fencing token, by default: not at all (the next token
#: rests on the server's clock). The transport option ``fence_retention`` (seconds) sets it.
FENCE_RETENTION = 0.0

#: How long a released key keeps the completion marker its release recorded, by default: one
#: day. The transport option ``marker_retention`` (seconds) sets it.
MARKER_RETENTION = DEFAULT_MARKER_KEEP_MS / 1000

#: How many plain locks a process remembers as found held (the set is emptied when full).
_REFUSED_KEPT = 1024

#: Client defaults; options given in the URL's query string or to ``from_url`` win.
CLIENT_DEFAULTS: dict[str, Any] = {
    "socket_timeout": 5.0,
    "socket_connect_timeout": 5.0,
    "health_check_interval": 30,
}


class RedisBackend(LockBackend):
    """Locks in Redis (or Valkey, or anything speaking its protocol with Lua scripting).

    Holder slots (``lock_limit``) are lock keys of their own (see
    :mod:`~singletask.backends.redis.slots`); rate records (``lock_rate``) and debounce windows
    (``lock_debounce``) are companion records of the key (see
    :mod:`~singletask.backends.redis.rates`); a named limit is a record and two companions
    of its own (see :mod:`~singletask.backends.redis.units`).

    Args:
        client: A ready client (``redis.Redis``, ``valkey.Valkey``, a cluster client, ...).
        url: A URL to build a client from, lazily, in the process that first uses it.
        fence_retention: How long a released key keeps its last fencing token, in seconds
            (:data:`~singletask.backends.redis.store.FENCE_RETENTION`, 0, by default: not at all).
        marker_retention: How long a released key keeps the completion marker its release
            recorded, in seconds (:data:`~singletask.backends.redis.store.MARKER_RETENTION`, a
            day, by default; 0: not at all).
        lock_record: How the plain acquire writes a lock: ``"string"`` (the default) or
            ``"hash"``, which singletask 0.3.0 and earlier can read (for a rolling upgrade).
        **options: Extra client options for ``redis.Redis.from_url``.

    Exactly one of ``client`` and ``url`` is required.
    """

    supports_limit = True
    supports_rate = True
    supports_debounce = True
    supports_replace = True
    supports_units = True
    supports_turns = True

    #: Whether the stores of this class are Redis Clusters (by their URL: the limits one
    #: take names must share a hash slot, :meth:`check_units_keys`).
    CLUSTER: ClassVar[bool] = False

    def __init__(
        self,
        *,
        client: redis.Redis | None = None,
        url: str | None = None,
        fence_retention: float = FENCE_RETENTION,
        marker_retention: float = MARKER_RETENTION,
        lock_record: str = "string",
        **options: Any,
    ) -> None:
        if (client is None) == (url is None):
            raise ConfigurationError("RedisBackend takes exactly one of client= and url=")
        # Whether the plain acquire writes a hash, as 0.3.0 and earlier do (see options.py).
        self._hash_records = record_layout({"lock_record": lock_record}, "RedisBackend") == "hash"
        self.fence_retention, self.marker_retention = retentions(
            {"fence_retention": fence_retention, "marker_retention": marker_retention},
            "RedisBackend",
            (FENCE_RETENTION, MARKER_RETENTION),
        )
        # The retentions in whole milliseconds, as the release scripts take them.
        self._keep = (keep_ms(self.marker_retention), keep_ms(self.fence_retention))
        # What the release that keeps nothing sends after the token: the marker retention,
        # unless it is the default, which the script applies when it is left out.
        self._marker = () if self._keep[0] == DEFAULT_MARKER_KEEP_MS else (self._keep[0],)
        if url is not None:
            self._check_url(url)  # fail early, and strictly, on a bad URL
        self._url = url
        # Whether scripts go out on this backend's own connections (see connections.py), or
        # through the client's methods (a ready client, or a cluster client, which routes by key).
        self._own_connections = url is not None
        self._options = {**CLIENT_DEFAULTS, **options}
        self._client = client
        self._pid = os.getpid() if client is None else None
        # Connections of a URL-built backend, idle between two script calls (see
        # connections.send).
        self._idle: list[Connection] = []
        # Whether the plain lock's calls go as functions (FCALL, Redis 7 and later): until the
        # server says it cannot (see functions.py), then scripts for the rest of the process.
        self._functions = True
        # The plain locks this process found held at its last try (at most _REFUSED_KEPT):
        # their next acquire reads the key first (ACQUIRE), the others' write first
        # (ACQUIRE_FIRST), which costs the server less for a free key and more for a held one.
        self._refused: set[str] = set()

    @classmethod
    def from_url(
        cls, url: str, *, transport_options: Mapping[str, Any] | None = None, **options: Any
    ) -> RedisBackend:
        """Build a backend for ``url``; ``transport_options`` are those of the setting
        ``singletask_backend_transport_options`` (TLS and socket options here)."""
        if transport_options:
            options = {**connection_options(transport_options, url), **options}
            where = "setting singletask_backend_transport_options"
            fence, marker = retentions(
                transport_options, where, (FENCE_RETENTION, MARKER_RETENTION)
            )
            options.setdefault("fence_retention", fence)
            options.setdefault("marker_retention", marker)
            options.setdefault("lock_record", record_layout(transport_options, where))
        return cls(url=url, **options)

    @classmethod
    def check_url(cls, url: str) -> None:
        parse_redis_url(url)

    def _check_url(self, url: str) -> None:
        """Raise ConfigurationError if ``url`` cannot be used: early, before any connection."""
        type(self).check_url(url)

    def _connect(self, options: dict[str, Any]) -> redis.Redis:
        """A new client for this backend's URL (called once per process)."""
        assert self._url is not None
        return redis.Redis.from_url(self._url, **options)

    def __repr__(self) -> str:
        where = mask_url(self._url) if self._url else mask_url(repr(self._client))
        return f"<RedisBackend {where}>"

    @property
    def client(self) -> redis.Redis:
        """The client, created on first use in each process (a forked child makes its own)."""
        if self._url is not None and (self._client is None or self._pid != this_pid()):
            options = dict(self._options)
            # Retry a dropped connection, never a timeout: redis-py would also retry it inside
            # each reconnect, multiplying the wait on a server that does not answer.
            options.setdefault(
                "retry",
                Retry(
                    ExponentialBackoff(cap=1.0, base=0.05),
                    2,
                    supported_errors=(redis.exceptions.ConnectionError,),
                ),
            )
            client = self._connect(options)
            # A forked child drops (never closes, never uses) its parent's connections.
            self._client, self._pid, self._idle = client, os.getpid(), []
        assert self._client is not None
        return self._client

    def _error(self, exc: Exception, operation: str, key: str) -> BackendError:
        """singletask's error for a redis-py one, naming the server but never its password
        (see :func:`~singletask.backends.redis.wire.driver_error`)."""
        return driver_error(exc, f"{self!r}: {operation} {key!r}")

    @contextlib.contextmanager
    def _translate(self, operation: str, key: str) -> Iterator[None]:
        """Raise the redis-py errors raised inside as singletask's (see :meth:`_error`)."""
        try:
            yield
        except DRIVER_ERRORS as exc:
            raise self._error(exc, operation, key) from exc

    def _call(
        self,
        operation: str,
        script: Script,
        keys: Sequence[str],
        args: Sequence[str | int | bytes],
    ) -> Any:
        """Run ``script`` (as its function when it is one and the server has functions, see
        functions.py): one round trip, two when the server does not have it cached.

        Errors are translated here rather than with :meth:`_translate`, which would cost a
        generator per call on the path every execution takes twice.
        """
        try:
            client = self.client
            fcall = self._functions and script.function is not None
            if self._own_connections:
                if fcall:
                    try:
                        return send(self._idle, client, script, keys, args, fcall=True)
                    except redis.exceptions.ResponseError as exc:
                        if not unavailable(exc):
                            raise
                        self._functions = False  # scripts, for the rest of this process
                return send(self._idle, client, script, keys, args)
            try:
                if fcall:
                    try:
                        return call_function(client, script, keys, args)
                    except redis.exceptions.RedisError as exc:
                        if not unavailable(exc):
                            raise
                        self._functions = False
                try:
                    return client.evalsha(script.sha, len(keys), *keys, *args)
                except redis.exceptions.NoScriptError:
                    return client.eval(script.text, len(keys), *keys, *args)
            except DRIVER_ERRORS as exc:
                if not_run(exc):
                    drop_idle(client)
                raise
        except DRIVER_ERRORS as exc:
            raise self._error(exc, operation, keys[0]) from exc

    def acquire(
        self,
        key: str,
        token: str,
        ttl: float,
        *,
        meta: Mapping[str, str] | None = None,
        takeover_prefix: str | None = None,
        units: Sequence[Units] = (),
    ) -> AcquireResult:
        if units and not self._units_with_lock():  # the key, then its units (two steps)
            result = self.acquire(key, token, ttl, meta=meta, takeover_prefix=takeover_prefix)
            return self._take_units_after(result, key, token, ttl, units, meta, takeover_prefix)
        self._check_key(key, "acquire")
        since, fields = encode_meta(key, token, meta or {})
        lease = lease_ms(ttl, "acquire")
        prefix = takeover_prefix or ""
        packed = (
            None
            if units or self._hash_records
            else pack_fields(token, prefix, lease, since, fields)
        )
        if packed is not None:  # the plain lock: a string record, its fields in one argument
            plain = (token, packed, prefix) if prefix else (token, packed)
            # Written first (a function: one command fewer) unless held at the last try here.
            seen = self._refused
            script = ACQUIRE if key in seen else ACQUIRE_FIRST
            reply = self._call("acquire", script, (key,), plain)
            if not isinstance(reply, bytes | str):  # the key is a hash
                return self._acquired(reply)
            value = as_text(reply)
            if "\0" not in value:  # taken: its fence
                seen.discard(key)
                return AcquireResult(True, fence=int(value))
            holder = string_conflict(value)  # held as a string record
            if holder is None:  # a string that is not a lock: as HGET would have said
                exc = redis.exceptions.ResponseError(WRONGTYPE)
                raise self._error(exc, "acquire", key) from exc
            if len(seen) >= _REFUSED_KEPT:
                seen.clear()
            seen.add(key)
            return AcquireResult(False, holder)
        args: list[str | int] = [token, lease, prefix, since, *fields]
        if units:  # the key and its units in one script
            unit_keys, unit_args = take_request(token, ttl, units, units_meta(meta))
            self.check_units_together([item.key for item in units], f"{self!r}: acquire")
            keys, both = with_lock([key], args, unit_keys, unit_args)
            reply = self._call("acquire", ACQUIRE_UNITS, keys, both)
            if reply[0] == 2:
                refused = take_result(units, [0, *reply[1:]])
                return AcquireResult(False, retry_after=refused.retry_after,
                                     limit=refused.limit, used=refused.used)  # fmt: skip
        else:
            reply = self._call("acquire", ACQUIRE_HASH, (key,), args)
        return self._acquired(reply)

    @staticmethod
    def _acquired(reply: Any) -> AcquireResult:
        """The result of an acquire script's reply (a hash's refusal, or the lock taken)."""
        if reply[0] == 1:
            _, fence, completed = reply
            return AcquireResult(
                True, fence=int(fence), completed=as_text(completed) if completed else None
            )
        return AcquireResult(False, conflict_holder(*reply[1:]))

    def acquire_slot(
        self,
        key: str,
        limit: int,
        token: str,
        ttl: float,
        *,
        meta: Mapping[str, str] | None = None,
        takeover_prefix: str | None = None,
        interval: float | None = None,
        units: Sequence[Units] = (),
    ) -> AcquireResult:
        self._check_key(key, "acquire")
        request = slot_request(key, limit, token, ttl, meta, takeover_prefix, interval)
        script, keys, args = request
        self._check_slots(keys)
        result = slot_result(keys[:limit], self._call("acquire", script, keys, args))
        return self._take_units_after(result, key, token, ttl, units, meta, takeover_prefix)

    def _units_with_lock(self) -> bool:
        """Whether a lock and the units of its limits go in one script: not on a cluster
        (their keys share no slot), and not while acquisitions wait for replicas (the
        deployed stores)."""
        return not self._clustered()

    def debounce(
        self, key: str, task_id: str, ttl: float, *, pending: float = 0.0
    ) -> tuple[str | None, float, str | None]:
        self._check_key(key, "debounce")
        args = debounce_args(task_id, ttl, pending)
        return debounce_result(self._call("debounce", DEBOUNCE, (window_key(key),), args))

    def debounce_published(self, key: str, task_id: str) -> bool:
        self._check_key(key, "debounce")
        args = (task_id,)
        return bool(self._call("debounce", DEBOUNCE_PUBLISHED, (window_key(key),), args))

    def debounce_take(
        self, key: str, task_id: str, *, overdue: bool = False
    ) -> tuple[str | None, float]:
        self._check_key(key, "debounce")
        args = (task_id, "1" if overdue else "")
        latest, left = self._call("debounce", DEBOUNCE_TAKE, (window_key(key),), args)
        return (as_text(latest) if latest else None), int(left) / 1000

    def debounce_undo(
        self, key: str, task_id: str, previous: str | None, *, closed: str | None = None
    ) -> bool:
        self._check_key(key, "debounce")
        args = (task_id, previous or "", closed or "")
        return bool(self._call("debounce", DEBOUNCE_UNDO, (window_key(key),), args))

    def _check_key(self, key: str, operation: str) -> None:
        """Refuse a raw key that may be another lock's companion record (the store's name,
        ``repr(self)``, is written out only for the error)."""
        if key.endswith(COMPANION_ENDS):
            check_key(repr(self), key, operation)

    def _check_slots(self, keys: Sequence[str]) -> None:
        """Refuse the keys of a slot acquisition (slots, rate record) one script cannot take
        together (the Cluster's check)."""

    def _release_keys(self, key: str) -> tuple[str, ...]:
        """The keys of a release of ``key``: a holder slot's base key too, for its marker."""
        base = base_key(key)
        return (key,) if base == key else (key, base)

    def release(
        self, key: str, token: str, *, completed: str | None = None, units: Sequence[Units] = ()
    ) -> bool:
        args = (token, completed or "", *self._keep)
        held = [item for item in units if item.period is None]
        if held and self._units_with_lock():  # given back and released in one script
            unit_keys, unit_args = give_request(token, held)
            self.check_units_together([item.key for item in held], f"{self!r}: release")
            keys, both = with_lock(self._release_keys(key), args, unit_keys, unit_args)
            return bool(self._call("release", RELEASE_UNITS, keys, both))
        if self._keeps_nothing(key, completed, held):  # the token (and the marker retention)
            return bool(self._call("release", RELEASE_STRING, (key,), (token, *self._marker)))
        self._give_units_before(token, held)
        return bool(self._call("release", RELEASE, self._release_keys(key), args))

    def _keeps_nothing(self, key: str, completed: str | None, held: Sequence[Units]) -> bool:
        """Whether the release of ``key`` can send the token alone (``RELEASE_STRING_SCRIPT``;
        and the marker retention, when it is not the default, for a hash it may meet): no
        completion marker to record, no fence kept, no units to give back, not a holder slot
        (whose base key records the marker), and the plain acquire writes string records
        (``lock_record``; with hash records, the full release)."""
        return not (held or completed or self._keep[1] or self._hash_records) and (
            base_key(key) == key
        )

    def extend(self, key: str, token: str, ttl: float) -> bool:
        return bool(self._call("extend", EXTEND, (key,), (token, lease_ms(ttl, "extend"))))

    def extend_many(self, leases: Sequence[tuple[str, str, float]]) -> list[bool]:
        if not leases:
            return []
        for _, _, ttl in leases:
            lease_ms(ttl, "extend")  # every lease checked before any is sent
        client = self.client
        if isinstance(client, RedisCluster):
            # A script's keys must share a slot (and cluster pipelines cannot run scripts):
            # one script per slot, so one round trip per slot the leases fall in.
            slots: dict[int, list[int]] = {}
            for index, (key, _, _) in enumerate(leases):
                slots.setdefault(client.keyslot(key), []).append(index)
            done: list[bool] = [False] * len(leases)
            for indexes in slots.values():
                group = [leases[i] for i in indexes]
                for i, ok in zip(indexes, self._extend_same_slot(group), strict=True):
                    done[i] = ok
            return done
        return self._extend_same_slot(leases)

    def _extend_same_slot(self, leases: Sequence[tuple[str, str, float]]) -> list[bool]:
        keys = [key for key, _, _ in leases]
        args: list[str | int] = []
        for _, token, ttl in leases:
            args += [token, lease_ms(ttl, "extend")]
        return [bool(done) for done in self._call("extend", EXTEND_MANY, keys, args)]

    def take_units(
        self,
        token: str,
        ttl: float,
        units: Sequence[Units],
        *,
        meta: Mapping[str, str] | None = None,
    ) -> UnitsResult:
        """Every limit checked and taken in one script (:mod:`.units`): one round trip."""
        keys, args = take_request(token, ttl, units, meta)
        if not units:
            return UnitsResult(True)
        self.check_units_together([item.key for item in units], f"{self!r}: take_units")
        return take_result(units, self._call("take_units", TAKE_UNITS, keys, args))

    def give_units(self, token: str, units: Sequence[Units]) -> list[bool]:
        """Every limit given back in one script (:mod:`.units`): one round trip."""
        keys, args = give_request(token, units)
        if not units:
            return []
        self.check_units_together([item.key for item in units], f"{self!r}: give_units")
        return [bool(found) for found in self._call("give_units", GIVE_UNITS, keys, args)]

    def check_units_together(self, keys: Sequence[str], where: str) -> None:
        """Raise ConfigurationError if the named limits of store keys ``keys``
        (:func:`singletask.protocol.limits.limit_key`) cannot be taken together in one
        :meth:`take_units` on this store: on a Redis Cluster (a cluster store, or a backend
        given a cluster client), unless every key is in one hash slot (names with one hash
        tag, ``"{openai}-requests"`` and ``"{openai}-tokens"``, are when the key prefix has
        none); on any Redis store, a key ending as a limit's companion record does
        (``}:holds``, ``}:units``, ``}:turns``). Connects to nothing: for a task's
        ``lock_limits`` when it is bound. ``where`` starts the message. take_units and
        give_units check the same before they send anything.

        Raises:
            ConfigurationError: They cannot; the message says how to name them.
        """
        check_limit_keys(keys, where, cluster=self._clustered())

    @classmethod
    def check_units_keys(cls, keys: Sequence[str], where: str) -> None:
        check_limit_keys(keys, where, cluster=cls.CLUSTER)

    def _clustered(self) -> bool:
        """Whether the store is a Redis Cluster (scripts must keep to one hash slot)."""
        return isinstance(self._client, RedisCluster)

    def claim_next(self, key: str, task_id: str, ttl: float) -> str:
        args = (task_id, lease_ms(ttl, "claim_next"))
        return as_text(self._call("claim_next", CLAIM_NEXT, (fence_key(key),), args))

    def clear_next(self, key: str, task_id: str) -> bool:
        return bool(self._call("clear_next", CLEAR_NEXT, (fence_key(key),), (task_id,)))

    def preempt(
        self,
        key: str,
        limit: int,
        token: str,
        ttl: float,
        victim: str,
        *,
        meta: Mapping[str, str] | None = None,
    ) -> AcquireResult:
        """The takeover and its preemption record in one script (:mod:`.replaced`)."""
        self._check_key(key, "preempt")
        script, keys, args = preempt_request(key, limit, token, ttl, victim, meta)
        self._check_slots(keys)
        reply = self._call("preempt", script, keys, args)
        if script is not PREEMPT:
            return slot_result(keys[:limit], reply)
        if reply[0] == 1:
            _, fence, completed = reply[:3]
            return AcquireResult(
                True, fence=int(fence), completed=as_text(completed) if completed else None
            )
        return AcquireResult(False, conflict_holder(*reply[1:]))

    def replaced_by(self, key: str, token: str) -> str | None:
        found = self._call("inspect", REPLACED_BY, (record_key(key, token),), ())
        return as_text(found) if found is not None else super().replaced_by(key, token)

    def holder(self, key: str) -> Holder | None:
        client = self.client
        with self._translate("inspect", key):
            with client.pipeline(transaction=True) as pipe:
                pipe.get(key)  # a plain lock's string record, or WRONGTYPE for a hash
                pipe.hgetall(key)  # a hash record, or WRONGTYPE for a string
                pipe.pttl(key)
                value, fields, pttl = pipe.execute(raise_on_error=False)
            return read_record(key, value, fields, pttl)

    def iter_locks(self, prefix: str, *, page_size: int = 500) -> Iterator[tuple[str, Holder]]:
        """One SCAN MATCH ``*prefix*`` (keys and holder slots alike), COUNT ``page_size``; each
        page of keys read in one pipeline (see :func:`~.slots.scan_locks`)."""
        client = self.client
        with self._translate("list", prefix):
            yield from scan_locks(client, prefix, max(1, page_size))

    def iter_state(self, prefix: str, *, page_size: int = 500) -> Iterator[StoreState]:
        """SCAN MATCH as :meth:`iter_locks` (``state.scan_state``)."""
        client = self.client
        with self._translate("list state", prefix):
            yield from scan_state(client, prefix, max(1, page_size))

    def release_held_by(self, key: str, task_id: str) -> Holder | None:
        args = (task_id, *self._keep)
        return removed_holder(key, self._call("release", OPERATOR_RELEASE, (key,), args))

    def force_release(self, key: str) -> Holder | None:
        args = ("", *self._keep)
        return removed_holder(key, self._call("release", OPERATOR_RELEASE, (key,), args))

    def close(self) -> None:
        if self._url is not None and self._client is not None and self._pid == os.getpid():
            while self._idle:
                self._idle.pop().disconnect()
            self._client.close()
            self._client = None
