"""A real worker whose lock store fails over or reshards while a singleton runs.

Each test starts a deployment of its own (tests/deployments.py) and a prefork worker whose lock
store it is; broker, results and probe are the session's private Redis. A holder blocks on its
gate while the store changes under it; duplicates sent meanwhile must still find it holding the
lock, no raw driver error may reach the worker's log, and the next run must go ahead.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from singletask import Skipped

from ..deployments import ClusterDeployment, SentinelDeployment, default_binary
from ..servers import unavailable
from .app import LOCK_OPTIONS_ENV, make_app
from .conftest import ROOT, Worker
from .probe import PROBE_URL_ENV, Probe
from .tasks_faults import LEASE, LONG_LEASE
from .tasks_faults import PREFIX as FAULTS
from .tasks_policies import PREFIX, gate_key

pytestmark = [pytest.mark.e2e, pytest.mark.deployments]

KEY = "singletask:" + PREFIX + "skip_none"


@dataclass
class Deployed:
    deployment: Any
    app: Celery
    worker: Worker
    probe: Probe

    def holder_and_duplicate(self, label: str) -> Any:
        """Start a holder of the global lock (blocked on its gate); return it."""
        task = self.app.tasks[PREFIX + "skip_none"]
        holder = task.delay(label, hold=True)
        self.probe.wait_for(label, "start")
        return holder

    def assert_duplicate_skipped(self, label: str, holder_id: str) -> None:
        duplicate = self.app.tasks[PREFIX + "skip_none"].delay(label)
        skipped = duplicate.get(timeout=30)
        assert isinstance(skipped, Skipped), self.worker.tail()
        assert skipped.holder == holder_id

    def finish(self, label: str, holder: Any) -> None:
        """Open the holder's gate; it must end normally, alone, and a new run go ahead."""
        self.probe.client.rpush(gate_key(label), "open")
        assert holder.get(timeout=30) is None
        assert self.probe.max_overlap(label) == 1
        deadline = time.monotonic() + 30
        again = f"{label}-again"
        while True:  # the lock is free again: a new run takes it
            result = self.app.tasks[PREFIX + "skip_none"].delay(again).get(timeout=30)
            if not isinstance(result, Skipped) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert result is None
        log = self.worker.log.read_text(errors="replace")
        assert "redis.exceptions" not in log, self.worker.tail()
        assert "Traceback" not in log, self.worker.tail()


@pytest.fixture
def deployed(
    redis_base_url: str, tmp_path: Path
) -> Iterator[Callable[[type, dict[str, Any]], Deployed]]:
    made: list[Deployed] = []

    def make(kind: type, options: dict[str, Any]) -> Deployed:
        deployment = kind(default_binary(), tmp_path / "store")
        try:
            deployment.start()
        except (RuntimeError, OSError) as exc:
            deployment.stop()
            unavailable(f"cannot start a {kind.__name__}: {exc}")
        queue = f"singletask-deploy-{uuid.uuid4().hex[:8]}"
        lock_options = {**getattr(deployment, "transport_options", {}), **options}
        settings = {
            "SINGLETASK_E2E_BROKER": f"{redis_base_url}/0",
            "SINGLETASK_E2E_RESULTS": f"{redis_base_url}/1",
            "SINGLETASK_E2E_LOCKS": deployment.url,
            LOCK_OPTIONS_ENV: json.dumps(lock_options),
            "SINGLETASK_E2E_QUEUE": queue,
            PROBE_URL_ENV: f"{redis_base_url}/3",
        }
        app = make_app(
            broker=settings["SINGLETASK_E2E_BROKER"],
            results=settings["SINGLETASK_E2E_RESULTS"],
            locks=deployment.url,
            queue=queue,
            lock_options=lock_options,
        )
        env = {**os.environ, **settings, "PYTHONPATH": str(ROOT)}
        worker = Worker(env, tmp_path / "worker.log", app, [])
        entry = Deployed(deployment, app, worker, Probe(settings[PROBE_URL_ENV]))
        made.append(entry)
        try:
            worker.start()
        except RuntimeError as exc:
            unavailable(f"cannot start a worker: {exc}")
        return entry

    yield make
    for entry in made:
        entry.worker.stop()
        entry.probe.client.close()
        entry.app.close()
        entry.deployment.stop()


