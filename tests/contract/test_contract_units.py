"""The contract of named limits, run against every backend: :meth:`LockBackend.take_units` takes
units from several limits at once, all or nothing, in one atomic step;
:meth:`LockBackend.give_units` gives a concurrency limit's units back and sets a rate start's
real cost. A concurrency limit counts the units held (a hold is a lease); a rate counts the
units started in a sliding window of its period, exactly.

A store without them (``supports_units`` False: memcached, the Django caches) refuses at
once with UnsupportedOperation, and tasks naming ``lock_limits`` on it are refused when they
are bound.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from singletask import ConfigurationError
from singletask.backends.base import LockBackend, Units
from singletask.exceptions import UnsupportedOperation
from singletask.protocol.limits import limit_key
from singletask.protocol.slots import slot_keys
from singletask.protocol.tokens import reservation_token

from ..conftest import ONE_HOLDER_BACKENDS
from .test_contract import (
    LEASE,
    SHORT,
    every_record_expires,  # noqa: F401 - the contract's autouse check
)

#: A rate's window: long enough that it never runs out by accident during a test.
PERIOD = 30.0


@pytest.fixture
def limited(backend: LockBackend) -> LockBackend:
    """A backend with named limits: tests that use it are not collected for the stores of
    ``ONE_HOLDER_BACKENDS`` (tests/conftest.py); the test below checks those refuse them."""
    return backend


def concurrency(prefix: str, name: str, size: int, units: int = 1) -> Units:
    return Units(limit_key(prefix, name), size, units)


def rate(prefix: str, name: str, size: int, units: int = 1, period: float = PERIOD) -> Units:
    return Units(limit_key(prefix, name, rate=True), size, units, period)


def test_only_the_stores_that_keep_one_holder_refuse_named_limits(
    backend: LockBackend, key_prefix: str, request: pytest.FixtureRequest
) -> None:
    """memcached and the Django caches refuse named limits at once; every other store has them."""
    if request.node.callspec.params["backend"] in ONE_HOLDER_BACKENDS:
        assert not backend.supports_units
        with pytest.raises(UnsupportedOperation):
            backend.take_units("token", LEASE, [concurrency(key_prefix, "a", 1)])
        with pytest.raises(UnsupportedOperation):
            backend.give_units("token", [concurrency(key_prefix, "a", 1)])
        with pytest.raises(UnsupportedOperation):
            backend.acquire("k", "token", LEASE, units=[concurrency(key_prefix, "a", 1)])
        assert backend.holder("k") is None
    else:
        assert backend.supports_units


# -- concurrency --------------------------------------------------------------------------------


def test_a_concurrency_limit_admits_units_up_to_its_size(
    limited: LockBackend, key_prefix: str
) -> None:
    """Holds of 2 and 1 fill a limit of 3; the next unit is refused, naming the limit and its
    units in use, and nothing more is held."""
    limit = concurrency(key_prefix, "warehouse", 3)
    assert limited.take_units("token-a", LEASE, [Units(limit.key, 3, 2)]).taken
    assert limited.take_units("token-b", LEASE, [limit]).taken

    refused = limited.take_units("token-c", LEASE, [limit])

    assert not refused.taken
    assert refused.limit == limit.key
    assert refused.used == 3
    assert refused.retry_after is None  # room comes back when a holder ends


def test_units_given_back_make_room(limited: LockBackend, key_prefix: str) -> None:
    limit = concurrency(key_prefix, "warehouse", 1)
    assert limited.take_units("token-a", LEASE, [limit]).taken
    assert not limited.take_units("token-b", LEASE, [limit]).taken

    assert limited.give_units("token-a", [limit]) == [True]

    assert limited.take_units("token-b", LEASE, [limit]).taken
    # giving back what a token does not hold changes nothing
    assert limited.give_units("token-a", [limit]) == [False]
    assert not limited.take_units("token-c", LEASE, [limit]).taken


def test_taking_again_renews_a_hold_without_counting_it_twice(
    limited: LockBackend, key_prefix: str
) -> None:
    """A holder's take of the same limit is its renewal: its units are not added again."""
    limit = concurrency(key_prefix, "warehouse", 2)
    assert limited.take_units("token-a", SHORT, [limit]).taken
    assert limited.take_units("token-a", LEASE, [limit]).taken  # renewed: a long lease now
    time.sleep(SHORT * 3)

    assert limited.take_units("token-b", LEASE, [limit]).taken
    assert not limited.take_units("token-c", LEASE, [limit]).taken  # a's hold did not run out


