"""The exporter's parts in one process: events to counters and histograms, the store read to
gauges, and its /metrics over real HTTP, on a SQLite lock store and the session's private Redis
as the broker. tests/visibility/test_exporter.py runs it as its own process beside a worker."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner
from prometheus_client import CollectorRegistry, generate_latest

from singletask.backends import backend_from_url
from singletask.backends.base import LockBackend
from singletask.backends.sql.sqlite import SQLiteBackend
from singletask.cli import singletask
from singletask.ops.exporter import (
    OUTCOMES,
    EventFollower,
    EventMetrics,
    Exporter,
    StoreCollector,
    task_of_key,
)
from singletask.protocol.keys import escape_name
from singletask.protocol.tokens import execution_token, reservation_token

from ..faultproxy import FaultProxy
from ..prometheus_text import exposed_names, names_in_examples, samples_of, scrape_text, value
from ..servers import free_port
from .limits import concurrency, rate, take

PREFIX = "singletask:"
#: Databases of the session's private Redis no other test module uses: the broker, the store.
BROKER_DB, STORE_DB = 14, 15


@pytest.mark.parametrize(
    ("key", "task"),
    [
        ("singletask:proj.sync", "proj.sync"),
        ("singletask:proj.sync:customer-42", "proj.sync"),
        (f"singletask:{escape_name('odd:name{%}')}:x:y", "odd:name{%}"),
        ("other:proj.sync", None),
        ("singletask:", None),
        ("singletask:bad%3a", None),  # not how singletask escapes a name
    ],
)
def test_the_task_name_is_read_back_from_a_key(key: str, task: str | None) -> None:
    assert task_of_key(key, PREFIX) == task


def metrics_of(registry: CollectorRegistry) -> dict[Any, float]:
    return samples_of(generate_latest(registry).decode())


def test_an_event_counts_once_under_its_task_and_outcome() -> None:
    registry = CollectorRegistry()
    events = EventMetrics(registry)
    for outcome in ("acquired", "skipped", "skipped"):
        assert events.handle({"type": f"task-singletask-{outcome}", "name": "proj.sync",
                              "singletask_outcome": outcome})  # fmt: skip
    samples = metrics_of(registry)
    assert value(samples, "singletask_outcomes_total", task="proj.sync", outcome="skipped") == 2
    assert value(samples, "singletask_outcomes_total", task="proj.sync", outcome="acquired") == 1
    # every documented outcome of a task seen starts at 0
    for outcome in OUTCOMES:
        found = value(samples, "singletask_outcomes_total", task="proj.sync", outcome=outcome)
        assert found is not None


def test_other_events_are_ignored_and_odd_fields_bounded() -> None:
    registry = CollectorRegistry()
    events = EventMetrics(registry)
    assert not events.handle({"type": "task-succeeded", "name": "proj.sync"})
    assert not events.handle({"type": "worker-heartbeat"})
    # an outcome not documented counts as "other"; the task comes from the key if not named
    events.handle({"type": "task-singletask-new", "singletask_outcome": "new",
                   "singletask_key": "singletask:proj.a%3Ab:k"})  # fmt: skip
    events.handle({"type": "task-singletask-skipped"})
    # a wait that is not a duration is not observed
    for wait in (None, "x", -1, float("nan"), True):
        events.handle({"type": "task-singletask-acquired", "name": "proj.sync",
                       "singletask_wait": wait})  # fmt: skip
    samples = metrics_of(registry)
    assert value(samples, "singletask_outcomes_total", task="proj.a:b", outcome="other") == 1
    assert value(samples, "singletask_outcomes_total", task="unknown", outcome="skipped") == 1
    assert value(samples, "singletask_outcomes_total", task="proj.sync", outcome="acquired") == 5
    assert value(samples, "singletask_lock_wait_seconds_count", task="proj.sync") is None


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[LockBackend]:
    backend = SQLiteBackend.from_url(f"sqlite:///{tmp_path / 'locks.db'}")
    try:
        yield backend
    finally:
        backend.close()


def hold(
    backend: LockBackend, key: str, task: str, *, since: float, reserved: bool = False
) -> None:
    task_id = str(uuid.uuid4())
    token = reservation_token(task_id, 0) if reserved else execution_token(task_id, 0)
    meta = {"task_id": task_id, "task": task, "scope": "execution", "since": f"{since:.3f}"}
    assert backend.acquire(key, token, 60, meta=meta).acquired


def test_the_store_gauges_count_holds_and_reservations_per_task(
    sqlite_store: LockBackend,
) -> None:
    registry = CollectorRegistry()
    store = StoreCollector(sqlite_store, PREFIX, interval=5)
    registry.register(store)
    now = time.time()
    hold(sqlite_store, f"{PREFIX}proj.sync:customer-1", "proj.sync", since=now - 30)
    hold(sqlite_store, f"{PREFIX}proj.sync:customer-2", "proj.sync", since=now - 5)
    hold(sqlite_store, f"{PREFIX}proj.mail:customer-1", "proj.mail", since=now - 7, reserved=True)

    store.read()
    samples = metrics_of(registry)
    assert value(samples, "singletask_store_up") == 1
    assert value(samples, "singletask_locks_held", task="proj.sync") == 2
    assert value(samples, "singletask_locks_held", task="proj.mail") == 0
    assert value(samples, "singletask_lock_reservations", task="proj.mail") == 1
    assert 29 <= (value(samples, "singletask_oldest_hold_age_seconds", task="proj.sync") or 0) < 40
    assert value(samples, "singletask_oldest_hold_age_seconds", task="proj.mail") is None
    assert 6 <= (value(samples, "singletask_oldest_reservation_age_seconds", task="proj.mail")
                 or 0) < 20  # fmt: skip
    assert "customer" not in generate_latest(registry).decode()

    # released: the counts of a task seen go to 0, its ages go
    for key in ("proj.sync:customer-1", "proj.sync:customer-2", "proj.mail:customer-1"):
        sqlite_store.force_release(PREFIX + key)
    store.read()
    samples = metrics_of(registry)
    assert value(samples, "singletask_locks_held", task="proj.sync") == 0
    assert value(samples, "singletask_oldest_hold_age_seconds", task="proj.sync") is None


def test_a_failed_read_makes_store_up_0_and_drops_the_gauges(
    sqlite_store: LockBackend, caplog: pytest.LogCaptureFixture
) -> None:
    """No stale numbers while the store fails; one log line when it starts failing, one when it
    answers again, not one per read."""
    registry = CollectorRegistry()
    store = StoreCollector(sqlite_store, PREFIX, interval=5)
    registry.register(store)
    hold(sqlite_store, f"{PREFIX}proj.sync", "proj.sync", since=time.time())
    store.read()
    assert value(metrics_of(registry), "singletask_locks_held", task="proj.sync") == 1
    # the store now answers no more (nothing listens on its port)
    store.backend = backend_from_url(f"redis://127.0.0.1:{free_port()}/0")
    try:
        store.read()
        store.read()
    finally:
        store.backend.close()
    samples = metrics_of(registry)
    assert value(samples, "singletask_store_up") == 0
    assert value(samples, "singletask_locks_held", task="proj.sync") is None
    # and it answers again
    store.backend = sqlite_store
    store.read()
    assert value(metrics_of(registry), "singletask_locks_held", task="proj.sync") == 1
    logged = [r.getMessage() for r in caplog.records if r.name == "singletask.exporter"]
    assert len(logged) == 2, logged
    assert "reading the lock store failed" in logged[0]
    assert "read again" in logged[1]


def test_the_store_gauges_show_each_named_limit_s_units_used_and_size(
    limits_store: tuple[str, LockBackend], key_prefix: str
) -> None:
    """One series per limit and kind, labelled by the limit's name and kind (no task id, no
    task name): units in use (held, or started in the rate's window) and the size."""
    # Given executions holding 2 and 1 units of a concurrency limit of 8, the first also
    # having started 1200 units of a rate of 90000 per minute
    _, backend = limits_store
    registry = CollectorRegistry()
    store = StoreCollector(backend, key_prefix, interval=5)
    registry.register(store)
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    units = concurrency(key_prefix, "openai-requests", 8, 2)
    token = take(backend, first, "proj.summarize", units,
                 rate(key_prefix, "openai-tokens", 90000, 1200))  # fmt: skip
    other = take(backend, second, "proj.embed", concurrency(key_prefix, "openai-requests", 8, 1))

    # When the store is read
    store.read()

    # Then each limit has its units in use and its size, by name and kind
    samples = metrics_of(registry)
    requests = {"limit": "openai-requests", "kind": "concurrency"}
    tokens = {"limit": "openai-tokens", "kind": "rate"}
    assert value(samples, "singletask_limit_units_used", **requests) == 3
    assert value(samples, "singletask_limit_units_size", **requests) == 8
    assert value(samples, "singletask_limit_units_used", **tokens) == 1200
    assert value(samples, "singletask_limit_units_size", **tokens) == 90000
    limit_series = [labels for name, labels in samples if name.startswith("singletask_limit_")]
    assert len(limit_series) == 4
    assert {label for labels in limit_series for label, _ in labels} == {"limit", "kind"}
    text = generate_latest(registry).decode()
    assert first not in text
    assert second not in text
    assert "proj.summarize" not in text  # a limit's holders are not counted as the task's locks

    # When the concurrency units are given back, the limit stays at 0 with its size
    assert backend.give_units(token, [units]) == [True]
    assert backend.give_units(other, [units]) == [True]
    store.read()
    samples = metrics_of(registry)
    assert value(samples, "singletask_limit_units_used", **requests) == 0
    assert value(samples, "singletask_limit_units_size", **requests) == 8
    assert value(samples, "singletask_limit_units_used", **tokens) == 1200


def test_the_limit_gauges_are_left_out_while_the_store_fails(
    limits_store: tuple[str, LockBackend], key_prefix: str
) -> None:
    _, backend = limits_store
    registry = CollectorRegistry()
    store = StoreCollector(backend, key_prefix, interval=5)
    registry.register(store)
    take(backend, str(uuid.uuid4()), "proj.summarize", concurrency(key_prefix, "a", 8, 2))
    store.read()
    assert value(metrics_of(registry), "singletask_limit_units_used", limit="a",
                 kind="concurrency") == 2  # fmt: skip
    store.backend = backend_from_url(f"redis://127.0.0.1:{free_port()}/0")
    try:
        store.read()
    finally:
        store.backend.close()
    samples = metrics_of(registry)
    assert value(samples, "singletask_store_up") == 0
    assert not [name for name, _ in samples if name.startswith("singletask_limit_")]


@pytest.fixture
def redis_store(redis_base_url: str) -> Iterator[LockBackend]:
    """The session's private Redis as the lock store (a store that keeps every record kind)."""
    backend = backend_from_url(f"{redis_base_url}/{STORE_DB}")
    try:
        yield backend
    finally:
        backend.close()


@pytest.fixture
def exporter(redis_base_url: str, redis_store: LockBackend) -> Iterator[tuple[Exporter, str]]:
    app = Celery("exporter-test", broker=f"{redis_base_url}/{BROKER_DB}", set_as_current=False)
    service = Exporter(app, redis_store, prefix=PREFIX, store_interval=0.3)
    host, port = service.bind("127.0.0.1", 0)
    thread = threading.Thread(target=service.serve_forever, daemon=True)
    thread.start()
    try:
        yield service, f"http://{host}:{port}/metrics"
    finally:
        service.shutdown()
        thread.join(10)
        app.close()


def wait_for_sample(url: str, name: str, expected: float, **labels: str) -> None:
    deadline = time.monotonic() + 30
    while value(samples_of(scrape_text(url)), name, **labels) != expected:
        assert time.monotonic() < deadline, f"{name}{labels} never {expected}"
        time.sleep(0.1)


def test_the_exporter_serves_events_and_store_over_http(
    exporter: tuple[Exporter, str], redis_store: LockBackend, redis_base_url: str
) -> None:
    _, url = exporter
    wait_for_sample(url, "singletask_broker_up", 1)
    hold(redis_store, f"{PREFIX}proj.sync:customer-7", "proj.sync", since=time.time())
    wait_for_sample(url, "singletask_locks_held", 1, task="proj.sync")
    sender = Celery("sender", broker=f"{redis_base_url}/{BROKER_DB}", set_as_current=False)
    with sender.events.default_dispatcher(hostname="celery@test") as dispatcher:
        dispatcher.send("task-singletask-acquired", uuid="t1", name="proj.sync",
                        singletask_outcome="acquired", singletask_wait=0.02)  # fmt: skip
    sender.close()
    wait_for_sample(url, "singletask_lock_wait_seconds_count", 1, task="proj.sync")
    assert "customer-7" not in scrape_text(url)
    redis_store.force_release(f"{PREFIX}proj.sync:customer-7")


def test_the_dashboard_and_the_alerts_name_only_metrics_the_exporter_serves(
    exporter: tuple[Exporter, str],
) -> None:
    """Every metric examples/grafana_dashboard.json and examples/prometheus_alerts.yml name is
    in the exporter's /metrics (tests/visibility/test_exporter.py checks it on a live fleet)."""
    _, url = exporter
    wait_for_sample(url, "singletask_store_up", 1)
    served = exposed_names(scrape_text(url))
    for example, names in names_in_examples().items():
        assert names, f"{example} names no metric"
        assert names <= served, f"{example} names metrics not served: {sorted(names - served)}"


def invoke(*args: str) -> Any:
    with contextlib.suppress(TypeError):
        return CliRunner(mix_stderr=False).invoke(singletask, list(args))  # type: ignore[call-arg]
    return CliRunner().invoke(singletask, list(args))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "no broker: give --broker URL"),
        (("--broker", "redis://127.0.0.1:1/0", "--store-interval", "0"), "must be above 0"),
        (("--broker", "redis://127.0.0.1:1/0", "--url", "memory://"), "lives inside one process"),
        (("--broker", "redis://127.0.0.1:1/0", "--url", "memcached://127.0.0.1:1"),
         "need a store that can list its locks"),
        (("--broker", "redis://127.0.0.1:1/0", "--port", "{busy}"), "cannot listen on"),
    ],
)  # fmt: skip
def test_bad_input_fails_at_once_with_a_clear_error(args: tuple[str, ...], message: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        result = invoke("exporter", *(arg.replace("{busy}", port) for arg in args))
    assert result.exit_code == 2, result.output
    assert message in result.stderr


def test_a_store_that_hangs_at_the_start_holds_up_neither_the_start_nor_a_scrape(
    redis_base_url: str,
) -> None:
    """The first read is waited for at most the interval; meanwhile store_up is 0."""
    app = Celery("exporter-test", broker=f"{redis_base_url}/{BROKER_DB}", set_as_current=False)
    with FaultProxy.for_url(f"{redis_base_url}/{STORE_DB}")[0] as proxy:
        proxy.stall()
        service = Exporter(
            app, backend_from_url(proxy.url_for(f"{redis_base_url}/{STORE_DB}")), prefix=PREFIX,
            store_interval=0.5,
        )  # fmt: skip
        started = time.monotonic()
        service.start_store(wait=0.5)
        assert time.monotonic() - started < 5
        time.sleep(0.6)  # the read still hangs, longer than the interval now
        samples = samples_of(generate_latest(service.registry).decode())
        assert value(samples, "singletask_store_up") == 0
        proxy.resume()
        deadline = time.monotonic() + 20
        while value(samples_of(generate_latest(service.registry).decode()),
                    "singletask_store_up") != 1:  # fmt: skip
            assert time.monotonic() < deadline, "the store is never read"
            time.sleep(0.1)
        service.close()
    app.close()


def test_the_exporter_receives_only_singletask_events(redis_base_url: str) -> None:
    """Its queue is bound to singletask's event types: a busy fleet's other task events and
    heartbeats are not delivered to it at all."""
    app = Celery("exporter-test", broker=f"{redis_base_url}/{BROKER_DB}", set_as_current=False)
    seen: list[dict[str, Any]] = []
    follower = EventFollower(app, seen.append)
    follower.start()
    try:
        deadline = time.monotonic() + 20
        while not follower.connected:
            assert time.monotonic() < deadline, "never connected"
            time.sleep(0.05)
        with app.events.default_dispatcher(hostname="celery@test") as dispatcher:
            dispatcher.send("task-succeeded", uuid="t1", name="proj.sync")
            dispatcher.send("worker-heartbeat")
            dispatcher.send("task-singletask-skipped", uuid="t2", name="proj.sync",
                            singletask_outcome="skipped")  # fmt: skip
        while not seen:
            assert time.monotonic() < deadline, "the singletask event never came"
            time.sleep(0.05)
        time.sleep(0.5)  # the others, had they been delivered, were sent before it
        assert [event["type"] for event in seen] == ["task-singletask-skipped"]
    finally:
        follower.stop()
        app.close()
