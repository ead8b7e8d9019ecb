"""Sentinel, Cluster and TLS lock stores: their URLs, and what failovers and resharding do.

The contract suite runs on each deployment through the ``backend`` fixture (tests/conftest.py);
this module covers what only they have. Tests that fail a master over or move a slot start a
deployment of their own, so that the session's stays as it was.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from singletask.backends import backend_from_url
from singletask.backends.redis.deploy import RedisClusterBackend, RedisSentinelBackend
from singletask.backends.redis.options import mask
from singletask.backends.redis.store import FENCE_RETENTION, MARKER_RETENTION
from singletask.exceptions import (
    BackendError,
    BackendUnavailable,
    ConfigurationError,
    LockKeyError,
)
from singletask.protocol.slots import companion_key, slot_key, slot_keys
from singletask.protocol.tokens import reservation_token

from ..deployments import (
    ClusterDeployment,
    SentinelDeployment,
    TLSServer,
    default_binary,
    wait_until,
)
from ..servers import unavailable

LEASE = 30.0


def own(deployment: Any, tmp_path: Path) -> Any:
    """Start ``deployment`` (a class of tests/deployments.py) for one test."""
    instance = deployment(default_binary(), tmp_path)
    try:
        instance.start()
    except (RuntimeError, OSError) as exc:
        instance.stop()
        unavailable(f"cannot start a {deployment.__name__}: {exc}")
    return instance


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[ClusterDeployment]:
    deployment = own(ClusterDeployment, tmp_path)
    yield deployment
    deployment.stop()


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[SentinelDeployment]:
    deployment = own(SentinelDeployment, tmp_path)
    yield deployment
    deployment.stop()


class Renewal(threading.Thread):
    """Extends one lock every 50 ms, as the renewer of a running task does, and records what
    each attempt gave: True, False (the lock is not ours any more) or the exception raised."""

    def __init__(self, backend: Any, key: str, token: str) -> None:
        super().__init__(daemon=True)
        self.backend, self.key, self.token = backend, key, token
        self.outcomes: list[object] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.05):
            try:
                self.outcomes.append(self.backend.extend(self.key, self.token, LEASE))
            except Exception as exc:
                self.outcomes.append(exc)

    def stop(self) -> list[object]:
        self.halt.set()
        self.join(10)
        return self.outcomes


def raw_errors(outcomes: list[object]) -> list[object]:
    """The outcomes that are neither a renewal's answer nor singletask's own error."""
    return [o for o in outcomes if not isinstance(o, bool | BackendError)]


# -- URLs and options ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "options", "message"),
    [
        ("sentinel://h:26379/0", {}, "master_name"),
        ("sentinel://h:26379/0;redis://h:1", {"master_name": "m"}, "every URL must be sentinel"),
        ("sentinel://h:bad/0", {"master_name": "m"}, "invalid port"),
        ("sentinel://h:26379/x", {"master_name": "m"}, "database number"),
        ("sentinel://h:26379/0?nope=1", {"master_name": "m"}, "unknown option 'nope'"),
        ("sentinel://h:26379/0", {"master_name": "m", "colour": 1}, "unknown option 'colour'"),
        ("sentinel://h:26379/0", {"master_name": "m", "sentinel_kwargs": 3}, "sentinel_kwargs"),
        ("sentinel://h/0", {"master_name": "m", "wait_replicas": -1}, "wait_replicas"),
        ("sentinel://h/0", {"master_name": "m", "wait_replicas": 1, "wait_timeout": 0}, "0"),
        (
            "redis+cluster://h:7000?socket_timeout=1",
            {"wait_replicas": 1, "wait_timeout": 2},
            "less than socket_timeout",
        ),
        ("redis+cluster://h:7000/1", {}, "database 0 only"),
        ("redis+cluster:///0", {}, "no node address"),
        ("redis+cluster://h:7000?ssl_cert_reqs=required", {}, r"rediss\+cluster"),
        ("rediss+cluster://h:7000?ssl_cert_reqs=maybe", {}, "ssl_cert_reqs"),
        ("redis+cluster://h:7000", {"master_name": "m"}, "unknown option 'master_name'"),
        ("redis+cluster://h:7000", {"dynamic_startup_nodes": "maybe"}, "dynamic_startup_nodes"),
        ("redis+cluster://h:7000", {"socket_timeout": "soon"}, "socket_timeout"),
        ("redis://h:6379/0", {"master_name": "m"}, "needs a sentinel:// URL"),
        ("redis://h:6379/0", {"wait_replicas": 1}, r"sentinel:// and redis\+cluster://"),
        ("redis://h:6379/0", {"ssl_ca_certs": "/ca.pem"}, "rediss://"),
        ("sqlite:///x.db", {"socket_timeout": 1}, "takes no transport options"),
    ],
)
def test_a_bad_url_or_option_is_a_configuration_error(
    url: str, options: dict[str, object], message: str
) -> None:
    """Malformed deployment URLs and options fail when the backend is built, saying why."""
    # When a backend is built from the URL and transport options, Then it is refused
    with pytest.raises(ConfigurationError, match=message):
        backend_from_url(url, transport_options=options)


@pytest.mark.parametrize(
    "url",
    [
        "sentinel://:s3cret@127.0.0.1:1/0;sentinel://:s3cret@127.0.0.1:2/0",
        "sentinel://user:s3cret@127.0.0.1:1/0;sentinel://127.0.0.1:2/0",
        "redis+cluster://user:s3cret@127.0.0.1:1,127.0.0.1:2/0",
        "rediss+cluster://:s3cret@127.0.0.1:1/0",
    ],
)
def test_passwords_never_appear_in_reprs_or_errors(url: str) -> None:
    """The password of every URL form is masked in the backend's repr and its errors."""
    # Given a backend on a URL with a password, where no server listens
    options: dict[str, object] = {"socket_connect_timeout": 0.2}
    if url.startswith("sentinel"):
        options["master_name"] = "m"
    backend = backend_from_url(url, transport_options=options)
    # Then its repr hides the password
    assert "s3cret" not in repr(backend)
    assert "**" in repr(backend)
    # And so does the error of a call that cannot connect
    with pytest.raises(BackendError) as failed:
        backend.acquire("k", "t", 1.0)
    assert "s3cret" not in str(failed.value)
    backend.close()
    assert "s3cret" not in mask(url)


