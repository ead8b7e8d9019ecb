"""The campaign's two rules of fair turns (docs/fair-turns.rst), beside checker.py's.

* ``turn-order``: a waiting execution is passed over by another key's executions no more than
  the keys waiting ahead of it allow. Judged for the executions whose wait the ledger can
  follow (*clean waits*): a configuration with ``lock_policy = "retry"`` that names one limit
  (``"pool"`` or ``"budget"``) and takes nothing else in units (no ``lock_cost``, no
  ``lock_rate``); every refusal of the attempt by that limit (no holder named: its key was
  never held), each back within its ticket's *hold* of the one before (so the room kept for it
  never lapsed), one delivery of the attempt (a redelivered one's refusals mix with the first
  delivery's), and no fault of the workers' link to its store while it waited. Such an
  execution ``E`` of key ``g`` (weight ``w``, priority ``p``, ``u`` units) took its ticket at
  its first refusal ``t0``; its ticket finishes at most ``(K + u) / w`` after the line's
  virtual time then, ``K`` being the units of the attempts of its own key waiting before it.
  Another key ``h``'s takes after ``t0`` start at that virtual time or later, each
  ``units / w_h`` on, and are served before ``E`` only while their tag is at most ``E``'s:
  the units of ``h``'s bodies that came into the line after ``t0`` (their first refusal, or
  their take when never refused) and started before ``E``'s last refusal (served while ``E``
  had no room) add up to at most ``w_h * ((K + u) / w + max(0, p_h - p))``, plus one of
  ``h``'s takes (two takes a few milliseconds apart are in no order the probe can tell).
* ``tickets-end``: every ticket ends: once the fleet is idle, a ticket still in a line belongs
  to an execution that stopped waiting without being served (its lease ends it), never to one
  whose body started after the ticket was last renewed and before its lease ended (a start
  uses its ticket; one that starts later, back from store retries, finds it ended), nor to one
  that ended ``TaskLocked`` naming a limit (lock retries spent: it gives its tickets back), and
  no ticket outlives its lease.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from singletask.conf.limits import check_spec
from singletask.execution.units import HOLD_SLACK, LEASE_COUNTDOWNS, LEASE_SLACK

from .space import FIXED, LIMITS, Config

if TYPE_CHECKING:
    from .checker import Body, _Judge

__all__ = ["Refusal", "Ticket", "lease_of", "tickets_end", "turn_order"]

#: The named limits of a clean wait (:mod:`space`'s ``NAMED``: the ones naming one limit).
SINGLE = ("pool", "budget")
#: Seconds of slack between what two processes record (the probe's order of two events this
#: close says nothing of the order of their store steps).
TIE = 0.05
#: The countdown of every campaign task (``lock_retry_countdown``), its ticket's hold and lease.
COUNTDOWN = float(FIXED["lock_retry_countdown"])
HOLD = 1.25 * COUNTDOWN + HOLD_SLACK
#: A refused attempt back within this of the one before never let its kept room lapse.
BACK_IN_TIME = HOLD - 0.25


@dataclass
class Refusal:
    """An execution refused (``lock_conflict``, recorded in the worker): its attempt, its key
    argument, the holder it met (None: a limit without room, or a rate), the policy's action."""

    task: str
    task_id: str
    retries: int
    key: str | None
    holder: str | None
    action: str
    t: float

    @property
    def attempt(self) -> tuple[str, int]:
        return (self.task_id, self.retries)


def lease_of(limit: str, rate: bool) -> float:
    """How long a ticket of the campaign's tasks lasts in the line of ``limit``'s concurrency,
    or its rate (singletask.execution.units: its owner's countdowns, or the rate's periods)."""
    lease = LEASE_COUNTDOWNS * COUNTDOWN + LEASE_SLACK
    if rate:
        period = float(check_spec(LIMITS[limit], limit).period or 0.0)
        lease = max(lease, LEASE_COUNTDOWNS * period + LEASE_SLACK)
    return lease


