"""The interaction campaign: every send accounted for (issue 29, docs/guarantees.rst).

Seeded bursts of sends, over configurations drawn from the whole option space that
``SingletonTask`` accepts, go to a real prefork worker from several producers, with bodies that
end in every way the lifecycle knows and faults at the hand-offs (publishes that fail, a
producer killed mid-burst, the lock store unreachable at send or at run, redeliveries). After a
quiet period the checker (checker.py) accounts for every send and checks exclusion, fences,
rates and what the idle store still holds.

The generator's space is tested against what ``SingletonTask`` accepts, and the checker's rules
on ledgers written by hand. A short run (one round, two configurations, on the session's Redis)
is part of the README's command; the long run is its own step of .ci/run:
``python -m pytest -m interactions -n 0`` (``SINGLETASK_INTERACTIONS_SECONDS`` of rounds, 180 by
default), its configurations taking turns on Redis, PostgreSQL, MySQL/MariaDB and SQLite
(``SINGLETASK_INTERACTIONS_STORES`` names others). Every run prints its seed, stores and
figures; ``SINGLETASK_INTERACTIONS_SEED=<seed>`` replays its draws, and
``SINGLETASK_INTERACTIONS_SCENARIO=<name>`` (runner.SCENARIOS) runs one targeted combination.
"""

from __future__ import annotations

import collections
import itertools
import os
from collections.abc import Sequence
from pathlib import Path

import celery
import pytest
from celery import Celery

from singletask import SingletonTask
from singletask.conf.options import ATTRIBUTE_CHECKS
from singletask.exceptions import ConfigurationError

from ...e2e.conftest import CLIENT_GARBAGE
from ...servers import CI, sql_problem, unavailable
from .checker import (
    REJECT_STORED,
    Body,
    Charge,
    Fault,
    History,
    Outcome,
    Report,
    Residue,
    Send,
    check,
)
from .runner import SCENARIOS, Servers, Settings, campaign_seed, run
from .space import (
    FIXED,
    LIMITS,
    NOT_DRAWN,
    OPTIONS,
    STORES,
    TURN_OPTIONS,
    Config,
    draw,
    find,
    names_limits,
    product,
    size,
    space,
    valid,
)
from .turns_rules import Refusal

# -- the option space ------------------------------------------------------------------------


def accepted_by_singletask(options: dict[str, object]) -> bool:
    """Whether defining a task with these options succeeds."""
    app = Celery("space", set_as_current=False, broker="memory://")
    app.conf.singletask_backend_url = "memory://"
    app.conf.singletask_limits = LIMITS  # as the campaign's app (app.py)
    config = Config(0, dict(options))

    def body(self: object, key: str, seq: int) -> None: ...

    try:
        app.task(base=SingletonTask, bind=True, shared=False, lazy=False, name="space.t",
                 **config.task_options())(body)  # fmt: skip
    except ConfigurationError:
        return False
    finally:
        app.close()
    return True


def test_the_table_names_every_task_option() -> None:
    """An option added to SingletonTask must join the campaign's table (drawn, fixed, or one
    of the key's): then the generator draws it."""
    covered = set(OPTIONS) | set(FIXED) | set(NOT_DRAWN)
    options = set(ATTRIBUTE_CHECKS) | {"lock_args", "lock_key"}
    assert options <= covered, f"options the campaign does not know: {options - covered}"


#: The options of named limits, and those the tasks' checks weigh them against.
NAMED_OPTIONS = ("lock_limits", "lock_cost")
NAMED_WITH = ("lock_scope", "lock_policy", "lock_limit", "lock_rate", "lock_debounce")
#: How many more combinations of the whole table are checked, drawn with a fixed seed.
SAMPLED = 2000


def checked_combinations() -> list[dict[str, object]]:
    """The combinations whose acceptance is checked: the whole table is too large to define a
    task for each (over 100,000), so every combination without named limits (the table
    before them), every combination of the named limits' options with the options their
    checks weigh them against (the others at their first value: no check reads them), and a
    seeded sample of the whole table."""
    import random

    first = {name: values[0] for name, values in OPTIONS.items()}
    plain = [o for o in product() if all(o[n] is None for n in (*NAMED_OPTIONS, *TURN_OPTIONS))]
    names = [*NAMED_OPTIONS, *NAMED_WITH]
    named = [
        {**first, **dict(zip(names, values, strict=True))}
        for values in itertools.product(*(OPTIONS[name] for name in names))
    ]
    # fair turns' options, with and without each kind of named limits, under each policy
    names = [*NAMED_OPTIONS, *TURN_OPTIONS, "lock_policy"]
    turns = [
        {**first, **dict(zip(names, values, strict=True))}
        for values in itertools.product(*(OPTIONS[name] for name in names))
    ]
    rng = random.Random(20261127)
    sample = [{name: rng.choice(values) for name, values in OPTIONS.items()}
              for _ in range(SAMPLED)]  # fmt: skip
    return plain + named + turns + sample


def test_the_generators_space_is_what_singletask_accepts() -> None:
    # Given the combinations of the table's values (every one without named limits, every one
    # of the named limits' options with what they are weighed against, a seeded sample)
    combinations = checked_combinations()
    # Then the generator's rule and SingletonTask agree on every one
    disagreements = [
        options for options in combinations if valid(options) != accepted_by_singletask(options)
    ]
    assert disagreements == []
    # And the space is neither empty nor everything, and draws named limits
    assert 0 < len(space()) < size()
    assert any(o["lock_limits"] is not None for o in combinations if valid(o))
    assert any(o["lock_cost"] is not None for o in combinations if valid(o))


def test_the_generator_draws_only_accepted_combinations_and_replays_by_seed() -> None:
    import random

    drawn = draw(random.Random(5), 12)
    assert all(valid(c.options) for c in drawn)
    assert sum(names_limits(c.options) for c in drawn) == 6  # half name limits
    assert [c.options for c in drawn] == [c.options for c in draw(random.Random(5), 12)]
    assert len({c.describe().split("[")[1] for c in drawn}) == 12


def test_the_stores_take_turns_over_the_drawn_configurations_without_changing_them() -> None:
    import random

    # Given twelve configurations drawn for every store, and the same seed for Redis alone
    mixed = draw(random.Random(7), 12, STORES)
    alone = draw(random.Random(7), 12)
    # Then each store carries three, and the options drawn are the same (a seed replays)
    assert [c.store for c in mixed[:4]] == list(STORES)
    assert {store: sum(c.store == store for c in mixed) for store in STORES} == dict.fromkeys(
        STORES, 3
    )
    assert [c.options for c in mixed] == [c.options for c in alone]
    assert {c.store for c in alone} == {"redis"}
    assert "store=sqlite]" in mixed[3].describe()


def test_every_targeted_scenario_is_a_combination_the_generator_can_draw() -> None:
    for name, scenario in SCENARIOS.items():
        for options in scenario.get("configs") or [scenario["options"]]:
            assert find(options) in space(), name


# -- the checker, on ledgers written by hand -------------------------------------------------

