"""memcached-only behaviour: URLs, the 30-day expiry limit, eviction, restarts, outages, servers.

The shared behaviour is in test_contract.py (the ``memcached`` param). These tests start their
own memcached servers where they stop, restart or starve one.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator

import pytest
from pymemcache.client.base import Client

from singletask.backends import backend_from_url
from singletask.backends.memcached import (
    MAX_RELATIVE_EXPIRY,
    MemcachedBackend,
    expiry,
    item_name,
    parse_servers,
)
from singletask.exceptions import (
    BackendTimeout,
    BackendUnavailable,
    ConfigurationError,
    UnsupportedOperation,
)

from ..servers import MemcachedServer, private_memcached, unavailable
from .memcached_records import memcached_records

LEASE = 60.0


@pytest.fixture
def own_server() -> Iterator[MemcachedServer]:
    """A memcached of this test's own, which it may stop and start again."""
    try:
        with private_memcached() as server:
            yield server
    except RuntimeError as exc:
        unavailable(f"cannot start a private memcached: {exc}")


@pytest.fixture
def small_server() -> Iterator[MemcachedServer]:
    """A memcached of this test's own with 4 MB for items (``-m 4``), easy to fill."""
    try:
        with private_memcached(memory_mb=4) as server:
            yield server
    except RuntimeError as exc:
        unavailable(f"cannot start a private memcached: {exc}")


@pytest.fixture
def store(memcached_url: str) -> Iterator[MemcachedBackend]:
    backend = MemcachedBackend.from_url(memcached_url)
    yield backend
    backend.close()


@pytest.fixture
def key(key_prefix: str) -> str:
    return f"{key_prefix}lock"


def raw_client(server: MemcachedServer | str) -> Client:
    port = server.port if isinstance(server, MemcachedServer) else int(server.rsplit(":", 1)[1])
    return Client(("127.0.0.1", port), default_noreply=False, timeout=5)


# -- URLs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "servers"),
    [
        ("memcached://cache-1", [("cache-1", 11211)]),
        ("memcached://10.0.0.5:11311", [("10.0.0.5", 11311)]),
        ("memcached://a:1;b:2", [("a", 1), ("b", 2)]),
        ("memcached://a:1,b:2", [("a", 1), ("b", 2)]),
        ("memcached://a:1;memcached://b:2", [("a", 1), ("b", 2)]),
    ],
)
def test_a_url_names_one_or_more_servers(url: str, servers: list[tuple[str, int]]) -> None:
    assert parse_servers(url)[0] == servers


def test_url_options_are_typed_and_checked() -> None:
    """Timeouts and the pool size come from the query string; anything else is refused."""
    _, options = parse_servers("memcached://a:1?timeout=0.5&connect_timeout=2&max_pool_size=8")
    assert options == {"timeout": 0.5, "connect_timeout": 2.0, "max_pool_size": 8}
    with pytest.raises(ConfigurationError, match="unknown option 'noreply'"):
        parse_servers("memcached://a:1?noreply=true")
    with pytest.raises(ConfigurationError, match="bad memcached server"):
        parse_servers("memcached://a:port")


def test_the_scheme_is_registered() -> None:
    backend = backend_from_url("memcached://127.0.0.1:1")
    assert isinstance(backend, MemcachedBackend)
    assert repr(backend) == "<MemcachedBackend 127.0.0.1:1>"


# -- memcached's 30-day expiry limit ---------------------------------------------------------


def test_expiries_are_whole_seconds_with_a_second_to_spare() -> None:
    """memcached's clock ticks in seconds: an item gets one more second than the lease."""
    assert expiry(0.2) == 2
    assert expiry(30.0) == 31
    assert expiry(30.5) == 32
    assert expiry(MAX_RELATIVE_EXPIRY - 1) == MAX_RELATIVE_EXPIRY


def test_a_lease_over_thirty_days_is_refused_and_writes_nothing(
    store: MemcachedBackend, key: str
) -> None:
    """Over 30 days memcached would read the expiry as a Unix time (in 1970: expired at once)."""
    # When a lock is asked for with a 31-day lease
    with pytest.raises(ConfigurationError, match="30 days"):
        store.acquire(key, "token-a", 31 * 24 * 3600.0)

    # Then nothing was written, and a 29-day lease works and lasts
    assert store.holder(key) is None
    assert store.acquire(key, "token-a", 29 * 24 * 3600.0).acquired
    holder = store.holder(key)
    assert holder is not None
    assert holder.ttl is not None
    assert holder.ttl > 28 * 24 * 3600
    # And an extension past the limit is refused too, leaving the lease as it was
    with pytest.raises(ConfigurationError, match="30 days"):
        store.extend(key, "token-a", 40 * 24 * 3600.0)
    assert store.release(key, "token-a")