def test_a_hold_whose_lease_ran_out_gives_its_units_back(
    limited: LockBackend, key_prefix: str
) -> None:
    """After a crash nobody gives the units back: the hold's lease does."""
    limit = concurrency(key_prefix, "warehouse", 1)
    # A lease long enough to outlast the next call on a loaded machine (a TLS cluster under
    # four test workers took more than SHORT between two calls), short enough to wait out.
    assert limited.take_units("token-a", 2.0, [limit]).taken
    assert not limited.take_units("token-b", LEASE, [limit]).taken

    deadline = time.monotonic() + 10
    while not limited.take_units("token-b", LEASE, [limit]).taken:
        assert time.monotonic() < deadline, "the hold never ran out"
        time.sleep(0.05)


def test_several_limits_are_taken_all_or_nothing(limited: LockBackend, key_prefix: str) -> None:
    """When one limit has no room, none is taken: the others keep all their room."""
    requests = concurrency(key_prefix, "{llm}-requests", 2)
    database = concurrency(key_prefix, "{llm}-database", 1)
    assert limited.take_units("token-a", LEASE, [database]).taken

    refused = limited.take_units("token-b", LEASE, [requests, database])

    assert not refused.taken
    assert refused.limit == database.key
    # requests was not taken by b: two other holders still fit
    assert limited.take_units("token-c", LEASE, [requests]).taken
    assert limited.take_units("token-d", LEASE, [requests]).taken
    assert not limited.take_units("token-e", LEASE, [requests]).taken


def test_concurrent_takes_never_hold_more_than_the_size(
    limited: LockBackend, key_prefix: str
) -> None:
    limit = concurrency(key_prefix, "warehouse", 3)
    start = threading.Barrier(12)

    def take(i: int) -> bool:
        start.wait()
        return limited.take_units(f"token-{i}", LEASE, [limit]).taken

    with ThreadPoolExecutor(12) as pool:
        taken = list(pool.map(take, range(12)))

    assert sum(taken) == 3


# -- rates --------------------------------------------------------------------------------------


def test_a_rate_counts_units_started_in_its_window(limited: LockBackend, key_prefix: str) -> None:
    """Starts of 4 and 5 units fill "10 per window" but for 1; 2 more are refused with the time
    until the first start leaves the window; rate units are spent, not given back."""
    tokens = rate(key_prefix, "tokens", 10)
    assert limited.take_units("token-a", LEASE, [Units(tokens.key, 10, 4, PERIOD)]).taken
    assert limited.take_units("token-b", LEASE, [Units(tokens.key, 10, 5, PERIOD)]).taken
    assert limited.take_units("token-c", LEASE, [tokens]).taken

    refused = limited.take_units("token-d", LEASE, [Units(tokens.key, 10, 2, PERIOD)])

    assert not refused.taken
    assert refused.limit == tokens.key
    assert refused.used == 10
    assert refused.retry_after is not None
    assert PERIOD - 5 < refused.retry_after <= PERIOD


def test_a_rate_has_room_again_when_enough_starts_left_the_window(
    limited: LockBackend, key_prefix: str
) -> None:
    """The window slides: a start counts for the period after it, then no more. (A window of
    3 s: the three takes and the expiry checks between them fit in it on a loaded TLS
    cluster; 0.2 s did not, once.)"""
    tokens = rate(key_prefix, "tokens", 2, period=3.0)
    assert limited.take_units("token-a", LEASE, [tokens]).taken
    assert limited.take_units("token-b", LEASE, [tokens]).taken
    refused = limited.take_units("token-c", LEASE, [tokens])
    assert not refused.taken
    assert refused.retry_after is not None
    assert refused.retry_after <= 3.0

    deadline = time.monotonic() + 15
    while not limited.take_units("token-c", LEASE, [tokens]).taken:
        assert time.monotonic() < deadline, "the starts never left the window"
        time.sleep(0.05)