CONFIG = Config(0, find({}))
DEBOUNCED = Config(1, find({"lock_debounce": 1.0}))
QUEUED = Config(2, find({"lock_scope": "queue"}))
LIMITED = Config(3, find({"lock_limit": 2, "lock_rate": "2/s"}))
REPLACING = Config(4, find({"lock_policy": "replace"}))
REPLACING_2 = Config(5, find({"lock_policy": "replace", "lock_limit": 2}))
LATEST = Config(6, find({"lock_scope": "coalesce", "lock_coalesce": "latest"}))
TERMINATING = Config(7, find({"lock_policy": "replace", "lock_replace_terminate": True}))
POOLED = Config(8, find({"lock_limits": "pool"}))  # 1 unit of "pool", a concurrency of 2
BUDGETED = Config(9, find({"lock_limits": "budget"}))  # the drawn units of "budget", 6/2s
RAISING = Config(10, find({"lock_limits": "pool+budget", "lock_policy": "raise"}))
COSTLY = Config(11, find({"lock_limit": 3, "lock_cost": 2}))  # one at a time per key


def send(seq: int, tid: str | None, t: float = 0.0, config: Config = CONFIG, **kw: object) -> Send:
    fields: dict[str, object] = {"returned": tid, "t_after": t + 0.01}
    fields.update(kw)
    return Send(seq, "p0", config.name, "k", "apply_async", "return", t, task_id=tid, **fields)  # type: ignore[arg-type]


def body(tid: str, start: float, end: float | None, fence: int, config: Config = CONFIG,
         retries: int = 0, how: str = "return", seq: int = 0) -> Body:  # fmt: skip
    return Body(tid, retries, seq, "k", config.name, 1, fence, start, end, how)


def judge(
    sends: list[Send],
    bodies: list[Body],
    outcomes: dict[str, Outcome],
    residues: list[Residue] | None = None,
    faults: list[Fault] | None = None,
    *,
    rejects_stored: bool = True,
    refusals: list[Refusal] | None = None,
) -> Report:
    every = (CONFIG, DEBOUNCED, QUEUED, LIMITED, REPLACING, REPLACING_2, LATEST, TERMINATING,
             POOLED, BUDGETED, RAISING, COSTLY)  # fmt: skip
    configs = {c.name: c for c in every}
    return check(History(
        42, configs, sends, bodies, outcomes, residues or [], faults or [],
        rejects_stored=rejects_stored, refusals=refusals or [],
    ))  # fmt: skip


def done(at: float, **kw: object) -> Outcome:
    return Outcome("SUCCESS", kind="value", date_done=at, **kw)  # type: ignore[arg-type]


def skipped(at: float, reason: str, holder: str | None) -> Outcome:
    return Outcome("SUCCESS", kind="skipped", reason=reason, holder=holder, date_done=at)


def rules(report: Report) -> list[str]:
    return [v.split(": rule ")[1].split(":")[0] for v in report.violations]


def test_a_clean_ledger_passes() -> None:
    # Given a send that ran, a duplicate skipped while it ran, and a failed publish
    sends = [send(0, "a"), send(1, "b", 0.05), send(2, "c", 0.1, error="OperationalError",
                                                    returned=None)]  # fmt: skip
    outcomes = {"a": done(0.5), "b": skipped(0.2, "held", "a"), "c": Outcome("PENDING")}
    report = judge(sends, [body("a", 0.1, 0.4, 10)], outcomes)
    # Then nothing is wrong, and the figures count them
    assert report.violations == []
    assert report.sends == 3
    assert report.bodies == 1


def test_a_result_pending_past_the_bound_is_a_violation_naming_seed_config_key_sends() -> None:
    report = judge([send(0, "a")], [], {})
    assert rules(report) == ["accounted"]
    violation = report.violations[0]
    assert violation.startswith("seed=42 interactions.c0[execution skip limit=1")
    assert "key='k'" in violation
    assert "send#0(" in violation
    assert "still PENDING past the bound (no body)" in violation


def test_a_rejected_body_is_accounted_for_as_the_workers_celery_stores_it() -> None:
    """Celery 5.7 stores FAILURE for a body that raised Reject(requeue=False); Celery 5.3 to
    5.6 store nothing, so its result stays PENDING as an Ignore's does (docs/quickstart.rst).
    The campaign asks for what the workers' Celery does, and for nothing from singletask."""
    rejecting = send(0, "a")
    rejecting.ending = "reject"
    rejected = [body("a", 0.1, 0.3, 10, how="reject")]
    assert rules(judge([rejecting], rejected, {}, rejects_stored=True)) == ["accounted"]
    assert judge([rejecting], rejected, {}, rejects_stored=False).violations == []
    failed = Outcome("FAILURE", kind="exception", exception="Reject", date_done=0.4)
    assert judge([rejecting], rejected, {"a": failed}).violations == []
    # An Ignore stores nothing on any version.
    assert judge([send(0, "a")], [body("a", 0.1, 0.3, 10, how="ignore")], {}).violations == []
    assert (celery.VERSION[:2] >= (5, 7)) == REJECT_STORED


def test_joining_a_send_whose_publish_failed_is_a_violation() -> None:
    """Finding 2: a later call joined an unpublished follow-up, PENDING for ever."""
    failed = send(0, "f", error="OperationalError", returned=None)
    joiner = send(1, "j", 0.2, returned="f")
    report = judge([failed, joiner], [], {})
    assert rules(report) == ["accounted"]
    assert "a send whose publish failed" in report.violations[0]


def test_a_failed_publish_that_ran_or_left_a_record_is_a_violation() -> None:
    failed = send(0, "f", error="EncodeError", returned=None)
    residue = Residue("k", "follow-up claim", "f", "claim")
    report = judge([failed], [body("f", 1, 2, 5)], {}, [residue])
    assert rules(report) == ["accounted", "accounted"]


def test_a_call_that_joined_a_send_whose_publish_failed_must_get_that_error() -> None:
    """Finding 2's kin: a call joined a queued send while its publish was failing. Its
    AsyncResult must end with that publish's error, never stay PENDING."""
    failed = send(0, "f", config=QUEUED, error="OperationalError", returned=None)
    joiner = send(1, "j", 0.1, config=QUEUED, returned="f")
    lost = judge([failed, joiner], [], {})
    assert "accounted" in rules(lost)
    told = Outcome("FAILURE", kind="exception", exception="OperationalError", date_done=0.2)
    # (and that error, stored for the unsent message, is the failure its send explains)
    assert judge([failed, joiner], [], {"f": told}).violations == []
    assert judge([failed], [], {"f": told}).violations == []


