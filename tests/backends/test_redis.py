"""Redis-only behaviour of RedisBackend and the backend registry, on the private Redis server."""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from singletask import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    ConfigurationError,
    LockKeyError,
)
from singletask.backends import backend_class, backend_from_url, known_schemes
from singletask.backends.memory import MemoryBackend
from singletask.backends.redis.store import RedisBackend, fence_key
from singletask.exceptions import UnknownBackendError
from singletask.protocol.slots import slot_key
from singletask.protocol.tokens import execution_token

from ..faultproxy import FaultProxy, address_of
from ..servers import free_port
from .redis_lock import lock_fields, lock_token

LEASE = 30.0


@pytest.fixture
def redis_backend(redis_url: str, redis_client: redis.Redis) -> Iterator[RedisBackend]:
    backend = RedisBackend.from_url(redis_url)
    yield backend
    backend.close()


@pytest.fixture
def key(key_prefix: str) -> str:
    return f"{key_prefix}lock"


# -- storage format -----------------------------------------------------------------------------


def test_a_lock_is_a_redis_string_with_an_expiry(
    redis_backend: RedisBackend, redis_client: redis.Redis, key: str
) -> None:
    """A plain lock is a Redis string at the lock key (token, fence, metadata), whose PTTL is the
    lease; nothing else is written (docs/architecture.rst; the fields: test_redis_records.py)."""
    # Given / When a lock acquired with metadata and a 30 s lease
    meta = {"task_id": "task-1", "task": "proj.sync", "hostname": "h", "pid": "7", "since": "1.0"}
    assert redis_backend.acquire(key, "token-1", LEASE, meta=meta).acquired

    # Then Redis holds a string with the token and the fencing token, and no companion hash
    assert redis_client.type(key) == b"string"
    assert redis_client.get(key).startswith(b"token-1\0")
    assert lock_token(redis_client, key) == "token-1"
    assert int(lock_fields(redis_client, key)["f"]) > 0
    assert not redis_client.exists(fence_key(key))
    # And the key expires within the lease
    pttl = redis_client.pttl(key)
    assert 0 < pttl <= LEASE * 1000


def test_a_held_lock_written_by_an_execution_is_one_string(
    redis_backend: RedisBackend, redis_client: redis.Redis, key_prefix: str
) -> None:
    """What an execution writes (its token, a UUID task id, the metadata of a worker) is one
    string value (see docs/performance.rst), read back as the metadata given."""
    # Given a lock_args key and the record an execution on a worker writes
    key = f"{key_prefix}proj.tasks.sync_customer:{'86af596c' * 8}"
    task_id = str(uuid.uuid4())
    meta = {
        "task": "proj.tasks.sync_customer",
        "scope": "execution",
        "hostname": "celery@worker-1.example.internal",
        "pid": str(os.getpid()),
        "since": f"{time.time():.3f}",
        "task_id": task_id,
    }

    # When it is acquired
    assert redis_backend.acquire(key, execution_token(task_id, 0), LEASE, meta=meta).acquired

    # Then Redis keeps it as one string, which reads back as the metadata given, but for the
    # start: an execution starts as it takes its lock, so the record says the fence's time (by
    # the Redis server's clock; here, this host's)
    assert redis_client.type(key) == b"string"
    holder = redis_backend.holder(key)
    assert holder is not None
    assert {**holder.meta, "since": meta["since"]} == meta
    assert abs(float(holder.meta["since"]) - float(meta["since"])) < 1.0
    assert holder.fence is not None
    assert holder.meta["since"] == f"{holder.fence // 1000 / 1000:.3f}"


@pytest.mark.parametrize(
    "value", [0.5, -1, "soon", True, float("nan"), 400 * 24 * 3600, 1e300, None]
)
@pytest.mark.parametrize("option", ["fence_retention", "marker_retention"])
def test_an_invalid_retention_is_a_configuration_error(
    redis_url: str, option: str, value: object
) -> None:
    """Each retention is 0 (nothing kept) or seconds from 1 to a year; anything else is refused
    when the store is built, with the option's name."""
    with pytest.raises(ConfigurationError, match=option):
        backend_from_url(redis_url, transport_options={option: value})
    with pytest.raises(ConfigurationError, match=option):
        RedisBackend(url=redis_url, **{option: value})  # type: ignore[arg-type]


def test_release_deletes_the_redis_key(
    redis_backend: RedisBackend, redis_client: redis.Redis, key: str
) -> None:
    """The owner's release removes the key from Redis entirely."""
    # Given a held lock
    assert redis_backend.acquire(key, "token-1", LEASE).acquired

    # When the owner releases it
    assert redis_backend.release(key, "token-1")

    # Then the key does not exist
    assert redis_client.exists(key) == 0


def test_extend_sets_the_redis_pttl(
    redis_backend: RedisBackend, redis_client: redis.Redis, key: str
) -> None:
    """extend() sets the key's PTTL to the new lease."""
    # Given a lock with a 30 s lease
    assert redis_backend.acquire(key, "token-1", LEASE).acquired

    # When the owner shortens it to 5 s
    assert redis_backend.extend(key, "token-1", 5.0)

    # Then Redis has the new expiry
    assert 0 < redis_client.pttl(key) <= 5000


