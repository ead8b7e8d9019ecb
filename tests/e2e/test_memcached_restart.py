"""End to end: what a restart of the memcached lock store does to a running singleton.

memcached keeps nothing across a restart. The scenarios of test_stores.py cover an outage that
keeps the data (connections cut, then back); this one restarts the server itself, as documented
in docs/guarantees.rst: the running execution's lock is gone, its next renewal finds that out
and it is told (``lock_lost``, ``self.lock.lost``), and a duplicate sent meanwhile runs at once,
beside it, with a larger fencing token.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from singletask import Skipped

from ..servers import MemcachedServer, start_memcached, unavailable
from .faults import BOUND, FaultEnv
from .tasks_faults import LEASE
from .tasks_faults import PREFIX as FAULTS

pytestmark = [pytest.mark.e2e, pytest.mark.stores]


@pytest.fixture
def memcached_env(tmp_path: Path) -> Iterator[tuple[FaultEnv, MemcachedServer]]:
    try:
        server = start_memcached()
    except RuntimeError as exc:
        unavailable(f"cannot start a private memcached: {exc}")
        raise
    try:
        env = FaultEnv(tmp_path, lock_store=f"{server.url}?connect_timeout=2&timeout=2")
        try:
            yield env, server
        finally:
            env.close()
    finally:
        server.stop()


def test_a_restart_loses_the_running_lock_and_the_holder_is_told(
    memcached_env: tuple[FaultEnv, MemcachedServer],
) -> None:
    """Restarted under a running body: the body learns its lock is lost, and a duplicate sent
    after the restart runs beside it (two at once, the documented cost) with a larger fence."""
    env, server = memcached_env
    env.start_worker()
    label = f"restart-{time.time_ns()}"
    task = env.app.tasks[FAULTS + "renewed"]

    # Given a body holding a renewed 2 s lease, 5 leases long
    holder = task.apply_async(kwargs={"label": label, "seconds": 5 * LEASE})
    (start,) = env.wait_starts(label, 1)

    # When memcached restarts (same port, empty)
    server.stop()
    server.start()

    # Then a duplicate sent now is not skipped: it runs while the first body still runs
    duplicate = task.apply_async(kwargs={"label": label, "seconds": 0.1})
    value = duplicate.get(timeout=BOUND)
    assert not isinstance(value, Skipped), value
    assert env.probe.max_overlap(label) == 2, env.explain()
    # With a larger fencing token than the first body's
    assert value["fence"] > start["fence"]
    # And the first body was told its lock is lost (the renewal found the lock gone)
    first = holder.get(timeout=BOUND)
    assert first["lost"] is True, env.explain()
    assert env.log_lines("lost"), env.explain()