# -- what memcached cannot do -----------------------------------------------------------------


def test_listing_locks_is_not_supported_and_says_so(store: MemcachedBackend, key: str) -> None:
    """memcached cannot list keys: iter_locks says so plainly on its first step."""
    assert store.acquire(key, "token-a", LEASE).acquired
    iterator = store.iter_locks(key)
    with pytest.raises(UnsupportedOperation, match="listing locks is not supported on memcached"):
        next(iterator)


def test_operator_releases_keep_the_fence_and_the_marker(store: MemcachedBackend, key: str) -> None:
    """release_held_by and force_release free the key; the next holder's fence is larger and it
    still sees the last completion marker; the old holder can neither renew nor release."""
    # Given a key released once with a marker, then held by task id-a
    assert store.acquire(key, "token-0", LEASE).acquired
    assert store.release(key, "token-0", completed="id-0:0")
    held = store.acquire(key, "token-a", LEASE, meta={"task_id": "id-a"})

    # When another task id is named, nothing happens; the holder's id releases it
    assert store.release_held_by(key, "id-b") is None
    removed = store.release_held_by(key, "id-a")

    # Then the holder removed is reported, and the key is free
    assert removed is not None
    assert (removed.token, removed.task_id, removed.fence) == ("token-a", "id-a", held.fence)
    assert store.holder(key) is None
    assert store.extend(key, "token-a", LEASE) is False
    assert store.release(key, "token-a") is False
    # And the next holder gets a larger fence and the marker; a forced release frees it too
    after = store.acquire(key, "token-b", LEASE)
    assert after.acquired
    assert after.fence is not None
    assert held.fence is not None
    assert after.fence > held.fence
    assert after.completed == "id-0:0"
    forced = store.force_release(key)
    assert forced is not None
    assert forced.token == "token-b"
    assert store.force_release(key) is None


def test_every_item_the_store_writes_expires(
    store: MemcachedBackend, memcached_server: MemcachedServer, key: str
) -> None:
    """Lock records, free records, fence counters and follow-up slots all carry an expiry, none
    beyond memcached's 30 days (read from the server's own dump of its items)."""
    # Given every kind of write: acquire, renewal, follow-up claim, release with a marker, and a
    # key acquired and then force-released
    assert store.acquire(key, "token-a", LEASE).acquired
    assert store.extend(key, "token-a", LEASE)
    assert store.claim_next(key, "next-id", LEASE) == "next-id"
    assert store.release(key, "token-a", completed="done")
    assert store.acquire(f"{key}:2", "token-b", LEASE).acquired
    assert store.force_release(f"{key}:2") is not None

    # When the server lists its items of those keys
    records = memcached_records(memcached_server.port, key)

    # Then there are the records, counters and the slot, each with an expiry within 30 days
    assert set(records) == {
        key,
        f"singletask::fence:{key}",
        f"singletask::next:{key}",
        f"{key}:2",
        f"singletask::fence:{key}:2",
    }
    for name, left in records.items():
        assert left is not None, f"{name} never expires"
        assert 0 < left <= MAX_RELATIVE_EXPIRY + 2, (name, left)


def test_keys_memcached_cannot_take_as_they_are_still_work(store: MemcachedBackend) -> None:
    """A key over 250 bytes, or with spaces, is stored under a digest of itself."""
    for key in (f"long:{'x' * 400}", f"spaced key {uuid.uuid4()}", f"ünïcode:{uuid.uuid4()}"):
        assert store.acquire(key, "token-a", LEASE, meta={"task_id": "t"}).acquired
        assert not store.acquire(key, "token-b", LEASE).acquired
        assert store.release(key, "token-a")


# -- eviction, lost fence counters, restarts ---------------------------------------------------


def test_an_evicted_lock_lets_a_second_holder_in_with_a_larger_fence(
    small_server: MemcachedServer,
) -> None:
    """memcached evicts live items under memory pressure: the documented hazard, shown.

    A lock evicted while its holder runs is free for another execution (two run at once); the
    new holder's fence is still larger, and the first holder's next renewal reports the loss.
    """
    store = MemcachedBackend.from_url(small_server.url)
    client = raw_client(small_server)
    # Given a lock held with a long lease (its key as long as the filler's keys)
    first = store.acquire("evict:lock", "token-a", LEASE, meta={"task_id": "a"})
    assert first.acquired

    # When filler items of the lock item's size (memcached evicts within a size class) fill
    # the 4 MB server, never reading the lock
    size = len(client.get(b"evict:lock"))
    for n in range(60_000):
        client.set(f"f{n:09d}".encode(), b"f" * size, expire=600, noreply=True)
    assert int(client.stats()[b"evictions"]) > 0

    # Then the lock was evicted although its lease had 50+ s left, and another token gets it
    assert store.holder("evict:lock") is None
    second = store.acquire("evict:lock", "token-b", LEASE, meta={"task_id": "b"})
    assert second.acquired
    # With a larger fence (the fence counter, evicted too, restarts from the clock)
    assert first.fence is not None
    assert second.fence is not None
    assert second.fence > first.fence
    # And the first holder's renewal and release report that it lost the lock
    assert store.extend("evict:lock", "token-a", LEASE) is False
    assert store.release("evict:lock", "token-a") is False
    client.close()
    store.close()


