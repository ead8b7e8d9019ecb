"""The Prometheus exporter on a real fleet: ``celery -A app singletask exporter`` beside a real
prefork worker started with ``-E``, a real broker and lock store (the session's private Redis),
scraped over HTTP as Prometheus would.

The exporter reaches the broker and the store through fault proxies of its own (the worker and
the test do not), so a test can take the broker away or make the store hang for the exporter
alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from ..faultproxy import FaultProxy
from ..prometheus_text import (
    Sample,
    exposed_names,
    names_in_examples,
    samples_of,
    scrape_text,
    value,
)
from ..servers import free_port, unavailable
from .exporter_app import ENV, make_app

pytestmark = [pytest.mark.visibility, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
#: Broker and lock store databases of the session's private Redis no other test module uses.
BROKER_DB, LOCKS_DB = 12, 13


def wait_for(check: Callable[[], Any], what: str, timeout: float = 45.0) -> Any:
    """Poll ``check`` until it returns something true; return that (fail after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.2)


class Process:
    """A subprocess of the test (its own process group) with its output in a log file."""

    def __init__(self, command: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        with log.open("ab") as out:
            self.popen = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def tail(self) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])
        return "(no log)"

    def stop(self) -> None:
        if self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()


@dataclass
class Fleet:
    """The worker, the exporter and what the test talks to."""

    app: Celery
    prefix: str
    metrics_url: str
    exporter: Process
    worker: Process
    broker_proxy: FaultProxy
    store_proxy: FaultProxy

    def scrape(self) -> dict[Sample, float]:
        if self.exporter.popen.poll() is not None:
            raise AssertionError(f"the exporter exited:\n{self.exporter.tail()}")
        return samples_of(scrape_text(self.metrics_url))

    def gauge(self, name: str, **labels: str) -> float | None:
        return value(self.scrape(), name, **labels)