def test_a_send_ended_superseded_by_a_failing_publish_is_a_violation_however_it_came() -> None:
    """docs/limits.rst, "While a send is being published": a message that starts while a later
    send's publish is going on waits for it to be published or taken back, so no send ends
    superseded by a send whose publish failed: not while the publish was failing (seed
    260319362 on MySQL, before the pending entries), not through a later send's undo (two sends
    failed at once, taken back in the opposite order), not through a chain of skips (seed
    2112489755: the chain is judged at its last link)."""
    last = send(0, "a", config=DEBOUNCED)
    failed = send(1, "f", 0.2, config=DEBOUNCED, error="OperationalError", returned=None)
    failed.t_after = 1.0  # Celery's publish to a broker that is down took 0.8 s to fail
    window = Residue("k", "open window", "a", "debounce_until +60s")
    # While the publish was failing, or after its undo: the burst ran nothing
    for ended in (0.7, 1.5):
        report = judge([last, failed], [], {"a": skipped(ended, "debounced", "f")}, [window])
        assert {"superseded", "last-runs", "idle"} <= set(rules(report)), ended
        assert not report.documented
    # Two failed sends taken back in the opposite order of their sends
    second = send(2, "g", 0.4, config=DEBOUNCED, error="EncodeError", returned=None)
    second.t_after = 0.7
    both = judge([last, failed, second], [], {"a": skipped(1.5, "debounced", "f")})
    assert "superseded" in rules(both)
    # A chain: A superseded by B (published), B by the failing F
    a, b = send(0, "a", config=DEBOUNCED), send(1, "b", 0.3, config=DEBOUNCED)
    chain = {"a": skipped(0.8, "debounced", "b"), "b": skipped(1.005, "debounced", "f")}
    assert rules(judge([a, b, failed], [], chain)).count("superseded") == 2


def test_a_killed_process_lock_is_left_to_its_lease_at_idle() -> None:
    """docs/lifecycle.rst: with acks_late and reject_on_worker_lost nothing releases for a killed
    pool process; its redelivered copy refused by lock_rate takes nothing over (seed 260319362
    on PostgreSQL, the last round): the lock stays until its lease runs out."""
    killed = body("a", 0.0, None, 5)
    lock = Residue("k", "lock", "a", "ttl 0.9")
    limited = Outcome("FAILURE", kind="exception", exception="RateLimited", date_done=0.6)
    history = History(42, {CONFIG.name: CONFIG}, [send(0, "a")], [killed], {"a": limited}, [lock])
    history.observed = 4.0  # within one lease (lock_ttl 5) of the kill
    assert check(history).violations == []
    history.observed = 7.0  # past it: the lock should have expired
    assert rules(check(history)) == ["idle"]


def test_a_burst_superseded_by_a_send_whose_publish_failed_is_a_violation() -> None:
    """Finding 1: the window named the unpublished send; no body of the burst ran."""
    first = send(0, "a", config=DEBOUNCED)
    failed = send(1, "f", 0.2, config=DEBOUNCED, error="OperationalError", returned=None)
    report = judge([first, failed], [], {"a": skipped(1.5, "debounced", "f")})
    assert "superseded" in rules(report)
    assert "last-runs" in rules(report)
    assert any("a send whose publish failed" in v for v in report.violations)


def test_a_follow_up_waiting_behind_a_killed_sends_reservation_is_documented() -> None:
    """Seed 2112489755: a send_task message became the follow-up of a key a killed producer's
    send had reserved (lock_queue_ttl 60 s, past the quiet bound); it still waits, its claim
    kept, when the outcomes are read."""
    killed = send(0, "k", config=LATEST, t_after=None, returned=None)
    waiting = send(1, "b", 2.0, config=LATEST)  # a send_task() one: no reservation at send
    claim = Residue("test:x:interactions.c6:k", "follow-up claim", "b", "claim")
    outcomes = {"b": Outcome("RETRY", kind="exception", exception="BackendUnavailable")}
    history = History(42, {LATEST.name: LATEST}, [killed, waiting], [], outcomes, [claim],
                      observed=45.0)  # fmt: skip
    report = check(history)
    assert report.violations == []
    assert any("waits behind the record of k" in d for d in report.documented)
    expired = History(42, {LATEST.name: LATEST}, [killed, waiting], [], outcomes, [claim],
                      observed=90.0)  # fmt: skip
    assert sorted(rules(check(expired))) == ["accounted", "idle"]


def test_the_last_published_send_of_a_burst_runs() -> None:
    sends = [send(0, "a", config=DEBOUNCED), send(1, "b", 0.3, config=DEBOUNCED)]
    good = judge(sends, [body("b", 1.4, 1.5, 3, DEBOUNCED, seq=1)],
                 {"a": skipped(1.1, "debounced", "b"), "b": done(1.5)})  # fmt: skip
    assert good.violations == []
    bad = judge(sends, [body("a", 1.1, 1.2, 3, DEBOUNCED)],
                {"a": done(1.2), "b": skipped(3.4, "held", "a")})  # fmt: skip
    assert "last-runs" not in rules(bad)  # a visible refusal of its own ...
    assert "holder-alive" in rules(bad)  # ... by a holder that had ended


def test_a_body_retry_that_never_runs_is_a_violation() -> None:
    """Findings 4 and 5: the retried attempt was refused (rate, debounce); its retry never ran."""
    refused = Outcome("SUCCESS", kind="skipped", reason="rate", date_done=0.5)
    report = judge([send(0, "a")], [body("a", 0, 0.1, 1, how="retry")], {"a": refused})
    assert rules(report) == ["retry-runs"]
    ran = judge([send(0, "a")], [body("a", 0, 0.1, 1, how="retry"),
                                 body("a", 0.5, 0.6, 2, retries=1)], {"a": done(0.6)})  # fmt: skip
    assert ran.violations == []


def test_a_body_retry_refused_through_its_lock_retries_in_any_mix_is_documented() -> None:
    """docs/policies.rst: one lock_retry_max budget covers the task id (the body's own retry
    inherits what its first attempt spent); a retried attempt refused until it is spent (its
    key held, its key's rate, a limit without room, in any mix) fails TaskLocked or RateLimited.
    The workers record each refusal: fewer than the budget is a retry that never ran."""
    spent = Outcome("FAILURE", kind="exception", exception="RateLimited", date_done=30.0)
    budget = int(FIXED["lock_retry_max"])
    waits = [Refusal(CONFIG.name, "a", 0 if i < 10 else 1, "k", "x" if i % 3 else None, "retry",
                     0.5 * i) for i in range(budget)]  # fmt: skip
    report = judge([send(0, "a")], [body("a", 4.0, 4.1, 1, how="retry")], {"a": spent},
                   refusals=waits)  # fmt: skip
    assert report.violations == []
    assert any("its lock retries spent" in d for d in report.documented)
    short = judge([send(0, "a")], [body("a", 4.0, 4.1, 1, how="retry")], {"a": spent},
                  refusals=waits[1:])  # fmt: skip
    assert rules(short) == ["retry-runs"]


def test_a_body_retry_that_met_the_store_down_through_its_budget_is_documented() -> None:
    """docs/configuration.rst, lock_backend_retry_max: a retried attempt that finds the lock
    store unreachable through its whole store-error budget fails with BackendUnavailable (seeds
    1784892769 on MySQL and 619470770 on PostgreSQL, a store stopped for tens of seconds on a
    loaded machine); another exception is still a violation."""
    unreachable = Outcome("FAILURE", kind="exception", exception="BackendUnavailable", date_done=9)
    report = judge([send(0, "a")], [body("a", 0, 0.1, 1, how="retry")], {"a": unreachable})
    assert report.violations == []
    assert any("store-error budget" in d for d in report.documented)
    other = Outcome("FAILURE", kind="exception", exception="RuntimeError", date_done=9)
    assert "retry-runs" in rules(
        judge([send(0, "a")], [body("a", 0, 0.1, 1, how="retry")], {"a": other})
    )