def test_a_client_with_decode_responses_works(redis_url: str, key: str) -> None:
    """A ready client created with decode_responses=True is usable as is."""
    # Given a backend built on a client that decodes replies to str
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    backend = RedisBackend(client=client)
    try:
        # When it acquires, conflicts, inspects, extends and releases
        assert backend.acquire(key, "token-1", LEASE, meta={"task_id": "task-1"}).acquired
        conflict = backend.acquire(key, "token-2", LEASE)
        holder = backend.holder(key)

        # Then every result carries str values
        assert conflict.holder is not None
        assert (conflict.holder.token, conflict.holder.task_id) == ("token-1", "task-1")
        assert holder is not None
        assert (holder.token, holder.task_id, dict(holder.meta)) == (
            "token-1",
            "task-1",
            {"task_id": "task-1"},
        )
        assert backend.extend(key, "token-1", LEASE)
        assert backend.release(key, "token-1")
        assert backend.holder(key) is None
    finally:
        client.close()


def test_a_given_client_is_not_closed_by_the_backend(redis_url: str, key: str) -> None:
    """close() leaves a client the caller passed in alone: the caller owns it."""
    # Given a backend on a caller's client
    client = redis.Redis.from_url(redis_url)
    try:
        backend = RedisBackend(client=client)

        # When the backend is closed
        backend.close()

        # Then the client and the backend still work
        assert client.ping()
        assert backend.acquire(key, "token-1", LEASE).acquired
        assert backend.client is client
    finally:
        client.close()


# -- construction -------------------------------------------------------------------------------


def test_client_and_url_together_are_a_configuration_error(redis_url: str) -> None:
    """RedisBackend takes exactly one of client= and url=: both is an error."""
    client = redis.Redis.from_url(redis_url)
    try:
        with pytest.raises(ConfigurationError, match="exactly one"):
            RedisBackend(client=client, url=redis_url)
    finally:
        client.close()


def test_neither_client_nor_url_is_a_configuration_error() -> None:
    """RedisBackend takes exactly one of client= and url=: neither is an error."""
    with pytest.raises(ConfigurationError, match="exactly one"):
        RedisBackend()


def test_url_query_options_are_honoured(redis_url: str, key: str) -> None:
    """Client options in the URL's query string (socket_timeout, ...) reach the client."""
    # Given a backend URL with client options
    backend = RedisBackend.from_url(f"{redis_url}?socket_timeout=0.75&health_check_interval=7")
    try:
        # When the backend is used
        assert backend.acquire(key, "token-1", LEASE).acquired

        # Then its client was built with them (over the library's defaults)
        kwargs = backend.client.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] == 0.75
        assert kwargs["health_check_interval"] == 7
    finally:
        backend.close()


def test_options_given_to_from_url_reach_the_client(redis_url: str) -> None:
    """Keyword options of from_url are client options too."""
    backend = RedisBackend.from_url(redis_url, socket_timeout=1.5)
    try:
        assert backend.client.connection_pool.connection_kwargs["socket_timeout"] == 1.5
    finally:
        backend.close()


def test_an_invalid_url_option_is_a_configuration_error() -> None:
    """A URL option redis-py cannot parse is a ConfigurationError (when built, or at first use).

    base.py documents ``from_url`` as raising ConfigurationError for an invalid option; a bare
    ValueError from the driver would escape ``except SingletaskError`` handlers.
    """
    url = f"redis://127.0.0.1:{free_port()}/0?socket_timeout=abc"

    def build_and_use() -> None:
        backend = backend_from_url(url)
        backend.acquire("test:invalid-option", "token-1", LEASE)

    # When a backend URL with a malformed option is built and used
    # Then the error is singletask's ConfigurationError naming the option
    with pytest.raises(ConfigurationError, match="socket_timeout"):
        build_and_use()


def test_repr_hides_the_password() -> None:
    """The backend's repr names the server but never the password."""
    backend = RedisBackend.from_url("redis://:s3cret@127.0.0.1:6399/0")
    assert "s3cret" not in repr(backend)
    assert "127.0.0.1:6399" in repr(backend)


# -- errors -------------------------------------------------------------------------------------


def test_an_unreachable_server_raises_backend_unavailable_without_the_password() -> None:
    """Connection refused -> BackendUnavailable, driver error chained, password not shown."""
    # Given a backend on a port nobody listens on, with a password in the URL
    backend = RedisBackend.from_url(f"redis://:s3cret@127.0.0.1:{free_port()}/0")

    # When it is used
    with pytest.raises(BackendUnavailable) as caught:
        backend.acquire("test:unreachable", "token-1", LEASE)

    # Then the error is singletask's, chains redis-py's, and never shows the password
    assert isinstance(caught.value, BackendError)
    assert isinstance(caught.value.__cause__, redis.exceptions.ConnectionError)
    assert "s3cret" not in str(caught.value)
    assert "test:unreachable" in str(caught.value)


@pytest.mark.parametrize("operation", ["release", "extend", "holder"])
def test_every_operation_on_an_unreachable_server_raises_backend_unavailable(
    operation: str,
) -> None:
    """Not only acquire: release, extend and holder translate connection errors too."""
    backend = RedisBackend.from_url(f"redis://127.0.0.1:{free_port()}/0")
    calls = {
        "release": lambda: backend.release("test:unreachable", "token-1"),
        "extend": lambda: backend.extend("test:unreachable", "token-1", LEASE),
        "holder": lambda: backend.holder("test:unreachable"),
    }
    with pytest.raises(BackendUnavailable) as caught:
        calls[operation]()
    assert isinstance(caught.value.__cause__, redis.exceptions.ConnectionError)