def test_cluster_and_sentinel_options_reach_the_client() -> None:
    """TLS and socket options from the URL and the transport options end up in the client's
    connection settings (the URL's win), without connecting anywhere."""
    # Given a cluster URL with TLS options in the query and more in the transport options
    backend = backend_from_url(
        "rediss+cluster://u:p@127.0.0.1:7000/0?ssl_cert_reqs=none&socket_timeout=2",
        transport_options={"ssl_ca_certs": "/ca.pem", "socket_timeout": 9, "wait_replicas": 1},
    )
    assert isinstance(backend, RedisClusterBackend)
    # When its options are worked out, Then they are redis-py's, converted
    _, options = backend._target(backend._url or "")
    assert options["ssl"] is True
    assert options["ssl_cert_reqs"] == 0  # ssl.CERT_NONE
    assert options["ssl_ca_certs"] == "/ca.pem"
    assert options["socket_timeout"] == 2.0
    assert options["username"] == "u"
    assert options["password"] == "p"
    # And a Sentinel URL gives its credentials and database to the master
    sentinel = backend_from_url(
        "sentinel://:pw@127.0.0.1:1/3;sentinel://127.0.0.1:2",
        transport_options={"master_name": "m", "ssl": True},
    )
    assert isinstance(sentinel, RedisSentinelBackend)
    nodes, master = sentinel._target(sentinel._url or "")
    assert nodes == [("127.0.0.1", 1), ("127.0.0.1", 2)]
    assert master == {"password": "pw", "db": 3, "ssl": True}
    # And both take the retentions of what a released key keeps (nothing, and a day for a
    # completion marker, without them)
    assert (backend.fence_retention, backend.marker_retention) == (
        FENCE_RETENTION,
        MARKER_RETENTION,
    )
    kept = backend_from_url(
        "sentinel://127.0.0.1:1",
        transport_options={"master_name": "m", "fence_retention": 60, "marker_retention": 0},
    )
    assert isinstance(kept, RedisSentinelBackend)
    assert (kept.fence_retention, kept.marker_retention) == (60.0, 0.0)
    for option in ("fence_retention", "marker_retention"):
        with pytest.raises(ConfigurationError, match=option):
            backend_from_url("redis+cluster://127.0.0.1:7000", transport_options={option: 0.5})


