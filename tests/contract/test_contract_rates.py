"""The contract of rate records (``lock_rate``) and debounce windows (``lock_debounce``), run
against every backend.

:meth:`LockBackend.acquire_slot` with ``interval`` spaces the starts of a key by at least that
many seconds of the store's clock, checked and recorded in the same atomic step as the slot it
takes. :meth:`LockBackend.debounce` names the latest send of a key's debounce window, and
:meth:`LockBackend.debounce_take` closes the window for that send only;
:meth:`LockBackend.debounce_undo` takes a send whose message was never published back out of
the window, and only while the window still names it. A store without them
(``supports_rate`` / ``supports_debounce`` False) refuses at once with UnsupportedOperation,
and task definitions on it are refused when they are bound (tests/execution/test_rate.py).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from singletask.backends.base import AcquireResult, LockBackend
from singletask.exceptions import UnsupportedOperation
from singletask.protocol.slots import slot_key

from ..conftest import ONE_HOLDER_BACKENDS
from .test_contract import (
    LEASE,
    SHORT,
    every_record_expires,  # noqa: F401 - the contract's autouse check
)

#: Starts of a key spaced by this much: long enough that a test never sees it run out by
#: accident, on a loaded machine too.
INTERVAL = 30.0


@pytest.fixture
def key(key_prefix: str) -> str:
    return f"{key_prefix}lock"


@pytest.fixture
def rated(backend: LockBackend) -> LockBackend:
    """A backend with rate records: tests that use it are not collected for the stores of
    ``ONE_HOLDER_BACKENDS`` (tests/conftest.py); the test below checks those refuse them."""
    return backend


@pytest.fixture
def debounced(backend: LockBackend) -> LockBackend:
    """A backend with debounce windows (collected as ``rated`` is)."""
    return backend


def test_only_the_stores_that_keep_one_holder_refuse_rates_and_debounce(
    backend: LockBackend, request: pytest.FixtureRequest
) -> None:
    """memcached and the Django caches refuse rate records and debounce windows at once; every
    other store has them."""
    if request.node.callspec.params["backend"] in ONE_HOLDER_BACKENDS:
        assert not backend.supports_rate
        assert not backend.supports_debounce
        with pytest.raises(UnsupportedOperation):
            backend.acquire_slot("any", 1, "token", LEASE, interval=1.0)
        with pytest.raises(UnsupportedOperation):
            backend.debounce("any", "task", LEASE)
    else:
        assert backend.supports_rate
        assert backend.supports_debounce


def start(
    backend: LockBackend, key: str, token: str, *, limit: int = 1, interval: float = INTERVAL
) -> AcquireResult:
    return backend.acquire_slot(key, limit, token, LEASE, interval=interval)


# -- rates ----------------------------------------------------------------------------------


def test_a_second_start_within_the_interval_is_refused_with_the_time_left(
    rated: LockBackend, key: str
) -> None:
    """After one start, the next one (by another token, the key free again) must wait out the
    interval; the refusal says how long, and takes nothing."""
    # Given one start, ended
    assert start(rated, key, "token-a").acquired
    assert rated.release(key, "token-a")

    # When another token starts within the interval
    refused = start(rated, key, "token-b")

    # Then it is refused by the rate, not by a holder, and told how long to wait
    assert not refused.acquired
    assert refused.holder is None
    assert refused.retry_after is not None
    assert INTERVAL - 5 < refused.retry_after <= INTERVAL
    assert rated.holder(key) is None


def test_a_start_is_allowed_again_once_the_interval_has_passed(
    rated: LockBackend, key: str
) -> None:
    assert start(rated, key, "token-a", interval=SHORT).acquired
    assert rated.release(key, "token-a")
    deadline = time.monotonic() + 10
    while True:
        result = start(rated, key, "token-b", interval=SHORT)
        if result.acquired or time.monotonic() > deadline:
            break
        assert result.retry_after is not None
        assert result.retry_after <= SHORT
        time.sleep(min(result.retry_after, 0.5))
    assert result.acquired


def test_a_refused_start_does_not_push_the_next_one_back(rated: LockBackend, key: str) -> None:
    """Only starts count: refused attempts leave the allowed time where it was."""
    assert start(rated, key, "token-a", interval=1.0).acquired
    assert rated.release(key, "token-a")
    first = start(rated, key, "token-b", interval=1.0)
    time.sleep(0.3)
    second = start(rated, key, "token-c", interval=1.0)
    assert first.retry_after is not None
    assert second.retry_after is not None
    assert second.retry_after < first.retry_after - 0.1


def test_a_key_held_by_others_refuses_without_spending_a_start(
    rated: LockBackend, key: str
) -> None:
    """With every slot held the refusal names the holder, and the rate record is untouched:
    the holder's own start is the last one."""
    # Given a holder that started without a rate, so no start is recorded
    assert rated.acquire(key, "token-a", LEASE).acquired

    # When another token tries with a rate, and then starts once the key is free
    refused = start(rated, key, "token-b")
    assert rated.release(key, "token-a")
    after = start(rated, key, "token-c")

    # Then the first was refused by the holder, and the refusal did not count as a start
    assert not refused.acquired
    assert refused.holder is not None
    assert refused.holder.token == "token-a"
    assert refused.retry_after is None
    assert after.acquired