class SilentServer:
    """A TCP port that accepts connections and never answers; counts the connections."""

    def __init__(self) -> None:
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.listener.settimeout(0.05)
        self.port = int(self.listener.getsockname()[1])
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                self.accepted.append(self.listener.accept()[0])
            except OSError:
                continue

    def connections(self) -> int:
        """How many connections were made so far (stops accepting, drains the backlog)."""
        self._stop.set()
        self._thread.join(5)
        while True:
            try:
                self.accepted.append(self.listener.accept()[0])
            except OSError:
                return len(self.accepted)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for connection in self.accepted:
            connection.close()
        self.listener.close()


@pytest.fixture
def silent_server() -> Iterator[SilentServer]:
    server = SilentServer()
    yield server
    server.close()


def test_a_server_that_does_not_answer_raises_backend_timeout(silent_server: SilentServer) -> None:
    """A command that gets no reply within socket_timeout -> BackendTimeout."""
    # Given a backend with a short socket timeout on a server that never replies
    url = f"redis://127.0.0.1:{silent_server.port}/0?socket_timeout=0.1"
    backend = RedisBackend.from_url(url)
    try:
        # When it is used / Then the timeout is singletask's, chaining redis-py's
        with pytest.raises(BackendTimeout) as caught:
            backend.acquire("test:silent", "token-1", LEASE)
        assert isinstance(caught.value, BackendError)
        assert isinstance(caught.value.__cause__, redis.exceptions.TimeoutError)
    finally:
        backend.close()


def test_a_timed_out_operation_is_not_retried_over_and_over(silent_server: SilentServer) -> None:
    """A silent server costs one operation at most 3 attempts (the client's 2 retries).

    Each attempt waits socket_timeout, so the attempts bound how long a worker can block on a
    lock operation (with the default socket_timeout of 5 s: 15 s, not minutes).
    """
    # Given a backend on a server that never replies
    backend = RedisBackend.from_url(f"redis://127.0.0.1:{silent_server.port}/0?socket_timeout=0.1")
    try:
        # When one operation times out
        with pytest.raises(BackendTimeout):
            backend.holder("test:silent")
    finally:
        backend.close()

    # Then the server saw at most 3 connection attempts
    assert silent_server.connections() <= 3


def test_a_key_of_the_wrong_type_raises_backend_error(
    redis_backend: RedisBackend, redis_client: redis.Redis, key: str
) -> None:
    """A lock key that holds another Redis type (WRONGTYPE) -> BackendError, key untouched."""
    # Given a plain string at the lock key
    redis_client.set(key, "not a lock", ex=60)

    # When the backend operates on it / Then each operation fails with BackendError
    with pytest.raises(BackendError) as caught:
        redis_backend.acquire(key, "token-1", LEASE)
    assert isinstance(caught.value.__cause__, redis.exceptions.ResponseError)
    assert "WRONGTYPE" in str(caught.value)
    with pytest.raises(BackendError):
        redis_backend.release(key, "token-1")
    with pytest.raises(BackendError):
        redis_backend.extend(key, "token-1", LEASE)
    with pytest.raises(BackendError):
        redis_backend.holder(key)
    # And the key was left as it was
    assert redis_client.get(key) == b"not a lock"


# -- connections --------------------------------------------------------------------------------


def test_an_uncontended_lock_costs_two_round_trips(
    redis_backend: RedisBackend, redis_client: redis.Redis, key: str
) -> None:
    """Acquire and release are one request each, as the server counts requests (read events),
    whether the release records a completion marker or not (two release scripts)."""
    # Given a backend that has already connected and cached its scripts
    for completed in (None, "t:0"):
        assert redis_backend.acquire(f"{key}:warm", "token-0", LEASE).acquired
        assert redis_backend.release(f"{key}:warm", "token-0", completed=completed)

    for completed in (None, "t:0"):
        before = redis_client.info("stats")["total_reads_processed"]

        # When a lock is acquired and released
        assert redis_backend.acquire(key, "token-1", LEASE, meta={"task_id": "t"}).acquired
        assert redis_backend.release(key, "token-1", completed=completed)

        # Then the server read two requests (and the INFO that reads the count)
        after = redis_client.info("stats")["total_reads_processed"]
        assert after - before - 1 == 2


def test_a_slot_acquisition_costs_one_round_trip(
    redis_backend: RedisBackend, redis_client: redis.Redis, key: str
) -> None:
    """acquire_slot reads every slot of a key and takes one in one script: one request, whether
    it takes a slot or finds them all held."""
    # Given a backend that has already connected and cached its scripts
    assert redis_backend.acquire_slot(f"{key}:warm", 3, "token-0", LEASE).acquired
    assert redis_backend.release(f"{key}:warm", "token-0")
    for n in range(3):
        assert redis_backend.acquire_slot(key, 3, f"token-{n}", LEASE).key == slot_key(key, n)
    calls = []

    # When one more slot is taken (of 4) and one acquisition finds all 3 held
    for limit, token in ((4, "token-3"), (3, "token-x")):
        before = redis_client.info("stats")["total_reads_processed"]
        calls.append(redis_backend.acquire_slot(key, limit, token, LEASE))
        after = redis_client.info("stats")["total_reads_processed"]
        # Then the server read one request (and the INFO that reads the count)
        assert after - before - 1 == 1
    assert calls[0].key == slot_key(key, 3)
    assert [h.token for h in calls[1].holders] == ["token-0", "token-1", "token-2"]