def test_rediss_checks_the_server_certificate(redis_tls: TLSServer) -> None:
    """A real TLS server: with its CA the lock store works; without, the connection is refused
    by certificate verification (``ssl_cert_reqs=required``), reported as unavailable."""
    # Given a TLS-only server, and a URL that trusts its CA, with a client certificate
    url = redis_tls.url(
        ssl_certfile=str(redis_tls.certs / "client.crt"),
        ssl_keyfile=str(redis_tls.certs / "client.key"),
    )
    with backend_from_url(url) as backend:
        # Then locks work over TLS
        assert backend.acquire(f"tls:{uuid.uuid4().hex}", "t", LEASE).acquired
    # And the same options as transport options work too
    plain = f"rediss://127.0.0.1:{redis_tls.port}/0"
    options = {"ssl_cert_reqs": "CERT_REQUIRED", "ssl_ca_certs": str(redis_tls.certs / "ca.crt")}
    with backend_from_url(plain, transport_options=options) as backend:
        assert backend.acquire(f"tls:{uuid.uuid4().hex}", "t", LEASE).acquired
    # But a client that does not trust the CA is refused
    with (
        backend_from_url(plain, transport_options={"ssl_cert_reqs": "required"}) as backend,
        pytest.raises(BackendUnavailable, match="certificate verify failed"),
    ):
        backend.acquire("tls:refused", "t", LEASE)


# -- Cluster ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    [
        "singletask:tasks.report",
        "singletask:tasks.report:" + "0" * 64,
        "singletask:tasks.feed:{customer}:42",
    ],
)
def test_every_key_of_one_lock_is_in_the_locks_slot(
    redis_cluster: ClusterDeployment, key: str
) -> None:
    """Lock, fence, completion marker and follow-up slot of one key all hash to one slot, so
    every script touches a single slot (Redis Cluster refuses any other)."""
    # Given the cluster, and a key no other test uses
    key = key.replace("singletask:", f"singletask:{uuid.uuid4().hex[:8]}:", 1)
    with backend_from_url(redis_cluster.url) as backend:
        # When the key goes through everything the lock and the scopes do with it
        assert backend.acquire(key, "t", LEASE, meta={"task_id": "id"}).acquired
        assert backend.claim_next(key, "follow-up", LEASE) == "follow-up"
        assert backend.extend_many([(key, "t", LEASE)]) == [True]
        assert backend.release(key, "t", completed="id")
        assert backend.acquire(key, "u", LEASE).acquired
    # Then every key it wrote is in the lock key's slot
    client = redis_cluster.client()
    try:
        name = key.split(":")[1]
        written = [k.decode() for k in client.scan_iter(match=f"*{name}*")]
        assert len(written) == 2  # the lock key (held again) and the companion hash (the claim)
        assert {client.keyslot(k) for k in written} == {client.keyslot(key)}
    finally:
        client.close()


@pytest.mark.parametrize("key", ["singletask:tasks.report", "singletask:tasks.feed:{customer}:42"])
def test_every_holder_slot_of_a_key_is_in_the_keys_slot(
    redis_cluster: ClusterDeployment, key: str
) -> None:
    """The holder slots of a key hash to the key's cluster slot, so one script reads and takes
    them; a key whose slots could not (a ``}`` without a hash tag) is refused."""
    key = key.replace("singletask:", f"singletask:{uuid.uuid4().hex[:8]}:", 1)
    client = redis_cluster.client()
    with backend_from_url(redis_cluster.url) as backend:
        assert {client.keyslot(k) for k in slot_keys(key, 50)} == {client.keyslot(key)}
        taken = [backend.acquire_slot(key, 3, f"t{n}", LEASE) for n in range(4)]
        assert [r.key for r in taken[:3]] == slot_keys(key, 3)
        assert len(taken[3].holders) == 3
        assert backend.release(slot_key(key, 2), "t2", completed="t2:0")
        assert backend.acquire_slot(key, 3, "u", LEASE).completed == "t2:0"
        with pytest.raises(LockKeyError, match="hash tag"):
            backend.acquire_slot("untagged}:x", 2, "t", LEASE)
        # nor can a rate record (in one script with the slots), even of a single slot
        with pytest.raises(LockKeyError, match="hash tag"):
            backend.acquire_slot("untagged}:x", 1, "t", LEASE, interval=1)
        rated = backend.acquire_slot(f"{key}:rated", 2, "t", LEASE, interval=60)
        assert rated.acquired
        rate = companion_key(f"{key}:rated", "rate")
        assert client.exists(rate)
        assert client.keyslot(rate) == client.keyslot(f"{key}:rated")
    client.close()


