"""The Redis stores under faults: a failover behind one address, and a store that stalls.

A failover behind one address (a managed service's primary endpoint, a virtual IP) leaves the
connections made before it on the demoted primary, which answers every write with READONLY:
the store drops such a connection and reports itself unavailable (so the task's store-error
policy applies), and the next call connects again, to the new primary. A store that stops
answering costs a bounded wait on every topology.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from singletask import BackendError, BackendTimeout, BackendUnavailable
from singletask.backends import backend_from_url
from singletask.backends.redis.store import CLIENT_DEFAULTS, RedisBackend
from singletask.backends.redis.wire import driver_error, not_run

from ..deployments import FailoverPair, default_binary, wait_until
from ..faultproxy import FaultProxy, address_of
from ..servers import unavailable
from .redis_lock import lock_token

LEASE = 30.0


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[FailoverPair]:
    deployment = FailoverPair(default_binary(), tmp_path)
    try:
        deployment.start()
    except (RuntimeError, OSError) as exc:
        deployment.stop()
        unavailable(f"cannot start a primary and its replica: {exc}")
    yield deployment
    deployment.stop()


def from_url(pair: FailoverPair) -> RedisBackend:
    return RedisBackend.from_url(pair.url + "?socket_timeout=2")


def from_client(pair: FailoverPair) -> RedisBackend:
    return RedisBackend(client=redis.Redis.from_url(pair.url, socket_timeout=2))


BUILDERS: dict[str, Callable[[FailoverPair], RedisBackend]] = {
    "url": from_url,
    "client": from_client,
}


def script_clients(port: int) -> int:
    """How many connections of the server at ``port`` last ran a script or function."""
    with contextlib.closing(redis.Redis(port=port, socket_timeout=5)) as admin:
        return sum(1 for c in admin.client_list() if c.get("cmd") in ("evalsha", "eval", "fcall"))


@pytest.mark.parametrize("made_with", sorted(BUILDERS))
def test_a_demoted_primary_is_dropped_and_the_store_is_unavailable_until_the_address_moves(
    pair: FailoverPair, key_prefix: str, made_with: str
) -> None:
    """READONLY from a primary demoted behind the store's address: BackendUnavailable (not a
    plain BackendError, which no store-error policy handles), the connection is closed, and
    once the address leads to the new primary the next call works there."""
    # Given a store reached through one address, holding a lock on the first primary
    backend = BUILDERS[made_with](pair)
    key = f"{key_prefix}vip"
    assert backend.acquire(key, "held", LEASE).acquired
    with contextlib.closing(redis.Redis(port=pair.first.port)) as first:
        assert first.wait(1, 5000) == 1  # the replica has it
    assert script_clients(pair.first.port) == 1

    # When the replica is promoted and the old primary follows it, the address not moved yet
    pair.failover()

    # Then a write through the address gets READONLY: the store is unavailable
    with pytest.raises(BackendUnavailable, match="cannot take writes") as caught:
        backend.acquire(f"{key}:other", "new", LEASE)
    # (Redis 7 replies READONLY to the script as such, which redis-py 8.1 raises as
    # ReadOnlyError without the code in its text; 6.2 wraps it in a script error)
    cause = caught.value.__cause__
    assert isinstance(cause, redis.exceptions.ResponseError)
    assert isinstance(cause, redis.exceptions.ReadOnlyError) or "READONLY" in str(cause), cause
    # And no connection is kept on the demoted primary
    wait_until(lambda: script_clients(pair.first.port) == 0, "the connection to be closed", 10)

    # When the address moves to the new primary
    assert pair.vip is not None
    pair.vip.repoint(("127.0.0.1", pair.second.port))

    # Then the next calls go there: the lock taken before the failover is still held, and a
    # new one is taken on the new primary
    assert backend.acquire(key, "rival", LEASE).acquired is False
    assert backend.acquire(f"{key}:other", "new", LEASE).acquired
    with contextlib.closing(redis.Redis(port=pair.second.port)) as second:
        assert lock_token(second, f"{key}:other") == "new"
    backend.close()


def test_a_call_that_meets_the_demoted_primary_after_the_address_moved_goes_through(
    pair: FailoverPair, key_prefix: str
) -> None:
    """A connection made before the failover gets READONLY: nothing ran, so the call is made
    once more on a new connection, which reaches the new primary; the caller sees no error."""
    # Given a store with an idle connection to the first primary
    backend = from_url(pair)
    key = f"{key_prefix}moved"
    assert backend.acquire(key, "held", LEASE).acquired
    with contextlib.closing(redis.Redis(port=pair.first.port)) as first:
        assert first.wait(1, 5000) == 1

    # When the primary fails over and the address moves, the idle connection left where it was
    pair.failover()
    assert pair.vip is not None
    pair.vip.repoint(("127.0.0.1", pair.second.port))

    # Then the next release goes through, on the new primary
    assert backend.release(key, "held")
    with contextlib.closing(redis.Redis(port=pair.second.port)) as second:
        assert second.exists(key) == 0
    wait_until(lambda: script_clients(pair.first.port) == 0, "the old connection to be closed", 10)
    backend.close()


# -- a store that stops answering ---------------------------------------------------------------


def finishes_within(seconds: float, call: Callable[[], Any]) -> BaseException | None:
    """Run ``call`` in a thread; fail unless it ends within ``seconds``; return what it raised."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=run, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(seconds)
    assert outcome, f"still blocked after {seconds}s"
    assert time.monotonic() - started < seconds
    return outcome[0]