def _env(settings: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **settings, "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def fleet(redis_base_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    broker, locks = f"{redis_base_url}/{BROKER_DB}", f"{redis_base_url}/{LOCKS_DB}"
    prefix, queue = f"exp-{uuid.uuid4().hex[:8]}:", f"exporter-{uuid.uuid4().hex[:8]}"
    logs = tmp_path_factory.mktemp("exporter")
    app = make_app(broker=broker, locks=locks, prefix=prefix, queue=queue)
    broker_proxy, proxied_broker = FaultProxy.for_url(broker)
    store_proxy, proxied_locks = FaultProxy.for_url(locks)
    worker_env = _env(dict(zip(ENV, (broker, locks, prefix, queue), strict=True)))
    exporter_env = _env(dict(zip(ENV, (proxied_broker, proxied_locks, prefix, queue), strict=True)))
    nodename = f"exporter-{uuid.uuid4().hex[:8]}@%h"
    worker = Process(
        [sys.executable, "-m", "celery", "-A", "tests.visibility.exporter_app", "worker", "-E",
         "-P", "prefork", "-c", "2", "-n", nodename, "-Q", queue, "-l", "INFO",
         "--without-gossip", "--without-mingle", "--without-heartbeat"],
        worker_env, logs / "worker.log",
    )  # fmt: skip
    port = free_port()
    exporter = Process(
        [sys.executable, "-m", "celery", "-A", "tests.visibility.exporter_app", "singletask",
         "exporter", "--port", str(port), "--store-interval", "0.5"],
        exporter_env, logs / "exporter.log",
    )  # fmt: skip
    fleet = Fleet(app, prefix, f"http://127.0.0.1:{port}/metrics", exporter, worker,
                  broker_proxy, store_proxy)  # fmt: skip
    try:
        hostname = nodename.replace("%h", os.uname().nodename)
        try:
            wait_for(
                lambda: (
                    worker.popen.poll() is None
                    and app.control.ping(destination=[hostname], timeout=0.5)
                ),
                "the worker answers a ping",
                timeout=60,
            )
        except AssertionError:
            unavailable(f"cannot start a celery worker:\n{worker.tail()}")

        def ready() -> bool:
            with contextlib.suppress(OSError):
                samples = fleet.scrape()
                return bool(value(samples, "singletask_broker_up") == 1.0
                            and value(samples, "singletask_store_up") == 1.0)  # fmt: skip
            return False

        wait_for(ready, f"the exporter follows the events and reads the store:\n{exporter.tail()}")
        yield fleet
    finally:
        exporter.stop()
        worker.stop()
        broker_proxy.close()
        store_proxy.close()
        app.close()


HOLD, QUEUED = "exporter.hold", "exporter.queued"
COALESCED, DEBOUNCED = "exporter.coalesced", "exporter.debounced"


def test_a_running_lock_shows_in_the_gauges_and_leaves_them_when_released(fleet: Fleet) -> None:
    """The store gauges: a lock held by a running execution counts in singletask_locks_held and
    ages in singletask_oldest_hold_age_seconds; once it ends, the count is 0 and the age gone."""
    # Given a task that holds its lock (key: the customer) for a few seconds
    customer = f"customer-secret-{uuid.uuid4().hex[:6]}"
    fleet.app.tasks[HOLD].delay(customer, 4)

    # Then the exporter shows one lock held by that task, held for a while already
    wait_for(lambda: fleet.gauge("singletask_locks_held", task=HOLD) == 1.0, "the lock shows")
    age = wait_for(
        lambda: (fleet.gauge("singletask_oldest_hold_age_seconds", task=HOLD) or 0) > 0.5 and
        fleet.gauge("singletask_oldest_hold_age_seconds", task=HOLD), "the hold ages",
    )  # fmt: skip
    assert age < 60
    text = scrape_text(fleet.metrics_url)
    # And neither the key nor its customer is in any label
    assert customer not in text
    assert fleet.prefix not in text

    # When the execution ends, its lock leaves the gauges
    wait_for(lambda: fleet.gauge("singletask_locks_held", task=HOLD) == 0.0, "the lock leaves")
    assert fleet.gauge("singletask_oldest_hold_age_seconds", task=HOLD) is None


def test_a_message_waiting_with_its_reservation_shows_as_a_reservation(fleet: Fleet) -> None:
    """A queue-scoped message reserves its key at send: until it runs, that is a reservation."""
    # Given a message reserved at its send and due in a few seconds
    fleet.app.tasks[QUEUED].apply_async((f"cust-{uuid.uuid4().hex[:6]}",), countdown=5)

    # Then the exporter shows the reservation, and how long it has waited
    wait_for(lambda: fleet.gauge("singletask_lock_reservations", task=QUEUED) == 1.0, "reserved")
    assert fleet.gauge("singletask_oldest_reservation_age_seconds", task=QUEUED) is not None
    assert fleet.gauge("singletask_locks_held", task=QUEUED) == 0.0

    # And once it has run, nothing of it is left
    wait_for(lambda: fleet.gauge("singletask_lock_reservations", task=QUEUED) == 0.0, "it ran")
    assert fleet.gauge("singletask_oldest_reservation_age_seconds", task=QUEUED) is None


def test_a_follow_up_claimed_during_a_run_shows_until_it_starts(fleet: Fleet) -> None:
    """A call made while a coalescing run holds the key claims the key's follow-up: it counts
    in singletask_follow_ups_pending until it starts."""
    # Given a coalescing run in progress
    customer = f"cust-{uuid.uuid4().hex[:6]}"
    fleet.app.tasks[COALESCED].delay(customer, 4)
    wait_for(lambda: fleet.gauge("singletask_locks_held", task=COALESCED) == 1.0, "it runs")

    # When another call comes meanwhile, it becomes the pending follow-up
    fleet.app.tasks[COALESCED].delay(customer, 0)
    wait_for(lambda: fleet.gauge("singletask_follow_ups_pending", task=COALESCED) == 1.0,
             "the follow-up shows")  # fmt: skip

    # Then once the run is over and the follow-up has started, none is pending
    wait_for(lambda: fleet.gauge("singletask_follow_ups_pending", task=COALESCED) == 0.0,
             "the follow-up started")  # fmt: skip


def test_an_open_debounce_window_shows_until_its_run_starts(fleet: Fleet) -> None:
    """A debounced send opens its key's window; the window closes when its run starts."""
    customer = f"cust-{uuid.uuid4().hex[:6]}"
    fleet.app.tasks[DEBOUNCED].delay(customer)
    wait_for(lambda: fleet.gauge("singletask_debounce_windows_open", task=DEBOUNCED) == 1.0,
             "the window shows")  # fmt: skip
    wait_for(lambda: fleet.gauge("singletask_debounce_windows_open", task=DEBOUNCED) == 0.0,
             "the window closed")  # fmt: skip


def test_a_worker_with_events_moves_the_counters_and_histograms(fleet: Fleet) -> None:
    """The worker (started with -E) tells each outcome: a run that acquires and releases, and a
    duplicate that finds the key held and is skipped, count under the task; the run's wait and
    hold go into the histograms; the key is in no label."""

    def count(samples: dict[Sample, float], outcome: str) -> float:
        return value(samples, "singletask_outcomes_total", task=HOLD, outcome=outcome) or 0.0

    # (the earlier tests' runs of the task have all told their release)
    before = wait_for(
        lambda: (s := fleet.scrape()) and count(s, "acquired") == count(s, "released") and s,
        "the earlier runs are counted",
    )

    def observed(samples: dict[Sample, float], name: str) -> float:
        return value(samples, f"{name}_count", task=HOLD) or 0.0

    # Given a run that holds its customer's key for a while
    customer = f"customer-secret-{uuid.uuid4().hex[:6]}"
    fleet.app.tasks[HOLD].delay(customer, 2)
    wait_for(lambda: fleet.gauge("singletask_locks_held", task=HOLD) == 1.0, "the lock shows")

    # When a duplicate arrives meanwhile, it is skipped; then the run ends
    fleet.app.tasks[HOLD].delay(customer, 0)
    after = wait_for(
        lambda: (s := fleet.scrape()) and count(s, "released") - count(before, "released") >= 1
        and count(s, "skipped") - count(before, "skipped") >= 1 and s,
        "the worker's events are counted",
    )  # fmt: skip

    # Then one acquire, one release and one skip were counted
    assert count(after, "acquired") - count(before, "acquired") == 1
    assert count(after, "released") - count(before, "released") == 1
    assert count(after, "skipped") - count(before, "skipped") == 1
    assert count(after, "lease_lost") == count(before, "lease_lost")
    # And the run's wait (first send to lock) and hold (about 2 s) were observed
    assert observed(after, "singletask_lock_wait_seconds") - observed(
        before, "singletask_lock_wait_seconds") == 1  # fmt: skip
    assert observed(after, "singletask_lock_hold_seconds") - observed(
        before, "singletask_lock_hold_seconds") == 1  # fmt: skip
    held = (value(after, "singletask_lock_hold_seconds_sum", task=HOLD) or 0) - (
        value(before, "singletask_lock_hold_seconds_sum", task=HOLD) or 0)  # fmt: skip
    assert 1.5 < held < 30
    # And the key, with its customer, is in no label
    assert customer not in scrape_text(fleet.metrics_url)


def _send_events(app: Celery, *events: dict[str, Any]) -> None:
    """Send singletask events through Celery's own event dispatcher, as a worker does."""
    with app.events.default_dispatcher(hostname="celery@sender") as dispatcher:
        for fields in events:
            fields = dict(fields)
            outcome = fields["singletask_outcome"]
            dispatcher.send(f"task-singletask-{outcome}", uuid=str(uuid.uuid4()), **fields)


def test_events_move_the_counters_and_histograms(fleet: Fleet) -> None:
    """Each task-singletask-<outcome> event counts under its task and outcome; an acquired
    event's wait and a released event's hold time go into their histograms."""
    name = f"proj.sync_{uuid.uuid4().hex[:6]}"
    key = f"{fleet.prefix}{name}:customer-9"
    before = fleet.scrape()
    assert value(before, "singletask_outcomes_total", task=name, outcome="acquired") is None

    # When a worker tells an acquire after 2.5 s of waiting, a release after 40 s, a skip, a
    # lost lease, and an outcome this exporter does not know
    _send_events(
        fleet.app,
        {"name": name, "singletask_outcome": "acquired", "singletask_key": key,
         "singletask_wait": 2.5, "singletask_fence": 7},
        {"name": name, "singletask_outcome": "released", "singletask_key": key,
         "singletask_held": 40.0},
        {"name": name, "singletask_outcome": "skipped", "singletask_key": key},
        {"name": name, "singletask_outcome": "lease_lost", "singletask_key": key,
         "singletask_reason": "expired"},
        {"name": name, "singletask_outcome": "vanished", "singletask_key": key},
    )  # fmt: skip

    # Then each counts once under the task, the unknown one as "other"
    samples = wait_for(
        lambda: (
            (s := fleet.scrape())
            and value(s, "singletask_outcomes_total", task=name, outcome="other") == 1.0
            and s
        ),
        "the events are counted",
    )
    for outcome in ("acquired", "released", "skipped", "lease_lost"):
        assert value(samples, "singletask_outcomes_total", task=name, outcome=outcome) == 1.0
    # And every other documented outcome of the task is there at 0 (so increase() sees a first)
    assert value(samples, "singletask_outcomes_total", task=name, outcome="store_error") == 0.0
    # And the wait is in the wait histogram, the hold in the hold histogram
    assert value(samples, "singletask_lock_wait_seconds_count", task=name) == 1.0
    assert value(samples, "singletask_lock_wait_seconds_sum", task=name) == 2.5
    assert value(samples, "singletask_lock_wait_seconds_bucket", task=name, le="1.0") == 0.0
    assert value(samples, "singletask_lock_wait_seconds_bucket", task=name, le="5.0") == 1.0
    assert value(samples, "singletask_lock_hold_seconds_sum", task=name) == 40.0
    # And no label holds the key
    assert key not in scrape_text(fleet.metrics_url)


def test_a_store_that_hangs_makes_store_up_0_and_scrapes_stay_quick(fleet: Fleet) -> None:
    """A lock store that stops answering never holds up a scrape: singletask_store_up turns 0
    and the store gauges go (no stale numbers), until the store answers again."""
    fleet.store_proxy.stall()
    try:
        wait_for(lambda: fleet.gauge("singletask_store_up") == 0.0, "store_up turns 0")
        started = time.monotonic()
        samples = fleet.scrape()
        assert time.monotonic() - started < 2.0
        assert not any(name == "singletask_locks_held" for name, _ in samples)
        assert value(samples, "singletask_broker_up") == 1.0
    finally:
        fleet.store_proxy.resume()
    wait_for(lambda: fleet.gauge("singletask_store_up") == 1.0, "store_up is 1 again")


def test_the_exporter_follows_the_events_again_after_the_broker_went_away(fleet: Fleet) -> None:
    """The broker goes away (port closed, connections reset) and comes back: the exporter says
    so in singletask_broker_up, reconnects, and counts the events sent after."""
    fleet.broker_proxy.stop()
    try:
        wait_for(lambda: fleet.gauge("singletask_broker_up") == 0.0, "broker_up turns 0")
    finally:
        fleet.broker_proxy.start()
    wait_for(lambda: fleet.gauge("singletask_broker_up") == 1.0, "broker_up is 1 again", 90)
    name = f"proj.after_{uuid.uuid4().hex[:6]}"
    _send_events(fleet.app, {"name": name, "singletask_outcome": "skipped"})
    wait_for(
        lambda: fleet.gauge("singletask_outcomes_total", task=name, outcome="skipped") == 1.0,
        "an event sent after the reconnection is counted",
    )


def test_the_dashboard_and_the_alerts_name_only_metrics_the_exporter_serves(fleet: Fleet) -> None:
    """Every metric named by examples/grafana_dashboard.json and examples/prometheus_alerts.yml
    is in the real exporter's /metrics (after the tests above made it serve every family)."""
    served = exposed_names(scrape_text(fleet.metrics_url))
    for example, names in names_in_examples().items():
        assert names, f"{example} names no metric"
        assert names <= served, f"{example} names metrics not served: {sorted(names - served)}"


def test_the_standalone_command_needs_no_app(
    fleet: Fleet, redis_base_url: str, tmp_path: Path
) -> None:
    """``singletask exporter --broker URL --url URL`` imports no app: it follows the same events
    and reads the same store, named by URL."""
    port = free_port()
    exporter = Process(
        [sys.executable, "-m", "singletask", "exporter", "--broker",
         f"{redis_base_url}/{BROKER_DB}", "--url", f"{redis_base_url}/{LOCKS_DB}",
         "--prefix", fleet.prefix, "--port", str(port), "--store-interval", "0.5"],
        _env({}), tmp_path / "standalone.log",
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/metrics"
    try:

        def up() -> bool:
            with contextlib.suppress(OSError):
                samples = samples_of(scrape_text(url))
                return bool(value(samples, "singletask_broker_up") == 1.0
                            and value(samples, "singletask_store_up") == 1.0)  # fmt: skip
            return False

        wait_for(up, f"the standalone exporter is up:\n{exporter.tail()}")
        fleet.app.tasks[HOLD].delay(f"cust-{uuid.uuid4().hex[:6]}", 3)
        wait_for(
            lambda: value(samples_of(scrape_text(url)), "singletask_locks_held", task=HOLD) == 1,
            "the standalone exporter sees the lock",
        )
    finally:
        exporter.stop()
    assert exporter.popen.returncode == 0, exporter.tail()