@pytest.mark.deployments
def test_the_replica_wait_confirms_or_refuses_a_slot_acquisition(
    redis_sentinel: SentinelDeployment,
) -> None:
    """``wait_replicas`` applies to acquire_slot too: a refused acquisition puts back the slot it
    took, as it was."""
    base = {**redis_sentinel.transport_options, "wait_timeout": 0.2}
    key = f"wait-slot:{uuid.uuid4().hex[:8]}"
    with backend_from_url(redis_sentinel.url, transport_options={**base, "wait_replicas": 1}) as b:
        assert b.acquire_slot(key, 2, "t", LEASE).key == key
        assert b.acquire_slot(key, 2, "u", LEASE).key == slot_key(key, 1)
        assert b.release(slot_key(key, 1), "u")
    with backend_from_url(redis_sentinel.url, transport_options={**base, "wait_replicas": 2}) as b:
        with pytest.raises(BackendUnavailable, match=r":slot:1.*only 1 of 2 replica"):
            b.acquire_slot(key, 2, "v", LEASE)
        assert b.holder(slot_key(key, 1)) is None
        holder = b.holder(key)
        assert holder is not None
        assert holder.token == "t"


def test_extend_many_renews_locks_spread_over_every_master(
    redis_cluster: ClusterDeployment,
) -> None:
    """One renewal of many locks (the renewer's call) works when their keys live on different
    masters: one script per slot."""
    # Given 30 locks, whose keys spread over the three masters
    with backend_from_url(redis_cluster.url) as backend:
        prefix = f"spread:{uuid.uuid4().hex[:8]}:"
        keys = [f"{prefix}{i}" for i in range(30)]
        for key in keys:
            assert backend.acquire(key, f"t{key}", LEASE).acquired
        # When all are renewed at once, one of them by the wrong token
        leases = [(key, f"t{key}", LEASE) for key in keys]
        leases[7] = (keys[7], "not-the-owner", LEASE)
        # Then each is renewed but that one
        assert backend.extend_many(leases) == [i != 7 for i in range(30)]


def test_iter_locks_lists_the_locks_of_every_master(redis_cluster: ClusterDeployment) -> None:
    """Listing SCANs every master: locks on all three are found, companion hashes are not."""
    with backend_from_url(redis_cluster.url) as backend:
        assert isinstance(backend, RedisClusterBackend)
        prefix = f"list:{uuid.uuid4().hex[:8]}:"
        keys = {f"{prefix}{i}" for i in range(40)}
        for key in keys:
            backend.acquire(key, "t", LEASE)
            backend.claim_next(key, "next", LEASE)  # writes the companion hash too
        client = redis_cluster.client()
        masters = {client.get_node_from_key(k).port for k in keys}
        client.close()
        # When the locks are listed with a small page size
        listed = dict(backend.iter_locks(prefix, page_size=7))
    # Then every lock is there, from every master, with its holder; nothing else
    assert len(masters) == 3
    assert set(listed) == keys
    assert all(holder.token == "t" for holder in listed.values())


