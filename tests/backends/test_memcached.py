"""memcached-only behaviour: URLs, the 30-day expiry limit, eviction, restarts, outages, servers.

The shared behaviour is in tests/contract/test_contract.py (the ``memcached`` param). These
tests start their own memcached servers where they stop, restart or starve one.
"""

from __future__ import annotations

import hashlib
import math
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from pymemcache.client.base import Client

from singletask.backends import backend_from_url
from singletask.backends.django import DjangoCacheBackend
from singletask.backends.memcached.store import (
    MAX_RELATIVE_EXPIRY,
    MemcachedBackend,
    expiry,
    item_name,
    parse_servers,
)
from singletask.exceptions import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    ConfigurationError,
    UnsupportedOperation,
)
from singletask.lease import drift_margin

from ..faultproxy import FaultProxy
from ..servers import MemcachedServer, private_memcached, unavailable
from .memcached_records import memcached_records

#: memcached's longest relative expiry (30 days), less the two seconds an item is kept longer.
LONGEST = 30 * 24 * 3600 - 2

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
    with pytest.raises(ConfigurationError, match="a server address is not host"):
        parse_servers("memcached://a:port")


def test_the_scheme_is_registered() -> None:
    backend = backend_from_url("memcached://127.0.0.1:1")
    assert isinstance(backend, MemcachedBackend)
    assert repr(backend) == "<MemcachedBackend 127.0.0.1:1>"


# -- memcached's 30-day expiry limit ---------------------------------------------------------


def test_expiries_are_whole_seconds_with_two_seconds_to_spare() -> None:
    """memcached's clock ticks in seconds and can move by two at one tick: an item gets two more
    seconds than the lease."""
    assert expiry(0.2) == 3
    assert expiry(30.0) == 32
    assert expiry(30.5) == 33
    assert expiry(MAX_RELATIVE_EXPIRY - 2) == MAX_RELATIVE_EXPIRY


def _ticks(client: Client) -> float:
    """The monotonic time of memcached's next tick, from two ticks seen."""
    ticks: list[float] = []
    last = int(client.stats()[b"time"])
    deadline = time.monotonic() + 5
    while len(ticks) < 2:
        if time.monotonic() > deadline:
            pytest.fail("memcached's clock did not tick twice in 5 s")
        time.sleep(0.001)
        now = int(client.stats()[b"time"])
        if now != last:
            ticks.append(time.monotonic())
            last = now
    return ticks[-1] + (ticks[-1] - ticks[-2])


def _next_tick(server: MemcachedServer, client: Client) -> float:
    """The monotonic time of a coming tick of memcached's clock, set 0.6 to 0.95 s past a whole
    second.

    The server is stopped until 0.8 s past the next whole second: its overdue timer then fires
    at once, and a second after each time it ran. Tried again where a loaded machine woke the
    server too late.
    """
    assert server.process is not None
    for _ in range(5):
        server.process.send_signal(signal.SIGSTOP)
        try:
            time.sleep(math.floor(time.monotonic()) + 1.8 - time.monotonic())
        finally:
            server.process.send_signal(signal.SIGCONT)
        tick = _ticks(client)
        if 0.6 <= tick % 1 <= 0.95:
            return tick
    pytest.fail("memcached's clock could not be set to tick 0.6 to 0.95 s past a second")


