"""Fair turns on a real prefork worker: one tenant floods a shared limit, and the others'
syncs start in their turn, not after the flood (docs/fair-turns.rst).

Tenant ``a`` sends 40 syncs at once, ``b`` and ``c`` 5 each right after; every sync takes one
unit of a limit of 1 and retries (``lock_policy = "retry"``) until it has room. The worker has
2 pool processes, more than the limit's room, as a fleet has: with no more processes than
room, nothing would wait, and the broker's order alone would decide. The order the
bodies started in is read from the probe's events (tasks_shared.py ``sync``). The same
experiment, with fair turns on and off in one run, with figures: bench/suites/turns.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from .app import TURNS_ENV
from .conftest import ON_REDIS_BROKER, Cluster
from .shared_limits import most_held
from .tasks_policies import gate_key
from .tasks_shared import PREFIX

pytestmark = [pytest.mark.e2e, ON_REDIS_BROKER]

#: Generous bound for the whole flood: 50 syncs of 0.2 s, one at a time, with retries.
BOUND = 120.0

FLOOD, FEW = 40, 5


@pytest.fixture
def label(cluster: Cluster) -> Iterator[str]:
    name = cluster.label()
    yield name
    cluster.probe.client.rpush(gate_key(name), *["open"] * 20)


def passed_before(order: Sequence[str], tenant: str, flooder: str = "a") -> int:
    """How many of ``flooder``'s syncs started before ``tenant``'s last one."""
    last = max(i for i, t in enumerate(order) if t == tenant)
    return sum(1 for t in order[:last] if t == flooder)


def jain_while_all_wait(
    starts: Sequence[dict[str, Any]], sent: dict[str, int], since: float
) -> float:
    """Jain's fairness index (sum x)^2 / (n sum x^2) of the starts x per tenant while every
    tenant has a sync waiting: from the first start after the last send (``since``) to the
    start that leaves one of them with none."""
    left = dict(sent)
    counts = dict.fromkeys(sent, 0)
    for start in starts:
        if min(left.values()) == 0:
            break
        tenant = start["tenant"]
        left[tenant] -= 1
        if start["t"] >= since:
            counts[tenant] += 1
    values = list(counts.values())
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def test_the_tenants_waiting_for_a_flooded_limit_take_turns(cluster: Cluster, label: str) -> None:
    # Given a limit of 1 that tenant a floods with 40 syncs, and b and c send 5 each after
    task = cluster.task(PREFIX + "sync")
    sent = {"a": FLOOD, "b": FEW, "c": FEW}
    results: list[Any] = [task.apply_async((label, "a")) for _ in range(FLOOD)]
    results += [task.apply_async((label, t)) for _ in range(FEW) for t in ("b", "c")]
    all_sent = time.time()

    # When every sync has run
    assert sorted(r.get(timeout=BOUND) for r in results) == sorted(
        t for t, n in sent.items() for _ in range(n)
    )

    # Then each sync started once, the limit was never exceeded, and b's and c's syncs did
    # not wait for a's flood: they started in turn with a's
    events = cluster.probe.events(label)
    starts = [e for e in events if e["event"] == "start"]
    assert sorted(e["task_id"] for e in starts) == sorted(r.id for r in results)
    assert most_held(events) <= 1
    order = [e["tenant"] for e in starts]
    before = {t: passed_before(order, t) for t in ("b", "c")}
    fairness = jain_while_all_wait(starts, sent, all_sent)
    log = cluster.worker.log.read_text(errors="replace")
    refusals = sum(1 for line in log.splitlines() if "retries in" in line and label in line)
    makespan = max(e["t"] for e in events) - min(e["t"] for e in starts)
    print(f"\nFAIR-TURNS {TURNS_ENV}={os.environ.get(TURNS_ENV, '1')} before_b={before['b']} "
          f"before_c={before['c']} jain={fairness:.3f} takes_per_start="
          f"{(refusals + len(starts)) / len(starts):.2f} makespan={makespan:.2f} "
          f"order={''.join(order)}")  # fmt: skip
    if os.environ.get(TURNS_ENV, "1") == "0":
        return  # fair turns off: the bench's comparison, nothing promised
    # Round robin lets about 5 of a's start before b's and c's last, plus the few that found
    # room before b and c sent anything; without turns, most of a's 40 start first.
    assert max(before.values()) <= 15, order
    assert fairness >= 0.9, order