@pytest.mark.deployments
def test_moving_a_held_locks_slot_to_another_master(cluster: ClusterDeployment) -> None:
    """A live lock's slot migrates to another master while its lease is being renewed: the
    redirections (ASK while migrating, MOVED after) never surface, the holder keeps its lock
    and nobody else gets it; a backend that waits for a replica follows them too. A new lock in
    that slot can be taken during the migration (its scripts name one key, so Redis redirects
    them with ASK instead of answering TRYAGAIN), and only once."""
    # Given a held lock, renewed every 50 ms, and backends with and without the replica wait
    key = f"migrate:{uuid.uuid4().hex[:8]}"
    owner = backend_from_url(cluster.url)
    waiting = backend_from_url(cluster.url, transport_options={"wait_replicas": 1})
    first = owner.acquire(key, "owner", LEASE)
    assert first.acquired
    assert waiting.holder(key) is not None  # it has read the topology
    renewal = Renewal(owner, key, "owner")
    renewal.start()
    client = cluster.client()
    sibling = f"{{{key}}}:sibling"

    def while_migrating() -> None:
        # Then, while it migrates (ASK), the lock is still the owner's and nobody else gets it
        time.sleep(0.3)
        assert owner.acquire(key, "intruder", LEASE).acquired is False
        holder = waiting.holder(key)
        assert holder is not None
        assert holder.token == "owner"
        # And a new lock in that slot is taken at once, on the importing master, by one backend
        # only
        assert waiting.acquire(sibling, "s", LEASE).acquired
        assert owner.acquire(sibling, "intruder", LEASE).acquired is False
        sibling_holder = owner.holder(sibling)
        assert sibling_holder is not None
        assert sibling_holder.token == "s"

    try:
        # When the slot is migrated to another master, then handed over to it for good
        _, target = cluster.move_slot(key, while_migrating)
        time.sleep(0.5)
        # Then (MOVED) the backends follow, and the lock is still the owner's
        assert owner.acquire(key, "intruder", LEASE).acquired is False
        assert waiting.acquire(key, "intruder", LEASE).acquired is False
        assert waiting.acquire(sibling, "s", LEASE).acquired  # still its own, on the target
        assert owner.acquire(sibling, "intruder", LEASE).acquired is False
        with contextlib.closing(cluster.client()) as fresh:
            assert fresh.get_node_from_key(key).port == target
    finally:
        outcomes = renewal.stop()
    # And the renewals went on without a raw driver error, and never found the lock gone
    assert raw_errors(outcomes) == []
    assert False not in outcomes
    assert outcomes.count(True) >= 5
    assert owner.release(key, "owner")
    owner.close()
    waiting.close()
    client.close()


@pytest.mark.deployments
def test_a_cluster_failover_keeps_the_held_lock(cluster: ClusterDeployment) -> None:
    """``CLUSTER FAILOVER`` on the replica of a held lock's master: the replica takes over with
    the lock (a manual failover waits for it to catch up), renewals go on (at worst reporting
    the store unavailable for a moment, never a raw error), nobody else gets the lock, and the
    next acquisition gets a greater fence."""
    # Given a held lock, renewed every 50 ms, and a contender
    key = f"failover:{uuid.uuid4().hex[:8]}"
    owner = backend_from_url(cluster.url)
    waiting = backend_from_url(cluster.url, transport_options={"wait_replicas": 1})
    first = waiting.acquire(key, "owner", LEASE)
    assert first.acquired
    renewal = Renewal(owner, key, "owner")
    renewal.start()
    client = cluster.client()
    master = client.get_node_from_key(key).port
    replica = cluster.replica_of(master)
    try:
        # When the replica fails its master over
        cluster.failover(replica)
        time.sleep(0.5)
        # Then the lock is still the owner's, on the new master
        assert owner.acquire(key, "intruder", LEASE).acquired is False
        holder = waiting.holder(key)
        assert holder is not None
        assert holder.token == "owner"
        # And a waiting acquisition works on the new master (whose replica is the old master)
        assert waiting.acquire(f"{{{key}}}:next", "n", LEASE).acquired
    finally:
        outcomes = renewal.stop()
    assert raw_errors(outcomes) == []
    assert False not in outcomes
    # And after the owner releases it, the next holder's fence is greater
    assert owner.release(key, "owner")
    second = owner.acquire(key, "next", LEASE)
    assert second.acquired
    assert second.fence is not None
    assert first.fence is not None
    assert second.fence > first.fence
    owner.close()
    waiting.close()
    client.close()


# -- Sentinel -----------------------------------------------------------------------------------


@pytest.mark.deployments
def test_a_sentinel_failover_keeps_locks_working(sentinel: SentinelDeployment) -> None:
    """``SENTINEL FAILOVER`` while a lock is held and renewed: renewals go on (translated errors
    at worst), the lock survives on the new master (it was replicated), and new locks are
    taken on the new master within seconds."""
    # Given a held lock, renewed every 50 ms
    options = sentinel.transport_options
    backend = backend_from_url(sentinel.url, transport_options=options)
    key = f"sentinel:{uuid.uuid4().hex[:8]}"
    first = backend.acquire(key, "owner", LEASE)
    assert first.acquired
    renewal = Renewal(backend, key, "owner")
    renewal.start()
    try:
        # When the sentinels are told to fail the master over
        started = time.monotonic()
        new_master = sentinel.failover()
        # Then new locks are taken, on the new master, within seconds
        fresh = f"{key}:fresh"
        wait_until(lambda: backend.acquire(fresh, "n", LEASE).acquired, "a new lock", 30)
        took = time.monotonic() - started
        with contextlib.closing(redis.Redis(port=new_master, db=2)) as master:
            assert master.exists(fresh)
        assert took < 30
        # And the held lock is still the owner's
        holder = backend.holder(key)
        assert holder is not None
        assert holder.token == "owner"
        time.sleep(0.5)
    finally:
        outcomes = renewal.stop()
    assert raw_errors(outcomes) == []
    assert False not in outcomes
    assert outcomes[-1] is True
    backend.close()


