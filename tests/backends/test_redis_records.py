"""The Redis lock record: one compact hash per held lock, little or nothing per released key, and
a store shared with singletask 0.1.0 workers during a rolling upgrade (docs/architecture.rst,
"How the stores encode a lock"; docs/performance.rst, "This version")."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from singletask.backends import backend_from_url
from singletask.backends.redis.store import (
    FENCE_RETENTION,
    MARKER_RETENTION,
    RedisBackend,
    fence_key,
)
from singletask.exceptions import ConfigurationError
from singletask.ops.inventory import find_locks
from singletask.protocol.tokens import execution_token, reservation_token

from ..servers import RedisServer, redis_server_binary
from .redis_010 import OldWorker
from .redis_lock import lock_fields

LEASE = 30.0
TASK = "proj.tasks.sync_customer"


@pytest.fixture
def store(redis_url: str, redis_client: redis.Redis) -> Iterator[RedisBackend]:
    backend = RedisBackend.from_url(redis_url)
    yield backend
    backend.close()


def fields_of(client: redis.Redis, key: str) -> dict[str, str]:
    return lock_fields(client, key)


def execution(key_prefix: str, n: int = 0) -> tuple[str, str, dict[str, str]]:
    """A lock_args key, and the token and metadata an execution on a worker writes for it."""
    task_id = str(uuid.UUID(int=n + 1, version=4))
    meta = {
        "task": TASK,
        "scope": "execution",
        "hostname": "celery@worker-1",
        "pid": str(os.getpid()),
        "since": "1763900000.123",
        "task_id": task_id,
    }
    key = f"{key_prefix}{TASK}:{uuid.UUID(int=n).hex * 2}"
    return key, execution_token(task_id, 0), meta


# -- the held record ----------------------------------------------------------------------------


def test_an_executions_lock_is_one_compact_string_and_nothing_else(
    store: RedisBackend, redis_client: redis.Redis, key_prefix: str
) -> None:
    """The lock key alone, one string: token, fence, lease, the since in milliseconds, and each
    metadata field in one letter, with what the token or the key already says left out."""
    # Given the record an execution on a worker writes
    key, token, meta = execution(key_prefix)

    # When it takes the lock
    result = store.acquire(key, token, LEASE, meta=meta)

    # Then the lock key is a string standing for exactly these fields
    assert result.acquired
    # (task id and pid: the token's; scope: execution; since: milliseconds after the fence's)
    assert result.fence is not None
    assert fields_of(redis_client, key) == {
        "token": token,
        "f": str(result.fence),
        "w": "worker-1",  # the node name after "celery@"
        "n": str(len(key_prefix)),  # where the task name stands in the key
        "a": str(result.fence // 1000 - 1763900000123),
    }
    # (the lease in ms, which runs from the fence's time: a refusal reads what is left of it)
    lease = str(int(LEASE * 1000))
    parts = [token, str(result.fence), lease, "1763900000123", "n", str(len(key_prefix)), "w"]
    assert redis_client.get(key) == "\x00".join([*parts, "worker-1"]).encode()
    # And no other key was written (no companion hash)
    assert redis_client.keys(f"*{key_prefix}*") == [key.encode()]
    # And every reader gets the metadata back as it was given
    holder = store.holder(key)
    assert holder is not None
    assert dict(holder.meta) == meta
    assert (holder.token, holder.task_id, holder.fence) == (token, meta["task_id"], result.fence)


@pytest.mark.parametrize(
    ("token", "meta"),
    [
        # A task name the key spells escaped, a since with more digits, another scope, a pid
        # and task id the token does not carry, a field of another version
        (
            "direct:0123abcd",
            {"task": "app:odd%name", "since": "1.5", "scope": "future", "pid": "7", "x": "1"},
        ),
        # A task id and pid that differ from the token's, a task name missing from the key
        ("t-1:0:AAAAAAAA:99:nonce0", {"task_id": "t-2", "pid": "98", "task": "elsewhere"}),
        # Values that look like the compact ones
        ("tok", {"task_id": "", "pid": "", "since": "0100.000", "scope": "q", "i": "x"}),
        # An execution's token with no task id, pid or scope given; a since before the fence
        ("t-1:0:AAAAAAAA:99:nonce0", {"since": "1000000000.001", "hostname": "celery@"}),
        ("t-1:0:AAAAAAAA:99:nonce0", {"scope": "execution", "task_id": "t-1", "hostname": "x"}),
        ("reserved-token", {}),
    ],
)
def test_the_compact_record_reads_back_exactly_the_metadata_given(
    store: RedisBackend, key_prefix: str, token: str, meta: dict[str, str]
) -> None:
    key = f"{key_prefix}some.task:suffix"
    assert store.acquire(key, token, LEASE, meta=meta).acquired
    holder = store.holder(key)
    assert holder is not None
    assert dict(holder.meta) == meta
    assert holder.task_id == meta.get("task_id")
    listed = dict(store.iter_locks(key_prefix))
    assert dict(listed[key].meta) == meta


def test_a_reservation_reads_back_its_task_id_from_its_token(
    store: RedisBackend, redis_client: redis.Redis, key_prefix: str
) -> None:
    """A lock reserved when a message is sent (lock_scope "queue") stores its task id once."""
    key = f"{key_prefix}{TASK}"
    meta = {"task_id": "msg-1", "task": TASK, "scope": "queue", "since": "1763900000.000"}
    assert store.acquire(key, reservation_token("msg-1", 0), LEASE, meta=meta).acquired
    assert "i" not in fields_of(redis_client, key)  # the token's
    conflict = store.acquire(key, "another", LEASE)
    assert conflict.holder is not None
    assert conflict.holder.task_id == "msg-1"


def test_held_locks_cost_at_most_350_bytes_of_redis_memory_each(
    redis_url: str, tmp_path: Path
) -> None:
    """The issue's bound, on the server's own accounting: used_memory grows by at most about 350
    bytes per held lock an execution takes, with the default key prefix, a lock_args key and a
    worker node name as Kubernetes makes them.

    (A server of its own, so that no other test's keys move used_memory meanwhile.)
    """
    binary = redis_server_binary()
    assert binary is not None  # the session's server started with it
    server = RedisServer(binary, tmp_path)
    server.start()
    url = f"{server.url}/0"
    client = redis.Redis.from_url(url)
    count = 16_000  # enough to spread the server's fixed costs and its tables' steps
    keys = [f"singletask:{TASK}:{uuid.UUID(int=n).hex * 2}" for n in range(count)]
    try:
        with RedisBackend.from_url(url) as store:
            before = int(client.info("memory")["used_memory"])
            for n, key in enumerate(keys):
                task_id = str(uuid.UUID(int=n + 1, version=4))
                meta = {
                    "task": TASK,
                    "scope": "execution",
                    "hostname": "celery@worker-7d9f8c6b5-x2k4p",  # a Kubernetes pod
                    "pid": str(os.getpid()),
                    "since": f"{time.time():.3f}",
                    "task_id": task_id,
                }
                assert store.acquire(key, execution_token(task_id, 0), LEASE, meta=meta).acquired
            grown = (int(client.info("memory")["used_memory"]) - before) / count
    finally:
        client.close()
        server.stop()
    assert grown <= 350, f"{grown:.0f} bytes per held lock"


# -- what a released key keeps ------------------------------------------------------------------


def test_by_default_a_release_without_a_marker_leaves_nothing(
    store: RedisBackend, redis_client: redis.Redis, key_prefix: str
) -> None:
    # Given a held lock
    key, token, meta = execution(key_prefix)
    first = store.acquire(key, token, LEASE, meta=meta).fence
    assert first is not None

    # When it is released without a completion marker
    assert store.release(key, token)

    # Then no key is left, and the next fence is still greater (the server's clock)
    assert redis_client.keys(f"*{key_prefix}*") == []
    again = store.acquire(key, "token-2", LEASE).fence
    assert again is not None
    assert again > first
    assert (store.fence_retention, store.marker_retention) == (FENCE_RETENTION, MARKER_RETENTION)
    assert (FENCE_RETENTION, MARKER_RETENTION) == (0.0, 86400.0)


def test_a_release_with_a_marker_leaves_a_released_record_for_the_marker_retention(
    store: RedisBackend, redis_client: redis.Redis, key_prefix: str
) -> None:
    # Given a held lock
    key, token, meta = execution(key_prefix)
    first = store.acquire(key, token, LEASE, meta=meta).fence

    # When it is released with a completion marker
    assert store.release(key, token, completed=f"{meta['task_id']}:0")

    # Then the key holds only its last fence and the marker, for a day, and is not a lock
    assert fields_of(redis_client, key) == {"f": str(first), "d": f"{meta['task_id']}:0"}
    assert 86_300_000 < redis_client.pttl(key) <= 86_400_000
    assert store.holder(key) is None
    assert dict(store.iter_locks(key_prefix)) == {}
    # And the next acquisition sees the marker and gets a greater fence
    again = store.acquire(key, "token-2", LEASE)
    assert again.completed == f"{meta['task_id']}:0"
    assert first is not None
    assert again.fence is not None
    assert again.fence > first


def test_the_last_marker_is_carried_through_later_holds_that_record_none(
    store: RedisBackend, key_prefix: str
) -> None:
    """Only the key's last completion is remembered, as long as its marker retention: a later
    execution that ends without completing (Ignore, requeue) does not forget it."""
    key = f"{key_prefix}k"
    assert store.acquire(key, "a", LEASE).acquired
    assert store.release(key, "a", completed="task-a:0")
    assert store.acquire(key, "b", LEASE).completed == "task-a:0"
    assert store.release(key, "b")
    assert store.acquire(key, "c", LEASE).completed == "task-a:0"


@pytest.mark.parametrize(
    ("options", "fields", "ttl"),
    [
        ({"fence_retention": 3600, "marker_retention": 0}, {"f"}, 3600),
        ({"fence_retention": 3600}, {"f", "d"}, 86400),
        ({"fence_retention": 3600, "marker_retention": 60}, {"f", "d"}, 3600),
        ({"fence_retention": 60, "marker_retention": 3600}, {"f", "d"}, 3600),
        ({"marker_retention": 0}, None, None),
    ],
)
def test_the_retentions_set_what_a_released_key_keeps_and_for_how_long(
    redis_url: str,
    redis_client: redis.Redis,
    key_prefix: str,
    options: dict[str, float],
    fields: set[str] | None,
    ttl: int | None,
) -> None:
    """fence_retention keeps the last fence of every release; marker_retention a release's
    completion marker; the record lasts as long as the longer of the two that applies."""
    key = f"{key_prefix}k"
    with backend_from_url(redis_url, transport_options=options) as backend:
        assert backend.acquire(key, "a", LEASE).acquired
        assert backend.release(key, "a", completed="task-a:0")
        if fields is None:
            assert not redis_client.exists(key)
        else:
            assert set(fields_of(redis_client, key)) == fields
            assert (ttl - 60) * 1000 < redis_client.pttl(key) <= ttl * 1000


def test_a_kept_fence_outranks_a_server_clock_set_back(
    redis_url: str, redis_client: redis.Redis, key_prefix: str
) -> None:
    """With fence_retention, a released record whose fence is ahead of the server's clock (as
    after the clock was stepped back) keeps the key's fences growing."""
    key = f"{key_prefix}k"
    ahead = 4 * 10**15  # year 2096 in microseconds, exact in a Lua number
    redis_client.hset(key, "f", ahead)
    redis_client.pexpire(key, 60_000)
    with backend_from_url(redis_url, transport_options={"fence_retention": 60}) as backend:
        assert backend.acquire(key, "a", LEASE).fence == ahead + 1
        assert backend.acquire(key, "b", LEASE, takeover_prefix="a").fence == ahead + 2
        assert backend.release(key, "b")
        assert int(redis_client.hget(key, "f")) == ahead + 2
        assert backend.acquire(key, "c", LEASE).fence == ahead + 3


