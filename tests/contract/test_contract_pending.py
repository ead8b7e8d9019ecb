"""The contract of a debounce window's *pending* latest send, run against every backend with
debounce windows.

A send written with ``pending`` is being published: an earlier send that asks
:meth:`LockBackend.debounce_take` meanwhile is told to wait (the seconds it stays pending at
most) instead of being superseded by a send that may never be published. The pending send is
settled by :meth:`LockBackend.debounce_published` (it supersedes the earlier sends), by
:meth:`LockBackend.debounce_undo` (it never existed), or by its deadline: still pending then, its
producer died between the write and the publish, and it is treated as taken back (the first
send to ask after that runs).
"""

from __future__ import annotations

import time

import pytest

from singletask.backends.base import LockBackend

from .test_contract import (
    EXPIRY_WAIT,
    LEASE,
    every_record_expires,  # noqa: F401 - the contract's autouse check
)

#: A publish deadline a test never sees run out by accident ...
PUBLISHING = 30.0
#: ... and one it watches run out.
BRIEF = 0.3


@pytest.fixture
def key(key_prefix: str) -> str:
    return f"{key_prefix}lock"


@pytest.fixture
def debounced(backend: LockBackend) -> LockBackend:
    """A backend with debounce windows (not collected for ``ONE_HOLDER_BACKENDS``)."""
    return backend


def test_an_earlier_send_is_told_to_wait_for_a_pending_latest_send(
    debounced: LockBackend, key: str
) -> None:
    # Given send-1 published, and send-2, its successor, still being published
    debounced.debounce(key, "send-1", LEASE)
    debounced.debounce(key, "send-2", LEASE, pending=PUBLISHING)

    # When send-1 starts, it learns send-2 and how long it stays pending at most
    latest, left = debounced.debounce_take(key, "send-1")

    # Then it waits: nothing changed, and send-2 itself still takes the window
    assert latest == "send-2"
    assert 0 < left <= PUBLISHING
    assert debounced.debounce_take(key, "send-1")[0] == "send-2"
    assert debounced.debounce_take(key, "send-2") == ("send-2", 0.0)
    assert debounced.debounce_take(key, "send-1") == ("send-2", 0.0)


def test_a_published_latest_send_supersedes_the_earlier_ones_at_once(
    debounced: LockBackend, key: str
) -> None:
    debounced.debounce(key, "send-1", LEASE)
    debounced.debounce(key, "send-2", LEASE, pending=PUBLISHING)

    assert debounced.debounce_published(key, "send-2") is True
    assert debounced.debounce_published(key, "send-2") is False  # once only

    assert debounced.debounce_take(key, "send-1") == ("send-2", 0.0)
    assert debounced.debounce_take(key, "send-2") == ("send-2", 0.0)


def test_only_the_windows_latest_pending_send_can_be_marked_published(
    debounced: LockBackend, key: str
) -> None:
    debounced.debounce(key, "send-1", LEASE, pending=PUBLISHING)
    debounced.debounce(key, "send-2", LEASE, pending=PUBLISHING)

    # send-1 is no longer the latest, and a window that does not exist has no send
    assert debounced.debounce_published(key, "send-1") is False
    assert debounced.debounce_published(f"{key}:other", "send-1") is False
    assert debounced.debounce_take(key, "send-0")[1] > 0  # send-2 still pending


def test_a_pending_send_taken_back_lets_the_send_before_it_run(
    debounced: LockBackend, key: str
) -> None:
    # Given send-2's publish fails while send-1 is waiting for it
    debounced.debounce(key, "send-1", LEASE)
    previous, _, closed = debounced.debounce(key, "send-2", LEASE, pending=PUBLISHING)
    assert debounced.debounce_take(key, "send-1")[1] > 0

    # When send-2 is taken back
    assert debounced.debounce_undo(key, "send-2", previous, closed=closed) is True

    # Then send-1 is the latest, published: it takes the window
    assert debounced.debounce_take(key, "send-1") == ("send-1", 0.0)


def test_a_pending_send_past_its_deadline_is_treated_as_taken_back(
    debounced: LockBackend, key: str
) -> None:
    # Given send-2's producer died between its write and its publish
    debounced.debounce(key, "send-1", LEASE)
    debounced.debounce(key, "send-2", LEASE, pending=BRIEF)

    # When its deadline has passed
    deadline = time.monotonic() + EXPIRY_WAIT
    while (taken := debounced.debounce_take(key, "send-1")) != ("send-1", 0.0):
        assert taken[0] == "send-2", taken
        assert taken[1] > 0, taken
        assert time.monotonic() < deadline, "the pending send never ran out"
        time.sleep(0.05)

    # Then send-1 took the window: the closed window names it, to send-2 too
    assert debounced.debounce_take(key, "send-2") == ("send-1", 0.0)


