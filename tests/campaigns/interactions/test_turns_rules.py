"""The campaign checker's rules of fair turns (turns_rules.py), on ledgers written by hand:
``turn-order`` (a waiting execution is passed over no more than the keys ahead of it allow)
and ``tickets-end`` (every ticket ends: used, given back, or at the end of its lease)."""

from __future__ import annotations

from .checker import Body, Fault, History, Outcome, Report, check
from .space import Config, find
from .turns_rules import HOLD, Refusal, Ticket, lease_of

#: Retries until "pool" (a concurrency of 2) has room: its waits are judged.
WAITING = Config(0, find({"lock_limits": "pool", "lock_policy": "retry"}))
#: The same, of twice the weight.
HEAVY = Config(1, find({"lock_limits": "pool", "lock_policy": "retry", "lock_weight": 2.0}))
#: The same, three turns ahead.
URGENT = Config(2, find({"lock_limits": "pool", "lock_policy": "retry", "lock_priority": 3}))
CONFIGS = {c.name: c for c in (WAITING, HEAVY, URGENT)}


def started(tid: str, start: float, config: Config = WAITING, key: str = "k") -> Body:
    """A body of ``config`` that took one unit of "pool", its acquire sent 5 ms before."""
    taken = Body(tid, 0, 0, key, config.name, 1, int(start * 1e6), start, start + 0.05, "return")
    taken.acquired = start - 0.005
    taken.units = config.costs(1)
    return taken


def refused(tid: str, *times: float, config: Config = WAITING, holder: str | None = None) -> list[
    Refusal
]:  # fmt: skip
    return [Refusal(config.name, tid, 0, "k", holder, "retry", t) for t in times]


def judged(
    bodies: list[Body],
    refusals: list[Refusal],
    tickets: list[Ticket] | None = None,
    outcomes: dict[str, Outcome] | None = None,
    faults: list[Fault] | None = None,
) -> Report:
    return check(History(42, CONFIGS, [], bodies, outcomes or {}, [], faults or [], 100.0,
                         refusals=refusals, tickets=tickets or []))  # fmt: skip


def rules(report: Report) -> list[str]:
    return [v.split(": rule ")[1].split(":")[0] for v in report.violations]


# -- turn-order ------------------------------------------------------------------------------


def test_a_waiter_passed_over_by_one_turn_of_another_key_is_in_its_turn() -> None:
    """E waits from 1.0 (its first refusal) to 2.2, nobody of its key ahead: key k2, coming
    after it, may be served once before it (a take in no order the probe can tell) and once
    more in its turn."""
    two = [started("b1", 1.2, key="k2"), started("b2", 1.5, key="k2")]
    report = judged([started("e", 2.2), *two], refused("e", 1.0, 1.4, 1.8))
    assert report.violations == []


def test_a_waiter_passed_over_more_than_the_keys_ahead_allow_is_a_violation() -> None:
    three = [started(f"b{i}", 1.1 + 0.2 * i, key="k2") for i in range(3)]
    report = judged([started("e", 2.2), *three], refused("e", 1.0, 1.4, 1.8))
    assert rules(report) == ["turn-order"]
    assert (
        "key 'k2' of interactions.c0 took 3 units past it, at most 2 allowed"
        in (report.violations[0])
    )


def test_a_heavier_key_or_a_higher_priority_passes_by_its_weight_or_its_turns_ahead() -> None:
    three = [started(f"b{i}", 1.1 + 0.2 * i, HEAVY, key="k2") for i in range(3)]
    assert judged([started("e", 2.2), *three], refused("e", 1.0, 1.4, 1.8)).violations == []
    five = [started(f"b{i}", 1.1 + 0.1 * i, URGENT, key="k2") for i in range(5)]
    assert judged([started("e", 2.2), *five], refused("e", 1.0, 1.4, 1.8)).violations == []
    six = [started(f"b{i}", 1.1 + 0.1 * i, URGENT, key="k2") for i in range(6)]
    assert rules(judged([started("e", 2.2), *six], refused("e", 1.0, 1.4, 1.8))) == ["turn-order"]