def test_a_debounced_body_retry_superseded_by_a_later_send_that_ran_is_no_violation() -> None:
    """docs/lifecycle.rst: with lock_debounce, a later send of the key supersedes the retry and
    runs the latest arguments; the retry not running is then what was asked for."""
    sends = [send(0, "a", config=DEBOUNCED), send(1, "b", 0.3, config=DEBOUNCED)]
    bodies = [body("a", 0, 0.1, 1, DEBOUNCED, how="retry"), body("b", 1.4, 1.5, 2, DEBOUNCED)]
    report = judge(sends, bodies, {"a": skipped(1.2, "debounced", "b"), "b": done(1.5)})
    assert report.violations == []


def test_a_send_deduplicated_onto_one_that_had_ended_is_a_violation() -> None:
    """Finding 3: a reservation kept by an ended message swallows later sends."""
    first = send(0, "a", config=QUEUED)
    late = send(1, "b", 5.0, config=QUEUED, returned="a")
    report = judge([first, late], [], {"a": skipped(0.5, "rate", None)})
    assert rules(report) == ["joined-ended"]
    assert "which had ended 4.50s before the send" in report.violations[0]


def test_a_send_joined_within_a_lease_of_a_release_a_store_fault_lost_is_documented() -> None:
    """docs/guarantees.rst: a send deduplicated onto one that had ended, while the lock store
    was unreachable at its release (seed 460816040 on PostgreSQL: the main process could not
    look up the lock after a hard time limit during a store stop; the key stayed for its
    lease), is documented; long after, or with no fault, a violation."""
    first = send(0, "a", config=QUEUED)
    first.ending = "hard"
    late = send(1, "b", 2.5, config=QUEUED, returned="a")
    ended = {"a": Outcome("FAILURE", kind="exception", exception="TimeLimitExceeded",
                          date_done=1.0)}  # fmt: skip
    fault = Fault("store-stop-at-run", 0.9, 1.2, "run")
    report = judge([first, late], [], ended, faults=[fault])
    assert report.violations == []
    assert any("whose release a store fault lost" in d for d in report.documented)
    assert rules(judge([first, late], [], ended)) == ["joined-ended"]
    much_later = send(1, "b", 9.0, config=QUEUED, returned="a")
    assert rules(judge([first, much_later], [], ended, faults=[fault])) == ["joined-ended"]


def test_of_two_delay_sends_given_one_id_the_one_whose_arguments_ran_published_it() -> None:
    """Seed 460816040 (queue scope): two ``delay`` sends, one published and one joined it;
    the joiner replied first. The body ran the publisher's arguments: its ending explains the
    failure, not the joiner's."""
    joiner = Send(0, "p0", QUEUED.name, "k", "delay", "retry", 0.0, returned="a", t_after=0.1)
    publisher = Send(1, "p1", QUEUED.name, "k", "delay", "raise", 0.0, returned="a", t_after=0.2)
    failed = Outcome("FAILURE", kind="exception", exception="RuntimeError", date_done=0.5)
    ran = [body("a", 0.2, 0.4, 1, QUEUED, how="raise", seq=1)]
    assert judge([joiner, publisher], ran, {"a": failed}).violations == []
    assert publisher.own == "a"
    assert joiner.own is None


def test_refused_as_held_by_an_ended_holder_unless_a_store_fault_lost_its_release() -> None:
    sends = [send(0, "a"), send(1, "b", 3.0)]
    outcomes = {"a": done(1.0), "b": skipped(3.1, "held", "a")}
    assert rules(judge(sends, [body("a", 0.1, 0.9, 1)], outcomes)) == ["holder-alive"]
    fault = Fault("store-stop-at-run", 0.8, 1.1, "run")
    excused = judge(sends, [body("a", 0.1, 0.9, 1)], outcomes, faults=[fault])
    assert excused.violations == []
    assert excused.documented


def test_a_store_fault_on_another_stores_link_excuses_no_lost_release() -> None:
    """A fault names the stores whose link it met: SQLite has none, so a fault of the Redis
    and SQL links is no excuse for a SQLite configuration."""
    sends = [send(0, "a"), send(1, "b", 3.0)]
    outcomes = {"a": done(1.0), "b": skipped(3.1, "held", "a")}
    elsewhere = Fault("store-stop-at-run", 0.8, 1.1, "run", ("redis", "postgresql"))
    assert CONFIG.store == "redis"
    assert judge(sends, [body("a", 0.1, 0.9, 1)], outcomes, faults=[elsewhere]).violations == []
    on_sqlite = Config(0, CONFIG.options, "sqlite")
    history = History(42, {on_sqlite.name: on_sqlite}, sends, [body("a", 0.1, 0.9, 1)],
                      outcomes, [], [elsewhere])  # fmt: skip
    assert rules(check(history)) == ["holder-alive"]


def test_more_bodies_than_the_limit_at_once_is_a_violation() -> None:
    ok = [body("a", 0, 1, 1, LIMITED), body("b", 0.5, 1.5, 2, LIMITED)]
    assert "exclusion" not in rules(judge([], ok, {}))
    over = [*ok, body("c", 0.7, 0.8, 3, LIMITED)]
    assert "exclusion" in rules(judge([], over, {}))
    single = [body("a", 0, 1, 1), body("b", 0.5, 1.5, 2)]
    assert rules(judge([], single, {})) == ["exclusion"]


def test_a_body_whose_lease_ran_out_no_longer_holds_once_a_newer_one_took_its_key() -> None:
    """docs/guarantees.rst, "Lease loss": renewals that fail until the lease passes lose the
    lock; the body runs on (it ends lost), and a newer execution takes the key with a larger
    fence. Not an overlap; without the loss, or taken with a smaller fence, it is one."""
    lost = body("a", 0, 10, 1)
    lost.lost = True
    assert rules(judge([], [lost, body("b", 6, 7, 2)], {})) == []
    held = body("a", 0, 10, 1)
    assert rules(judge([], [held, body("b", 6, 7, 2)], {})) == ["exclusion"]
    assert rules(judge([], [lost, body("b", 6, 7, 0)], {})) == ["exclusion", "fences"]


def test_a_body_that_killed_its_process_no_longer_holds_once_its_lock_passed_on() -> None:
    """A dead process acts no more: a later body with a larger fence (the store handed the key
    on once the worker saw the process gone) is no overlap, however soon it started; one with a
    fence that is not larger still is."""
    dead = body("a", 0, None, 1)
    dead.ending = "kill"
    assert "exclusion" not in rules(judge([], [dead, body("b", 0.005, 0.2, 2)], {}))
    assert "exclusion" in rules(judge([], [dead, body("b", 0.005, 0.2, 1)], {}))