def test_a_held_locks_slot_moves_then_its_master_fails_over_while_the_task_runs(
    deployed: Callable[[type, dict[str, Any]], Deployed],
) -> None:
    """Redis Cluster under a running singleton: its lock's slot migrates to another master,
    then that master is failed over to its replica (``CLUSTER FAILOVER``). Duplicates sent at
    each step are skipped (the holder still has the lock), the holder ends normally and alone,
    and the next run goes ahead; no raw driver error anywhere."""
    # Given a worker whose lock store is a 6-node cluster, and a holder of the global lock
    env = deployed(ClusterDeployment, {})
    cluster: ClusterDeployment = env.deployment
    label = f"deploy-{uuid.uuid4().hex[:8]}"
    holder = env.holder_and_duplicate(label)
    # When its slot is moved to another master while it runs (a duplicate sent mid-migration)
    _, target = cluster.move_slot(KEY, lambda: env.assert_duplicate_skipped(label, holder.id))
    # Then a duplicate after the move is skipped too
    env.assert_duplicate_skipped(label, holder.id)
    # When the new master fails over to its replica
    cluster.failover(cluster.replica_of(target))
    # Then duplicates are still skipped, and the holder ends alone, and the next run goes ahead
    env.assert_duplicate_skipped(label, holder.id)
    env.finish(label, holder)


def test_a_sentinel_failover_while_the_task_runs(
    deployed: Callable[[type, dict[str, Any]], Deployed],
) -> None:
    """Sentinel under a running singleton (the opt-in replica wait on): ``SENTINEL FAILOVER``
    promotes the replica; the holder keeps its lock (duplicates are skipped), ends normally,
    and new runs take their locks on the new master within seconds."""
    # Given a worker whose lock store is behind 3 sentinels, and a holder of the global lock
    env = deployed(SentinelDeployment, {"wait_replicas": 1})
    sentinel: SentinelDeployment = env.deployment
    label = f"deploy-{uuid.uuid4().hex[:8]}"
    holder = env.holder_and_duplicate(label)
    env.assert_duplicate_skipped(label, holder.id)
    # When the sentinels fail the master over
    old = sentinel.master_port()
    new = sentinel.failover()
    assert new != old
    # Then the holder still has the lock (duplicates are skipped), on the new master
    env.assert_duplicate_skipped(label, holder.id)
    # And it ends alone; then a new run takes the lock on the new master
    started = time.monotonic()
    env.finish(label, holder)
    assert time.monotonic() - started < 60


def _lock_client(deployment: Any) -> Any:
    """A client of the deployment's lock database, to watch the keys."""
    if isinstance(deployment, ClusterDeployment):
        return deployment.client()
    return redis.Redis(port=deployment.master_port(), db=2)


def _wait(check: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("kind", [ClusterDeployment, SentinelDeployment])
def test_renewal_and_crash_recovery_on_the_deployment(
    deployed: Callable[[type, dict[str, Any]], Deployed], kind: type
) -> None:
    """On each deployment: a body four leases long keeps its renewed lock all along (a
    duplicate is skipped), and a pool process killed while holding a 60 s lease has its lock
    freed by the worker within seconds, after which the next run goes ahead."""
    env = deployed(kind, {})
    client = _lock_client(env.deployment)
    renewed = env.app.tasks[FAULTS + "renewed"]
    label = f"renew-{uuid.uuid4().hex[:8]}"
    key = f"singletask:{FAULTS}renewed:{label}"
    try:
        # Given a body that runs for four 2 s leases
        holder = renewed.apply_async(kwargs={"label": label, "seconds": 4 * LEASE})
        start = _wait(lambda: env.probe.starts(label), "the holder to start")[0]
        # Then its lock stays stored all along, and a duplicate after 2.5 leases is skipped
        missing, duplicate = [], None
        while time.time() < start["t"] + 3.5 * LEASE:
            if not client.exists(key):
                missing.append(time.time() - start["t"])
            if duplicate is None and time.time() > start["t"] + 2.5 * LEASE:
                duplicate = renewed.apply_async(kwargs={"label": label})
            time.sleep(0.1)
        assert not missing, env.worker.tail()
        assert duplicate is not None
        skipped = duplicate.get(timeout=30)
        assert isinstance(skipped, Skipped), skipped
        assert holder.get(timeout=30)["lost"] is False

        # Given a singleton with a 60 s lease, whose pool process is killed while it runs
        long_lease = env.app.tasks[FAULTS + "long_lease"]
        label = f"crash-{uuid.uuid4().hex[:8]}"
        key = f"singletask:{FAULTS}long_lease:{label}"
        victim = long_lease.apply_async(kwargs={"label": label, "seconds": 30})
        start = _wait(lambda: env.probe.starts(label), "the victim to start")[0]
        os.kill(start["pid"], signal.SIGKILL)
        # Then the worker frees its lock far sooner than the lease, and the next run goes ahead
        _wait(lambda: not client.exists(key), "the lock to be freed", LONG_LEASE / 3)
        _wait(lambda: victim.state == "FAILURE", "the killed task to fail")
        following = long_lease.apply_async(kwargs={"label": label, "seconds": 0.1})
        assert following.get(timeout=30)["lost"] is False
    finally:
        client.close()