def _clean(config: Config) -> str | None:
    """The one limit a configuration's clean waits are judged on, or None."""
    o = config.options
    if o["lock_policy"] != "retry" or o.get("lock_cost") is not None or o["lock_rate"]:
        return None
    named = o.get("lock_limits")
    return named if named in SINGLE else None


def _weight(config: Config | None) -> float:
    return float((config.options.get("lock_weight") if config else None) or 1.0)


def _priority(config: Config | None) -> int:
    return int((config.options.get("lock_priority") if config else None) or 0)


def turn_order(judge: _Judge, refusals: Sequence[Refusal]) -> None:
    """The ``turn-order`` rule over every clean wait of the run."""
    h = judge.h
    by_attempt: dict[tuple[str, int], list[Refusal]] = collections.defaultdict(list)
    for refusal in sorted(refusals, key=lambda r: r.t):
        by_attempt[refusal.attempt].append(refusal)
    first = {attempt: rs[0].t for attempt, rs in by_attempt.items()}
    takers: dict[tuple[str, str], list[Body]] = collections.defaultdict(list)
    started = {b.token: b for b in h.bodies}
    deliveries = collections.Counter(b.token for b in h.bodies)
    for body in h.bodies:
        if body.config in h.configs:
            for name in body.units:
                takers[(h.configs[body.config].store, name)].append(body)
    for body in h.bodies:
        config = h.configs.get(body.config)
        limit = _clean(config) if config is not None else None
        waited = by_attempt.get(body.token, [])
        if config is None or limit is None or not waited or body.redelivered:
            continue
        if deliveries[body.token] > 1:
            continue  # delivered again (its process killed): its waits are split between them
        if any(r.holder is not None or r.action != "retry" for r in waited):
            continue  # its key was held too: a refusal that did not renew its ticket
        times = [r.t for r in waited] + [body.start]
        if any(b - a > BACK_IN_TIME for a, b in itertools.pairwise(times)):
            continue  # back late: the room kept for it may have lapsed (documented)
        t0, last = times[0], times[-2]
        if any(f.side == "run" and f.hits(config.store) and f.start - TIE <= body.start
               and f.end + TIE >= t0 for f in h.faults):  # fmt: skip
            continue
        mates = _waiting_before(by_attempt, started, body, limit, t0)
        _judge_wait(judge, body, config, limit, (t0, last, mates), first,
                    takers[(config.store, limit)])  # fmt: skip


def _waiting_before(
    by_attempt: Mapping[tuple[str, int], Sequence[Refusal]],
    started: Mapping[tuple[str, int], Body],
    body: Body,
    limit: str,
    t0: float,
) -> tuple[int, int]:
    """The attempts of ``body``'s key (its configuration and key argument) that waited before
    it (a first refusal before ``t0``) and had not started by then (its ticket is behind
    theirs), and their units of ``limit`` (for one that never started, the most a send
    draws)."""
    from .sends import COSTS  # sends.py imports checker.py, which imports this module

    count = units = 0
    for attempt, rs in by_attempt.items():
        mate = started.get(attempt)
        if (
            attempt != body.token and rs[0].task == body.config and rs[0].key == body.key
            and rs[0].t < t0 - TIE and (mate is None or mate.start > t0)
        ):  # fmt: skip
            count += 1
            units += mate.units.get(limit, max(COSTS)) if mate is not None else max(COSTS)
    return count, units


