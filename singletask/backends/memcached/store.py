"""The memcached lock store: every state change is one ``add`` or one ``cas``.

URLs: ``memcached://host:11211`` and, for several servers, ``memcached://h1:11211;h2:11211``
(``,`` works too). Query options: ``timeout`` and ``connect_timeout`` (seconds) and
``max_pool_size``. Needs ``pip install singletask[memcached]`` (pymemcache).

A lock is one item, named after the lock key, holding a JSON record: the owner token, its
fencing token, the metadata, the deadline of the lease and the key's last completion marker. A
released lock becomes a *free record* (no token) that keeps the last fencing token and
completion marker, so a release and its marker are one ``cas``. Every change reads the record
with ``gets`` and writes it with ``cas``, so a concurrent change makes the write fail and the
step is decided again on the new record. A lock record is only ever created free (``add``) and
taken with a ``cas``; the fencing token comes from a counter item per lock (``incr``, seeded
with ``add``) read between that ``gets`` and that ``cas`` (why:
:mod:`~singletask.backends.memcached.fences`). A pending follow-up is one item (``add``; cleared
by a ``cas`` with a negative expiry, memcached's delete-if-unchanged). The counter and the
follow-up slot have names no lock key can have (see
:func:`~singletask.backends.memcached.items.item_name`).

What differs from Redis (the guarantees page has the details): memcached's own expiry ends a
lease, in whole seconds of its clock, and the lease time reported is derived from a deadline the
writing host stored; memcached may evict a live lock, and loses every lock when it restarts; a
lost fence counter restarts from the acquiring host's clock; keys cannot be listed
(:meth:`~singletask.backends.memcached.MemcachedBackend.iter_locks` raises
:class:`~singletask.exceptions.UnsupportedOperation`).
Each lock lives on the one server its key hashes to, and never moves: a server that does not
answer makes its locks unavailable (:class:`~singletask.exceptions.BackendUnavailable`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ...exceptions import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    ConfigurationError,
    SingletaskError,
    UnsupportedOperation,
)
from ..base import AcquireResult, Holder, LockBackend, Units
from .fences import next_fence
from .items import (
    CLIENT_DEFAULTS,
    EXPIRY_SLACK,
    MAX_RELATIVE_EXPIRY,
    OPTION_TYPES,
    RECORD_RETENTION,
    decode,
    encode,
    expiry,
    holder_of,
    item_name,
    parse_servers,
)

try:
    from pymemcache.client.base import PooledClient
    from pymemcache.exceptions import MemcacheError, MemcacheUnexpectedCloseError
except ImportError:  # pragma: no cover - the extra is not installed
    PooledClient = None

__all__ = ["MAX_RELATIVE_EXPIRY", "MemcachedBackend", "expiry", "item_name", "parse_servers"]

#: How often a step is decided again when the record keeps changing under it.
CAS_ATTEMPTS = 50


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _unsupported(message: str) -> Iterator[tuple[str, Holder]]:
    raise UnsupportedOperation(message)
    yield  # a generator: the error comes with the first step of the iteration


class MemcachedBackend(LockBackend):
    """Locks in one or more memcached servers.

    Args:
        servers: ``(host, port)`` pairs (a host starting with ``/`` is a Unix socket path).
        options: ``connect_timeout``, ``timeout`` (seconds), ``max_pool_size`` per server, and
            ``tls_context`` (an :class:`ssl.SSLContext`).
    """

    def __init__(self, servers: Sequence[tuple[str, int]], **options: Any) -> None:
        if not servers:
            raise ConfigurationError("MemcachedBackend needs at least one server")
        if PooledClient is None:  # pragma: no cover - the extra is not installed
            raise ConfigurationError(
                "the memcached:// lock store needs pymemcache: pip install 'singletask[memcached]'"
            )
        unknown = set(options) - {*OPTION_TYPES, "tls_context"}
        if unknown:
            raise ConfigurationError(f"MemcachedBackend: unknown options {sorted(unknown)}")
        self.servers = [(str(host), int(port)) for host, port in servers]
        self._options = {**CLIENT_DEFAULTS, **options}
        self._mutex = threading.Lock()
        self._clients: dict[tuple[str, int], Any] = {}
        self._pid: int | None = None

    #: The longest lease and follow-up claim, 30 days less two seconds: memcached reads an
    #: expiry over 30 days (2,592,000 s) as an absolute Unix time, and an item is kept two
    #: seconds longer than its lease (see :func:`~singletask.backends.memcached.store.expiry`).
    #: Longer leases as absolute times are not offered: they would rest on the agreement of the
    #: workers' and the server's clocks.
    max_lease = float(MAX_RELATIVE_EXPIRY - EXPIRY_SLACK)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> MemcachedBackend:
        servers, query = parse_servers(url)
        return cls(servers, **{**query, **options})

    def __repr__(self) -> str:
        return f"<MemcachedBackend {';'.join(f'{h}:{p}' for h, p in self.servers)}>"

    # -- connections and errors ------------------------------------------------------------------

    def _server(self, key: str) -> tuple[str, int]:
        """The server of ``key``'s items: rendezvous hashing over the fixed server list."""
        if len(self.servers) == 1:
            return self.servers[0]
        return max(
            self.servers, key=lambda s: hashlib.blake2b(f"{s[0]}:{s[1]}\0{key}".encode()).digest()
        )

    def _client(self, key: str) -> Any:
        """The pooled client of ``key``'s server, created on first use in each process."""
        server = self._server(key)
        pid = os.getpid()
        with self._mutex:
            if self._pid != pid:  # a forked child drops (never uses) its parent's sockets
                self._clients, self._pid = {}, pid
            client = self._clients.get(server)
            if client is None:
                spec: Any = server[0] if server[0].startswith("/") else server
                # default_noreply=False: otherwise add/set answer True without waiting for the
                # server, and every acquire would seem to succeed.
                client = PooledClient(spec, default_noreply=False, **self._options)
                self._clients[server] = client
        return client

    @contextlib.contextmanager
    def _translate(self, operation: str, key: str) -> Iterator[None]:
        """pymemcache's and the socket's errors, raised inside, as singletask's, chained.

        A timeout is :class:`BackendTimeout`; a refused, reset or closed connection, or no free
        connection in a pool of ``max_pool_size``, :class:`BackendUnavailable`; what memcached
        or pymemcache refuses, and anything else unexpected, :class:`BackendError`.
        """
        try:
            yield
        except SingletaskError:
            raise
        except TimeoutError as exc:
            raise BackendTimeout(f"{self!r}: {operation} {key!r} timed out: {exc}") from exc
        except (OSError, MemcacheUnexpectedCloseError) as exc:
            raise BackendUnavailable(f"{self!r}: {operation} {key!r} failed: {exc!r}") from exc
        except RuntimeError as exc:
            if not str(exc).startswith("Too many objects"):  # pymemcache's full pool
                raise BackendError(f"{self!r}: {operation} {key!r} failed: {exc!r}") from exc
            raise BackendUnavailable(
                f"{self!r}: {operation} {key!r}: every connection of the pool "
                f"(max_pool_size={self._options.get('max_pool_size')}) is in use: {exc}"
            ) from exc
        except MemcacheError as exc:
            raise BackendError(f"{self!r}: {operation} {key!r} failed: {exc!r}") from exc
        except Exception as exc:  # every error a caller sees is singletask's, with its cause
            raise BackendError(f"{self!r}: {operation} {key!r} failed: {exc!r}") from exc

    def _changing(self, operation: str, key: str) -> BackendError:
        return BackendError(
            f"{self!r}: {operation} {key!r}: the record changed under each of {CAS_ATTEMPTS} tries"
        )

    # -- fencing ---------------------------------------------------------------------------------

    def _next_fence(self, client: Any, key: str, floor: int | None, *, fresh: bool) -> int:
        """A fencing token greater than every one issued before (and than ``floor``): see
        :func:`~singletask.backends.memcached.fences.next_fence`."""
        return next_fence(client, key, floor, fresh=fresh, owner=self)

    # -- the primitives --------------------------------------------------------------------------

    # Why a fence is never below one issued before it for the key, whatever the interleaving:
    # see :mod:`~singletask.backends.memcached.fences`.
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
        if units:
            self.take_units(token, ttl, units)  # refused: memcached keeps no named limits
        exptime = expiry(ttl, "acquire")
        item = item_name(key)
        with self._translate("acquire", key):
            client = self._client(key)
            created = False
            for _ in range(CAS_ATTEMPTS):
                value, cas = client.gets(item)
                record = decode(value, key)
                if record is None:
                    # No item: create it free, then take it with a cas like any free record.
                    # A failed add means another item is there now: decided on next turn.
                    created = client.add(item, encode({"c": None}), expire=RECORD_RETENTION)
                    continue
                current = record.get("t")
                if (
                    current is not None
                    and current != token
                    and not (takeover_prefix and str(current).startswith(takeover_prefix))
                ):
                    return AcquireResult(False, holder_of(record, full=False))
                if current == token:
                    fence = int(record["f"])
                else:
                    floor = record.get("f")
                    fence = self._next_fence(client, key, floor, fresh=created)
                done = record.get("c")
                fields = {"t": token, "f": fence, "d": time.time() + ttl, "m": dict(meta or {})}
                if client.cas(item, encode({**fields, "c": done}), cas, expire=exptime):
                    return AcquireResult(True, fence=fence, completed=done)
                created = False
        raise self._changing("acquire", key)

    def _free(
        self,
        key: str,
        operation: str,
        held_by: str | None,
        *,
        task_id: str | None = None,
        completed: str | None = None,
    ) -> Holder | None:
        """Turn the lock into a free record if ``held_by`` (a token) or ``task_id`` holds it.

        With neither, whoever holds it. Returns the holder removed, or None.
        """
        item = item_name(key)
        with self._translate(operation, key):
            client = self._client(key)
            for _ in range(CAS_ATTEMPTS):
                value, cas = client.gets(item)
                record = decode(value, key)
                if record is None or record.get("t") is None:
                    return None
                holder = holder_of(record)
                if held_by is not None and holder.token != held_by:
                    return None
                if task_id is not None and holder.task_id != task_id:
                    return None
                done = completed if completed is not None else record.get("c")
                free = encode({"f": record["f"], "c": done})
                stored = client.cas(item, free, cas, expire=RECORD_RETENTION)
                if stored:
                    return holder
                if stored is None:  # the item is gone: its lease ran out meanwhile
                    return None
        raise self._changing(operation, key)

    def release(
        self, key: str, token: str, *, completed: str | None = None, units: Sequence[Units] = ()
    ) -> bool:
        if units:
            self.give_units(token, units)  # refused: memcached keeps no named limits
        return self._free(key, "release", token, completed=completed) is not None

    def release_held_by(self, key: str, task_id: str) -> Holder | None:
        return self._free(key, "release", None, task_id=task_id)

    def force_release(self, key: str) -> Holder | None:
        return self._free(key, "release", None)

    def _extend(self, client: Any, key: str, token: str, ttl: float, seen: Any) -> bool:
        """Extend from an already read ``(value, cas)``; read again while the record changes."""
        item = item_name(key)
        exptime = expiry(ttl, "extend")
        value, cas = seen
        for _ in range(CAS_ATTEMPTS):
            record = decode(value, key)
            if record is None or record.get("t") != token:
                return False
            record["d"] = time.time() + ttl
            stored = client.cas(item, encode(record), cas, expire=exptime)
            if stored is not None:
                if stored:
                    return True
                value, cas = client.gets(item)
            else:
                return False
        raise self._changing("extend", key)

    def extend(self, key: str, token: str, ttl: float) -> bool:
        with self._translate("extend", key):
            client = self._client(key)
            return self._extend(client, key, token, ttl, client.gets(item_name(key)))

    def extend_many(self, leases: Sequence[tuple[str, str, float]]) -> list[bool]:
        """One ``gets`` of many keys per server, then one ``cas`` per lease still held."""
        if not leases:
            return []
        for _, _, ttl in leases:
            expiry(ttl, "extend")  # every lease checked before any changes
        by_server: dict[tuple[str, int], list[str]] = {}
        for key, _, _ in leases:
            by_server.setdefault(self._server(key), []).append(key)
        seen: dict[bytes, Any] = {}
        with self._translate("extend", leases[0][0]):
            for keys in by_server.values():
                seen.update(self._client(keys[0]).gets_many([item_name(k) for k in keys]))
            return [
                self._extend(
                    self._client(key), key, token, ttl, seen.get(item_name(key), (None, None))
                )
                for key, token, ttl in leases
            ]

    def claim_next(self, key: str, task_id: str, ttl: float) -> str:
        item = item_name(key, "next")
        exptime = expiry(ttl, "claim_next")
        with self._translate("claim_next", key):
            client = self._client(key)
            for _ in range(CAS_ATTEMPTS):
                if client.add(item, task_id.encode(), expire=exptime):
                    return task_id
                pending = client.get(item)
                if pending is not None:
                    return _text(pending)
        raise self._changing("claim_next", key)

    def clear_next(self, key: str, task_id: str) -> bool:
        item = item_name(key, "next")
        with self._translate("clear_next", key):
            client = self._client(key)
            for _ in range(CAS_ATTEMPTS):
                value, cas = client.gets(item)
                if (
                    value is None
                    or (value.decode() if isinstance(value, bytes) else value) != task_id
                ):
                    return False
                # A negative expiry ends the item at once: memcached's delete-if-unchanged.
                stored = client.cas(item, value, cas, expire=-1)
                if stored is not None:
                    if stored:
                        return True
                else:
                    return False
        raise self._changing("clear_next", key)

    def holder(self, key: str) -> Holder | None:
        with self._translate("inspect", key):
            record = decode(self._client(key).get(item_name(key)), key)
        if record is None or record.get("t") is None:
            return None
        return holder_of(record)

    def iter_locks(self, prefix: str, *, page_size: int = 500) -> Iterator[tuple[str, Holder]]:
        """Not supported: memcached cannot list its keys.

        Raises:
            UnsupportedOperation: on the first step of the iteration, always.
        """
        return _unsupported(
            "listing locks is not supported on memcached: it cannot list its keys "
            "(a lock can still be looked up, released or force-released by its key)"
        )

    def close(self) -> None:
        with self._mutex:
            clients, self._clients = (self._clients, {}) if self._pid == os.getpid() else ({}, {})
        for client in clients.values():
            with contextlib.suppress(Exception):
                client.close()
