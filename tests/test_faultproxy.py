"""The test fault proxy (tests/faultproxy.py) does what the fault tests rely on, in front of a
real redis-server: it forwards, delays, stalls, cuts, refuses, re-points, and leaves no thread
or socket behind."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from .faultproxy import FaultProxy, address_of
from .servers import RedisServer, redis_server_binary, unavailable

#: A margin for timing assertions on a loaded machine.
SLACK = 2.0


@pytest.fixture
def second_redis(tmp_path: Path, redis_url: str) -> Iterator[str]:
    """URL of database 0 of a second redis-server of this test's own."""
    binary = redis_server_binary()
    if binary is None:
        unavailable("no redis-server for a second server")
    assert binary is not None
    server = RedisServer(binary, tmp_path / "second")
    server.start()
    try:
        yield f"{server.url}/0"
    finally:
        server.stop()


@pytest.fixture
def proxy(redis_url: str, redis_client: redis.Redis) -> Iterator[FaultProxy]:
    with FaultProxy(address_of(redis_url)) as proxy:
        yield proxy


def client_through(proxy: FaultProxy, redis_url: str, timeout: float = 5.0) -> redis.Redis:
    return redis.Redis.from_url(
        proxy.url_for(redis_url), socket_timeout=timeout, socket_connect_timeout=timeout
    )


def proxy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("faultproxy-")]


def test_url_for_keeps_everything_but_the_address() -> None:
    with FaultProxy(("127.0.0.1", 1), listen=False) as proxy:
        url = proxy.url_for("postgresql://user:p%40ss@db.example:5432/test?connect_timeout=2")
        assert url == f"postgresql://user:p%40ss@127.0.0.1:{proxy.port}/test?connect_timeout=2"
        assert proxy.url_for("memcached://h:11211") == f"memcached://127.0.0.1:{proxy.port}"
    assert address_of("redis://h:6379/0") == ("h", 6379)
    with pytest.raises(ValueError, match="no host and port"):
        address_of("redis:///0")


def test_it_forwards_many_concurrent_connections(proxy: FaultProxy, redis_url: str) -> None:
    """Forty clients at once, each with a reply larger than one socket buffer."""
    value = b"x" * 300_000

    def round_trip(number: int) -> bool:
        client = client_through(proxy, redis_url)
        try:
            key = f"test:faultproxy:{number}"
            client.set(key, value, px=10_000)
            return client.get(key) == value
        finally:
            client.close()

    with ThreadPoolExecutor(40) as pool:
        assert all(pool.map(round_trip, range(40)))
    assert proxy.accepted >= 40


def test_delay_replies_holds_the_answer_after_the_server_acted(
    proxy: FaultProxy, redis_url: str, redis_client: redis.Redis
) -> None:
    client = client_through(proxy, redis_url, timeout=0.3)
    client.ping()
    proxy.delay_replies(1.0)
    started = time.monotonic()
    with pytest.raises(redis.TimeoutError):
        client.set("test:faultproxy:delayed", "done", px=10_000)
    assert time.monotonic() - started < 0.3 + SLACK
    assert redis_client.get("test:faultproxy:delayed") == b"done"  # the server acted at once
    proxy.delay_replies(0)
    client.close()
    late = client_through(proxy, redis_url)
    late.ping()  # connected first (a connect is several round trips)
    proxy.delay_replies(0.5)
    started = time.monotonic()
    assert late.ping()
    assert 0.5 <= time.monotonic() - started < 0.5 + SLACK
    late.close()


def test_delay_requests_holds_the_command_back(
    proxy: FaultProxy, redis_url: str, redis_client: redis.Redis
) -> None:
    client = client_through(proxy, redis_url, timeout=0.3)
    client.ping()
    proxy.delay_requests(1.0)
    with pytest.raises(redis.TimeoutError):
        client.set("test:faultproxy:request", "done", px=10_000)
    assert redis_client.get("test:faultproxy:request") is None  # not there yet ...
    deadline = time.monotonic() + 1.0 + SLACK
    while redis_client.get("test:faultproxy:request") is None:  # ... then it arrives
        assert time.monotonic() < deadline
        time.sleep(0.05)
    client.close()


def test_stall_blocks_open_and_new_connections_until_resume(
    proxy: FaultProxy, redis_url: str
) -> None:
    open_client = client_through(proxy, redis_url, timeout=0.3)
    open_client.ping()
    proxy.stall()
    with pytest.raises(redis.TimeoutError):
        open_client.ping()
    # a new connection is accepted (no refusal, no reset) but gets no answer
    with socket.create_connection(proxy.address, timeout=2) as raw:
        raw.settimeout(0.3)
        raw.sendall(b"PING\r\n")
        with pytest.raises(socket.timeout):
            raw.recv(16)
        proxy.resume()
        raw.settimeout(2)
        assert raw.recv(16) == b"+PONG\r\n"  # held, then forwarded
    open_client.close()
    fresh = client_through(proxy, redis_url)
    assert fresh.ping()
    fresh.close()


def test_cut_resets_open_connections_and_keeps_listening(proxy: FaultProxy, redis_url: str) -> None:
    with socket.create_connection(proxy.address, timeout=2) as raw:
        raw.sendall(b"PING\r\n")
        assert raw.recv(16) == b"+PONG\r\n"
        proxy.cut()
        with pytest.raises(ConnectionResetError):
            raw.recv(16)
    assert proxy.connections == 0
    client = client_through(proxy, redis_url)
    assert client.ping()
    client.close()


