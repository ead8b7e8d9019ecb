"""``lock_rate`` and ``lock_debounce`` on a real prefork worker (its two pool processes).

Timing here is only checked against generous bounds of the properties themselves (no window of
one period holds more starts than the rate; a debounced burst runs once, after its last send).
The rate a fleet actually reaches is measured in bench/, not asserted here.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from kombu.exceptions import OperationalError

from singletask import Skipped

from ..faultproxy import FaultProxy
from .app import LOCK_OPTIONS_ENV, make_app
from .conftest import ON_REDIS_BROKER, Cluster
from .tasks_limits import PREFIX
from .test_scopes import log_offset, log_since, without_broker

# On the Redis broker only: rates and debounce live in the lock store, and the other e2e
# modules already cover RabbitMQ; this keeps the suite short.
pytestmark = [pytest.mark.e2e, ON_REDIS_BROKER]

#: A generous bound for what should happen "soon".
BOUND = 30.0
#: Seconds the probe's start times may lag the store's start of a lease (the body records its
#: start after the acquire's reply, in another process).
SLACK = 0.1


@pytest.fixture
def label(cluster: Cluster) -> str:
    return cluster.label()


def test_a_rate_of_five_a_second_is_never_exceeded_and_every_call_runs(
    cluster: Cluster, label: str
) -> None:
    # Given a task limited to 5 starts a second per label, retrying when over the rate
    task = cluster.task(PREFIX + "call_partner_retry")

    # When 15 calls are sent at once to both pool processes
    results = [task.delay(label) for _ in range(15)]
    ids = [r.get(timeout=BOUND) for r in results]

    # Then every call ran, once, and no second held more than 5 starts
    starts = sorted(s["t"] for s in cluster.probe.starts(label))
    assert sorted(ids) == sorted(r.id for r in results)
    assert len(starts) == 15
    for first, sixth in zip(starts, starts[5:], strict=False):
        assert sixth - first >= 1.0 - SLACK, starts


def test_over_the_rate_skip_returns_a_skipped_saying_it_was_the_rate(
    cluster: Cluster, label: str
) -> None:
    task = cluster.task(PREFIX + "call_partner_skip")
    values = [task.delay(label) for _ in range(4)]
    outcomes = [v.get(timeout=BOUND) for v in values]
    ran = [o for o in outcomes if not isinstance(o, Skipped)]
    skipped = [o for o in outcomes if isinstance(o, Skipped)]
    assert len(ran) == 1
    assert len(skipped) == 3
    assert {s.reason for s in skipped} == {"rate"}
    assert all(s.retry_after is not None and 0 < s.retry_after <= 60 for s in skipped)


def test_a_burst_of_sends_runs_once_with_the_last_arguments_after_the_last_send(
    cluster: Cluster, label: str
) -> None:
    # Given a task debounced by 1 s per label
    task = cluster.task(PREFIX + "rebuild")

    # When five sends come within a fraction of a second
    sends = []
    for version in range(1, 6):
        sends.append(task.delay(label, version))
    last_sent = time.time()
    outcomes = [s.get(timeout=BOUND) for s in sends]

    # Then only the last one ran, at least a second after it was sent, and the earlier four
    # were skipped, each naming the send that superseded it
    assert outcomes[-1] == 5
    assert [s["version"] for s in cluster.probe.starts(label)] == [5]
    assert cluster.probe.starts(label)[0]["t"] >= last_sent + 1.0 - SLACK
    for skipped in outcomes[:-1]:
        assert isinstance(skipped, Skipped), skipped
        assert skipped.reason == "debounced"
        assert skipped.holder == sends[-1].id


def test_a_send_that_cannot_be_published_leaves_the_burst_to_its_last_published_send(
    cluster: Cluster, label: str
) -> None:
    """Issue 29: a debounced send whose publish fails is taken back out of the window, so the
    burst's last published send still runs, with its arguments (it is not skipped as superseded
    by a send that no worker will ever run)."""
    # Given a task debounced by 1.5 s per label, and a producer whose broker is down
    task = cluster.task(PREFIX + "rebuild_slow")
    with without_broker(cluster, PREFIX + "rebuild_slow") as dead:
        # When a send is published, and a later one of the burst cannot be
        published = task.delay(label, 1)
        with pytest.raises(OperationalError):
            dead.apply_async((label, 2), task_id=f"lost-{label}", ignore_result=True)

    # Then the published send runs its body, once; nothing ran the lost one
    assert published.get(timeout=BOUND) == 1
    assert [s["version"] for s in cluster.probe.starts(label)] == [1]


@contextmanager
def through_proxy(cluster: Cluster, name: str) -> Iterator[tuple[Any, FaultProxy]]:
    """Task ``name`` of a producer that reaches the cluster's broker through a TCP proxy the
    test can stop, and the proxy. Its publish retry policy gives a publish to a stopped broker
    a few seconds before it fails (interval 1 s, 3 retries), as kombu's default policy does
    with a broker that times out: longer than the task's debounce wait."""
    env = cluster.worker.env
    proxy, broker = FaultProxy.for_url(str(cluster.app.conf.broker_url))
    producer = make_app(
        broker=broker,
        results=env["SINGLETASK_E2E_RESULTS"],
        locks=env["SINGLETASK_E2E_LOCKS"],
        queue=env["SINGLETASK_E2E_QUEUE"],
        lock_options=json.loads(env.get(LOCK_OPTIONS_ENV) or "{}"),
    )
    producer.conf.update(
        broker_connection_timeout=1.0,
        task_publish_retry_policy={
            "max_retries": 3, "interval_start": 1.0, "interval_step": 0.5, "interval_max": 1.0,
        },
        broker_transport_options={**producer.conf.broker_transport_options, "max_retries": 0},
    )  # fmt: skip
    task = producer.tasks[name]
    try:
        with proxy:
            yield task, proxy
    finally:
        task.lock_backend.close()
        producer.close()