def test_a_lease_outlives_a_tick_of_memcacheds_clock_that_moves_it_by_two_seconds(
    own_server: MemcachedServer, key: str
) -> None:
    """memcached's clock is its monotonic clock's whole seconds, read by a timer that fires a
    second after it last ran. It fires a little late each time, and when its phase crosses a
    whole second the clock moves by two at one tick (seen in the fault campaign: a 3-second
    lease taken by a rival after 2.4 s). Here the tick is made to cross at once: the server is
    stopped from just before a tick until just past the next whole second."""
    assert own_server.process is not None
    client = raw_client(own_server)
    store = MemcachedBackend.from_url(own_server.url)
    try:
        # Given a lock taken for 1 s just before a tick of memcached's clock
        tick = _next_tick(own_server, client)
        time.sleep(max(0.0, tick - 0.1 - time.monotonic()))
        sent = time.monotonic()
        assert store.acquire(key, "token-a", 1.0).acquired
        # When the server stops before that tick and goes on past the next whole second
        own_server.process.send_signal(signal.SIGSTOP)
        try:
            time.sleep(max(0.0, math.ceil(tick) + 0.1 - time.monotonic()))
        finally:
            own_server.process.send_signal(signal.SIGCONT)
        # Then the lock stays taken for the whole lease, as its holder believes
        believed = sent + 1.0 - drift_margin(1.0)
        tries = 0
        while time.monotonic() < believed - 0.05:
            rival = store.acquire(key, "token-b", 1.0)
            assert not rival.acquired, (
                f"a rival took the lock {time.monotonic() - sent:.2f}s into a 1 s lease"
            )
            tries += 1
            time.sleep(0.02)
        assert tries > 0, "the server's stop took the whole lease: nothing was tried"
    finally:
        store.close()
        client.close()


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


# -- fences only grow, whatever the interleaving ----------------------------------------------


@pytest.mark.parametrize("rival_lease_ends_by", ["expiry", "release"])
def test_an_acquire_paused_before_its_write_never_issues_a_fence_below_a_rivals(
    memcached_url: str, key: str, monkeypatch: pytest.MonkeyPatch, rival_lease_ends_by: str
) -> None:
    """A takes a fence and pauses before it writes; B acquires (a larger fence) and its lease
    ends; A's acquisition then succeeds with a fence above B's, never the one it took first."""
    first = MemcachedBackend.from_url(memcached_url)
    rival = MemcachedBackend.from_url(memcached_url)
    rivals: list[int] = []
    take_fence = first._next_fence

    def pause_after_the_fence(*args: Any, **kwargs: Any) -> int:
        fence = take_fence(*args, **kwargs)
        if not rivals:  # the first time only: the rival's whole lease happens in the pause
            won = rival.acquire(key, "token-b", 1.0)
            assert won.acquired
            assert won.fence is not None
            rivals.append(won.fence)
            if rival_lease_ends_by == "release":
                assert rival.release(key, "token-b")
            deadline = time.monotonic() + 10
            while rival.holder(key) is not None:  # memcached ends the lease in whole seconds
                assert time.monotonic() < deadline, "the rival's lease never ended"
                time.sleep(0.05)
        return fence

    monkeypatch.setattr(first, "_next_fence", pause_after_the_fence)

    # When A's acquisition goes on after the pause
    result = first.acquire(key, "token-a", LEASE)

    # Then it holds the key with a fence above the rival's
    assert result.acquired
    assert result.fence is not None
    assert result.fence > rivals[0]
    holder = first.holder(key)
    assert holder is not None
    assert (holder.token, holder.fence) == ("token-a", result.fence)
    first.close()
    rival.close()


# -- the store's own items and lock keys --------------------------------------------------------