@pytest.mark.deployments
def test_the_replica_wait_confirms_or_refuses_an_acquisition(
    redis_sentinel: SentinelDeployment,
) -> None:
    """``wait_replicas``: an acquisition returns once that many replicas have the lock; when
    they cannot confirm it in ``wait_timeout``, the lock is given back and the store reported
    unavailable (the task's store-error policy then applies)."""
    base = {**redis_sentinel.transport_options, "wait_timeout": 0.2}
    key = f"wait:{uuid.uuid4().hex[:8]}"
    # Given the deployment's one replica: waiting for it works
    with backend_from_url(redis_sentinel.url, transport_options={**base, "wait_replicas": 1}) as b:
        assert b.acquire(key, "t", LEASE).acquired
        assert b.release(key, "t")
    # But waiting for two cannot: the acquisition is refused, and nothing is left held
    with backend_from_url(redis_sentinel.url, transport_options={**base, "wait_replicas": 2}) as b:
        with pytest.raises(BackendUnavailable, match="only 1 of 2 replica"):
            b.acquire(key, "t", LEASE)
        assert b.holder(key) is None


@pytest.mark.deployments
def test_after_a_failover_a_replica_waiting_store_reaches_the_new_master_at_once(
    sentinel: SentinelDeployment,
) -> None:
    """With ``wait_replicas``, an acquisition is a pipeline (the script, then WAIT) on a pooled
    connection. After a failover its reply is READONLY: that connection, back in the pool, still
    leads to the demoted master, and is closed, so the next call asks the sentinels again
    (it used to be reused, and every acquisition failed until the worker restarted)."""
    options = {**sentinel.transport_options, "wait_replicas": 1, "wait_timeout": 1.0}
    key = f"sentinel-wait:{uuid.uuid4().hex[:8]}"
    with backend_from_url(sentinel.url, transport_options=options) as backend:
        # Given a store that acquires all through a failover (so that some of its pooled
        # connections are made to the old master after it was demoted)
        stop = threading.Event()

        def acquire_meanwhile() -> None:
            while not stop.is_set():
                with contextlib.suppress(BackendUnavailable, BackendError):
                    backend.acquire(f"{key}:meanwhile:{uuid.uuid4().hex[:6]}", "t", LEASE)

        workers = [threading.Thread(target=acquire_meanwhile) for _ in range(4)]
        for worker in workers:
            worker.start()
        try:
            # When the sentinels fail the master over (and the old one follows the new)
            sentinel.failover()
            time.sleep(1.0)
        finally:
            stop.set()
            for worker in workers:
                worker.join()

        # Then at most one call meets the demoted master, and the next one takes the lock
        outcomes: list[object] = []
        for attempt in range(3):
            try:
                outcomes.append(backend.acquire(f"{key}:{attempt}", "t", LEASE).acquired)
                break
            except BackendUnavailable as exc:
                outcomes.append(exc)
        assert outcomes[-1] is True, outcomes
        assert len(outcomes) <= 2, outcomes