def test_a_rate_waits_for_the_oldest_starts_it_needs_gone(
    limited: LockBackend, key_prefix: str
) -> None:
    """retry_after is when enough of the oldest starts have left the window for the units
    asked: here the first two, so the second's time."""
    tokens = rate(key_prefix, "tokens", 3)
    assert limited.take_units("token-a", LEASE, [tokens]).taken
    time.sleep(1.0)
    assert limited.take_units("token-b", LEASE, [tokens]).taken
    assert limited.take_units("token-c", LEASE, [tokens]).taken

    one = limited.take_units("token-d", LEASE, [tokens])
    two = limited.take_units("token-d", LEASE, [Units(tokens.key, 3, 2, PERIOD)])

    assert one.retry_after is not None
    assert two.retry_after is not None
    assert one.retry_after < PERIOD - 0.5  # a's start leaves first
    assert two.retry_after > one.retry_after + 0.5  # then b's


def test_a_retried_take_counts_its_start_once(limited: LockBackend, key_prefix: str) -> None:
    tokens = rate(key_prefix, "tokens", 2)
    assert limited.take_units("token-a", LEASE, [tokens]).taken
    assert limited.take_units("token-a", LEASE, [tokens]).taken

    assert limited.take_units("token-b", LEASE, [tokens]).taken


def test_the_real_cost_given_back_moves_the_window(limited: LockBackend, key_prefix: str) -> None:
    """A start estimated at 5 units that used 1 leaves room for 4 more; one that used 9 leaves
    none; 0 removes the start."""
    tokens = rate(key_prefix, "tokens", 10)
    assert limited.take_units("token-a", LEASE, [Units(tokens.key, 10, 5, PERIOD)]).taken

    assert limited.give_units("token-a", [Units(tokens.key, 10, 1, PERIOD)]) == [True]
    assert limited.take_units("token-b", LEASE, [Units(tokens.key, 10, 9, PERIOD)]).taken
    assert not limited.take_units("token-c", LEASE, [tokens]).taken

    assert limited.give_units("token-b", [Units(tokens.key, 10, 0, PERIOD)]) == [True]
    assert limited.take_units("token-c", LEASE, [Units(tokens.key, 10, 9, PERIOD)]).taken
    # charged above the estimate: the next starts see it
    assert limited.give_units("token-c", [Units(tokens.key, 10, 10, PERIOD)]) == [True]
    refused = limited.take_units("token-d", LEASE, [tokens])
    assert not refused.taken
    assert refused.used == 11


def test_a_concurrency_and_a_rate_are_taken_together(limited: LockBackend, key_prefix: str) -> None:
    """The LLM quota: requests at once and tokens per window, in one take; a full rate takes
    no request, and giving the request back leaves the tokens spent."""
    requests = concurrency(key_prefix, "{llm}-requests", 8)
    tokens = Units(limit_key(key_prefix, "{llm}-tokens", rate=True), 100, 60, PERIOD)
    assert limited.take_units("token-a", LEASE, [requests, tokens]).taken

    refused = limited.take_units("token-b", LEASE, [requests, tokens])
    assert not refused.taken
    assert refused.limit == tokens.key

    assert limited.give_units("token-a", [requests]) == [True]
    assert not limited.take_units("token-b", LEASE, [requests, tokens]).taken
    small = Units(tokens.key, 100, 40, PERIOD)
    assert limited.take_units("token-b", LEASE, [requests, small]).taken