def test_the_client_defaults_bound_connect_read_and_write() -> None:
    """Without options, a connection waits 5 s at most to connect and for each reply."""
    assert CLIENT_DEFAULTS["socket_timeout"] == 5.0
    assert CLIENT_DEFAULTS["socket_connect_timeout"] == 5.0


def test_a_store_that_stalls_costs_a_bounded_wait(redis_url: str, key_prefix: str) -> None:
    """redis://: a link that goes silent mid-use (the proxy forwards nothing, closes nothing) ->
    BackendTimeout after the socket timeout, for a held connection and for new ones."""
    # Given a store used through a proxy, with a connection already made
    vip = FaultProxy(address_of(redis_url))
    backend = RedisBackend.from_url(f"redis://127.0.0.1:{vip.port}/0?socket_timeout=0.5")
    key = f"{key_prefix}stall"
    try:
        assert backend.acquire(key, "t", LEASE).acquired
        # When the link stalls
        vip.stall()
        # Then each operation fails within its bound: 0.5 s for the reply, and no retry of a
        # timeout (generous margins for a loaded machine)
        for call in (
            lambda: backend.extend(key, "t", LEASE),
            lambda: backend.release(key, "t"),
            lambda: backend.holder(key),
        ):
            raised = finishes_within(5, call)
            assert isinstance(raised, BackendTimeout), raised
            assert isinstance(raised.__cause__, redis.exceptions.TimeoutError)
    finally:
        backend.close()
        vip.close()


def silent_port() -> tuple[FaultProxy, int]:
    """A port that accepts connections and never answers (a stalled proxy)."""
    vip = FaultProxy(("127.0.0.1", 1))  # never reached: the proxy is stalled, connects nowhere
    vip.stall()
    return vip, vip.port


@pytest.mark.parametrize(
    ("url", "options"),
    [
        # the sentinels' own connection options given (a password, say) without timeouts
        ("sentinel://127.0.0.1:{port}/0", {"master_name": "m", "sentinel_kwargs": {"db": 0}}),
        ("sentinel://127.0.0.1:{port}/0", {"master_name": "m"}),
        ("redis+cluster://127.0.0.1:{port}/0", {}),
    ],
    ids=["sentinel-with-sentinel-kwargs", "sentinel", "cluster"],
)
def test_a_sentinel_or_cluster_node_that_stalls_costs_a_bounded_wait(
    url: str, options: dict[str, Any]
) -> None:
    """sentinel:// and redis+cluster://: a node that accepts and never answers fails the call
    with singletask's error (unavailable or timed out) within a few socket timeouts."""
    vip, port = silent_port()
    backend = backend_from_url(
        url.format(port=port), transport_options={**options, "socket_timeout": 0.5}
    )
    try:
        raised = finishes_within(15, lambda: backend.acquire("stall", "t", LEASE))
        assert isinstance(raised, BackendUnavailable | BackendTimeout), repr(raised)
        assert isinstance(raised, BackendError)
        assert raised.__cause__ is not None
    finally:
        with contextlib.suppress(BackendError):
            backend.close()
        vip.close()


def test_a_replicas_refusal_of_the_replica_wait_counts_as_a_write_refused(
    pair: FailoverPair,
) -> None:
    """With ``wait_replicas``, an acquisition on a connection to a demoted master gets, for a
    script that only read (a conflict), the replica's refusal of ``WAIT``: like READONLY, the
    store could not write there, so the call is unavailable and its idle connections dropped."""
    with (
        contextlib.closing(redis.Redis(port=pair.second.port)) as replica,
        pytest.raises(redis.exceptions.ResponseError) as caught,
    ):
        replica.execute_command("WAIT", 1, 100)
    assert not_run(caught.value)
    assert isinstance(driver_error(caught.value, "acquire"), BackendUnavailable)