def test_a_holder_acquiring_its_slot_again_is_no_new_start(rated: LockBackend, key: str) -> None:
    """A redelivered message re-acquires its own slot within the interval."""
    first = start(rated, key, "token-a")
    again = start(rated, key, "token-a")
    assert again.acquired
    assert again.fence == first.fence


def test_the_rate_counts_starts_of_every_slot_of_a_key(rated: LockBackend, key: str) -> None:
    """With three free slots, the interval still spaces starts: the second waits."""
    assert start(rated, key, "token-a", limit=3).acquired
    refused = start(rated, key, "token-b", limit=3)
    assert not refused.acquired
    assert refused.retry_after is not None
    assert rated.holder(slot_key(key, 1)) is None


def test_racing_starts_within_one_interval_have_exactly_one_winner(
    rated: LockBackend, key: str
) -> None:
    """16 threads starting a key of 5 slots at once, with a rate: exactly one starts."""
    contenders = 16
    barrier = threading.Barrier(contenders)

    def contend(index: int) -> AcquireResult:
        barrier.wait(timeout=30)
        return start(rated, key, f"token-{index}", limit=5)

    with ThreadPoolExecutor(max_workers=contenders) as pool:
        outcomes = list(pool.map(contend, range(contenders)))

    assert sum(r.acquired for r in outcomes) == 1
    assert all(r.retry_after is not None for r in outcomes if not r.acquired)


def test_keys_have_rates_of_their_own(rated: LockBackend, key: str) -> None:
    assert start(rated, key, "token-a").acquired
    assert start(rated, f"{key}:other", "token-b").acquired


# -- debounce windows -----------------------------------------------------------------------


def test_each_send_becomes_the_windows_latest_and_is_told_the_one_before(
    debounced: LockBackend, key: str
) -> None:
    # Given / When three sends into one window
    first = debounced.debounce(key, "send-1", LEASE)
    time.sleep(0.2)
    second = debounced.debounce(key, "send-2", LEASE)
    third = debounced.debounce(key, "send-3", LEASE)

    # Then the first opened it, and each later one learns the one it superseded and the age of
    # the window, counted from its first send
    assert first == (None, 0.0, None)
    assert second[0] == "send-1"
    assert third[0] == "send-2"
    assert 0.1 < second[1] <= third[1] < 10


def test_only_the_latest_send_closes_the_window(debounced: LockBackend, key: str) -> None:
    debounced.debounce(key, "send-1", LEASE)
    debounced.debounce(key, "send-2", LEASE)

    # An earlier send learns its successor and changes nothing
    assert debounced.debounce_take(key, "send-1") == ("send-2", 0.0)
    assert debounced.debounce_take(key, "send-1") == ("send-2", 0.0)
    # The latest closes the window; the closed window still names it, to the latest itself
    # (its message sent again) and to an earlier send that starts only now
    assert debounced.debounce_take(key, "send-2") == ("send-2", 0.0)
    assert debounced.debounce_take(key, "send-2") == ("send-2", 0.0)
    assert debounced.debounce_take(key, "send-1") == ("send-2", 0.0)