def test_replace_a_preempted_body_may_run_on_beside_its_successor_with_a_smaller_fence() -> None:
    """docs/guarantees.rst, "Latest wins": exclusion is by fence. The preempted body runs on
    until it learns (here: its end, as it never checks) and ends replaced, naming the newer."""
    sends = [send(0, "a", config=REPLACING), send(1, "b", 0.1, config=REPLACING)]
    bodies = [body("a", 0, 0.3, 1, REPLACING), body("b", 0.1, 0.5, 2, REPLACING, seq=1)]
    outcomes = {"a": skipped(0.31, "replaced", "b"), "b": done(0.5)}
    assert judge(sends, bodies, outcomes).violations == []
    # A later body without a larger fence cannot have preempted it: an overlap
    smaller = [body("a", 0, 0.3, 2, REPLACING), body("b", 0.1, 0.5, 1, REPLACING, seq=1)]
    assert "exclusion" in rules(judge(sends, smaller, outcomes))


def test_replace_a_body_taken_over_before_it_started_may_start_after_its_successor() -> None:
    """docs/guarantees.rst, "Latest wins": an execution preempted between its acquire and its
    body's start still starts its body (it learns at its renewer's next renewal), a few
    milliseconds after the newer execution's body; its smaller fence tells it apart."""
    sends = [send(0, "a", config=REPLACING), send(1, "b", config=REPLACING)]
    bodies = [
        body("b", 0, 0.5, 2, REPLACING, seq=1),
        body("a", 0.003, 0.04, 1, REPLACING, how="unwound"),
    ]
    assert (
        judge(sends, bodies, {"a": skipped(0.05, "replaced", "b"), "b": done(0.5)}).violations == []
    )


def test_replace_with_a_limit_preempts_the_oldest_and_still_counts_the_others() -> None:
    bodies = [body("a", 0, 1, 1, REPLACING_2), body("b", 0.1, 1, 2, REPLACING_2),
              body("c", 0.2, 1, 3, REPLACING_2)]  # fmt: skip
    outcomes = {"a": skipped(1.0, "replaced", "c"), "b": done(1), "c": done(1)}
    assert "exclusion" not in rules(judge([], bodies, outcomes))
    # Two preemptions need two newer bodies, each with a fence larger than its victim's
    over = [*bodies, body("d", 0.3, 1, 0, REPLACING_2)]
    assert "exclusion" in rules(judge([], over, outcomes))


def test_replace_a_preempted_body_that_returned_while_its_successor_held_ends_replaced() -> None:
    sends = [send(0, "a", config=REPLACING), send(1, "b", 0.1, config=REPLACING)]
    bodies = [body("a", 0, 0.3, 1, REPLACING), body("b", 0.1, 0.5, 2, REPLACING, seq=1)]
    assert rules(judge(sends, bodies, {"a": done(0.3), "b": done(0.5)})) == ["replaced"]
    # Its successor had ended before it returned: the key no longer names it (documented)
    early = [body("a", 0, 0.3, 1, REPLACING), body("b", 0.1, 0.2, 2, REPLACING, seq=1)]
    assert judge(sends, early, {"a": done(0.3), "b": done(0.2)}).violations == []


def test_replace_terminate_a_preempted_body_revoked_as_it_returned_ends_revoked() -> None:
    """docs/policies.rst: with lock_replace_terminate, the newer execution revokes the preempted
    one with terminate=True, and the state stored is REVOKED, not the Skipped. The SIGTERM can
    reach its pool process just after the body returned, before the execution ended (seed
    353802103 on MySQL: the body returned at .981, "Terminating" at .981, REVOKED)."""
    sends = [send(0, "a", config=TERMINATING), send(1, "b", 0.1, config=TERMINATING)]
    bodies = [body("a", 0, 0.3, 1, TERMINATING), body("b", 0.1, 0.5, 2, TERMINATING, seq=1)]
    revoked = Outcome("REVOKED", kind="exception", exception="TaskRevokedError", date_done=0.3)
    assert judge(sends, bodies, {"a": revoked, "b": done(0.5)}).violations == []
    # Without lock_replace_terminate nothing revokes it: it ends replaced
    plain = [body("a", 0, 0.3, 1, REPLACING), body("b", 0.1, 0.5, 2, REPLACING, seq=1)]
    plain_sends = [send(0, "a", config=REPLACING), send(1, "b", 0.1, config=REPLACING)]
    assert rules(judge(plain_sends, plain, {"a": revoked, "b": done(0.5)})) == ["replaced"]


def test_replace_terminate_a_preemptor_revoked_before_its_body_started_is_documented() -> None:
    """With lock_replace_terminate, an execution that took the key over can itself be preempted
    and terminated before its body starts (seed 353802103 on MySQL): the probe never sees it
    hold the key. The execution it replaced names it (and it ended REVOKED), or, ending before
    its renewer noticed, finds a later holder at its release and ends as its body did."""
    revoked = Outcome("REVOKED", kind="exception", exception="TaskRevokedError", date_done=0.19)
    sends = [send(0, "a", config=TERMINATING), send(1, "m", 0.1, config=TERMINATING),
             send(2, "b", 0.15, config=TERMINATING)]  # fmt: skip
    bodies = [body("a", 0, 0.3, 1, TERMINATING), body("b", 0.2, 0.5, 3, TERMINATING, seq=2)]
    named = {"a": skipped(0.3, "replaced", "m"), "m": revoked, "b": done(0.5)}
    assert judge(sends, bodies, named).violations == []
    returned = {"a": done(0.3), "m": revoked, "b": done(0.5)}
    report = judge(sends, bodies, returned)
    assert report.violations == []
    assert any("revoked before its body started" in d for d in report.documented)
    # Without a revoked execution between them, the return is a violation, as it is when the
    # named execution did not end REVOKED
    assert rules(judge(sends, bodies, {**returned, "m": done(0.4)})) == ["replaced"]
    assert "replaced" in rules(judge(sends, bodies, {**named, "m": Outcome("PENDING")}))


def test_replace_a_skip_naming_a_newer_execution_that_never_ran_is_a_violation() -> None:
    sends = [send(0, "a", config=REPLACING)]
    report = judge(sends, [body("a", 0, 0.3, 1, REPLACING)], {"a": skipped(0.3, "replaced", "z")})
    assert rules(report) == ["replaced"]


def test_replace_a_retried_attempt_that_stood_aside_for_a_newer_execution_is_no_violation() -> None:
    sends = [send(0, "a", config=REPLACING), send(1, "b", 0.1, config=REPLACING)]
    bodies = [body("a", 0, 0.05, 1, REPLACING, how="retry"),
              body("b", 0.1, 0.6, 2, REPLACING, seq=1)]  # fmt: skip
    outcomes = {"a": skipped(0.5, "replaced", "b"), "b": done(0.6)}
    assert judge(sends, bodies, outcomes).violations == []


def test_latest_a_follow_up_superseded_by_a_later_call_that_ran_is_no_violation() -> None:
    sends = [send(0, "a", config=LATEST), send(1, "b", 0.1, config=LATEST),
             send(2, "c", 0.2, config=LATEST)]  # fmt: skip
    bodies = [body("a", 0, 0.5, 1, LATEST), body("c", 0.9, 1.0, 2, LATEST, seq=2)]
    outcomes = {"a": done(0.5), "b": skipped(0.6, "superseded", "c"), "c": done(1.0)}
    assert judge(sends, bodies, outcomes).violations == []
    # Superseded by a send whose body never ran, and the burst's last send never ran
    lost = {"a": done(0.5), "b": skipped(0.6, "superseded", "c"), "c": Outcome("PENDING")}
    assert {"superseded", "last-runs"} <= set(rules(judge(sends, bodies[:1], lost)))


