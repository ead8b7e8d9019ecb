"""The table of endings and the policy registry, as the lifecycle module states them.

The behaviour behind each row is tested end to end (tests/e2e/test_endings.py) and in process
(tests/test_task_inprocess.py); these tests pin the table itself to docs/lifecycle.rst.
"""

from __future__ import annotations

import pytest
from celery.exceptions import Ignore, Reject, Retry

from singletask.config import POLICIES as POLICY_NAMES
from singletask.lifecycle import ENDINGS, ending_of
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