def test_a_waiter_with_its_own_key_ahead_of_it_waits_behind_them_too() -> None:
    """Two of E's key waited before it: its turn ends three turns on, and k2 may pass it that
    often (plus one)."""
    mates = [started("m1", 2.3), started("m2", 2.6)]
    mates_refused = refused("m1", 0.8, 1.2, 1.6, 2.0) + refused("m2", 0.9, 1.3, 1.7, 2.1, 2.5)
    four = [started(f"b{i}", 1.1 + 0.15 * i, key="k2") for i in range(4)]
    report = judged([started("e", 2.9), *mates, *four],
                    refused("e", 1.0, 1.4, 1.8, 2.2, 2.6) + mates_refused)  # fmt: skip
    assert [v for v in report.violations if "body(e" in v] == []


def test_an_attempt_delivered_twice_is_not_judged_on_a_wait_spanning_both() -> None:
    """E's first delivery started at 1.5 and its process was killed; the message came back,
    was refused at 2.4 and ran at 2.8. Its refusals are one attempt's, but no one wait of a
    delivery runs from 1.0 to 2.4: k2's three takes are not judged against it (seed
    1131123807)."""
    first = started("e", 1.5)
    first.end, first.how = None, None
    again = started("e", 2.8)
    three = [started(f"b{i}", 1.3 + 0.4 * i, key="k2") for i in range(3)]
    report = judged([first, again, *three], refused("e", 1.0, 1.4, 2.4))
    assert report.violations == []


def test_a_wait_the_ledger_cannot_follow_is_not_judged() -> None:
    """Back later than its hold (the room kept for it may have lapsed), refused by its key's
    holder, or met by a fault of the workers' store link: not judged."""
    three = [started(f"b{i}", 1.1 + 0.2 * i, key="k2") for i in range(3)]
    late = refused("e", 1.0, 1.0 + HOLD)
    assert judged([started("e", 1.1 + HOLD), *three], late).violations == []
    held = refused("e", 1.0, 1.4) + refused("e", 1.8, holder="x")
    assert judged([started("e", 2.2), *three], held).violations == []
    fault = [Fault("store-stall", 1.5, 1.6, side="run")]
    report = judged([started("e", 2.2), *three], refused("e", 1.0, 1.4, 1.8), faults=fault)
    assert report.violations == []


# -- tickets-end ----------------------------------------------------------------------------


def ticket(name: str, renewed: float) -> Ticket:
    """A ticket of "pool"'s line last renewed at ``renewed``."""
    return Ticket("pool", False, name, renewed + lease_of("pool", False), "redis")


def test_a_ticket_left_by_an_execution_that_stopped_waiting_ends_with_its_lease() -> None:
    outcome = {"e": Outcome("FAILURE", kind="exception", exception="BackendUnavailable")}
    report = judged([], refused("e", 95.0), [ticket("e", 95.0)], outcome)
    assert report.violations == []
    assert any("left by an execution that stopped waiting" in d for d in report.documented)


def test_a_ticket_its_execution_started_after_is_a_violation() -> None:
    report = judged([started("e", 97.0)], refused("e", 95.0), [ticket("e", 95.0)])
    assert rules(report) == ["tickets-end"]
    assert "a start uses its ticket" in report.violations[0]


def test_a_ticket_whose_lease_ended_before_its_execution_started_is_documented() -> None:
    """Back from retries on an unreachable store after its ticket's lease ended, the
    execution starts: the ended ticket is left in the stored line until the line next
    changes, which is no violation (seed 1131123807 on PostgreSQL)."""
    report = judged([started("e", 95.0)], refused("e", 80.0), [ticket("e", 80.0)])
    assert report.violations == []
    assert any("before its execution started" in d for d in report.documented)


def test_a_ticket_of_an_execution_whose_lock_retries_ran_out_is_a_violation() -> None:
    spent = {"e": Outcome("FAILURE", kind="exception", exception="TaskLocked", limit="pool")}
    report = judged([], refused("e", 95.0), [ticket("e", 95.0)], spent)
    assert rules(report) == ["tickets-end"]
    assert "it gives its tickets back" in report.violations[0]
    # unless a fault of the workers' store link may have lost the giving back
    fault = [Fault("store-down", 94.0, 95.5, side="run")]
    assert judged([], refused("e", 95.0), [ticket("e", 95.0)], spent, fault).violations == []


def test_a_ticket_that_outlives_its_lease_is_a_violation() -> None:
    report = judged([], [], [ticket("e", 130.0)])
    assert rules(report) == ["tickets-end"]
    assert "over its lease" in report.violations[0]


def test_a_tickets_lease_in_a_rates_line_covers_the_rates_period() -> None:
    assert lease_of("pool", False) < lease_of("budget", True)
    assert lease_of("budget", True) >= 3 * 2.0