def test_a_later_send_that_fails_slowly_leaves_the_burst_to_its_latest_published_send(
    cluster: Cluster, label: str
) -> None:
    """Issue 37: the second send of a burst is written to the window, then its publish fails
    slowly (the producer's broker went down; kombu retries for seconds). Meanwhile the first
    message's wait ends: it finds the second send pending, waits for it instead of ending
    superseded by it, and runs when the second send is taken back."""
    # Given a task debounced by 1.5 s per label, sent by a producer whose broker link works
    with through_proxy(cluster, PREFIX + "rebuild_slow") as (task, proxy):
        offset = log_offset(cluster)
        published = task.delay(label, 1)

        # When its broker goes down for the second send of the burst
        proxy.stop()
        began = time.monotonic()
        with pytest.raises(OperationalError):
            task.apply_async((label, 2), task_id=f"lost-{label}")
        failing = time.monotonic() - began

        # Then the caller of the second send got its error, after the first message's wait
        # ended (the case of the issue: the first message started while the publish failed);
        # the first message waited for it, and runs its body, once
        assert failing > 1.5, f"the publish failed within {failing:.1f}s: no race to test"
        assert published.get(timeout=BOUND) == 1
    assert [s["version"] for s in cluster.probe.starts(label)] == [1]
    waited = [line for line in log_since(cluster, offset) if "waits up to" in line]
    assert any(published.id in line and f"lost-{label}" in line for line in waited), waited


def test_a_steady_stream_still_runs_within_debounce_max(cluster: Cluster, label: str) -> None:
    """Sends every 0.3 s for 4.5 s, debounced by 1 s but at most 2 s: the stream is never
    quiet for 1 s, yet the key runs every 2 s or so, and the last send runs at the end."""
    task = cluster.task(PREFIX + "rebuild_bounded")
    sends = []
    for version in range(15):
        sends.append(task.delay(label, version))
        time.sleep(0.3)
    outcomes = [s.get(timeout=BOUND) for s in sends]
    versions = [s["version"] for s in cluster.probe.starts(label)]
    assert outcomes[-1] == 14
    assert versions[-1] == 14
    assert 3 <= len(versions) <= 6, versions
    assert all(isinstance(o, Skipped) for o in outcomes if not isinstance(o, int))