def test_a_rated_slot_acquisition_and_a_debounce_cost_one_round_trip_each(
    redis_backend: RedisBackend, redis_client: redis.Redis, key: str
) -> None:
    """acquire_slot with an interval checks and records the rate in the script that takes the
    slot: one request, whether it starts, is refused by the rate, or re-acquires its own slot;
    debounce (pending or not), debounce_published and debounce_take are one request each."""
    # Given a backend that has already connected and cached its scripts
    assert redis_backend.acquire_slot(f"{key}:warm", 2, "token-0", LEASE, interval=60).acquired
    redis_backend.debounce(f"{key}:warm", "send-0", LEASE, pending=LEASE)
    redis_backend.debounce_published(f"{key}:warm", "send-0")
    redis_backend.debounce_take(f"{key}:warm", "send-0")
    calls: list[Callable[[], Any]] = [
        lambda: redis_backend.acquire_slot(key, 2, "token-1", LEASE, interval=60),
        lambda: redis_backend.acquire_slot(key, 2, "token-2", LEASE, interval=60),
        lambda: redis_backend.acquire_slot(key, 2, "token-1", LEASE, interval=60),
        lambda: redis_backend.debounce(key, "send-1", LEASE, pending=LEASE),
        lambda: redis_backend.debounce_published(key, "send-1"),
        lambda: redis_backend.debounce_take(key, "send-1"),
    ]
    outcomes: list[Any] = []
    for call in calls:
        before = redis_client.info("stats")["total_reads_processed"]
        outcomes.append(call())
        after = redis_client.info("stats")["total_reads_processed"]
        # Then the server read one request (and the INFO that reads the count)
        assert after - before - 1 == 1
    started, refused, again, opened, published, taken = outcomes
    assert started.acquired
    assert again.acquired
    assert again.fence == started.fence
    assert not refused.acquired
    assert refused.retry_after is not None
    assert opened == (None, 0.0, None)
    assert published is True
    assert taken == ("send-1", 0.0)


def test_a_rate_record_and_a_debounce_window_are_companions_of_the_key(
    redis_backend: RedisBackend, redis_client: redis.Redis, key_prefix: str
) -> None:
    """The rate record is a string of the server time (µs) of the next allowed start, expiring
    then; the window a hash {l: latest, o: opened ms} kept for the debounce's ttl. Both hash to
    the key's cluster slot and are never listed as locks."""
    from redis.crc import key_slot

    key = f"{key_prefix}{{tenant}}:sync"  # a tagged key: its companions are under the prefix
    rate, window = f"{key}}}:rate", f"{key}}}:debounce"
    # When the key starts with a rate, and a send opens its window
    server_ms = int(redis_client.time()[0]) * 1000
    assert redis_backend.acquire_slot(key, 1, "token-a", LEASE, interval=20).acquired
    assert redis_backend.debounce(key, "send-1", 40) == (None, 0.0, None)

    # Then each is a key of its own, with an expiry, in the key's cluster slot
    allowed = int(redis_client.get(rate) or 0) // 1000
    assert server_ms + 19_000 < allowed <= server_ms + 22_000
    assert 19_000 < redis_client.pttl(rate) <= 20_000
    fields = redis_client.hgetall(window)
    assert fields[b"l"] == b"send-1"
    assert abs(int(fields[b"o"]) - allowed + 20_000) < 2_000
    assert 39_000 < redis_client.pttl(window) <= 40_000
    assert {key_slot(k.encode()) for k in (rate, window)} == {key_slot(key.encode())}
    # And only the lock is listed under the prefix
    assert [name for name, _ in redis_backend.iter_locks(key_prefix)] == [key]


def test_a_take_closes_the_window_keeping_its_record_and_expiry(
    redis_backend: RedisBackend, redis_client: redis.Redis, key: str
) -> None:
    """debounce_take by the latest send deletes field o alone: the hash keeps naming that send,
    with its expiry, and the next send opens a new window over it."""
    window = f"{{{key}}}:debounce"
    # Given a window whose latest send takes it
    assert redis_backend.debounce(key, "send-1", 40) == (None, 0.0, None)
    assert redis_backend.debounce(key, "send-2", 40)[0] == "send-1"
    assert redis_backend.debounce_take(key, "send-2") == ("send-2", 0.0)

    # Then the record stays, closed (no o), naming send-2, its expiry unchanged
    assert redis_client.hgetall(window) == {b"l": b"send-2"}
    assert 39_000 < redis_client.pttl(window) <= 40_000
    # And a take on it returns its latest, changing nothing
    assert redis_backend.debounce_take(key, "send-1") == ("send-2", 0.0)
    assert redis_backend.debounce_take(key, "send-2") == ("send-2", 0.0)
    assert redis_client.hgetall(window) == {b"l": b"send-2"}
    # When a send comes, it opens a new window, keeping the record's longer expiry: send-1,
    # which asked for 40 s, may still start and must find a window naming its successor
    assert redis_backend.debounce(key, "send-3", 10) == (None, 0.0, "send-2")
    fields = redis_client.hgetall(window)
    assert fields[b"l"] == b"send-3"
    assert b"o" in fields
    assert 30_000 < redis_client.pttl(window) <= 40_000
    # And a send asking for longer than the record has left extends it
    assert redis_backend.debounce(key, "send-4", 60)[0] == "send-3"
    assert 59_000 < redis_client.pttl(window) <= 60_000
    # And with no record a take returns None
    redis_client.delete(window)
    assert redis_backend.debounce_take(key, "send-3") == (None, 0.0)