def test_lock_keys_that_spell_the_stores_own_item_names_are_locks_of_their_own(
    store: MemcachedBackend, key: str
) -> None:
    """No lock key, whatever its text, reaches another lock's record, fence counter or follow-up
    slot: keys spelling their item names (old and new) are independent locks."""
    long_key = f"{key}{'x' * 300}"  # stored under a digest of itself
    spelled = [
        f"{key}|fence",
        f"{key}|next",
        f"singletask::fence:{key}",
        f"singletask::next:{key}",
        f"singletask:sha256:{hashlib.sha256(long_key.encode()).hexdigest()}",
    ]
    # Given a lock on the first spelled key, then the key itself held with a pending follow-up,
    # and the long key held
    assert store.acquire(spelled[0], "token-0", LEASE).acquired
    first = store.acquire(key, "token-a", LEASE)
    assert first.acquired
    assert store.claim_next(key, "next-a", LEASE) == "next-a"
    assert store.acquire(long_key, "token-long", LEASE).acquired

    # When every spelled key is locked, claimed and released in turn
    for n, other in enumerate(spelled):
        result = store.acquire(other, f"token-{n}", LEASE)
        assert result.acquired, other
        assert store.claim_next(other, f"next-{n}", LEASE) == f"next-{n}"
        assert store.clear_next(other, f"next-{n}")
        assert store.release(other, f"token-{n}")

    # Then the key and the long key are as they were: same holders, same follow-up
    held = store.holder(key)
    assert held is not None
    assert (held.token, held.fence) == ("token-a", first.fence)
    long_holder = store.holder(long_key)
    assert long_holder is not None
    assert long_holder.token == "token-long"
    assert store.claim_next(key, "next-b", LEASE) == "next-a"
    # And the key's next holder still gets a larger fence
    assert store.release(key, "token-a")
    again = store.acquire(key, "token-c", LEASE)
    assert again.fence is not None
    assert first.fence is not None
    assert again.fence > first.fence


def test_an_item_that_is_not_a_lock_record_is_a_backend_error(
    store: MemcachedBackend, memcached_url: str, key: str
) -> None:
    """Another program's item at a lock's name: a BackendError naming it, not a KeyError."""
    client = raw_client(memcached_url)
    for value in (b"not json", b"[1]", b'{"t": "x"}', b'{"t": "x", "f": "1", "d": 1}'):
        client.set(key.encode(), value, expire=60)
        with pytest.raises(BackendError, match="not a singletask lock record"):
            store.acquire(key, "token-a", LEASE)
        with pytest.raises(BackendError, match="not a singletask lock record"):
            store.holder(key)
    client.close()


# -- the longest lease --------------------------------------------------------------------------


def test_the_longest_lease_is_memcacheds_longest_relative_expiry_less_two_seconds(
    store: MemcachedBackend, memcached_server: MemcachedServer, key: str
) -> None:
    """max_lease is what memcached keeps as a relative expiry; every write checks against it."""
    assert MemcachedBackend.max_lease == LONGEST
    assert DjangoCacheBackend.max_lease == LONGEST

    # When a lock and a follow-up claim are written with the longest lease
    assert store.acquire(key, "token-a", LONGEST).acquired
    assert store.extend(key, "token-a", LONGEST)
    assert store.claim_next(key, "next-a", LONGEST) == "next-a"

    # Then memcached keeps them for 30 days (not read as a date of 1970: gone at once)
    records = memcached_records(memcached_server.port, key)
    for name in (key, f"singletask::next:{key}"):
        left = records[name]
        assert left is not None
        assert LONGEST - 5 < left <= MAX_RELATIVE_EXPIRY + 1, (name, left)

    # And a second more is refused by every write, naming the store and the operation
    other = f"{key}:other"
    calls: list[tuple[str, Callable[[], object]]] = [
        ("acquire", lambda: store.acquire(other, "token-b", LONGEST + 1)),
        ("extend", lambda: store.extend(key, "token-a", LONGEST + 1)),
        ("extend", lambda: store.extend_many([(key, "token-a", LONGEST + 1)])),
        ("claim_next", lambda: store.claim_next(other, "next-b", LONGEST + 1)),
    ]
    for operation, call in calls:
        with pytest.raises(ConfigurationError, match=rf"memcached:// {operation}: .*2591998s"):
            call()
    assert store.holder(other) is None
    assert store.claim_next(other, "next-c", LEASE) == "next-c"


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


@pytest.fixture
def forwarder(memcached_server: MemcachedServer) -> Iterator[FaultProxy]:
    """The session's memcached through a fault proxy (``url_through`` gives its URL)."""
    with FaultProxy(("127.0.0.1", memcached_server.port)) as proxy:
        yield proxy


def url_through(proxy: FaultProxy) -> str:
    return f"memcached://127.0.0.1:{proxy.port}"