def test_concurrent_starts_never_exceed_the_rate(limited: LockBackend, key_prefix: str) -> None:
    tokens = rate(key_prefix, "tokens", 5)
    start = threading.Barrier(12)

    def take(i: int) -> bool:
        start.wait()
        return limited.take_units(f"token-{i}", LEASE, [tokens]).taken

    with ThreadPoolExecutor(12) as pool:
        taken = list(pool.map(take, range(12)))

    assert sum(taken) == 5


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "units",
    [
        Units("x", 2, 3),  # more than the size
        Units("x", 0, 0),
        Units("x", 2, 0),
        Units("x", 2, 1, 0.0),  # a rate without a window
        Units("x", 2, 1, float("inf")),
    ],
)
def test_a_take_out_of_range_is_refused_before_anything_is_written(
    limited: LockBackend, key_prefix: str, units: Units
) -> None:
    units = Units(f"{key_prefix}{units.key}", units.size, units.units, units.period)
    with pytest.raises(ConfigurationError):
        limited.take_units("token-a", LEASE, [concurrency(key_prefix, "fine", 1), units])
    assert limited.take_units("token-b", LEASE, [concurrency(key_prefix, "fine", 1)]).taken


def test_a_lease_out_of_range_is_refused(limited: LockBackend, key_prefix: str) -> None:
    with pytest.raises(ConfigurationError):
        limited.take_units("token-a", 0, [concurrency(key_prefix, "fine", 1)])


def test_a_limit_named_twice_is_refused(limited: LockBackend, key_prefix: str) -> None:
    limit = concurrency(key_prefix, "fine", 2)
    with pytest.raises(ConfigurationError):
        limited.take_units("token-a", LEASE, [limit, limit])


# -- for operators ------------------------------------------------------------------------------


def test_iter_state_lists_each_limit_with_its_holds(limited: LockBackend, key_prefix: str) -> None:
    """Each limit's record: its size, period, units in use and holds with their task ids."""
    requests = concurrency(key_prefix, "{llm}-requests", 8, 2)
    tokens = rate(key_prefix, "{llm}-tokens", 100, 30)
    meta = {"task_id": "task-a", "task": "app.summarize"}
    assert limited.take_units("token-a", LEASE, [requests, tokens], meta=meta).taken
    assert limited.take_units("token-b", LEASE, [Units(tokens.key, 100, 5, PERIOD)]).taken

    found = {s.key: s for s in limited.iter_state(key_prefix) if s.kind == "limit"}

    assert set(found) == {requests.key, tokens.key}
    held = found[requests.key]
    assert held.detail["size"] == 8
    assert held.detail["period"] is None
    assert held.detail["used"] == 2
    [hold] = held.detail["holds"]
    assert (hold["token"], hold["units"], hold["task_id"], hold["task"]) == (
        "token-a", 2, "task-a", "app.summarize",
    )  # fmt: skip
    assert 0 < hold["ttl"] <= LEASE
    assert held.ttl is not None
    assert 0 < held.ttl <= LEASE
    started = found[tokens.key]
    assert started.detail["size"] == 100
    assert started.detail["period"] == PERIOD
    assert started.detail["used"] == 35
    assert [h["token"] for h in started.detail["holds"]] == ["token-a", "token-b"]
    assert started.detail["holds"][1]["task_id"] is None

    # a limit whose last hold is given back is listed no more
    limited.give_units("token-a", [requests])
    assert not [s for s in limited.iter_state(key_prefix) if s.key == requests.key]


# -- with a lock ----------------------------------------------------------------------------------


def test_a_key_and_its_units_are_taken_together(limited: LockBackend, key_prefix: str) -> None:
    """acquire with units takes the key and every limit, or nothing: a limit without room
    leaves the key free, a held key leaves the limits untouched; release gives them back."""
    key = f"{key_prefix}lock"
    limit = concurrency(key_prefix, "warehouse", 1)
    assert limited.take_units("elsewhere", LEASE, [limit]).taken

    # a limit without room: refused naming it, the key not taken
    refused = limited.acquire(key, "token-a", LEASE, meta={"task_id": "a"}, units=[limit])
    assert not refused.acquired
    assert (refused.limit, refused.used, refused.holder) == (limit.key, 1, None)
    assert limited.holder(key) is None

    # room again: key and unit taken together
    limited.give_units("elsewhere", [limit])
    taken = limited.acquire(key, "token-a", LEASE, meta={"task_id": "a"}, units=[limit])
    assert taken.acquired
    assert taken.fence is not None
    assert not limited.take_units("token-b", LEASE, [limit]).taken

    # a held key: refused by its holder, the limits not read nor taken
    other = concurrency(key_prefix, "other", 1)
    held = limited.acquire(key, "token-c", LEASE, units=[other])
    assert not held.acquired
    assert held.holder is not None
    assert held.limit is None
    assert limited.take_units("token-d", LEASE, [other]).taken

    # release: the unit back with the key
    assert limited.release(key, "token-a", units=[limit])
    assert limited.holder(key) is None
    assert limited.take_units("token-b", LEASE, [limit]).taken