def test_a_rate_record_never_lets_a_start_come_a_rounding_early(
    redis_backend: RedisBackend, redis_client: redis.Redis, key: str
) -> None:
    """ "3/s" spaces starts by a third of a second: the record is kept in microseconds and the
    interval rounded up to the millisecond, never truncated to 333 ms (4 starts a second)."""
    seconds, micros = redis_client.time()
    before_us = int(seconds) * 1_000_000 + int(micros)
    assert redis_backend.acquire_slot(key, 1, "token-a", LEASE, interval=1 / 3).acquired
    allowed_us = int(redis_client.get(f"{{{key}}}:rate") or 0)
    assert allowed_us >= before_us + 333_334


@pytest.mark.parametrize("end", ["}:rate", "}:debounce"])
def test_a_raw_key_naming_a_companion_record_is_refused(
    redis_backend: RedisBackend, key: str, end: str
) -> None:
    """As one ending in '}:fence': such a key may be another lock's companion record."""
    with pytest.raises(LockKeyError, match="companion"):
        redis_backend.acquire(f"{key}{end}", "token-a", LEASE)
    with pytest.raises(LockKeyError, match="companion"):
        redis_backend.acquire_slot(f"{key}{end}", 2, "token-a", LEASE, interval=1)


def test_a_slots_completion_marker_lands_on_its_key(
    redis_backend: RedisBackend, redis_client: redis.Redis, key: str
) -> None:
    """A slot's release records its marker on the key (slot 0), held or free, with the marker's
    retention; the slot keeps nothing (no fence retention by default)."""
    # Given slots 0 and 1 held
    assert redis_backend.acquire_slot(key, 2, "token-0", LEASE).acquired
    assert redis_backend.acquire_slot(key, 2, "token-1", LEASE).acquired
    one = slot_key(key, 1)
    # When slot 1 is released with a marker / Then the held key carries it, its lease unchanged
    assert redis_backend.release(one, "token-1", completed="t-1:0")
    assert redis_client.hget(key, "d") == b"t-1:0"
    assert 0 < redis_client.pttl(key) <= LEASE * 1000
    assert not redis_client.exists(one)
    # And on a key that is free and left nothing, a slot's release leaves a released record {d}
    other = f"{key}:other"
    assert redis_backend.acquire_slot(other, 2, "token-2", LEASE).key == other
    assert redis_backend.acquire_slot(other, 2, "token-3", LEASE).key == slot_key(other, 1)
    assert redis_backend.release(other, "token-2")
    assert not redis_client.exists(other)
    assert redis_backend.release(slot_key(other, 1), "token-3", completed="t-3:0")
    assert redis_client.hgetall(other) == {b"d": b"t-3:0"}
    assert redis_client.pttl(other) > LEASE * 1000
    assert redis_backend.acquire_slot(other, 2, "token-4", LEASE).completed == "t-3:0"


def test_a_connection_dropped_while_idle_is_replaced(
    redis_backend: RedisBackend, redis_client: redis.Redis, key: str
) -> None:
    """Connections the server closed between two calls (restart, timeout) cost no error."""
    # Given a backend holding a lock, whose idle connection the server has since closed
    assert redis_backend.acquire(key, "token-1", LEASE).acquired
    assert redis_client.client_kill_filter(_type="normal", skipme=True) >= 1

    # When the owner releases it / Then the release goes through on a new connection
    assert redis_backend.release(key, "token-1")
    assert redis_client.exists(key) == 0


def test_scripts_flushed_from_the_server_are_sent_again(
    redis_backend: RedisBackend, redis_client: redis.Redis, key: str
) -> None:
    """After SCRIPT FLUSH (or a restart) the scripts are sent once more and work."""
    # Given a backend that has run its scripts, and a server that has forgotten them
    assert redis_backend.acquire(key, "token-1", LEASE).acquired
    redis_client.script_flush()

    # When the backend calls them again / Then they run
    assert redis_backend.extend(key, "token-1", LEASE)
    assert redis_backend.release(key, "token-1")
    assert redis_backend.acquire(key, "token-2", LEASE).acquired


def test_threads_share_a_backend_without_mixing_replies(
    redis_backend: RedisBackend, key: str
) -> None:
    """Concurrent threads each get their own connection, so each gets its own reply."""
    # Given 8 threads, each acquiring and releasing its own key 100 times
    errors: list[str] = []

    def work(number: int) -> None:
        for attempt in range(100):
            token = f"token-{number}-{attempt}"
            result = redis_backend.acquire(f"{key}:{number}", token, LEASE)
            if not (result.acquired and redis_backend.release(f"{key}:{number}", token)):
                errors.append(f"{number}/{attempt}: {result}")

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    # Then every call saw its own outcome
    assert errors == []


# -- fork ---------------------------------------------------------------------------------------


def test_the_client_is_recreated_after_fork(
    redis_backend: RedisBackend, redis_client: redis.Redis, key: str
) -> None:
    """A forked child builds its own client (never shares the parent's sockets) and works."""
    # Given a backend whose client the parent has already used
    assert redis_backend.acquire(f"{key}:parent", "parent-token", LEASE).acquired
    parent_client = redis_backend.client

    # When a forked child uses the same backend object
    with warnings.catch_warnings():
        # Python >= 3.12 warns about fork() in a process with threads; the child below only
        # talks to Redis and leaves with os._exit.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        status = 1
        try:
            fresh = redis_backend.client is not parent_client
            acquired = redis_backend.acquire(key, "child-token", LEASE).acquired
            status = 0 if fresh and acquired else 2
        finally:
            os._exit(status)
    _, wait_status = os.waitpid(pid, 0)

    # Then the child exited cleanly with a client of its own, and its lock is in Redis
    assert os.waitstatus_to_exitcode(wait_status) == 0
    assert lock_token(redis_client, key) == "child-token"
    # And the parent's client still works
    assert redis_backend.client is parent_client
    assert redis_backend.release(f"{key}:parent", "parent-token")