def test_a_send_after_the_window_closed_opens_a_new_one(debounced: LockBackend, key: str) -> None:
    debounced.debounce(key, "send-1", LEASE)
    time.sleep(0.2)
    assert debounced.debounce_take(key, "send-1") == ("send-1", 0.0)
    assert debounced.debounce(key, "send-2", LEASE) == (None, 0.0, "send-1")
    # The new window is open: the first send is superseded, the new one takes it
    assert debounced.debounce_take(key, "send-1") == ("send-2", 0.0)
    assert debounced.debounce_take(key, "send-2") == ("send-2", 0.0)


def test_a_window_runs_out_by_itself(debounced: LockBackend, key: str) -> None:
    debounced.debounce(key, "send-1", SHORT)
    deadline = time.monotonic() + 10
    while debounced.debounce_take(key, "send-0") != (None, 0.0):
        assert time.monotonic() < deadline, "the window did not run out"
        time.sleep(0.05)
    assert debounced.debounce(key, "send-2", LEASE) == (None, 0.0, None)


def test_a_later_send_with_a_shorter_wait_never_shortens_the_window(
    debounced: LockBackend, key: str
) -> None:
    """Each send keeps the window at least as long as its own ``ttl`` asks, never shorter than
    an earlier send asked: an earlier send with a longer countdown of its own, superseded by a
    later send with a short one, still finds the window (naming the later send) when it starts,
    whether the later send's run has closed it or not, and never runs its older arguments."""
    # Given send-1 with a long countdown of its own (its window kept LEASE seconds), and
    # send-2, a later send with a short one (its window kept SHORT seconds)
    assert debounced.debounce(key, "send-1", LEASE) == (None, 0.0, None)
    assert debounced.debounce(key, "send-2", SHORT)[0] == "send-1"

    # When send-2's wait has long passed (it starts and closes the window), and send-1 starts
    # only then
    time.sleep(SHORT + 0.3)
    assert debounced.debounce_take(key, "send-2") == ("send-2", 0.0)
    time.sleep(SHORT + 0.3)

    # Then send-1 still finds the window naming send-2: it is superseded
    assert debounced.debounce_take(key, "send-1") == ("send-2", 0.0)

    # And the same holds for a window that is still open when send-1 starts
    other = f"{key}:open"
    debounced.debounce(other, "send-1", LEASE)
    debounced.debounce(other, "send-2", SHORT)
    time.sleep(SHORT + 0.3)
    assert debounced.debounce_take(other, "send-1") == ("send-2", 0.0)
    assert debounced.debounce_take(other, "send-2") == ("send-2", 0.0)


def test_racing_sends_each_supersede_exactly_one_other(debounced: LockBackend, key: str) -> None:
    """16 sends at once: one opened the window, every other superseded a distinct send."""
    contenders = 16
    barrier = threading.Barrier(contenders)

    def send(index: int) -> str | None:
        barrier.wait(timeout=30)
        return debounced.debounce(key, f"send-{index}", LEASE)[0]

    with ThreadPoolExecutor(max_workers=contenders) as pool:
        previous = list(pool.map(send, range(contenders)))

    assert previous.count(None) == 1
    superseded = [p for p in previous if p is not None]
    assert len(set(superseded)) == contenders - 1


# -- debounce windows: taking back a send that was never published ---------------------------