def _judge_wait(
    judge: _Judge,
    body: Body,
    config: Config,
    limit: str,
    wait: tuple[float, float, tuple[int, int]],
    first: Mapping[tuple[str, int], float],
    takers: Sequence[Body],
) -> None:
    """``body``'s wait in ``limit``'s line (``wait``: its first and last refusals, and the
    attempts of its key ahead of it), against the bodies of other keys served meanwhile."""
    h = judge.h
    t0, last, (mates, ahead_units) = wait
    group = (body.config, body.key)
    share = (ahead_units + body.units[limit]) / _weight(config)
    passed: dict[tuple[str, str], list[Body]] = collections.defaultdict(list)
    for other in takers:
        if (other.config, other.key) == group or other.acquired is None:
            continue
        # it came into the line after E (its first refusal; never refused: its take) and was
        # served while E had no room
        came = first.get(other.token, other.acquired)
        if came > t0 + TIE and other.start < last - TIE:
            passed[(other.config, other.key)].append(other)
    for (name, key), bodies in passed.items():
        other_config = h.configs.get(name)
        ahead = max(0, _priority(other_config) - _priority(config))
        allowed = _weight(other_config) * (share + ahead) + max(b.units[limit] for b in bodies)
        took = sum(b.units[limit] for b in bodies)
        if took <= allowed:
            continue
        sends = judge.sends_of(body.task_id)[:1] + [
            s for b in bodies[:4] for s in judge.sends_of(b.task_id)[:1]
        ]
        judge.violation(
            "turn-order", judge.where(sends[0] if sends else None, body.key, body.config),
            sends,
            f"{body.describe()} waited in {limit!r}'s line from {t0:.3f} (refused last at "
            f"{last:.3f}, {mates} of its key ahead); key {key!r} of {name} took "
            f"{took} units past it, at most {allowed:g} allowed: "
            + ", ".join(b.describe() for b in bodies),
        )  # fmt: skip


@dataclass
class Ticket:
    """A ticket a limit's line still holds once the fleet is idle: its limit (its rate's line,
    or its concurrency's), its name (its execution's task id), when its lease ends (seconds
    since the epoch, the store's clock: the host's) and its store."""

    limit: str
    rate: bool
    ticket: str
    expires: float
    store: str


def tickets_end(judge: _Judge, tickets: Iterable[Ticket]) -> None:
    """The ``tickets-end`` rule over the tickets the idle stores still hold."""
    h = judge.h
    for ticket in tickets:
        lease = lease_of(ticket.limit, ticket.rate)
        sends = judge.sends_of(ticket.ticket)[:1]
        where = judge.where(sends[0]) if sends else f"seed={h.seed} ticket {ticket.ticket}"
        kind = "rate" if ticket.rate else "concurrency"
        here = f"{ticket.store} ticket {ticket.ticket} in the line of {ticket.limit!r}'s {kind}"
        renewed = ticket.expires - lease  # its owner's last take
        left = ticket.expires - (h.observed or renewed)
        if h.observed is not None and h.observed < renewed - TIE:
            judge.violation(
                "tickets-end",
                where,
                sends,
                f"{here} has {left:.1f} s left, over its lease {lease:.1f} s",
            )
            continue  # fmt: skip
        bodies = judge.bodies.get(ticket.ticket, ())
        started = [b for b in bodies if renewed + TIE < b.start < ticket.expires - TIE]
        late = [b for b in bodies if b.start >= ticket.expires - TIE]
        outcome = judge.outcome(ticket.ticket)
        if late and not started:
            judge.report.documented.append(
                f"{here}: its lease ended at {ticket.expires:.3f}, before its execution started "
                f"({late[0].describe()}): an ended ticket takes no part in the line, and the "
                "line's next change drops it"
            )
        elif started:
            judge.violation(
                "tickets-end", where, sends,
                f"{here} was renewed at {renewed:.3f}, and its execution started after: "
                f"{started[0].describe()} (a start uses its ticket)",
            )  # fmt: skip
        elif (
            outcome.exception == "TaskLocked"
            and outcome.limit is not None
            and not any(f.side == "run" and f.hits(ticket.store) for f in h.faults)
        ):
            judge.violation(
                "tickets-end", where, sends,
                f"{here} is left by an execution that ended {outcome.describe()} "
                "(lock retries spent: it gives its tickets back)",
            )  # fmt: skip
        else:
            judge.report.documented.append(
                f"{here}: left by an execution that stopped waiting ({outcome.describe()}); "
                f"its lease ends it {left:.1f} s after the outcomes were read"
            )