def test_a_fence_that_does_not_grow_is_a_violation() -> None:
    bodies = [body("a", 0, 1, 5), body("b", 2, 3, 5), body("c", 4, 5, 9)]
    assert rules(judge([], bodies, {})) == ["fences"]


def test_starts_closer_than_the_rate_interval_are_a_violation() -> None:
    spaced = [body("a", 0, 0.1, 1, LIMITED), body("b", 0.5, 0.6, 2, LIMITED)]
    assert judge([], spaced, {}).violations == []
    close = [body("a", 0, 0.1, 1, LIMITED), body("b", 0.3, 0.4, 2, LIMITED)]
    assert rules(judge([], close, {})) == ["rate"]


def test_starts_the_store_clock_spaced_are_no_violation_when_a_stall_delayed_the_first_body() -> (
    None
):
    """Issue 37 (seed 530434469, MySQL, coalescing with ``lock_rate = "2/s"``): a stalled link
    held the first body back after its acquire, so the bodies started 0.319 s apart. The rate
    is promised by the store's clock (docs/limits.rst), which the fences carry (microseconds)."""
    clock = 1_800_000_000_000_000
    delayed = [body("a", 0.181, 0.3, clock, LIMITED), body("b", 0.5, 0.6, clock + 500_000, LIMITED)]
    assert judge([], delayed, {}).violations == []
    # Closer by the store's clock too: a violation
    close = [body("a", 0.181, 0.3, clock, LIMITED), body("b", 0.5, 0.6, clock + 319_000, LIMITED)]
    assert rules(judge([], close, {})) == ["rate"]


# -- the checker: named limits ---------------------------------------------------------------


def taking(tid: str, start: float, end: float | None, config: Config = POOLED, *,
           key: str = "k", acquired: float | None = None, cost: int = 1,
           charges: Sequence[Charge] = (), retries: int = 0, fence: int | None = None,
           ) -> Body:  # fmt: skip
    """A body of ``config`` that took its named limits' units (``cost``: what a callable cost
    answered), its acquire sent ``acquired`` (by default 5 ms before its start), its fence the
    store's clock then (unless given); with no ``end``, killed."""
    fence = int(start * 1_000_000) + 1 if fence is None else fence
    how = None if end is None else "return"
    taken = Body(tid, retries, 0, key, config.name, 1, fence, start, end, how)
    taken.acquired = start - 0.005 if acquired is None else acquired
    taken.units = config.costs(cost)
    taken.charges = list(charges)
    return taken


def test_more_units_of_a_concurrency_held_at_once_than_its_size_is_a_violation() -> None:
    """docs/sharing-limits.rst: never more units held than a concurrency's size. "pool" has 2:
    two bodies of two keys, or of two tasks naming it, may hold it at once; a third may not."""
    two = [taking("a", 0, 1), taking("b", 0.5, 1.5, key="k2")]
    assert judge([], two, {}).violations == []
    # Another task naming the limit, on the same store, holds its third unit: over
    over = [*two, taking("c", 0.7, 0.8, RAISING)]
    report = judge([], over, {})
    assert rules(report) == ["limit-held"]
    assert "3 units held at once at 0.700, over the size 2" in report.violations[0]
    assert "limit 'pool'" in report.violations[0]
    # A body that had recorded its end had given its units back (or was about to): no overlap
    assert judge([], [*two, taking("c", 1.01, 1.2, RAISING)], {}).violations == []
    # Each store keeps its own limits
    elsewhere = Config(RAISING.index, RAISING.options, "sqlite")
    history = History(42, {c.name: c for c in (POOLED, elsewhere)}, [], over, {}, [])
    assert check(history).violations == []


def test_a_killed_body_holds_its_units_only_as_far_as_the_ledger_shows() -> None:
    """A body with no end (its process killed) is counted at its start only: the worker gives
    its units back once it sees the process gone, or its lease ends."""
    killed = [
        taking("a", 0, None),
        taking("b", 0.1, 0.5, key="k2"),
        taking("c", 0.2, 0.6, key="k3"),
    ]
    assert judge([], killed, {}).violations == []
    ended = [taking("a", 0, 0.3), *killed[1:]]
    assert rules(judge([], ended, {})) == ["limit-held"]


def test_units_over_a_concurrency_of_a_body_that_lost_its_lease_are_documented() -> None:
    lost = taking("a", 0, 1)
    lost.lost = True
    report = judge([], [lost, taking("b", 0.5, 1.5, key="k2"), taking("c", 0.7, 0.8, key="k3")], {})
    assert report.violations == []
    assert any("lost its lease" in d for d in report.documented)


def test_more_units_of_a_rate_started_in_a_window_than_it_allows_is_a_violation() -> None:
    """docs/sharing-limits.rst: never more units started in a window than a rate allows, by
    the store's clock. "budget" allows 6 units per 2 s; each start is taken between its
    acquire and its recorded start."""
    six = [taking("a", 0, 0.1, BUDGETED, cost=3), taking("b", 1.0, 1.1, BUDGETED, cost=3)]
    assert judge([], six, {}).violations == []
    seven = [*six, taking("c", 1.9, 2.0, BUDGETED, cost=1, key="k2")]
    report = judge([], seven, {})
    assert rules(report) == ["limit-rate"]
    assert "7 units started within" in report.violations[0]
    # A window later: the first start left it
    assert judge([], [*six, taking("c", 2.1, 2.2, BUDGETED, cost=1)], {}).violations == []
    # Within the period by the bodies' starts, but the first start may have been taken more
    # than a period before the last (a stalled link held its body back): not judged
    late = [taking("a", 0.5, 0.6, BUDGETED, cost=3, acquired=-0.2), *seven[1:]]
    assert judge([], late, {}).violations == []
    # Tasks of one store share the rate; "pool+budget" costs 2 units of it
    shared = [*six, taking("c", 1.9, 2.0, RAISING)]
    assert rules(judge([], shared, {})) == ["limit-rate"]


def test_a_charged_start_counts_its_charge_once_written_and_its_estimate_until_then() -> None:
    """charge: the start counts its real units from the call on, at its start's time. A take
    that may have come after the charge was written is judged with the smaller of the two."""
    back = Charge("budget", 0, 0.05, 0.06)  # the first start taken back, before the others
    taken_back = [
        taking("a", 0, 0.1, BUDGETED, cost=3, charges=[back]),
        taking("b", 1.0, 1.1, BUDGETED, cost=3),
        taking("c", 1.9, 2.0, BUDGETED, cost=3, key="k2"),
    ]
    assert judge([], taken_back, {}).violations == []
    # Charged only after the last start: its estimate counted
    after = Charge("budget", 0, 1.95, 1.96)
    late = [taking("a", 0, 2.1, BUDGETED, cost=3, key="k0", charges=[after]), *taken_back[1:]]
    assert rules(judge([], late, {})) == ["limit-rate"]
    # A charge above the estimate, written before the later takes: they had to count it
    more = Charge("budget", 5, 0.05, 0.06)
    raised = [taking("a", 0, 0.1, BUDGETED, cost=1, charges=[more]),
              taking("b", 1.0, 1.1, BUDGETED, cost=2)]  # fmt: skip
    assert rules(judge([], raised, {})) == ["limit-rate"]
    # ... but not a charge that may have come after them (no take saw it), nor one that failed
    maybe = Charge("budget", 5, 0.5, 1.0)
    failed = Charge("budget", 5, 0.05, 0.06, error="BackendUnavailable")
    for charge in (maybe, failed):
        raised[0].charges = [charge]
        assert judge([], raised, {}).violations == [], charge