@pytest.mark.deployments
def test_a_refused_replica_wait_leaves_the_key_as_it_was(
    redis_sentinel: SentinelDeployment,
) -> None:
    """When too few replicas confirm an acquisition that took over a queue reservation, or
    renewed the caller's own lock, or took a released record, the key is put back as it was:
    the reservation is still there for its task (its removal would let a duplicate be sent),
    the caller's own lock keeps its lease, the released record its fence."""
    base = {**redis_sentinel.transport_options, "wait_timeout": 0.1, "fence_retention": 3600}
    reservation = reservation_token("task-1", 0)
    prefix = reservation.rsplit(":", 2)[0] + ":"
    reserved, own, released = (f"wait:{uuid.uuid4().hex[:8]}:{n}" for n in range(3))
    with (
        backend_from_url(redis_sentinel.url, transport_options=base) as plain,
        backend_from_url(redis_sentinel.url, transport_options={**base, "wait_replicas": 2}) as b,
    ):
        # Given a queue reservation, a lock held by "mine" and a released record
        first = plain.acquire(reserved, reservation, LEASE)
        assert first.acquired
        assert plain.acquire(own, "mine", 20.0).acquired
        assert plain.acquire(released, "gone", LEASE).acquired
        assert plain.release(released, "gone")
        last_fence = plain.acquire(released, "probe", LEASE).fence  # and given back again
        assert plain.release(released, "probe")

        # When the worker takes over the reservation, "mine" acquires again, and another
        # takes the released key, each on a store whose replica wait cannot be met
        for key, token, takeover in (
            (reserved, "task-1:0:h:1:n", prefix),
            (own, "mine", None),
            (released, "new", None),
        ):
            with pytest.raises(BackendUnavailable, match="only 1 of 2 replica") as refused:
                b.acquire(key, token, LEASE, takeover_prefix=takeover)
            assert "put back as it was" in str(refused.value)

        # Then the reservation still holds its key, with its fence and lease
        holder = plain.holder(reserved)
        assert holder is not None
        assert holder.token == reservation
        assert holder.fence == first.fence
        assert holder.ttl is not None
        assert 20 < holder.ttl <= LEASE
        # And "mine" still holds its lock, with the lease it had (not the refused one's)
        mine = plain.holder(own)
        assert mine is not None
        assert mine.token == "mine"
        assert mine.ttl is not None
        assert mine.ttl <= 20.0
        # And the released key is still free, and its next fence is greater than every fence
        # issued before, the refused acquisition's too
        assert plain.holder(released) is None
        after = plain.acquire(released, "after", LEASE)
        assert after.acquired
        assert after.fence is not None
        assert last_fence is not None
        assert after.fence > last_fence
        for key, token in ((reserved, reservation), (own, "mine"), (released, "after")):
            assert plain.release(key, token)


@pytest.mark.deployments
def test_a_lock_not_yet_replicated_is_lost_in_a_failover(sentinel: SentinelDeployment) -> None:
    """The asynchronous-replication window, reproduced: a lock acquired on a master that dies
    before its replica got it is gone after the failover, and a second holder gets it (with a
    greater fence). With ``wait_replicas`` the same acquisition is refused instead."""
    # Given a replica that stops receiving (frozen, its link dropped), and backends with and
    # without the replica wait
    plain = backend_from_url(sentinel.url, transport_options=sentinel.transport_options)
    waiting = backend_from_url(
        sentinel.url,
        transport_options={**sentinel.transport_options, "wait_replicas": 1, "wait_timeout": 0.2},
    )
    key = f"lost:{uuid.uuid4().hex[:8]}"
    assert plain.holder(key) is None  # both connected
    assert waiting.holder(key) is None
    replica, master = sentinel.replica.process, sentinel.master.process
    assert replica is not None
    assert master is not None
    replica.send_signal(signal.SIGSTOP)
    try:
        # (the master drops its link to the replica, with what it had not sent yet)
        with contextlib.closing(redis.Redis(port=sentinel.master.port)) as client:
            client.client_kill_filter(_type="replica")
        # When a lock is taken on the master then, and the master dies at once
        first = plain.acquire(key, "first", LEASE)
        with pytest.raises(BackendUnavailable, match="only 0 of 1"):
            waiting.acquire(f"{key}:waited", "w", LEASE)
        master.kill()
    finally:
        replica.send_signal(signal.SIGCONT)
    assert first.acquired
    old = sentinel.master.port
    wait_until(lambda: sentinel.master_port() != old, "the sentinels to promote the replica", 60)
    # Then, after the failover, the lock is gone: a second holder gets it
    second = plain.acquire(key, "second", LEASE)
    assert second.acquired
    # with a greater fence (drawn from the server clock: the fence record was lost too)
    assert second.fence is not None
    assert first.fence is not None
    assert second.fence > first.fence
    plain.close()
    waiting.close()


