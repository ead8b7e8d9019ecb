"""The table of endings and the policy registry, as the lifecycle module states them.

The behaviour behind each row is tested end to end (tests/e2e/test_endings.py) and in process
(tests/execution/test_task_inprocess.py); these tests pin the table itself to docs/lifecycle.rst.
"""

from __future__ import annotations

import time

import pytest
from celery.exceptions import Ignore, Reject, Retry

from singletask.conf.settings import POLICIES as POLICY_NAMES
from singletask.exceptions import BackendError, BackendTimeout, BackendUnavailable
from singletask.execution.endings import END_PERSISTENCE, ENDINGS, ending_of, persist
from singletask.policies import POLICIES, Policy


def _retry_with_message() -> Retry:
    retry = Retry("again", when=5)
    retry.sig = object()  # type: ignore[assignment]  # a published retry carries its signature
    return retry


@pytest.mark.parametrize(
    ("raised", "worker", "ending", "reserve", "completed"),
    [
        (ValueError("boom"), True, "raised", False, True),
        (Reject("no", requeue=False), True, "rejected", False, True),
        (Reject("later", requeue=True), True, "requeued", False, False),
        (Ignore(), True, "ignored", False, False),
        (_retry_with_message(), True, "retried", True, False),
        (_retry_with_message(), False, "retried-inline", False, False),
        (Retry("direct"), True, "retried-inline", False, False),
        (SystemExit(-241), True, "stopped", False, False),
        (KeyboardInterrupt(), True, "stopped", False, False),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else None,
)
def test_each_way_a_body_ends_has_its_row(
    raised: BaseException, worker: bool, ending: str, reserve: bool, completed: bool
) -> None:
    """How the hold ends, by the way the body ended (docs/lifecycle.rst, "Which hook releases
    on which ending")."""
    # When the body ended by raising this
    row = ending_of(raised, worker=worker)

    # Then its row keeps the lock only for a worker's own retry, and marks the message
    # completed only when it is done with
    assert row == ending
    assert ENDINGS[row].reserve is reserve
    assert ENDINGS[row].completed is completed


def test_a_body_that_returns_releases_and_completes() -> None:
    """The ending without an exception: released, completion recorded."""
    assert ENDINGS["returned"].reserve is False
    assert ENDINGS["returned"].completed is True


def test_only_a_retry_published_by_a_worker_keeps_the_lock() -> None:
    """Every other ending releases: exactly one row reserves."""
    assert [name for name, row in ENDINGS.items() if row.reserve] == ["retried"]


def test_every_policy_name_the_settings_accept_is_one_policy_object() -> None:
    """``lock_policy`` values and the policy classes are the same set."""
    assert set(POLICIES) == set(POLICY_NAMES)
    for name, policy in POLICIES.items():
        assert isinstance(policy, Policy)
        assert policy.name == name
        assert policy.at_send in ("dedupe", "raise")


def test_a_retried_attempt_waits_longer_at_each_check_while_its_previous_attempt_runs() -> None:
    """The checks of a retried attempt that finds the attempt before it still running: 0.5 to
    0.75 s first, then doubling (up to 25 % more), never above the holder's lease left (at
    least 1 s, at most ``lock_ttl``)."""
    from singletask.execution.outcomes import previous_attempt_wait

    for _ in range(50):
        assert 0.5 <= previous_attempt_wait(0, 30.0, 29.0) <= 0.75
        assert 1.0 <= previous_attempt_wait(1, 30.0, 29.0) <= 1.25
        assert 4.0 <= previous_attempt_wait(3, 30.0, 29.0) <= 5.0
        assert 20.0 <= previous_attempt_wait(9, 30.0, 20.0) <= 25.0
        assert 30.0 <= previous_attempt_wait(9, 30.0, None) <= 37.5
        assert 1.0 <= previous_attempt_wait(9, 30.0, 0.1) <= 1.25


def test_the_count_of_checks_belongs_to_one_attempt() -> None:
    """Celery copies a message's headers into the next retry: a count kept by attempt 1 is no
    count for attempt 2, which starts again from 0."""
    from types import SimpleNamespace

    from singletask.protocol.headers import PREVIOUS_WAITS_HEADER, attempt_count

    def request(retries: int, value: object) -> object:
        return SimpleNamespace(retries=retries, headers={PREVIOUS_WAITS_HEADER: value})

    assert attempt_count(request(1, "1:3"), PREVIOUS_WAITS_HEADER) == 3
    assert attempt_count(request(2, "1:3"), PREVIOUS_WAITS_HEADER) == 0
    assert attempt_count(request(1, None), PREVIOUS_WAITS_HEADER) == 0
    assert attempt_count(request(1, "garbage"), PREVIOUS_WAITS_HEADER) == 0


# -- the end of a hold while the store cannot be reached (issue 37) -------------------------


class Flaky:
    """An operation that fails ``failures`` times with ``error``, then returns True."""

    def __init__(self, failures: int, error: Exception) -> None:
        self.failures, self.error, self.calls = failures, error, 0

    def __call__(self) -> bool:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return True


def test_the_end_of_a_hold_is_sent_again_while_the_store_cannot_be_reached() -> None:
    flaky = Flaky(3, BackendUnavailable("connection refused"))
    assert persist(flaky, lease=30.0) == (True, 3)
    timeout = Flaky(1, BackendTimeout("timed out"))
    assert persist(timeout, lease=30.0) == (True, 1)


def test_the_end_of_a_hold_gives_up_after_its_bound_or_the_lease() -> None:
    started = time.monotonic()
    with pytest.raises(BackendUnavailable):
        persist(Flaky(10**6, BackendUnavailable("down")), lease=0.3)
    assert time.monotonic() - started < END_PERSISTENCE  # the lease (0.3 s) bounds it
    started = time.monotonic()
    with pytest.raises(BackendUnavailable):
        persist(Flaky(10**6, BackendUnavailable("down")), lease=30.0)
    assert END_PERSISTENCE - 0.5 < time.monotonic() - started < END_PERSISTENCE + 1.0


def test_other_store_errors_are_not_sent_again() -> None:
    flaky = Flaky(1, BackendError("WRONGTYPE"))
    with pytest.raises(BackendError):
        persist(flaky, lease=30.0)
    assert flaky.calls == 1