def test_a_redelivered_copy_counts_its_attempts_start_once() -> None:
    """A redelivered copy (acks_late, its pool process killed) takes with its attempt's token:
    the store finds that start counted and adds none."""
    copies = [taking("a", 0, None, BUDGETED, cost=3), taking("a", 0.5, 0.6, BUDGETED, cost=3),
              taking("b", 1.0, 1.1, BUDGETED, cost=3, key="k2")]  # fmt: skip
    assert judge([], copies, {}).violations == []
    copies[1].retries = 1  # another attempt: a start of its own
    assert rules(judge([], copies, {})) == ["limit-rate"]
    # The copy's charge is its attempt's start's: taken back before the third start
    copies[1].retries = 0
    copies[1].charges = [Charge("budget", 0, 0.55, 0.56)]
    copies.append(taking("c", 1.5, 1.6, BUDGETED, cost=3, key="k3"))
    assert judge([], copies, {}).violations == []


def test_a_refusal_for_want_of_room_names_a_limit_of_its_task_and_is_its_policys() -> None:
    """docs/sharing-limits.rst, "No room": "skip" ends Skipped(reason="limit", limit=name),
    "raise" TaskLocked with the limit; "lock_limit" names the key's own with lock_cost."""

    def refused(config: Config, outcome: Outcome) -> list[str]:
        return rules(judge([send(0, "a", config=config)], [], {"a": outcome}))

    def skip(limit: str) -> Outcome:
        return Outcome("SUCCESS", kind="skipped", reason="limit", date_done=1.0, limit=limit)

    def locked(limit: str) -> Outcome:
        return Outcome("FAILURE", kind="exception", exception="TaskLocked", date_done=1.0,
                       limit=limit)  # fmt: skip

    assert refused(POOLED, skip("pool")) == []
    assert refused(RAISING, locked("budget")) == []
    assert refused(COSTLY, skip("lock_limit")) == []
    assert refused(POOLED, skip("budget")) == ["limit-refusal"]  # a limit it does not take
    assert refused(RAISING, skip("pool")) == ["limit-refusal"]  # not its policy's
    assert refused(POOLED, locked("pool")) == ["limit-refusal"]
    assert refused(CONFIG, skip("lock_limit")) == ["limit-refusal"]


def test_a_named_limits_hold_the_idle_store_still_holds_is_a_violation() -> None:
    """docs/sharing-limits.rst: units come back on every ending; a hold the store could not
    drop (a give that failed, a take whose reply a fault lost) ends with its lease."""
    hold = Residue("test:x:%limit:pool", "limit hold", "a", "redis: 1 units", "redis")
    history = History(42, {POOLED.name: POOLED}, [send(0, "a", config=POOLED)],
                      [taking("a", 0, 0.1)], {"a": done(0.1)}, [hold], observed=20.0)  # fmt: skip
    assert rules(check(history)) == ["idle"]
    # A fault of the workers' link to that store less than one lease before: documented
    history.faults = [Fault("store-cut-at-run", 16.0, 16.0, "run", ("redis",))]
    report = check(history)
    assert report.violations == []
    assert any("a fault of the workers' link to its store" in d for d in report.documented)
    # ... not one of another store's link, nor one more than a lease before
    history.faults = [Fault("store-cut-at-run", 16.0, 16.0, "run", ("postgresql",)),
                      Fault("store-cut-at-run", 10.0, 10.0, "run", ("redis",))]  # fmt: skip
    assert rules(check(history)) == ["idle"]


def test_a_body_retry_that_spent_its_lock_retries_on_a_full_limit_is_documented() -> None:
    """docs/sharing-limits.rst, "No room": a retried attempt that finds no room retries
    whatever the policy, spending lock_retry_max; then TaskLocked names the limit (seed
    1733704974 on SQLite: "gate" kept full by two tasks' bursts for 28 s). Skipped for want of
    room, the retry it asked for would be lost: a violation, whatever the policy."""
    retried = [taking("a", 0, 0.1), taking("b", 0.2, 0.3, key="k2")]
    retried[0].how = "retry"
    spent = Outcome("FAILURE", kind="exception", exception="TaskLocked", date_done=20.0,
                    limit="pool")  # fmt: skip
    report = judge([send(0, "a", config=POOLED)], retried, {"a": spent, "b": done(0.3)})
    assert report.violations == []
    assert any("spent its lock retries waiting for room in limit 'pool'" in d
               for d in report.documented)  # fmt: skip
    lost = Outcome("SUCCESS", kind="skipped", reason="limit", date_done=0.5, limit="pool")
    report = judge([send(0, "a", config=POOLED)], retried, {"a": lost, "b": done(0.3)})
    assert sorted(rules(report)) == ["limit-refusal", "retry-runs"]


def test_lock_cost_counts_the_keys_executions_in_units() -> None:
    """lock_limit 3 with lock_cost 2: one execution of a key at a time (2 of its 3 units)."""
    one_at_a_time = [body("a", 0, 1, 1, COSTLY), body("b", 1.1, 1.5, 2, COSTLY)]
    assert judge([], one_at_a_time, {}).violations == []
    two = [body("a", 0, 1, 1, COSTLY), body("b", 0.5, 1.5, 2, COSTLY)]
    assert rules(judge([], two, {})) == ["exclusion"]


def test_a_fence_is_judged_against_the_holders_that_started_before_its_acquire() -> None:
    """An execution takes its named limits' units between its acquire and its body's start: a
    body whose take a stalled link held back starts after a later holder of its key, with the
    smaller fence. Bodies that started before its acquire was sent still have smaller ones."""
    held_back = taking("a", 1.0, 1.2, POOLED, acquired=0.1, fence=5)
    later = taking("b", 0.3, 0.5, POOLED, fence=9)
    assert judge([], [later, held_back], {}).violations == []
    assert rules(judge([], [later, taking("a", 1.0, 1.2, POOLED, fence=5)], {})) == ["fences"]


def test_what_the_idle_store_still_holds_is_a_violation_unless_a_killed_producer_left_it() -> None:
    residue = Residue("test:x:interactions.c0:k", "reservation", "a", "token a:0:-:0:reserved")
    report = judge([send(0, "a")], [body("a", 0, 0.1, 1)], {"a": done(0.1)}, [residue])
    assert rules(report) == ["idle"]
    killed = send(0, "a", t_after=None, returned=None)
    excused = judge([killed], [], {}, [residue])
    assert excused.violations == []
    assert len(excused.documented) == 2