# -- registry -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://localhost:6379/1", RedisBackend),
        ("rediss://:pw@redis.example.com:6380/0", RedisBackend),
        ("unix:///var/run/redis/redis.sock?db=2", RedisBackend),
        ("memory://", MemoryBackend),
    ],
)
def test_backend_from_url_selects_the_class_by_scheme(url: str, expected: type) -> None:
    """The URL scheme picks the backend class; building it connects to nothing."""
    assert backend_class(url) is expected
    backend = backend_from_url(url)
    assert type(backend) is expected
    backend.close()


def test_memory_urls_build_independent_stores() -> None:
    """Each memory:// backend is its own store."""
    first, second = backend_from_url("memory://"), backend_from_url("memory://")
    assert first.acquire("k", "token-1", LEASE).acquired
    assert second.acquire("k", "token-2", LEASE).acquired


def test_an_unknown_scheme_is_an_unknown_backend_error_listing_known_schemes() -> None:
    """An unknown scheme fails with UnknownBackendError (a ConfigurationError and ValueError)."""
    # When a URL with an unregistered scheme is used
    with pytest.raises(UnknownBackendError) as caught:
        backend_from_url("etcd://:s3cret@localhost:2379")

    # Then the error is a configuration error that lists every known scheme
    assert isinstance(caught.value, ConfigurationError)
    assert isinstance(caught.value, ValueError)
    message = str(caught.value)
    assert "'etcd'" in message
    for scheme in ("memory", "redis", "rediss", "unix"):
        assert scheme in message
    assert set(known_schemes()) >= {"memory", "redis", "rediss", "unix"}
    # And it does not show the URL's password
    assert "s3cret" not in message


def test_fences_keep_growing_when_the_key_is_lost(
    redis_backend: RedisBackend, redis_client: redis.Redis, key: str
) -> None:
    """With the lock key evicted or gone, new fences still exceed the old ones (clock)."""
    # Given a fence issued, then the lock deleted behind the backend's back
    first = redis_backend.acquire(key, "token-1", LEASE).fence
    assert first is not None
    redis_client.delete(key)

    # When the key is acquired again
    second = redis_backend.acquire(key, "token-2", LEASE).fence

    # Then its fence is still greater
    assert second is not None
    assert second > first


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("singletask:sync", "{singletask:sync}:fence"),
        ("singletask:{tenant-1}:sync", "singletask:{tenant-1}:sync}:fence"),
        ("{:sync", "{{:sync}:fence"),
    ],
)
def test_the_companion_hash_shares_the_locks_cluster_slot(key: str, expected: str) -> None:
    # Given a lock key with or without a hash tag, the companion key hashes to the same slot
    from redis.crc import key_slot

    assert fence_key(key) == expected
    assert key_slot(fence_key(key).encode()) == key_slot(key.encode())


#: Key prefixes: plain, hash-tagged (every lock in one Cluster slot), with a stray "}".
PREFIXES = ["singletask:", "{app}:singletask:", "app}:", "{}:"]
#: lock_key texts that try to name the companion hash of the lock whose text is "x".
REACHING = ["x:fence", "x}:fence", "{x}:fence", "x%7D:fence", "x:fence}", "x}"]


@pytest.mark.parametrize("prefix", PREFIXES)
def test_no_lock_key_names_another_locks_companion_hash(prefix: str) -> None:
    """Whatever a lock_key's text, its key is never the companion hash of another lock under
    the same prefix (nor of its own)."""
    from singletask.protocol.keys import KeySpec

    spec = KeySpec("tasks.sync", None, None, lambda text: text)
    lock = spec.key(prefix, "tasks.sync", ("x",), {})
    for text in REACHING:
        other = spec.key(prefix, "tasks.sync", (text,), {})
        assert other != fence_key(lock)
        assert lock != fence_key(other)
    for name in ("tasks.sync:x:fence", "tasks.sync:x}:fence"):  # nor a task name
        assert KeySpec(name, None, None, None).key(prefix, name, (), {}) != fence_key(lock)


@pytest.mark.parametrize("prefix", PREFIXES)
def test_a_lock_whose_text_ends_in_fence_leaves_another_locks_follow_up_claim_alone(
    redis_backend: RedisBackend, redis_client: redis.Redis, key_prefix: str, prefix: str
) -> None:
    """The lock key "<...>:x:fence" and the companion hash of the lock "<...>:x" (a coalescing
    task's pending follow-up) are two keys, also under a hash-tagged prefix: taking, renewing
    or releasing the one never touches the other."""
    from singletask.protocol.keys import KeySpec

    spec = KeySpec("tasks.sync", None, None, lambda text: text)
    lock = spec.key(key_prefix + prefix, "tasks.sync", ("x",), {})
    other = spec.key(key_prefix + prefix, "tasks.sync", ("x:fence",), {})
    # Given a held lock with a short lease, and a follow-up claimed for the lock "x"
    assert redis_backend.acquire(other, "holder", 2.0).acquired
    assert redis_backend.claim_next(lock, "follow-up-1", 60.0) == "follow-up-1"

    # Then the held lock keeps its own lease and fields
    assert redis_client.pttl(other) <= 2000
    assert "next" not in lock_fields(redis_client, other)

    # When the held lock is released and taken again
    assert redis_backend.release(other, "holder")
    assert redis_backend.acquire(other, "holder-2", LEASE).acquired
    assert redis_backend.release(other, "holder-2")

    # Then the follow-up claim is still pending: a second claim gets the first
    assert redis_backend.claim_next(lock, "follow-up-2", 60.0) == "follow-up-1"
    assert redis_backend.clear_next(lock, "follow-up-1")