def test_a_release_gives_the_units_back_even_when_the_key_was_lost(
    limited: LockBackend, key_prefix: str
) -> None:
    key = f"{key_prefix}lock"
    limit = concurrency(key_prefix, "warehouse", 1)
    assert limited.acquire(key, "token-a", LEASE, units=[limit]).acquired
    assert limited.force_release(key) is not None

    assert not limited.release(key, "token-a", units=[limit])

    assert limited.take_units("token-b", LEASE, [limit]).taken


def test_a_rate_taken_with_a_key_stays_spent_after_the_release(
    limited: LockBackend, key_prefix: str
) -> None:
    key = f"{key_prefix}lock"
    tokens = rate(key_prefix, "tokens", 1)
    assert limited.acquire(key, "token-a", LEASE, units=[tokens]).acquired
    assert limited.release(key, "token-a", units=[tokens])

    refused = limited.acquire(key, "token-b", LEASE, units=[tokens])

    assert not refused.acquired
    assert refused.limit == tokens.key
    assert refused.retry_after is not None


def test_a_slot_and_its_units_are_taken_together(limited: LockBackend, key_prefix: str) -> None:
    key = f"{key_prefix}lock"
    limit = concurrency(key_prefix, "warehouse", 1)
    assert limited.acquire_slot(key, 2, "token-a", LEASE, units=[limit]).acquired

    refused = limited.acquire_slot(key, 2, "token-b", LEASE, units=[limit])

    assert not refused.acquired
    assert refused.limit == limit.key
    assert sum(h is not None for h in (limited.holder(k) for k in slot_keys(key, 2))) == 1


@pytest.mark.parametrize("path", ["acquire", "slot", "slot with a rate"])
def test_a_take_over_refused_by_a_limit_leaves_the_reservation_in_place(
    limited: LockBackend, key_prefix: str, path: str
) -> None:
    """A body's retry keeps its key as a reservation; the retried attempt takes it over with
    its units. When a limit has no room, nothing is taken, and nothing is given up either: the
    reservation still holds the key against other executions while the attempt waits. (A
    reservation in another of a key's holder slots is not put back: a gap, see
    docs/sharing-limits.rst.)"""
    key = f"{key_prefix}lock"
    reserved = reservation_token("task-a", 1)
    limit = concurrency(key_prefix, "warehouse", 1)
    assert limited.take_units("elsewhere", LEASE, [limit]).taken
    interval = 0.05 if path == "slot with a rate" else None
    slots = 1
    if path == "acquire":
        assert limited.acquire(key, reserved, LEASE).acquired
    else:
        assert limited.acquire_slot(key, slots, reserved, LEASE, interval=interval).acquired
        time.sleep(0.1)  # past the rate's interval: only the limit refuses

    if path == "acquire":
        refused = limited.acquire(key, "task-a:1:x", LEASE, takeover_prefix=reserved,
                                  units=[limit])  # fmt: skip
    else:
        refused = limited.acquire_slot(key, slots, "task-a:1:x", LEASE,
                                       takeover_prefix=reserved, interval=interval,
                                       units=[limit])  # fmt: skip

    assert not refused.acquired
    assert refused.limit == limit.key
    holders = [limited.holder(k) for k in slot_keys(key, slots)]
    assert reserved in [h.token for h in holders if h is not None]
    other = limited.acquire_slot(key, slots, "task-b:0:x", LEASE, interval=interval)
    assert not other.acquired
