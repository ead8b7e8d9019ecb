"""The contract of fair turns, run against every store that keeps named limits: a take of
:class:`~singletask.backends.base.Units` carrying a :class:`~singletask.backends.base.Turn`
that finds no room waits in the limit's line, in the same atomic step (a ticket); freed room goes
to the tickets in turn, round robin over their groups, weighted, within a group first come first
served; room freed for a ticket is kept for its owner for its ``hold``; a ticket not taken again
within its ``lease`` ends. A take without a turn, or with room and nobody waiting, is what it was.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest

from singletask import ConfigurationError
from singletask.backends.base import LockBackend, Turn, Units
from singletask.protocol.limits import limit_key

from ..conftest import NO_TURN_BACKENDS
from .test_contract import (
    LEASE,
    every_record_expires,  # noqa: F401 - the contract's autouse check
)
from .test_contract_units import limited  # noqa: F401 - the stores that keep named limits

#: A ticket's lease and hold that never run out by accident during a test.
LONG = 60.0


def turn(ticket: str, group: str, **kwargs: float) -> Turn:
    return Turn(ticket, group, lease=kwargs.pop("lease", LONG), hold=kwargs.pop("hold", LONG),
                **kwargs)  # type: ignore[arg-type]  # fmt: skip


def take(
    backend: LockBackend, limit: Units, ticket: str, group: str, units: int = 1, **kwargs: float
) -> bool:
    """One take of ``units`` by ``ticket`` (also its token), waiting in line if refused."""
    item = Units(limit.key, limit.size, units, limit.period, turn(ticket, group, **kwargs))
    return backend.take_units(ticket, LEASE, [item], meta={"task_id": ticket}).taken


def served_in_turn(backend: LockBackend, limit: Units, waiting: dict[str, str]) -> list[str]:
    """Free the one unit of ``limit`` (held by ``first``) again and again; each time every
    waiting ticket comes back (the last to wait first, so that the order is the line's, not the
    order of coming back), and the one let in holds the unit until the next round. The tickets
    in the order served."""
    order: list[str] = []
    holder = "first"
    left = dict(waiting)
    while left:
        backend.give_units(holder, [limit])
        admitted = [t for t in reversed(list(left)) if take(backend, limit, t, left[t])]
        assert len(admitted) == 1, f"round {len(order)}: admitted {admitted}"
        holder = admitted[0]
        order.append(holder)
        del left[holder]
    backend.give_units(holder, [limit])
    return order


def wait_in_line(backend: LockBackend, limit: Units, tickets: Sequence[tuple[str, str]]) -> None:
    for ticket, group in tickets:
        assert not take(backend, limit, ticket, group), ticket


@pytest.fixture
def lined(limited: LockBackend) -> LockBackend:  # noqa: F811
    """A store that keeps the limits' lines (``supports_turns``): tests that use it are not
    collected for the stores of ``NO_TURN_BACKENDS`` (tests/conftest.py); the test below
    checks that those take as though no turn were given."""
    return limited


def test_a_store_without_lines_takes_as_though_no_turn_were_given(
    limited: LockBackend,  # noqa: F811
    key_prefix: str,
    request: pytest.FixtureRequest,
) -> None:
    if request.node.callspec.params["backend"] not in NO_TURN_BACKENDS:
        assert limited.supports_turns
        return
    assert not limited.supports_turns
    limit = Units(limit_key(key_prefix, "unlined"), 1, 1)
    assert limited.take_units("first", LEASE, [limit]).taken
    assert not take(limited, limit, "a1", "A")
    limited.give_units("first", [limit])
    assert limited.take_units("stranger", LEASE, [limit]).taken


@pytest.fixture
def full(lined: LockBackend, key_prefix: str) -> Units:
    """A concurrency limit of 1, held by ``first``."""
    limit = Units(limit_key(key_prefix, "turns"), 1, 1)
    assert lined.take_units("first", LEASE, [limit]).taken
    return limit


def test_a_take_with_room_and_nobody_waiting_is_taken_as_without_a_turn(
    lined: LockBackend,
    key_prefix: str,
) -> None:
    limit = Units(limit_key(key_prefix, "open"), 2, 1)
    assert take(lined, limit, "a1", "A")
    assert take(lined, limit, "b1", "B")
    assert not take(lined, limit, "c1", "C")


def test_a_refused_turn_waits_and_the_room_freed_is_kept_for_it(
    lined: LockBackend,
    full: Units,
) -> None:
    """The ticket's owner is let in when room frees; a take without a turn, and another turn
    behind it, are refused meanwhile, though a unit is free."""
    wait_in_line(lined, full, [("a1", "A")])
    lined.give_units("first", [full])
    assert not lined.take_units("stranger", LEASE, [full]).taken
    assert not take(lined, full, "b1", "B")
    assert take(lined, full, "a1", "A")


def test_freed_room_goes_round_robin_over_the_groups_and_first_come_within_one(
    lined: LockBackend,
    full: Units,
) -> None:
    """A floods with four, B and C wait with one each after it: B and C are served right after
    A's first, not after all of A's."""
    waiting = {"a1": "A", "a2": "A", "a3": "A", "a4": "A", "b1": "B", "c1": "C"}
    wait_in_line(lined, full, waiting.items())
    assert served_in_turn(lined, full, waiting) == ["a1", "b1", "c1", "a2", "a3", "a4"]


def test_a_group_of_twice_the_weight_takes_twice_the_turns(
    lined: LockBackend,
    full: Units,
) -> None:
    waiting = {f"a{i}": "A" for i in range(1, 7)} | {f"b{i}": "B" for i in range(1, 7)}
    for ticket, group in waiting.items():
        weight = 2.0 if group == "A" else 1.0
        assert not take(lined, full, ticket, group, weight=weight)
    order = []
    holder = "first"
    for _ in range(6):
        lined.give_units(holder, [full])
        admitted = [
            t for t in waiting
            if t not in order and take(lined, full, t, waiting[t],
                                       weight=2.0 if waiting[t] == "A" else 1.0)
        ]  # fmt: skip
        assert len(admitted) == 1
        holder = admitted[0]
        order.append(holder)
    assert [waiting[t] for t in order].count("A") == 4, order


def test_a_priority_moves_a_ticket_ahead_by_at_most_that_many_turns(
    lined: LockBackend,
    full: Units,
) -> None:
    waiting = {f"a{i}": "A" for i in range(1, 6)}
    wait_in_line(lined, full, waiting.items())
    assert not take(lined, full, "a6", "A", priority=2)
    waiting["a6"] = "A"
    order = served_in_turn(lined, full, waiting)
    assert order == ["a1", "a2", "a3", "a4", "a6", "a5"]


def test_a_holder_renewing_its_units_is_never_held_back_by_the_line(
    lined: LockBackend,
    key_prefix: str,
) -> None:
    """A take by a token that holds units already renews its lease (the renewer's take):
    tickets waiting for the limit do not refuse it."""
    limit = Units(limit_key(key_prefix, "renewed"), 2, 1)
    assert lined.take_units("x", LEASE, [limit]).taken
    assert lined.take_units("y", LEASE, [limit]).taken
    wait_in_line(lined, limit, [("a1", "A"), ("b1", "B")])
    assert lined.take_units("x", LEASE, [limit]).taken
    assert take(lined, limit, "y", "Y")


def test_a_ticket_renewed_by_its_owner_keeps_its_place(
    lined: LockBackend,
    full: Units,
) -> None:
    wait_in_line(lined, full, [("a1", "A"), ("a2", "A")])
    assert not take(lined, full, "a2", "A")  # a2 comes back first: still behind a1
    lined.give_units("first", [full])
    assert not take(lined, full, "a2", "A")
    assert take(lined, full, "a1", "A")


def test_takes_that_find_room_without_waiting_move_the_line_on_as_if_they_had_waited(
    lined: LockBackend,
    full: Units,
) -> None:
    """A heavier key whose executions each come when room has just freed, and so never wait,
    takes its weight's share of turns past a waiting ticket, not every turn."""
    assert not take(lined, full, "a1", "A")
    lined.give_units("first", [full])
    assert take(lined, full, "b1", "B", weight=2.0)  # its turn would end half of a1's
    lined.give_units("b1", [full])
    assert not take(lined, full, "b2", "B", weight=2.0)  # it would end with a1's: a1 came first
    assert take(lined, full, "a1", "A")


def test_room_kept_for_a_ticket_whose_owner_does_not_come_back_lapses_after_its_hold(
    lined: LockBackend,
    full: Units,
) -> None:
    """The room is kept for ``hold`` seconds after a take found it free for the ticket; then
    others may take it; the ticket keeps its place for when its owner comes back."""
    assert not take(lined, full, "a1", "A", hold=0.5)
    lined.give_units("first", [full])
    assert not take(lined, full, "b1", "B")  # marks a1 ready: its hold starts
    time.sleep(1.0)
    assert take(lined, full, "b1", "B")
    assert not take(lined, full, "a1", "A", hold=0.5)  # no room: still waiting
    lined.give_units("b1", [full])
    assert take(lined, full, "a1", "A", hold=0.5)


def test_a_lapsed_ticket_whose_owner_comes_back_to_no_room_is_kept_room_again(
    lined: LockBackend,
    full: Units,
) -> None:
    """An owner late for its room loses that room, not its place: back and still refused, its
    ticket holds the next freed room for it again, against a stranger and a later ticket."""
    assert not take(lined, full, "a1", "A", hold=0.5)
    lined.give_units("first", [full])
    assert not take(lined, full, "b1", "B")  # marks a1 ready: its hold starts
    time.sleep(1.0)
    assert take(lined, full, "b1", "B")  # a1's hold ran out: b1 takes the room
    assert not take(lined, full, "a1", "A", hold=0.5)  # a1 is back: no room, armed again
    assert not take(lined, full, "c1", "C")
    lined.give_units("b1", [full])
    assert not lined.take_units("stranger", LEASE, [full]).taken
    assert not take(lined, full, "c1", "C")
    assert take(lined, full, "a1", "A", hold=0.5)


def test_a_ticket_whose_owner_never_comes_back_ends_with_its_lease(
    lined: LockBackend,
    full: Units,
) -> None:
    assert not take(lined, full, "a1", "A", lease=0.5)
    lined.give_units("first", [full])
    time.sleep(1.0)
    assert lined.take_units("stranger", LEASE, [full]).taken


def test_a_ticket_given_back_leaves_the_line(
    lined: LockBackend,
    full: Units,
) -> None:
    wait_in_line(lined, full, [("a1", "A")])
    lined.give_units("first", [full])
    item = Units(full.key, full.size, 1, None, turn("a1", "A"))
    assert lined.give_units("a1", [item]) == [False]  # it held nothing; its ticket is gone
    assert lined.take_units("stranger", LEASE, [full]).taken


def test_a_ticket_holds_back_only_the_limit_it_waits_for(
    lined: LockBackend,
    key_prefix: str,
) -> None:
    """A take of two limits refused by one waits there alone: the other, with room, is taken by
    others as if nobody waited."""
    full = Units(limit_key(key_prefix, "{t}-full"), 1, 1)  # one hash tag: one cluster slot
    assert lined.take_units("first", LEASE, [full]).taken
    other = Units(limit_key(key_prefix, "{t}-other"), 1, 1)
    both = [Units(u.key, u.size, 1, None, turn("a1", "A")) for u in (other, full)]
    result = lined.take_units("a1", LEASE, both)
    assert not result.taken
    assert result.limit == full.key
    assert lined.take_units("stranger", LEASE, [other]).taken


def test_two_takes_each_first_in_one_line_never_keep_each_other_out(
    lined: LockBackend,
    key_prefix: str,
) -> None:
    """x is first in one limit's line and y in the other's, and each take names both: the
    first to come back and find its own room but not the other's gives that room up at once,
    and the other is let in."""
    one, two = (Units(limit_key(key_prefix, f"{{t}}-{n}"), 1, 1) for n in ("one", "two"))
    assert lined.take_units("first", LEASE, [one, two]).taken

    def both(ticket: str, *limits: Units) -> bool:
        items = [Units(u.key, u.size, 1, None, turn(ticket, ticket)) for u in limits]
        return lined.take_units(ticket, LEASE, items).taken

    assert not both("y", two)  # y waits first in two's line
    assert not both("x", one, two)  # x first in one's line, behind y in two's
    assert not both("y", two, one)  # y behind x in one's line
    lined.give_units("first", [one, two])
    assert not both("x", one, two)  # x has one's room, not two's: it gives one's up
    assert both("y", two, one)


def test_a_rate_serves_its_line_in_turn_as_its_window_frees(
    lined: LockBackend,
    key_prefix: str,
) -> None:
    """The window is a few seconds long, so that the three refusals come within it on a loaded
    machine (a TLS Cluster took over a second for one of them in CI with a window of one)."""
    period = 3.0
    rate = Units(limit_key(key_prefix, "per-window", rate=True), 1, 1, period)
    assert lined.take_units("first", LEASE, [rate]).taken
    taken_at = time.monotonic()
    wait_in_line(lined, rate, [("a1", "A"), ("a2", "A"), ("b1", "B")])
    time.sleep(max(0.0, taken_at + period + 0.2 - time.monotonic()))
    assert not take(lined, rate, "a2", "A")
    assert not take(lined, rate, "b1", "B")
    assert take(lined, rate, "a1", "A")


def test_an_acquire_with_units_waits_in_line_in_its_one_step(
    lined: LockBackend,
    full: Units,
) -> None:
    """The key is given back with the refusal; the ticket stays, and the room freed is kept for
    the next acquire of its owner."""
    waiting = [Units(full.key, full.size, 1, None, turn("a1", "A"))]
    result = lined.acquire("key-a", "a1", LEASE, units=waiting)
    assert not result.acquired
    assert result.limit == full.key
    assert lined.holder("key-a") is None
    lined.give_units("first", [full])
    assert not lined.acquire("key-b", "b1", LEASE, units=[full]).acquired
    assert lined.acquire("key-a", "a1", LEASE, units=waiting).acquired
    assert lined.release("key-a", "a1", units=waiting)


@pytest.mark.parametrize(
    ("field", "value"),
    [("weight", 0), ("weight", -1.0), ("weight", float("nan")), ("priority", 11),
     ("priority", 1.5), ("lease", 0), ("hold", -1.0)],
)  # fmt: skip
def test_a_turn_out_of_range_is_refused_before_anything_is_written(
    lined: LockBackend,
    key_prefix: str,
    field: str,
    value: float,
) -> None:
    limit = Units(limit_key(key_prefix, "checked"), 1, 1)
    fields = {"lease": LONG, "hold": LONG, field: value}
    bad = Units(limit.key, 1, 1, None, Turn("a1", "A", **fields))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=field):
        lined.take_units("a1", LEASE, [bad])
    assert lined.take_units("other", LEASE, [limit]).taken