def test_an_operator_release_leaves_what_a_release_leaves(
    redis_url: str, redis_client: redis.Redis, key_prefix: str
) -> None:
    key, token, meta = execution(key_prefix)
    with backend_from_url(redis_url, transport_options={"fence_retention": 60}) as backend:
        fence = backend.acquire(key, token, LEASE, meta=meta).fence
        removed = backend.release_held_by(key, meta["task_id"])
        assert removed is not None
        assert dict(removed.meta) == meta
        assert fields_of(redis_client, key) == {"f": str(fence)}
        assert backend.release_held_by(key, meta["task_id"]) is None
    with RedisBackend.from_url(redis_url) as default:
        assert default.acquire(key, token, LEASE, meta=meta).acquired
        assert default.force_release(key) is not None
        assert not redis_client.exists(key)


def test_a_follow_up_claim_keeps_its_companion_hash_only_as_long_as_the_claim(
    store: RedisBackend, redis_client: redis.Redis, key_prefix: str
) -> None:
    key = f"{key_prefix}k"
    assert store.claim_next(key, "next-1", 20.0) == "next-1"
    assert 19_000 < redis_client.pttl(fence_key(key)) <= 20_000
    assert store.clear_next(key, "next-1")


# -- a rolling upgrade: 0.1.0 and this version on one store --------------------------------------