# -- no key without an expiry, whatever a script is given ----------------------------------------


@pytest.mark.parametrize("millis", ["10000000000000000000", "0", "-5", "1.5", "nan", "x"])
def test_a_script_given_a_duration_out_of_range_writes_nothing(
    redis_client: redis.Redis, key: str, millis: str
) -> None:
    """Each script checks its durations before its first write: called directly with one out of
    range (bypassing the backend's own check), it fails and leaves no key behind.

    (The acquire script used to write the lock hash and then fail on PEXPIRE: a lock that never
    expired, so its task was skipped for ever.)
    """
    from singletask.backends.redis import lock_scripts as scripts

    fence = fence_key(key)
    calls = [
        (scripts.ACQUIRE_SCRIPT, [key], ["token-1", millis + "\0"]),
        (scripts.ACQUIRE_HASH_SCRIPT, [key], ["token-1", millis, "", ""]),
        (scripts.CLAIM_NEXT_SCRIPT, [fence], ["task-1", millis]),
    ]
    for script, keys, args in calls:
        # When the script runs with the bad duration / Then it fails, and no key exists
        with pytest.raises(redis.exceptions.ResponseError, match="duration out of range"):
            redis_client.eval(script, len(keys), *keys, *args)
        assert redis_client.exists(key, fence) == 0

    # Given a held lock, extend and release with a bad duration change nothing (a retention
    # may be 0: nothing kept)
    redis_client.eval(scripts.ACQUIRE_SCRIPT, 1, key, "token-1", "30000\0")
    bad_keep = (
        []
        if millis == "0"
        else [
            (scripts.RELEASE_SCRIPT, [key], ["token-1", "done", millis, "0"]),
            (scripts.RELEASE_SCRIPT, [key], ["token-1", "done", "0", millis]),
            (scripts.OPERATOR_RELEASE_SCRIPT, [key], ["", millis, "0"]),
            (scripts.OPERATOR_RELEASE_SCRIPT, [key], ["", "0", millis]),
        ]
    )
    for script, keys, args in [
        (scripts.EXTEND_SCRIPT, [key], ["token-1", millis]),
        (scripts.EXTEND_MANY_SCRIPT, [key, key], ["token-1", "1000", "token-1", millis]),
        *bad_keep,
    ]:
        with pytest.raises(redis.exceptions.ResponseError, match="duration out of range"):
            redis_client.eval(script, len(keys), *keys, *args)
        assert lock_token(redis_client, key) == "token-1"
        assert 20_000 < redis_client.pttl(key) <= 30_000

    # And another owner's acquire with the bad duration is refused, as it would be with a good
    # one (a refusal writes nothing, so the plain acquire does not read the lease for it)
    refused = redis_client.eval(scripts.ACQUIRE_SCRIPT, 1, key, "token-2", millis + "\0")
    assert refused.split(b"\0", 1)[0] == b"token-1"
    assert lock_token(redis_client, key) == "token-1"


# -- an acquire whose reply comes too late ------------------------------------------------------


def test_an_acquire_that_times_out_blocks_the_key_for_one_lease_at_most(
    redis_url: str, redis_client: redis.Redis, key: str
) -> None:
    """The client gave up waiting, but the server ran the acquire: the orphaned lock expires
    within its own lease (nothing renews it), and the connection that would still deliver the
    late reply is never used again."""
    # Given a backend whose store answers its first script call only after its socket timeout
    # (with the script already cached on the server, so that call runs it)
    with RedisBackend.from_url(redis_url) as direct:
        assert direct.acquire(f"{key}:warm-up", "token", LEASE).acquired
        assert direct.release(f"{key}:warm-up", "token")
    proxy = FaultProxy(address_of(redis_url))
    # (the acquire is a function on Redis 7 and later, a script before)
    functions = int(str(redis_client.info("server")["redis_version"]).split(".")[0]) >= 7
    proxy.delay_reply_to(b"FCALL" if functions else b"EVALSHA", 1.5)  # answered late, once
    backend = RedisBackend.from_url(f"redis://127.0.0.1:{proxy.port}/0?socket_timeout=0.5")
    lease = 2.0
    try:
        # When an acquire times out
        with pytest.raises(BackendTimeout):
            backend.acquire(key, "orphan-token", lease)
        # (the server ran it: the key is held by the orphan, with the acquire's lease)
        deadline = time.monotonic() + 10
        while lock_token(redis_client, key) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lock_token(redis_client, key) == "orphan-token"
        assert 0 < redis_client.pttl(key) <= lease * 1000

        # Then the same backend still gets its own replies, not the late one
        holder = backend.holder(key)
        assert holder is not None
        assert holder.token == "orphan-token"
        assert backend.acquire(key, "next-token", LEASE).acquired is False

        # And the key is free again within the lease (generous bound for a loaded machine)
        started = time.monotonic()
        while backend.holder(key) is not None:
            assert time.monotonic() - started < lease + 10, "the orphaned lock outlived its lease"
            time.sleep(0.05)
        assert backend.acquire(key, "next-token", LEASE).acquired
        assert backend.release(key, "next-token")
    finally:
        backend.close()
        proxy.close()