@pytest.mark.deployments
def test_a_killed_cluster_master_is_replaced_and_locks_go_on(cluster: ClusterDeployment) -> None:
    """A master is killed (SIGKILL): the cluster promotes its replica after the node timeout.
    A lock that the replica confirmed (replica wait) survives it; calls in between fail with
    BackendUnavailable, never a raw error; afterwards locks of that slot are taken on the new
    master, except with the replica wait, which now has no replica to confirm them."""
    # Given a lock taken with the replica wait, so its master's replica has it
    key = f"killed:{uuid.uuid4().hex[:8]}"
    plain = backend_from_url(cluster.url)
    waiting = backend_from_url(cluster.url, transport_options={"wait_replicas": 1})
    assert waiting.acquire(key, "owner", LEASE).acquired
    with contextlib.closing(cluster.client()) as client:
        master = client.get_node_from_key(key).port
    replica = cluster.replica_of(master)
    # When its master is killed
    node = next(n for n in cluster.nodes if n.port == master)
    assert node.process is not None
    node.process.kill()
    node.process.wait()
    # Then, within the failover time, new locks of that slot are taken again
    errors: list[Exception] = []

    def taken() -> bool:
        try:
            return plain.acquire(f"{{{key}}}:new", "n", LEASE).acquired
        except BackendError as exc:
            errors.append(exc)
            return False

    wait_until(taken, "a lock taken after the failover", 60)
    assert all(isinstance(e, BackendUnavailable) for e in errors), errors
    with contextlib.closing(redis.Redis(port=replica)) as promoted:
        assert promoted.info("replication")["role"] == "master"
    # And the confirmed lock is still the owner's
    holder = plain.holder(key)
    assert holder is not None
    assert holder.token == "owner"
    # But the replica wait refuses new locks there now: the new master has no replica
    with pytest.raises(BackendUnavailable):
        waiting.acquire(f"{{{key}}}:waited", "w", LEASE)
    plain.close()
    waiting.close()


def _use_in_child(backend: Any, key: str, parent_client: int, out: Any) -> None:
    try:
        result = backend.acquire(key, "child", LEASE)
        out.put((result.acquired, id(backend.client) != parent_client))
    except Exception as exc:  # reported to the parent
        out.put(repr(exc))


# Python 3.12+ warns about fork() in a process with threads (pytest-xdist has some); the child
# here only uses the backend, as a prefork pool process does.
@pytest.mark.deployments
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize("kind", ["redis_cluster", "redis_sentinel"])
def test_a_forked_process_builds_its_own_client(request: pytest.FixtureRequest, kind: str) -> None:
    """The client is created lazily in each process: a child forked after the parent used the
    backend builds its own (sharing the parent's sockets would mix their replies)."""
    import multiprocessing

    # Given a backend the parent has used
    deployment = request.getfixturevalue(kind)
    options = getattr(deployment, "transport_options", None)
    backend = backend_from_url(deployment.url, transport_options=options)
    key = f"fork:{uuid.uuid4().hex[:8]}"
    assert backend.acquire(f"{key}:parent", "parent", LEASE).acquired
    # When a forked child uses the same backend object
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    child = context.Process(target=_use_in_child, args=(backend, key, id(backend.client), out))
    child.start()
    reply = out.get(timeout=30)
    child.join(30)
    # Then it took its lock, with a client of its own
    assert reply == (True, True)
    assert backend.holder(key) is not None
    backend.close()


def test_a_cluster_lists_a_lock_whose_name_is_not_utf8_escaped(
    redis_cluster: ClusterDeployment,
) -> None:
    """A lock-shaped hash under the prefix whose name is not UTF-8 (another program's) is read by
    its bytes and listed with backslash escapes, as the single server lists it; the listing
    never fails on it."""
    prefix = f"singletask:{uuid.uuid4().hex[:8]}:"
    odd = prefix.encode() + b"tasks.report:\xff"
    client = redis_cluster.client()
    try:
        client.hset(odd, mapping={b"token": b"tok\xfe", b"_note\xff": b"\xff"})
        client.expire(odd, 60)
        with backend_from_url(redis_cluster.url) as backend:
            assert backend.acquire(f"{prefix}tasks.report:1", "t", LEASE).acquired
            listed = sorted((key, held.token) for key, held in backend.iter_locks(prefix))
        assert listed == [
            (f"{prefix}tasks.report:1", "t"),
            (f"{prefix}tasks.report:\\xff", "tok\\xfe"),
        ]
    finally:
        client.delete(odd)
        client.close()