def test_stop_refuses_and_start_listens_again(proxy: FaultProxy, redis_url: str) -> None:
    client = client_through(proxy, redis_url, timeout=1)
    client.ping()
    proxy.stop()
    assert not proxy.listening
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(proxy.address, timeout=1).close()
    with pytest.raises(redis.ConnectionError):
        client.ping()
    proxy.start()
    assert client.ping()  # the client reconnects on the same port
    client.close()


def test_repoint_sends_new_connections_to_another_server(
    proxy: FaultProxy, redis_url: str, second_redis: str
) -> None:
    client = client_through(proxy, redis_url)
    client.set("test:faultproxy:where", "first", px=10_000)
    proxy.repoint(address_of(second_redis), cut=True)
    with contextlib.suppress(redis.ConnectionError):  # the old connection was cut
        client.ping()
    assert client.get("test:faultproxy:where") is None  # a new connection: the second server
    client.set("test:faultproxy:where", "second", px=10_000)
    second = redis.Redis.from_url(second_redis)
    assert second.get("test:faultproxy:where") == b"second"
    second.close()
    client.close()


def test_a_server_that_refuses_looks_like_a_reset() -> None:
    with FaultProxy(("127.0.0.1", 1)) as nowhere, socket.create_connection(nowhere.address) as raw:
        raw.settimeout(2)
        with pytest.raises(ConnectionResetError):
            raw.recv(16)


def test_close_ends_the_thread_and_every_socket(redis_url: str, redis_client: redis.Redis) -> None:
    before = len(proxy_threads())
    proxy = FaultProxy(address_of(redis_url))
    clients = [client_through(proxy, redis_url) for _ in range(5)]
    for client in clients:
        client.ping()
    proxy.stall()  # connections held open, mid-fault
    assert proxy.connections == 5
    proxy.close()
    assert proxy.connections == 0
    assert len(proxy_threads()) == before
    with pytest.raises(RuntimeError):
        proxy.start()
    for client in clients:
        client.close()


def test_the_thread_runs_only_while_there_is_something_to_serve(
    redis_url: str, redis_client: redis.Redis
) -> None:
    with FaultProxy(address_of(redis_url)) as proxy:
        thread_names = {t.name for t in proxy_threads()}
        assert f"faultproxy-{proxy.port}" in thread_names
        proxy.stop()
        deadline = time.monotonic() + SLACK
        while f"faultproxy-{proxy.port}" in {t.name for t in proxy_threads()}:
            assert time.monotonic() < deadline, "the thread outlived the last socket"
            time.sleep(0.01)
        proxy.start()
        client = client_through(proxy, redis_url)
        assert client.ping()
        client.close()


def test_a_delay_can_spare_the_first_replies_and_be_lifted_while_held(
    proxy: FaultProxy, redis_url: str
) -> None:
    client = client_through(proxy, redis_url)
    client.ping()
    proxy.delay_replies(60, after=1)
    assert client.ping()  # the first reply passes
    done = threading.Event()

    def ping() -> None:
        client.ping()
        done.set()

    thread = threading.Thread(target=ping)
    thread.start()
    deadline = time.monotonic() + SLACK
    while proxy.held_replies == 0:  # the second is held
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not done.wait(0.3)
    proxy.delay_replies(0)  # lifting the delay lets what is held go
    assert done.wait(SLACK)
    thread.join()
    client.close()


def test_delay_reply_to_holds_only_the_reply_to_a_matching_request(
    proxy: FaultProxy, redis_url: str, redis_client: redis.Redis
) -> None:
    key = "test:faultproxy:only"
    redis_client.set(key, "v", px=10_000)
    client = client_through(proxy, redis_url)
    client.ping()
    proxy.delay_reply_to(b"GET", 0.5)
    started = time.monotonic()
    assert client.ping()  # other requests pass at once
    assert client.set(f"{key}:other", "w", px=10_000)
    assert time.monotonic() - started < 0.5
    started = time.monotonic()
    assert client.get(key) == b"v"  # the one matching request is answered late
    assert 0.5 <= time.monotonic() - started < 0.5 + SLACK
    started = time.monotonic()
    assert client.get(key) == b"v"  # once: the next one is not
    assert time.monotonic() - started < 0.5
    client.close()


def test_delay_reply_to_finds_a_split_request_and_heal_lets_its_reply_go(
    proxy: FaultProxy, redis_url: str
) -> None:
    proxy.delay_reply_to(b"PING", 60)
    with socket.create_connection(proxy.address, timeout=2) as raw:
        raw.sendall(b"PI")
        time.sleep(0.1)  # two reads for the proxy
        raw.sendall(b"NG\r\n")
        deadline = time.monotonic() + SLACK
        while proxy.held_replies == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        raw.settimeout(0.3)
        with pytest.raises(socket.timeout):
            raw.recv(16)
        proxy.heal()
        raw.settimeout(2)
        assert raw.recv(16) == b"+PONG\r\n"
        raw.sendall(b"PING\r\n")  # healed: no delay left
        assert raw.recv(16) == b"+PONG\r\n"