def test_a_010_holder_excludes_a_new_worker_and_reads_as_it_did(
    store: RedisBackend, redis_client: redis.Redis, key_prefix: str
) -> None:
    # Given a lock taken by a 0.1.0 worker
    key, _, meta = execution(key_prefix)
    taken = OldWorker(redis_client).acquire(
        key, "old-task:0:f805907e2752:12:9df9d448", 30_000, meta
    )
    assert taken[0] == 1

    # When a new worker tries it
    result = store.acquire(key, "new-token", LEASE)

    # Then it is locked out and sees the old holder's task id and fence; every reader shows the
    # old record's metadata
    assert not result.acquired
    assert result.holder is not None
    assert result.holder.task_id == meta["task_id"]
    assert result.holder.fence == int(taken[1])
    holder = store.holder(key)
    assert holder is not None
    assert dict(holder.meta) == meta
    (record,) = find_locks(store, key_prefix)
    assert (record.task, record.hostname, record.fence) == (TASK, "celery@worker-1", int(taken[1]))


def test_a_new_holder_excludes_a_010_worker(
    store: RedisBackend, redis_client: redis.Redis, key_prefix: str
) -> None:
    """A plain lock of this version is a string, which 0.1.0's acquire cannot read: it fails
    with WRONGTYPE before writing anything, so it never takes the key (it is not refused
    cleanly: its worker's store-error handling applies). A hash lock of this version (here a
    holder slot's) refuses it as before."""
    key, token, meta = execution(key_prefix)
    assert store.acquire(key, token, LEASE, meta=meta).acquired
    with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
        OldWorker(redis_client).acquire(key, "old-token", 30_000, meta)
    assert lock_fields(redis_client, key)["token"] == token
    assert store.release(key, token)
    assert store.acquire_slot(key, 2, token, LEASE, meta=meta).acquired
    old = OldWorker(redis_client).acquire(key, "old-token", 30_000, meta)
    assert old[0] == 0
    assert old[1].decode() == token
    assert store.release(key, token)