def test_an_unpublished_send_taken_back_makes_the_send_before_it_the_latest_again(
    debounced: LockBackend, key: str
) -> None:
    """The window is as it was before the send: the send it superseded is the latest again
    (and runs), and the window keeps the time it opened."""
    # Given a window opened by send-1, then superseded by send-2, whose publish failed
    assert debounced.debounce(key, "send-1", LEASE) == (None, 0.0, None)
    time.sleep(0.2)
    assert debounced.debounce(key, "send-2", LEASE)[0] == "send-1"

    # When send-2 is taken back
    assert debounced.debounce_undo(key, "send-2", "send-1") is True

    # Then send-1 is the latest again: a later send supersedes it, in the same window (its age
    # counted from send-1's send)
    previous, age, closed = debounced.debounce(key, "send-3", LEASE)
    assert previous == "send-1"
    assert 0.1 < age < 10
    assert closed is None
    # And once that one is taken back too, send-1 is the send that runs and closes the window
    assert debounced.debounce_undo(key, "send-3", "send-1") is True
    assert debounced.debounce_take(key, "send-1") == ("send-1", 0.0)
    assert debounced.debounce_take(key, "send-2") == ("send-1", 0.0)


def test_an_unpublished_send_that_opened_the_window_takes_the_window_away(
    debounced: LockBackend, key: str
) -> None:
    # Given a window opened by send-1, whose publish failed
    assert debounced.debounce(key, "send-1", LEASE) == (None, 0.0, None)

    # When send-1 is taken back
    assert debounced.debounce_undo(key, "send-1", None) is True

    # Then the key has no window: a message that starts finds none, the next send opens one
    assert debounced.debounce_take(key, "send-0") == (None, 0.0)
    assert debounced.debounce(key, "send-2", LEASE) == (None, 0.0, None)
    assert debounced.debounce_take(key, "send-2") == ("send-2", 0.0)


def test_a_send_that_opens_a_window_over_a_closed_one_is_told_the_send_that_closed_it(
    debounced: LockBackend, key: str
) -> None:
    """debounce returns, third, the latest send of the closed window it replaced (what its
    take-back puts back); None over an open window, no window, or one that ran out."""
    # Given a window closed by send-1 (it ran)
    debounced.debounce(key, "send-1", LEASE)
    assert debounced.debounce_take(key, "send-1") == ("send-1", 0.0)

    # When send-2 opens a new window over it / Then it is told send-1 closed the one it replaced
    assert debounced.debounce(key, "send-2", LEASE) == (None, 0.0, "send-1")
    # And a send into that open window is told of no closed one
    assert debounced.debounce(key, "send-3", LEASE)[::2] == ("send-2", None)

    # And a closed window that ran out is no window: nothing to put back
    other = f"{key}:short"
    debounced.debounce(other, "send-1", SHORT)
    assert debounced.debounce_take(other, "send-1") == ("send-1", 0.0)
    deadline = time.monotonic() + 10
    while debounced.debounce_take(other, "send-0") != (None, 0.0):
        assert time.monotonic() < deadline, "the closed window did not run out"
        time.sleep(0.05)
    assert debounced.debounce(other, "send-2", LEASE) == (None, 0.0, None)


def test_an_unpublished_send_that_opened_a_window_over_a_closed_one_puts_the_closed_one_back(
    debounced: LockBackend, key: str
) -> None:
    """The previous burst ran (its latest send closed the window); a send of the next burst
    opened a new window over it and was never published. Taken back, the closed window is as
    it was: an earlier send of that burst that a worker starts late is still superseded by the
    send that ran, instead of finding no window and running a second body for the burst."""
    # Given a burst of send-1, send-2 whose latest, send-2, ran and closed the window
    debounced.debounce(key, "send-1", LEASE)
    debounced.debounce(key, "send-2", LEASE)
    assert debounced.debounce_take(key, "send-2") == ("send-2", 0.0)
    # And send-3, whose publish failed, which opened a new window over the closed one
    assert debounced.debounce(key, "send-3", LEASE) == (None, 0.0, "send-2")

    # When send-3 is taken back
    assert debounced.debounce_undo(key, "send-3", None, closed="send-2") is True

    # Then the window is closed again, naming send-2: send-1, started late, is superseded by
    # send-2, and send-2 (its message sent again) gets its own id back
    assert debounced.debounce_take(key, "send-1") == ("send-2", 0.0)
    assert debounced.debounce_take(key, "send-2") == ("send-2", 0.0)
    # And it stays closed: the next send opens a new window, told send-2 closed the one before
    assert debounced.debounce(key, "send-4", LEASE) == (None, 0.0, "send-2")
    assert debounced.debounce_take(key, "send-1") == ("send-4", 0.0)
    assert debounced.debounce_take(key, "send-4") == ("send-4", 0.0)


