"""When singletask sends its Celery events, that sending one never holds an execution up, and how
Flower's formatter reads an outcome back (the events themselves, on a real worker and a real
Flower: tests/visibility/)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
from celery import Celery

from singletask import ConfigurationError, RateLimited, SingletonTask, Skipped, TaskLocked
from singletask.conf.settings import Settings
from singletask.observe import events, report
from singletask.observe.flower import describe, format_task, shown_state
from tests.servers import free_port


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("observe", broker=f"redis://127.0.0.1:{free_port()}/0")  # nothing listens
    app.conf.singletask_backend_url = "memory://"
    yield app
    app.close()


def test_events_follow_the_worker_unless_the_setting_forces_them(app: Celery) -> None:
    # Given no worker and no setting, no events
    assert not report.sends_events(app)
    # When the worker was started with -E, its processes send them
    report.worker_started(app, True, "w@host")
    assert report.sends_events(app)
    # And the setting wins over the worker either way
    app.conf.singletask_send_events = False
    app.__dict__.pop("_singletask_state", None)  # settings are read once per app
    assert not report.sends_events(app)


def test_a_producer_sends_them_with_task_sent_events(app: Celery) -> None:
    assert not report.sends_events(app, producer=True)
    app.conf.task_send_sent_event = True
    assert report.sends_events(app, producer=True)


def test_the_setting_is_none_or_a_bool(app: Celery) -> None:
    app.conf.singletask_send_events = "yes"
    with pytest.raises(ConfigurationError, match="singletask_send_events"):
        Settings.from_app(app)


def test_every_conflict_action_maps_onto_an_outcome_of_the_contract() -> None:
    assert set(report.CONFLICT_OUTCOMES.values()) <= report.OUTCOMES
    assert len(report.OUTCOMES) == 11


def test_an_unreachable_broker_does_not_hold_the_execution_up(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    # Given events forced on, and a broker nothing listens on
    app.conf.singletask_send_events = True

    @app.task(base=SingletonTask, bind=True, name="report.t")
    def t(self: SingletonTask) -> None: ...

    t.push_request(id="an-id", hostname="w@host")
    try:
        # When an outcome is told
        start = time.monotonic()
        report.emit(t, "skipped", "k", holder="other")
        took = time.monotonic() - start
    finally:
        t.pop_request()

    # Then it returns at once; the event is dropped later, with a WARNING
    assert took < 0.5
    sender = app.__dict__["_singletask_event_sender"]
    with caplog.at_level(logging.WARNING, logger="singletask"):
        assert sender.join(timeout=60)
    assert "could not send the event task-singletask-skipped" in caplog.text


def test_events_queue_up_to_a_bound(
    app: Celery, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(events, "QUEUE_LIMIT", 2)
    with caplog.at_level(logging.WARNING, logger="singletask"):
        for _ in range(20):
            events.send(app, "task-singletask-skipped", None, {"uuid": "x"})
    # (once per run of drops: the thread may take one event between two of them)
    assert 1 <= caplog.text.count("2 events wait for the broker; dropping new ones") <= 3


KEY = "singletask:t:1"
SKIPPED = repr(Skipped(KEY, "holder-id", 3.0))
LOCKED = repr(TaskLocked(KEY, "holder-id", 2.0))


@pytest.mark.parametrize(
    ("state", "result", "exception", "outcome", "holder"),
    [
        ("SUCCESS", SKIPPED, None, "skipped", "holder-id"),
        ("SUCCESS", repr(Skipped(KEY, "l", reason="debounced")), None, "superseded", "l"),
        ("SUCCESS", repr(Skipped(KEY, "n", reason="replaced")), None, "preempted", "n"),
        ("SUCCESS", repr(Skipped(KEY, reason="rate", retry_after=1.0)), None, "rate_limited", None),
        ("FAILURE", None, LOCKED, "raised", "holder-id"),
        ("RETRY", None, LOCKED, "retried", "holder-id"),
        ("RETRY", None, repr(RateLimited(KEY, 1.0, "1/m")), "rate_limited", None),
    ],
)  # fmt: skip
def test_flower_s_formatter_reads_the_outcome_back(
    state: str, result: str | None, exception: str | None, outcome: str, holder: str | None
) -> None:
    found = describe(state, result, exception)
    assert found == {"lock_outcome": outcome, "lock_key": KEY, "lock_holder": holder}


@pytest.mark.parametrize(
    ("state", "result", "exception"),
    [
        ("SUCCESS", "'did the work'", None),
        ("SUCCESS", SKIPPED[:40] + "...", None),  # cut short by Celery's resultrepr_maxsize
        ("SUCCESS", "Skipped(__import__('os'))", None),
        ("FAILURE", None, "ValueError('boom')"),
        ("SUCCESS", None, repr(TaskLocked("k", "h", 1.0))),  # retried, then ran
        ("STARTED", SKIPPED, None),
    ],
)
def test_a_run_that_did_its_work_is_shown_as_it_is(
    state: str, result: str | None, exception: str | None
) -> None:
    assert describe(state, result, exception) is None


def test_the_formatter_adds_the_outcome_to_the_state_and_rows_to_the_page() -> None:
    from celery.events.state import Task

    task = format_task(Task("an-id", name="t", state="SUCCESS", result=SKIPPED))
    assert task.state == "SUCCESS: skipped"
    assert task._fields[-3:] == ("lock_outcome", "lock_key", "lock_holder")
    assert task.as_dict()["lock_holder"] == "holder-id"
    assert Task._fields[-1] == "children"  # the class is left alone


@pytest.mark.parametrize(
    ("state", "shown"),
    [
        ("SINGLETASK-ACQUIRED", "STARTED"),  # Celery's state after the acquired event
        ("SINGLETASK-RELEASED", "STARTED"),
        ("SINGLETASK-LEASE_LOST", "STARTED"),
        ("SINGLETASK-SKIPPED", "STARTED: skipped"),  # its SUCCESS not reported yet
        ("SINGLETASK-RETRIED", "RETRY: retried"),
        ("SUCCESS", "SUCCESS"),
        ("STARTED", "STARTED"),
    ],
)
def test_the_state_an_event_of_singletask_left_is_shown_as_celery_s(state: str, shown: str) -> None:
    assert shown_state(state) == shown


def test_a_revoked_run_is_shown_revoked() -> None:
    assert shown_state("SINGLETASK-ACQUIRED", revoked=True) == "REVOKED"