def test_with_lock_record_hash_every_lock_is_a_hash_that_older_workers_read(
    redis_url: str, redis_client: redis.Redis, key_prefix: str
) -> None:
    """The transport option for a rolling upgrade from 0.3.0 or earlier: the plain acquire writes
    the hash those versions read, so their acquire is refused cleanly instead of failing."""
    store = backend_from_url(redis_url, transport_options={"lock_record": "hash"})
    assert isinstance(store, RedisBackend)
    key, token, meta = execution(key_prefix)
    try:
        taken = store.acquire(key, token, LEASE, meta=meta)
        assert taken.acquired
        assert redis_client.type(key) == b"hash"
        old = OldWorker(redis_client).acquire(key, "old-token", 30_000, meta)
        assert (old[0], old[1].decode()) == (0, token)
        holder = store.holder(key)
        assert holder is not None
        assert (dict(holder.meta), holder.fence) == (meta, taken.fence)
        assert store.release(key, token)
        assert not redis_client.exists(key)
    finally:
        store.close()


def test_lock_record_takes_string_or_hash_only(redis_url: str) -> None:
    with pytest.raises(ConfigurationError, match="lock_record: expected one of string, hash"):
        backend_from_url(redis_url, transport_options={"lock_record": "json"})


def test_a_010_worker_taking_a_released_record_hands_the_key_back_in_order(
    store: RedisBackend, redis_client: redis.Redis, key_prefix: str
) -> None:
    """0.1.0 sees a released record as free and writes its lock over it; a new worker then
    reads that lock (its fence, not the record's) and, once it is released, takes the key with a
    greater fence."""
    key, token, meta = execution(key_prefix)
    first = store.acquire(key, token, LEASE, meta=meta).fence
    assert store.release(key, token, completed="done:0")
    old = OldWorker(redis_client)
    taken = old.acquire(key, "old-token", 30_000, meta)
    assert taken[0] == 1
    holder = store.holder(key)
    assert holder is not None
    assert holder.fence == int(taken[1])
    assert first is not None
    assert int(taken[1]) > first
    assert not store.acquire(key, "new", LEASE).acquired
    assert old.release(key, "old-token")
    again = store.acquire(key, "new", LEASE).fence
    assert again is not None
    assert again > int(taken[1])


def test_executions_leave_a_marker_only_for_acks_late_tasks(
    redis_url: str, redis_client: redis.Redis, key_prefix: str
) -> None:
    """A message acknowledged before its body ran cannot come back once it has run, so its key
    keeps nothing; an acks_late message's completion is recorded for its redelivered copies."""
    import celery

    from singletask import SingletonTask

    app = celery.Celery("records", set_as_current=False)
    app.conf.update(
        task_always_eager=True, singletask_backend_url=redis_url, singletask_key_prefix=key_prefix
    )

    @app.task(base=SingletonTask, shared=False, lazy=False, name="records.early")
    def early() -> None: ...

    @app.task(base=SingletonTask, shared=False, lazy=False, name="records.late", acks_late=True)
    def late() -> None: ...

    early.apply(task_id="early-1")
    late.apply(task_id="late-1")
    time.sleep(0.05)
    assert not redis_client.exists(f"{key_prefix}records.early")
    assert fields_of(redis_client, f"{key_prefix}records.late")["d"] == "late-1:0"