def test_unpublished_sends_over_a_closed_window_taken_back_in_turn_put_it_back(
    debounced: LockBackend, key: str
) -> None:
    """Two sends of the next burst failed, taken back latest first: the first is the latest
    again, then the closed window is back."""
    # Given a window closed by send-1, then send-2 (over it) and send-3, both unpublished
    debounced.debounce(key, "send-1", LEASE)
    assert debounced.debounce_take(key, "send-1") == ("send-1", 0.0)
    assert debounced.debounce(key, "send-2", LEASE) == (None, 0.0, "send-1")
    assert debounced.debounce(key, "send-3", LEASE)[::2] == ("send-2", None)

    # When send-3, then send-2 are taken back
    assert debounced.debounce_undo(key, "send-3", "send-2") is True
    assert debounced.debounce_undo(key, "send-2", None, closed="send-1") is True

    # Then the closed window names send-1 again
    assert debounced.debounce_take(key, "send-0") == ("send-1", 0.0)
    assert debounced.debounce(key, "send-4", LEASE) == (None, 0.0, "send-1")


def test_taking_back_a_send_the_window_no_longer_names_changes_nothing(
    debounced: LockBackend, key: str
) -> None:
    """Only the open window's latest send can be taken back: a send superseded since, or a
    window closed or gone, is left as it is."""
    # Given send-2 superseding send-1
    debounced.debounce(key, "send-1", LEASE)
    debounced.debounce(key, "send-2", LEASE)

    # When send-1 (superseded) is taken back / Then send-2 stays the latest
    assert debounced.debounce_undo(key, "send-1", None) is False
    assert debounced.debounce_take(key, "send-1") == ("send-2", 0.0)

    # When send-2 closed the window (it ran) and is then taken back / Then the closed window
    # still names it
    assert debounced.debounce_take(key, "send-2") == ("send-2", 0.0)
    assert debounced.debounce_undo(key, "send-2", "send-1") is False
    assert debounced.debounce_take(key, "send-1") == ("send-2", 0.0)
    assert debounced.debounce_take(key, "send-2") == ("send-2", 0.0)

    # And a key without a window stays without one
    assert debounced.debounce_undo(f"{key}:other", "send-1", None) is False
    assert debounced.debounce_take(f"{key}:other", "send-1") == (None, 0.0)


def test_a_take_back_racing_a_later_send_never_loses_the_later_send(
    debounced: LockBackend, key: str
) -> None:
    """Whichever comes first, the later send ends as the latest: the take-back either restores
    send-1 before send-3 supersedes it, or finds send-3 there and changes nothing."""
    for round_ in range(10):
        name = f"{key}:{round_}"
        debounced.debounce(name, "send-1", LEASE)
        debounced.debounce(name, "send-2", LEASE)
        barrier = threading.Barrier(2)

        def undo(name: str = name, barrier: threading.Barrier = barrier) -> object:
            barrier.wait(timeout=30)
            return debounced.debounce_undo(name, "send-2", "send-1")

        def later(
            name: str = name, barrier: threading.Barrier = barrier
        ) -> tuple[str | None, float, str | None]:
            barrier.wait(timeout=30)
            return debounced.debounce(name, "send-3", LEASE)

        with ThreadPoolExecutor(max_workers=2) as pool:
            undoing, sending = pool.submit(undo), pool.submit(later)
            undone, (previous, _, _) = undoing.result(), sending.result()
        assert debounced.debounce_take(name, "send-1") == ("send-3", 0.0)
        assert previous == ("send-1" if undone else "send-2")