def test_a_body_completing_twice_and_an_unexplained_failure_are_violations() -> None:
    twice = [body("a", 0, 0.1, 1), body("a", 1, 1.1, 2)]
    assert "once" in rules(judge([send(0, "a")], twice, {"a": done(1.1)}))
    failed = Outcome("FAILURE", kind="exception", exception="KeyError", date_done=1)
    assert rules(judge([send(0, "a")], [body("a", 0, 0.1, 1)], {"a": failed})) == ["failures"]


# -- what the idle store still holds, store by store -----------------------------------------


@pytest.mark.parametrize(
    "store",
    [pytest.param(s, marks=[pytest.mark.stores] if s in ("postgresql", "mysql") else [])
     for s in STORES],
)  # fmt: skip
def test_the_idle_store_listing_reads_every_store_alike(
    store: str, redis_base_url: str, tmp_path: Path
) -> None:
    """Locks (with their slots), open debounce windows, follow-up claims, rate records and
    the holds of named limits' concurrencies are listed, on every store; a closed window (kept
    until it expires, by design) and a named rate's starts (spent, whatever the executions do)
    are not."""
    import uuid

    from singletask.backends import backend_from_url
    from singletask.backends.base import Units
    from singletask.protocol.limits import limit_key

    from ...servers import drop_sql_table
    from .runner import Group, _residues, _store_url

    if store in ("postgresql", "mysql") and (problem := sql_problem(store)):
        unavailable(problem)
    url, table = _store_url(servers(redis_base_url), store, tmp_path)
    prefix = f"test:{uuid.uuid4().hex[:8]}:"
    key = f"{prefix}interactions.c0:"
    backend = backend_from_url(url)
    try:
        # Given a key held (its rate record written), a window open, one closed, a claim
        backend.acquire_slot(f"{key}held", 2, "a:0:-:0", 30, interval=20)
        backend.debounce(f"{key}open", "w", 30)
        backend.debounce(f"{key}closed", "c", 30)
        backend.debounce_take(f"{key}closed", "c")
        backend.claim_next(f"{key}claim", "n", 30)
        # ... a named limit's concurrency held, and a start of its rate (it counts for its
        # period whatever the execution does: not listed)
        pool, budget = limit_key(prefix, "pool"), limit_key(prefix, "budget", rate=True)
        taken = [Units(pool, 2, 1), Units(budget, 6, 2, 2.0)]
        assert backend.take_units("t:0:-:0", 30, taken, meta={"task_id": "t"}).taken
        # When the run's keys are listed
        found = {(r.kind, r.task_id, r.key.strip("{").removeprefix(key).split("}")[0])
                 for r in _residues(Group(store, [], url, "q", table), prefix)}  # fmt: skip
    finally:
        backend.close()
        if table is not None:
            drop_sql_table(store, table)
    # Then each live record is there once, and the closed window is not
    assert found == {
        ("lock", None, "held"), ("rate record", None, "held"), ("open window", "w", "open"),
        ("follow-up claim", "n", "claim"), ("limit hold", "t", pool),
    }  # fmt: skip


# -- the runs --------------------------------------------------------------------------------


def verdict(report: Report, seconds: float, history: History | None = None) -> None:
    stores = collections.Counter(c.store for c in (history.configs.values() if history else ()))
    on = "; stores: " + ", ".join(f"{s} {n}" for s, n in stores.items()) if stores else ""
    line = f"{report.summary()}{on} in {seconds:.0f}s"
    print(line)
    out = os.environ.get("SINGLETASK_INTERACTIONS_REPORT")
    if out:
        with open(out, "a", encoding="utf-8") as file:
            file.write("\n".join([line, *(f"  VIOLATION: {v}" for v in report.violations)]) + "\n")
    if report.violations:
        shown = "\n  ".join(report.violations[:30])
        more = len(report.violations) - 30
        pytest.fail(
            f"{line}\n  {shown}" + (f"\n  ... and {more} more" if more > 0 else "")
            + f"\nreplay: SINGLETASK_INTERACTIONS_SEED={report.seed}",
            pytrace=False,
        )  # fmt: skip


def servers(redis_base_url: str) -> Servers:
    if not redis_base_url:
        unavailable("the interaction campaign needs the session's Redis")
    return Servers(redis_base_url)


def _run(redis_base_url: str, tmp_path: Path, settings: Settings) -> None:
    import time

    scenario = os.environ.get("SINGLETASK_INTERACTIONS_SCENARIO") or None
    if scenario:
        settings.scenario = scenario
    started = time.monotonic()
    report, history = run(servers(redis_base_url), campaign_seed(), settings, tmp_path)
    verdict(report, time.monotonic() - started, history)


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.filterwarnings(*CLIENT_GARBAGE)
def test_short_interactions(redis_base_url: str, tmp_path: Path) -> None:
    """One round of two drawn configurations, on the session's Redis."""
    _run(redis_base_url, tmp_path, Settings(configs=2, rounds=1, sends_per_key=6, keys=2))


def long_seconds() -> float:
    return float(os.environ.get("SINGLETASK_INTERACTIONS_SECONDS", "180"))


def long_stores() -> tuple[str, ...]:
    """The long run's stores (SINGLETASK_INTERACTIONS_STORES, comma-separated; every store of
    space.STORES by default). A SQL server that does not answer fails the run in CI; elsewhere
    its store is left out, and the report line's stores say so."""
    named = os.environ.get("SINGLETASK_INTERACTIONS_STORES", "").strip()
    stores = tuple(s.strip() for s in named.split(",") if s.strip()) if named else STORES
    unknown = set(stores) - set(STORES)
    assert not unknown, f"SINGLETASK_INTERACTIONS_STORES: not stores of the campaign: {unknown}"
    kept = []
    for store in stores:
        problem = sql_problem(store) if store in ("postgresql", "mysql") else None
        if problem and CI:
            unavailable(problem)
        if problem:
            print(f"interactions: {store} left out: {problem}")
        else:
            kept.append(store)
    return tuple(kept)


@pytest.mark.interactions
@pytest.mark.timeout(1800)
@pytest.mark.filterwarnings(*CLIENT_GARBAGE)
def test_long_interactions(redis_base_url: str, tmp_path: Path) -> None:
    """Rounds for SINGLETASK_INTERACTIONS_SECONDS over 12 drawn configurations taking turns on
    the stores (Redis, PostgreSQL, MySQL, SQLite; a worker for each), with a producer killed
    mid-burst and the workers' store links cut and stalled (SQLite has no link)."""
    _run(redis_base_url, tmp_path, Settings(
        configs=12, seconds=long_seconds(), sends_per_key=7, keys=2, configs_per_round=3,
        killed_producer=True, run_faults=True, quiet_bound=40.0, stores=long_stores(),
    ))  # fmt: skip


def test_a_failed_publish_whose_undo_met_a_store_fault_is_documented() -> None:
    """docs/limits.rst: the store unreachable between the publish and the undo leaves the
    window naming the unsent send (a WARNING says so) until a later send or its expiry."""
    first = send(0, "a", config=DEBOUNCED)
    failed = send(1, "f", 0.2, config=DEBOUNCED, error="EncodeError", returned=None,
                  fault="store-down-at-send+encode")  # fmt: skip
    report = judge([first, failed], [], {"a": skipped(1.5, "debounced", "f")})
    assert report.violations == []
    assert report.documented