def test_every_call_to_a_stalled_server_times_out_within_its_timeout(
    forwarder: FaultProxy, key: str
) -> None:
    """A server that stops answering mid-session: every primitive raises BackendTimeout, with
    the socket's error chained, within the read timeout (each call waits on one reply at most)."""
    store = MemcachedBackend.from_url(f"{url_through(forwarder)}?timeout=0.3&connect_timeout=0.3")
    # Given a lock held and a follow-up claimed through the link
    assert store.acquire(key, "token-a", LEASE).acquired
    assert store.claim_next(key, "next-a", LEASE) == "next-a"

    # When the link stalls
    forwarder.stall()

    # Then every call times out within the timeout (and a margin), none hangs
    calls: list[Callable[[], object]] = [
        lambda: store.acquire(key, "token-b", LEASE),
        lambda: store.extend(key, "token-a", LEASE),
        lambda: store.extend_many([(key, "token-a", LEASE)]),
        lambda: store.release(key, "token-a"),
        lambda: store.claim_next(key, "next-b", LEASE),
        lambda: store.clear_next(key, "next-a"),
        lambda: store.holder(key),
        lambda: store.release_held_by(key, "id-a"),
        lambda: store.force_release(key),
    ]
    for call in calls:
        started = time.monotonic()
        with pytest.raises(BackendTimeout) as caught:
            call()
        assert time.monotonic() - started < 2.0
        assert isinstance(caught.value.__cause__, TimeoutError)
    store.close()


def test_a_connect_that_is_never_answered_times_out() -> None:
    """A server whose accept queue is full (SYNs dropped, as behind a black hole): connecting
    raises BackendTimeout after connect_timeout."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    port = listener.getsockname()[1]
    queued: list[socket.socket] = []
    try:
        for _ in range(16):  # fill the accept queue until a connect is left unanswered
            probe = socket.socket()
            probe.settimeout(0.3)
            queued.append(probe)
            try:
                probe.connect(("127.0.0.1", port))
            except TimeoutError:
                break
        else:
            pytest.skip("this kernel answers every connect; cannot stall one")
        store = MemcachedBackend.from_url(
            f"memcached://127.0.0.1:{port}?connect_timeout=0.5&timeout=0.5"
        )
        started = time.monotonic()
        with pytest.raises(BackendTimeout) as caught:
            store.acquire("stalled:lock", "token-a", LEASE)
        assert time.monotonic() - started < 2.0
        assert isinstance(caught.value.__cause__, TimeoutError)
        store.close()
    finally:
        for sock in (*queued, listener):
            sock.close()


def test_a_pool_with_every_connection_in_use_is_unavailable_at_once(
    forwarder: FaultProxy, key: str
) -> None:
    """With max_pool_size connections all waiting on a stalled server, another call does not
    wait: BackendUnavailable (pymemcache's error chained), so the store-error policy applies."""
    store = MemcachedBackend.from_url(f"{url_through(forwarder)}?timeout=2&max_pool_size=1")
    assert store.holder(key) is None  # the pool's one connection is open
    forwarder.delay_requests(60)  # the server sees no request (and answers none) in the test
    outcomes: list[BaseException] = []

    def wait_on_the_stalled_server() -> None:
        try:
            store.holder(key)
        except Exception as exc:
            outcomes.append(exc)

    waiting = threading.Thread(target=wait_on_the_stalled_server)
    waiting.start()
    deadline = time.monotonic() + 5
    while forwarder.held_requests == 0:  # the one connection waits on the stalled server
        assert time.monotonic() < deadline, "the request never reached the proxy"
        time.sleep(0.01)

    # When another call comes meanwhile
    started = time.monotonic()
    with pytest.raises(BackendUnavailable, match="max_pool_size=1") as caught:
        store.acquire(key, "token-a", LEASE)

    # Then it fails at once, with the driver's error chained
    assert time.monotonic() - started < 1.0
    assert caught.value.__cause__ is not None
    # And the call that held the connection times out
    waiting.join()
    assert [type(exc) for exc in outcomes] == [BackendTimeout]
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