def test_a_send_that_can_wait_no_longer_takes_the_window_from_a_pending_send(
    debounced: LockBackend, key: str
) -> None:
    """``overdue``: the message of send-1 cannot wait until send-2's deadline (its time limit
    is near): send-2 is treated as a publish that outlasted its deadline."""
    # Given send-2 still being published, its deadline far away
    debounced.debounce(key, "send-1", LEASE)
    debounced.debounce(key, "send-2", LEASE, pending=PUBLISHING)

    # When send-1 takes the window overdue
    taken = debounced.debounce_take(key, "send-1", overdue=True)

    # Then it has the window, closed: send-2's publish, if it ends, changes nothing, its undo
    # neither, and its message, if it starts, is told send-1 superseded it
    assert taken == ("send-1", 0.0)
    assert debounced.debounce_published(key, "send-2") is False
    assert debounced.debounce_undo(key, "send-2", "send-1") is False
    assert debounced.debounce_take(key, "send-2") == ("send-1", 0.0)


def test_overdue_never_takes_the_window_from_a_published_later_send(
    debounced: LockBackend, key: str
) -> None:
    debounced.debounce(key, "send-1", LEASE)
    debounced.debounce(key, "send-2", LEASE, pending=PUBLISHING)
    debounced.debounce_published(key, "send-2")

    assert debounced.debounce_take(key, "send-1", overdue=True) == ("send-2", 0.0)
    assert debounced.debounce_take(key, "send-2") == ("send-2", 0.0)


def test_a_publish_that_succeeds_after_its_deadline_still_counts_if_nobody_took_the_window(
    debounced: LockBackend, key: str
) -> None:
    debounced.debounce(key, "send-1", LEASE)
    debounced.debounce(key, "send-2", LEASE, pending=BRIEF)
    time.sleep(BRIEF + 0.2)

    assert debounced.debounce_published(key, "send-2") is True
    assert debounced.debounce_take(key, "send-1") == ("send-2", 0.0)


def test_the_latest_send_never_waits_for_itself(debounced: LockBackend, key: str) -> None:
    """Its message started, so it was published, even if the store was never told."""
    debounced.debounce(key, "send-1", LEASE, pending=PUBLISHING)

    assert debounced.debounce_take(key, "send-1") == ("send-1", 0.0)
    assert debounced.debounce_take(key, "send-0") == ("send-1", 0.0)


def test_a_later_published_send_ends_the_wait_for_a_pending_one(
    debounced: LockBackend, key: str
) -> None:
    debounced.debounce(key, "send-1", LEASE)
    debounced.debounce(key, "send-2", LEASE, pending=PUBLISHING)
    debounced.debounce(key, "send-3", LEASE)

    assert debounced.debounce_take(key, "send-1") == ("send-3", 0.0)


def test_taking_back_a_send_puts_back_whether_the_send_it_superseded_was_pending(
    debounced: LockBackend, key: str
) -> None:
    """Two producers publish at once and the later one fails: the earlier one is pending again
    (it may still fail too), or published again if it was marked before it was superseded."""
    # A pending send superseded by a pending send taken back: pending again
    debounced.debounce(key, "send-1", LEASE, pending=PUBLISHING)
    previous, _, _ = debounced.debounce(key, "send-2", LEASE, pending=PUBLISHING)
    assert debounced.debounce_undo(key, "send-2", previous) is True
    latest, left = debounced.debounce_take(key, "send-0")
    assert latest == "send-1"
    assert 0 < left <= PUBLISHING

    # A published send superseded by a pending send taken back: published again
    other = f"{key}:other"
    debounced.debounce(other, "send-1", LEASE, pending=PUBLISHING)
    assert debounced.debounce_published(other, "send-1") is True
    previous, _, _ = debounced.debounce(other, "send-2", LEASE, pending=PUBLISHING)
    assert debounced.debounce_undo(other, "send-2", previous) is True
    assert debounced.debounce_take(other, "send-0") == ("send-1", 0.0)


def test_a_window_opened_over_a_closed_one_and_taken_back_is_closed_and_settled(
    debounced: LockBackend, key: str
) -> None:
    debounced.debounce(key, "send-1", LEASE)
    assert debounced.debounce_take(key, "send-1") == ("send-1", 0.0)
    previous, _, closed = debounced.debounce(key, "send-2", LEASE, pending=PUBLISHING)
    assert (previous, closed) == (None, "send-1")

    assert debounced.debounce_undo(key, "send-2", previous, closed=closed) is True

    assert debounced.debounce_take(key, "send-0") == ("send-1", 0.0)
    assert debounced.debounce_published(key, "send-2") is False
