"""With OpenTelemetry's Celery instrumentation active, an execution's ``run/<task>`` span carries
singletask's attributes, and a lease loss is an event of that span.

A worker in this process (``celery.contrib.testing.worker.start_worker``, a threads pool) on the
session's private Redis server, instrumented with ``CeleryInstrumentor`` and a tracer provider
whose spans go to the SDK's ``InMemorySpanExporter``.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
import redis
from celery.contrib.testing.worker import start_worker

from singletask import Skipped
from singletask.observe.report import spans
from tests.visibility.events_app import GATES_ENV, gate_key, make_app

if TYPE_CHECKING:
    # Imported by the fixture: the SDK is the dependency group `visibility`, which a run that
    # does not select these tests (the README's command) does not install; collecting this
    # module must not need it.
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

pytestmark = pytest.mark.visibility

TIMEOUT = 30

#: The attribute in which the instrumentation puts the task id.
MESSAGE_ID = "messaging.message.id"


class Traced:
    def __init__(self, app: Any, exporter: InMemorySpanExporter, gates: redis.Redis) -> None:
        self.app = app
        self.exporter = exporter
        self.gates = gates

    def run_span(self, task_id: str, timeout: float = TIMEOUT) -> ReadableSpan:
        """The ended ``run/...`` span of ``task_id``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for span in self.exporter.get_finished_spans():
                attributes = span.attributes or {}
                # (the instrumentation's attribute for the task id)
                if span.name.startswith("run/") and attributes.get(MESSAGE_ID) == task_id:
                    return span
            time.sleep(0.05)
        raise AssertionError(f"no run span of {task_id} within {timeout}s")

    def acquired(self, task: Any, label: str, task_id: str) -> None:
        """Wait until the run ``task_id`` of ``task`` holds the lock of ``label``."""
        key = task.lock_key_for((label,))
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            holder = task.lock_backend.holder(key)
            if holder is not None and holder.task_id == task_id:
                return
            time.sleep(0.05)
        raise AssertionError(f"{task_id} did not take lock {key!r} within {TIMEOUT}s")

    def open_gate(self, label: str) -> None:
        self.gates.rpush(gate_key(label), 1)
        self.gates.expire(gate_key(label), 300)


@pytest.fixture(scope="module")
def traced(redis_base_url: str, monkeypatch_module: pytest.MonkeyPatch) -> Iterator[Traced]:
    monkeypatch_module.setenv(GATES_ENV, f"{redis_base_url}/8")
    app = make_app(
        broker=f"{redis_base_url}/9",
        results=f"{redis_base_url}/10",
        locks=f"{redis_base_url}/11",
        queue=f"otel-{uuid.uuid4().hex[:8]}",
    )
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = CeleryInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    gates = redis.Redis.from_url(f"{redis_base_url}/8")
    traced = Traced(app, exporter, gates)
    try:
        with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
            yield traced
    finally:
        instrumentor.uninstrument()
        gates.close()
        app.close()


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_a_run_span_carries_key_outcome_fence_and_wait(traced: Traced) -> None:
    # Given a singleton task sent and run
    label = uuid.uuid4().hex[:12]
    task = traced.app.tasks["events.skip"]
    result = task.delay(label)
    assert result.get(timeout=TIMEOUT) == f"did the work of {label}"

    # Then its run span carries singletask's attributes
    attributes = traced.run_span(result.id).attributes or {}
    assert attributes["singletask.key"] == task.lock_key_for((label,))
    assert attributes["singletask.outcome"] == "acquired"
    assert isinstance(attributes["singletask.fence"], int)
    assert 0 <= attributes["singletask.wait"] < TIMEOUT
    assert attributes["singletask.held"] >= 0
    assert "singletask.holder" not in attributes
    # (and, the worker sending no task events, singletask sent none)
    assert "_singletask_event_sender" not in traced.app.__dict__


def test_a_skipped_duplicate_span_names_the_holder(traced: Traced) -> None:
    # Given a run holding its lock
    label = uuid.uuid4().hex[:12]
    task = traced.app.tasks["events.skip"]
    holder = task.delay(label, hold=True)
    try:
        traced.acquired(task, label, holder.id)
        # When a duplicate runs
        duplicate = task.delay(label)
        assert isinstance(duplicate.get(timeout=TIMEOUT), Skipped)
    finally:
        traced.open_gate(label)
    holder.get(timeout=TIMEOUT)

    # Then its span tells the outcome and names the holder
    attributes = traced.run_span(duplicate.id).attributes or {}
    assert attributes["singletask.outcome"] == "skipped"
    assert attributes["singletask.holder"] == holder.id
    assert attributes["singletask.key"] == task.lock_key_for((label,))
    assert "singletask.fence" not in attributes


def test_a_lease_loss_is_an_event_of_the_run_span(traced: Traced) -> None:
    # Given a run of a "replace" task holding its lock, and a newer one preempting it
    label = uuid.uuid4().hex[:12]
    task = traced.app.tasks["events.replace"]
    holder = task.delay(label, hold=True)
    traced.acquired(task, label, holder.id)
    newer = task.delay(label, hold=True)
    try:
        value = holder.get(timeout=TIMEOUT)
    finally:
        traced.open_gate(label)
    newer.get(timeout=TIMEOUT)
    assert isinstance(value, Skipped)
    assert value.reason == "replaced"

    # Then the preempted run's span has the lease loss as an event (sent from the renewer
    # thread) and ends with the outcome "preempted", naming the newer execution
    span = traced.run_span(holder.id)
    lost = [event for event in span.events if event.name == "singletask.lease_lost"]
    assert len(lost) == 1
    attributes = span.attributes or {}
    event = lost[0].attributes or {}
    assert event["singletask.key"] == task.lock_key_for((label,))
    assert event["singletask.reason"]
    assert event["singletask.fence"] == attributes["singletask.fence"]
    assert attributes["singletask.outcome"] == "preempted"
    assert attributes["singletask.holder"] == newer.id
    newer_attributes = traced.run_span(newer.id).attributes or {}
    assert newer_attributes["singletask.fence"] > attributes["singletask.fence"]


def test_without_opentelemetry_nothing_is_traced(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a process where nothing has imported OpenTelemetry's trace API
    monkeypatch.delitem(sys.modules, "opentelemetry.trace")

    # Then singletask finds no span (and does not import it), and telling one is a no-op
    assert spans.current() is None
    assert "opentelemetry.trace" not in sys.modules
    spans.annotate(None, {"key": "k"})
    spans.add_event(None, "lease_lost", {"key": "k"})