def test_a_lost_fence_counter_restarts_above_every_earlier_fence(
    store: MemcachedBackend, memcached_url: str, key: str
) -> None:
    """The fence counter is an item memcached may drop: it is re-seeded from the clock."""
    # Given a few acquisitions of a key
    fences = []
    for n in range(3):
        result = store.acquire(key, f"token-{n}", LEASE)
        fences.append(result.fence)
        assert store.release(key, f"token-{n}")

    # When its counter item disappears (eviction, expiry)
    client = raw_client(memcached_url)
    assert client.delete(item_name(key, "fence"), noreply=False)
    client.close()

    # Then the next acquisition still gets a larger fence
    after = store.acquire(key, "token-x", LEASE)
    assert after.fence is not None
    assert all(after.fence > fence for fence in fences if fence is not None)


def test_a_restart_loses_every_lock_and_a_down_server_is_unavailable(
    own_server: MemcachedServer,
) -> None:
    """Stopped: every call fails with BackendUnavailable. Restarted: the locks are gone, a new
    acquisition succeeds with a larger fence, and the old holder cannot renew."""
    store = MemcachedBackend.from_url(f"{own_server.url}?connect_timeout=1&timeout=1")
    held = store.acquire("restart:lock", "token-a", LEASE, meta={"task_id": "a"})
    assert held.acquired

    # When the server stops
    own_server.stop()

    # Then every primitive raises BackendUnavailable, with the driver's error chained
    with pytest.raises(BackendUnavailable) as caught:
        store.acquire("restart:lock", "token-b", LEASE)
    assert caught.value.__cause__ is not None
    for call in (
        lambda: store.extend("restart:lock", "token-a", LEASE),
        lambda: store.release("restart:lock", "token-a"),
        lambda: store.holder("restart:lock"),
        lambda: store.claim_next("restart:lock", "next", LEASE),
    ):
        with pytest.raises(BackendUnavailable):
            call()

    # When it starts again on the same port
    own_server.start()

    # Then the lock is gone; another token gets it with a larger fence; the old holder lost it
    assert store.holder("restart:lock") is None
    after = store.acquire("restart:lock", "token-b", LEASE)
    assert after.acquired
    assert after.fence is not None
    assert held.fence is not None
    assert after.fence > held.fence
    assert store.extend("restart:lock", "token-a", LEASE) is False
    store.close()


def test_a_server_that_does_not_answer_times_out() -> None:
    """A server that accepts connections but never answers: BackendTimeout, not a hang."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        store = MemcachedBackend.from_url(f"memcached://127.0.0.1:{port}?timeout=0.3")
        with pytest.raises(BackendTimeout) as caught:
            store.acquire("silent:lock", "token-a", LEASE)
        assert caught.value.__cause__ is not None
        store.close()


# -- several servers ----------------------------------------------------------------------------


def test_several_servers_keep_each_lock_on_one_and_never_move_it(
    memcached_server: MemcachedServer, own_server: MemcachedServer, key_prefix: str
) -> None:
    """Keys spread over the servers; a down server fails its own keys only, never remaps them."""
    store = MemcachedBackend.from_url(
        f"memcached://127.0.0.1:{memcached_server.port};127.0.0.1:{own_server.port}"
        "?connect_timeout=1&timeout=1"
    )
    keys = [f"{key_prefix}k{n}" for n in range(40)]
    for name in keys:
        assert store.acquire(name, "token-a", LEASE).acquired
    client = raw_client(own_server)
    on_own = {name for name in keys if client.get(name.encode()) is not None}
    client.close()
    assert 0 < len(on_own) < len(keys)  # both servers hold some

    # When one server stops
    own_server.stop()

    # Then its keys are unavailable (not silently free elsewhere); the others still work
    for name in keys:
        if name in on_own:
            with pytest.raises(BackendUnavailable):
                store.acquire(name, "token-b", LEASE)
        else:
            assert not store.acquire(name, "token-b", LEASE).acquired
            assert store.release(name, "token-a")
    store.close()
