"""The fault campaign: the store's promise checked over whole histories, under faults.

Workers (threads, and processes where the store is shared across processes) take, renew,
check and release random keys while a seeded schedule delays, stalls and cuts their links,
pauses their processes, restarts the servers the tests own and fails Redis over. Then the
checker (tests/campaigns/faults/history.py) asserts, over every worker's history: no two believed
holding intervals of one key overlap (no more than N of a key taken with ``acquire_slot`` and a
limit of N, on the stores that keep holder slots), fences strictly increase between successive
holders (across all the slots of a key),
every error a caller saw is a ``SingletaskError`` with its cause chained, and no call blocked
longer than the store's timeouts allow.

A short run per store (``python -m pytest -m campaign -k short_campaign``, 3 seconds of faults
each) checks the campaign itself in under a minute; the long one is a step of .ci/run:
``python -m pytest -m campaign -k long_campaign -n 2 --dist load`` (two stores at a time, each on
servers of its own; ``SINGLETASK_CAMPAIGN_SECONDS`` of faults per store, 75 by default). Neither
is in the README's command, which runs the checker's own tests above.
Every run prints its seed; ``SINGLETASK_CAMPAIGN_SEED=<seed>`` replays its fault schedule.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .history import CallError, Fault, Hold, Report, check
from .runner import campaign_seed, run_campaign
from .stores import STORES, cluster_env, sentinel_env

#: Seconds of faults per store in a short run.
SHORT = 3.0


def long_seconds() -> float:
    return float(os.environ.get("SINGLETASK_CAMPAIGN_SECONDS", "75"))


def verdict(store: str, seed: int, report: Report) -> None:
    """Print the run's figures (and append them to ``SINGLETASK_CAMPAIGN_REPORT``, if set, in
    one write: the stores' runs may go on in parallel); fail with every violation and the seed
    that replays the schedule."""
    line = report.summary(store, seed)
    print(line)
    out = os.environ.get("SINGLETASK_CAMPAIGN_REPORT")
    if out:
        entry = [line]
        entry += [f"  documented loss: {loss}" for loss in report.documented_losses]
        entry += [f"  VIOLATION: {violation}" for violation in report.violations]
        with open(out, "a", encoding="utf-8") as file:
            file.write("\n".join(entry) + "\n")
    if report.violations:
        shown = "\n  ".join(report.violations[:30])
        more = len(report.violations) - 30
        pytest.fail(
            f"{line}\n  {shown}"
            + (f"\n  ... and {more} more" if more > 0 else "")
            + f"\nreplay: SINGLETASK_CAMPAIGN_SEED={seed}",
            pytrace=False,
        )


# -- the checker, on histories written by hand ---------------------------------------------


def hold(worker: str, start: float, end: float, fence: int, key: str = "k") -> Hold:
    return Hold(key, worker, start - 0.01, start, end, fence, ttl=1.0)


def judge(holds: list[Hold], faults: list[Fault] | None = None, **kwargs: object) -> Report:
    return check(holds, kwargs.get("errors", []), [], faults or [], operations=1, block_bound=5)  # type: ignore[arg-type]


def test_successive_holders_with_growing_fences_pass() -> None:
    report = judge([hold("a", 0, 1, 10), hold("b", 1.5, 2, 11), hold("a", 3, 4, 12)])
    assert report.violations == []


def test_overlapping_believed_intervals_are_a_violation_naming_key_intervals_and_fences() -> None:
    report = judge([hold("a", 0, 1.2, 10), hold("b", 1.0, 2, 11)])
    assert len(report.violations) == 1
    assert "key 'k': believed intervals overlap by 0.200000s" in report.violations[0]
    assert "a [0.000000, 1.200000] (acquire sent at -0.010000) fence=10" in report.violations[0]
    assert "b [1.000000, 2.000000] (acquire sent at 0.990000) fence=11" in report.violations[0]


def test_an_interval_inside_a_longer_one_is_found() -> None:
    report = judge([hold("a", 0, 5, 1), hold("b", 1, 2, 2), hold("c", 3, 4, 3)])
    assert len(report.violations) == 2


def test_a_fence_that_does_not_grow_between_successive_holders_is_a_violation() -> None:
    report = judge([hold("a", 0, 1, 11), hold("b", 2, 3, 11), hold("c", 4, 5, 10)])
    assert len(report.violations) == 2
    assert "fence did not increase" in report.violations[0]


def test_keys_are_judged_apart() -> None:
    report = judge([hold("a", 0, 2, 5, key="x"), hold("b", 1, 3, 1, key="y")])
    assert report.violations == []


def test_an_overlap_across_a_lossy_fault_is_a_documented_loss_within_one_lease() -> None:
    restart = Fault("restart", "memcached", 1.0, 1.5, lossy=True)
    excused = judge([hold("a", 0, 2.0, 1), hold("b", 1.6, 3, 2)], [restart])
    assert excused.violations == []
    assert len(excused.documented_losses) == 1
    # The old holder still believed more than a lease after the fault: not excused.
    late = judge([hold("a", 0, 2.6, 1), hold("b", 1.6, 3, 2)], [restart])
    assert len(late.violations) == 1
    # A lossless fault excuses nothing.
    cut = Fault("cut", "link-0", 1.0, 1.0)
    assert len(judge([hold("a", 0, 2.0, 1), hold("b", 1.6, 3, 2)], [cut]).violations) == 1


def test_errors_must_be_singletask_errors_chaining_the_error_they_were_raised_for() -> None:
    def error(type_: str, singletask: bool, cause: str | None, context: str | None) -> CallError:
        backend = type_.startswith("singletask.exceptions.Backend")
        return CallError("w", "acquire", type_, singletask, backend, cause, context, "boom")

    errors = [
        error("singletask.exceptions.BackendTimeout", True, "TimeoutError", "TimeoutError"),
        error("singletask.exceptions.LockLost", True, None, None),
        # A condition the store itself decided (no driver error behind it): nothing to chain.
        error("singletask.exceptions.BackendUnavailable", True, None, None),
        error("redis.exceptions.ReadOnlyError", False, None, None),
        # Raised while handling a driver error without `from` (or `from None`): not chained.
        error("singletask.exceptions.BackendError", True, None, "ConnectionError"),
    ]
    report = judge([], errors=errors)
    assert len(report.violations) == 2
    assert "ReadOnlyError, not a SingletaskError" in report.violations[0]
    assert "while handling ConnectionError without chaining it" in report.violations[1]


def test_a_request_in_flight_while_the_holder_finishes_is_no_overlap() -> None:
    """The belief starts when the reply says "acquired": a rival's acquire sent while the holder
    still works, and granted after its release, overlaps nothing."""
    holder = Hold("k", "a", 0.0, 0.01, 1.0, 1, ttl=2.0)
    rival = Hold("k", "b", 0.9, 1.05, 2.0, 2, ttl=2.0)
    assert judge([holder, rival]).violations == []


def slot_hold(
    worker: str, slot: int, start: float, end: float, fence: int, sent: float | None = None
) -> Hold:
    """A hold of slot ``slot`` of the limit-3 key ``k``."""
    sent = start - 0.01 if sent is None else sent
    return Hold("k", worker, sent, start, end, fence, ttl=1.0, limit=3, slot=f"{{k}}:slot:{slot}")


def test_as_many_believed_holders_as_the_limit_pass() -> None:
    holds = [
        slot_hold("a", 0, 0, 2, 1),
        slot_hold("b", 1, 0.5, 2.5, 2),
        slot_hold("c", 2, 1, 3, 3),
        slot_hold("d", 0, 2, 4, 4),  # a's slot, after a stopped believing
    ]
    report = judge(holds)
    assert report.violations == []
    assert report.slot_holds == {3: 4}
    assert report.most_at_once == {3: 3}


def test_more_believed_holders_than_the_limit_are_a_violation() -> None:
    holds = [
        slot_hold("a", 0, 0, 2, 1),
        slot_hold("b", 1, 0.5, 2.5, 2),
        slot_hold("c", 2, 1, 3, 3),
        slot_hold("d", 0, 1.5, 4, 4),  # a fourth believer, in a's slot while a believes
    ]
    report = judge(holds)
    assert report.most_at_once == {3: 4}
    assert len(report.violations) == 2
    assert "key 'k': 4 believed holders at once, over its limit of 3" in report.violations[0]
    assert "d slot '{k}:slot:0' [1.500000, 4.000000]" in report.violations[0]
    overlap = "key 'k' slot '{k}:slot:0': believed intervals overlap by 0.500000s"
    assert overlap in report.violations[1]


def test_a_fence_going_backwards_across_slots_is_a_violation() -> None:
    holds = [
        slot_hold("a", 0, 0, 2, 5),
        slot_hold("b", 1, 0.5, 2.5, 3),  # sent after a's reply came: must be above 5
        slot_hold("c", 2, 1, 1.5, 6),
    ]
    report = judge(holds)
    assert len(report.violations) == 1
    backwards = "key 'k': fence did not increase across its slots: a slot '{k}:slot:0'"
    assert backwards in report.violations[0]
    assert "was granted before b slot '{k}:slot:1'" in report.violations[0]


def test_acquisitions_in_flight_together_may_take_fences_in_either_order() -> None:
    """Two acquires sent before either reply came: the store may have served either first."""
    holds = [slot_hold("a", 0, 0.2, 2, 8, sent=0.0), slot_hold("b", 1, 0.3, 2, 7, sent=0.1)]
    assert judge(holds).violations == []
    # ... but not one sent after the other's reply.
    late = [slot_hold("a", 0, 0.2, 2, 8, sent=0.0), slot_hold("b", 1, 0.3, 2, 7, sent=0.25)]
    assert len(judge(late).violations) == 1


# -- the runs ------------------------------------------------------------------------------


def run(store: str, tmp_path: Path, seconds: float, scale: int) -> None:
    seed = campaign_seed()
    with STORES[store](tmp_path, scale) as env:
        report = run_campaign(env, seed, seconds, tmp_path)
    verdict(store, seed, report)


@pytest.mark.campaign
@pytest.mark.timeout(90)
@pytest.mark.parametrize("store", sorted(STORES))
def test_short_campaign(store: str, tmp_path: Path) -> None:
    run(store, tmp_path, SHORT, scale=1)


@pytest.mark.campaign
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("store", sorted(STORES))
def test_long_campaign(store: str, tmp_path: Path) -> None:
    run(store, tmp_path, long_seconds(), scale=2)


def _sentinel(request: pytest.FixtureRequest, tmp_path: Path, seconds: float) -> None:
    deployment = request.getfixturevalue("redis_sentinel")
    seed = campaign_seed()
    with sentinel_env(tmp_path, 1, deployment) as env:
        report = run_campaign(env, seed, seconds, tmp_path)
    verdict("sentinel", seed, report)


@pytest.mark.deployments
@pytest.mark.timeout(180)
def test_short_campaign_sentinel(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    _sentinel(request, tmp_path, 3 * SHORT)


@pytest.mark.campaign
@pytest.mark.timeout(1800)
def test_long_campaign_sentinel(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    _sentinel(request, tmp_path, long_seconds())


@pytest.mark.campaign
@pytest.mark.timeout(1800)
def test_long_campaign_cluster(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Redis Cluster in the long run only: its failovers change the session's cluster, which
    the deployment tests of the same session share."""
    deployment = request.getfixturevalue("redis_cluster")
    seed = campaign_seed()
    with cluster_env(tmp_path, 1, deployment) as env:
        report = run_campaign(env, seed, long_seconds(), tmp_path)
    verdict("cluster", seed, report)
