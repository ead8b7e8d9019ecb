"""``lock_rate = "N/s" | "N/m" | "N/h"``: starts of one lock key spaced fleet-wide (issue 24).

In one process (eager mode), against the memory store, SQLite and the session's private Redis:
a start within the interval of the key's last one is refused, and the lock policy decides,
saying it was the rate and how long until a start is allowed. Definition time refuses what
Celery's rate syntax would not parse and intervals out of range. Real workers and the fleet's
observed rate: tests/e2e/test_rates.py and bench/.
"""

from __future__ import annotations

from typing import Any

import celery
import pytest

from singletask import ConfigurationError, RateLimited, SingletonTask, Skipped, TaskLocked


@pytest.fixture
def app(eager_store_app: celery.Celery) -> celery.Celery:
    """An eager app on each store with limits, rates and debounce (tests/conftest.py)."""
    return eager_store_app


def test_a_start_within_the_interval_is_skipped_saying_it_was_the_rate(app: celery.Celery) -> None:
    @app.task(base=SingletonTask, shared=False, lazy=False, lock_rate="2/m")
    def call_partner() -> str:
        return "called"

    # Given one start (2/m: the next is allowed 30 s later)
    assert call_partner.delay().get() == "called"

    # When the task is started again at once
    value = call_partner.delay().get()

    # Then it is skipped by the rate, with the time left, not by a holder
    assert isinstance(value, Skipped)
    assert value.reason == "rate"
    assert value.holder is None
    assert value.retry_after is not None
    assert 25 < value.retry_after <= 30
    assert "lock_rate" in str(value)


def test_raise_fails_with_rate_limited_a_task_locked_carrying_retry_after(
    app: celery.Celery,
) -> None:
    @app.task(base=SingletonTask, shared=False, lazy=False, lock_rate="1/h", lock_policy="raise")
    def call_partner() -> str:
        return "called"

    call_partner.delay().get()
    with pytest.raises(RateLimited) as raised:
        call_partner.apply(throw=True)
    assert isinstance(raised.value, TaskLocked)
    assert 3500 < raised.value.retry_after <= 3600
    assert raised.value.rate == "1/h"


def test_the_rate_spaces_starts_even_with_free_slots(app: celery.Celery) -> None:
    """With ``lock_limit = 3`` and a rate, the second start waits although two slots are free."""

    @app.task(
        base=SingletonTask, shared=False, lazy=False, lock_rate="1/m", lock_limit=3, bind=True
    )
    def export(self: Any) -> str:
        return str(self.lock.key)

    assert export.delay().get() == export.lock_key_for()
    assert export.delay().get().reason == "rate"


def test_per_argument_keys_have_rates_of_their_own(app: celery.Celery) -> None:
    @app.task(base=SingletonTask, shared=False, lazy=False, lock_rate="1/m", lock_args=("partner",))
    def call(partner: str) -> str:
        return partner

    assert call.delay("a").get() == "a"
    assert call.delay("b").get() == "b"
    assert isinstance(call.delay("a").get(), Skipped)


# -- definition time ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    ["10/x", "abc", "0/m", "-1/s", "10/minute", "10", 10, "", "nan/s", "2000/s", "0.0001/h"],
)
def test_a_bad_rate_is_refused_naming_task_and_attribute(value: object) -> None:
    app = celery.Celery("rate-bad", set_as_current=False)
    with pytest.raises(ConfigurationError, match=r"task 'rate\.bad' attribute lock_rate"):

        @app.task(base=SingletonTask, shared=False, lazy=False, name="rate.bad", lock_rate=value)
        def bad() -> None: ...


@pytest.mark.parametrize("value", ["10/s", "10/m", "1.5/h", " 3/m "])
def test_celerys_rate_syntax_is_accepted(value: str) -> None:
    app = celery.Celery("rate-good", set_as_current=False)

    @app.task(base=SingletonTask, shared=False, lazy=False, name="rate.good", lock_rate=value)
    def good() -> None: ...


@pytest.mark.parametrize("url", ["memcached://127.0.0.1:1", "django://default"])
def test_a_store_without_rate_records_refuses_a_rate_at_definition(url: str) -> None:
    app = celery.Celery("rate-store", set_as_current=False)
    app.conf.update(singletask_backend_url=url)
    scheme = url.split(":", 1)[0]
    with pytest.raises(ConfigurationError, match=rf"lock_rate: the {scheme}:// lock store"):

        @app.task(base=SingletonTask, shared=False, lazy=False, name="rate.m", lock_rate="1/s")
        def bad() -> None: ...