# -- operator primitives ------------------------------------------------------------------------


def commands_run(client: redis.Redis, name: str) -> int:
    """How many times the server has run command ``name`` (INFO commandstats)."""
    stats = client.info("commandstats").get(f"cmdstat_{name}")
    return int(stats["calls"]) if stats else 0


def test_iter_locks_scans_and_leaves_out_keys_that_are_not_locks(
    redis_backend: RedisBackend, redis_client: redis.Redis, key_prefix: str
) -> None:
    """Under the prefix, only held locks are listed: not a released record, nor a companion hash
    (a tagged key keeps it under the prefix), nor another application's string, list or hash.
    SCAN, never KEYS."""
    # Given a lock with a hash tag and a follow-up claim (its companion shares the prefix), a
    # released record, and foreign keys
    lock = f"{key_prefix}{{tenant}}:sync"
    assert redis_backend.acquire(lock, "token-a", LEASE, meta={"task_id": "id-a"}).acquired
    assert redis_backend.claim_next(lock, "id-next", LEASE) == "id-next"
    assert fence_key(lock).startswith(key_prefix)
    released = f"{key_prefix}released"
    assert redis_backend.acquire(released, "token-b", LEASE).acquired
    assert redis_backend.release(released, "token-b", completed="id-b:0")
    assert redis_client.exists(released)
    redis_client.set(f"{key_prefix}string", "x", ex=60)
    redis_client.rpush(f"{key_prefix}list", "x")
    redis_client.expire(f"{key_prefix}list", 60)
    redis_client.hset(f"{key_prefix}hash", "field", "x")
    redis_client.expire(f"{key_prefix}hash", 60)
    keys_before = commands_run(redis_client, "keys")
    scans_before = commands_run(redis_client, "scan")

    # When the prefix is listed in pages of two keys
    found = dict(redis_backend.iter_locks(key_prefix, page_size=2))

    # Then only the lock is there, read with SCAN and never KEYS
    assert list(found) == [lock]
    assert found[lock].task_id == "id-a"
    assert commands_run(redis_client, "keys") == keys_before
    assert commands_run(redis_client, "scan") > scans_before


def test_iter_state_scans_reads_and_writes_nothing_and_leaves_out_foreign_keys(
    redis_backend: RedisBackend, redis_client: redis.Redis, key_prefix: str
) -> None:
    """iter_state lists the companion records that hold something live: not a lock, not a
    0.1.0 fence hash without a follow-up, nor a foreign key whose name looks like a companion
    (another type, or no expiry). SCAN, never KEYS; it writes nothing and renews nothing."""
    # Given a lock with a follow-up claim, a fence hash without one, and look-alikes
    lock = f"{key_prefix}sync"
    assert redis_backend.acquire(lock, "token-a", LEASE).acquired
    assert redis_backend.claim_next(lock, "id-next", LEASE) == "id-next"
    redis_client.hset(fence_key(f"{key_prefix}old"), "fence", "7")
    redis_client.expire(fence_key(f"{key_prefix}old"), 60)
    redis_client.set("{" + key_prefix + "string}:fence", "x", ex=60)  # not a hash
    redis_client.hset("{" + key_prefix + "forever}:debounce", "l", "id-x")  # no expiry
    redis_client.set("{" + key_prefix + "text}:rate", "soon", ex=60)  # not a number
    writing = ("hset", "hdel", "set", "pexpire", "expire", "del", "evalsha", "eval")
    keys_before = commands_run(redis_client, "keys")
    writes_before = [commands_run(redis_client, name) for name in writing]
    ttl_before = redis_client.pttl(fence_key(lock))

    # When the prefix's bookkeeping is listed in pages of one key
    found = list(redis_backend.iter_state(key_prefix, page_size=1))

    # Then only the follow-up is there, found with SCAN, and nothing was renewed
    assert [(state.kind, state.key, state.task_id) for state in found] == [
        ("follow_up", lock, "id-next")
    ]
    assert commands_run(redis_client, "keys") == keys_before
    assert [commands_run(redis_client, name) for name in writing] == writes_before
    assert redis_client.pttl(fence_key(lock)) <= ttl_before
    redis_client.delete("{" + key_prefix + "forever}:debounce")  # the suite's own check


def test_operator_releases_touch_only_held_locks(
    redis_backend: RedisBackend, redis_client: redis.Redis, key_prefix: str
) -> None:
    """A forced release of a companion hash, a released record or a foreign key changes nothing
    and returns None."""
    lock = f"{key_prefix}{{tenant}}:sync"
    assert redis_backend.acquire(lock, "token-a", LEASE, meta={"task_id": "id-a"}).acquired
    assert redis_backend.claim_next(lock, "id-next", LEASE) == "id-next"
    released = f"{key_prefix}released"
    assert redis_backend.acquire(released, "token-b", LEASE, meta={"task_id": "id-a"}).acquired
    assert redis_backend.release(released, "token-b", completed="id-a:0")
    foreign = f"{key_prefix}string"
    redis_client.set(foreign, "x", ex=60)
    for name in (fence_key(lock), released, foreign):
        assert redis_backend.force_release(name) is None
        assert redis_backend.release_held_by(name, "id-a") is None
        assert redis_client.exists(name)
    assert redis_backend.holder(lock) is not None
