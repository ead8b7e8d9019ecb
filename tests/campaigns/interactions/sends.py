"""The seeded burst of sends, and how one send is made (in a producer thread or process).

:func:`plan_round` draws, from one ``random.Random``, the sends of a round: for each
configuration a few keys, each with a burst of sends from several producers, each send with
its method (``delay``, ``apply_async``, with a countdown sometimes, ``send_task``, a ``group``
of two), the way its body is to end, the units it costs where a callable cost reads them
(``cost``: space.drawn_cost) and sometimes the real cost its body charges a rate it started
(``charge``), and now and then a fault at the hand-off (a publish that fails: the broker down,
an argument the serializer refuses). :func:`perform` makes one send and writes down what its
caller got.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from celery import Celery, group

from .checker import Send
from .space import Config

__all__ = ["ENDING_WEIGHTS", "SendPlan", "perform", "plan_round"]

#: How often each ending is drawn.
ENDING_WEIGHTS: dict[str, float] = {
    "return": 34, "raise": 8, "retry": 16, "ignore": 6, "reject": 6, "soft": 6, "hard": 6,
    "kill": 8,
}  # fmt: skip

#: How often each method is drawn (the failing publishes are drawn apart, FAULT_SHARE).
METHOD_WEIGHTS: dict[str, float] = {"delay": 30, "apply_async": 38, "send_task": 18, "group": 8}

#: The share of sends whose publish fails, and the kinds.
FAULT_SHARE = 0.12
FAULTS = ("broker-down", "encode")

#: The units a send's callable costs answer (space.drawn_cost), each as often as listed; every
#: one fits every limit with a callable cost (space.LIMITS).
COSTS = (1, 1, 2, 3)
#: The share of sends whose body charges a rate it started, and the units charged (0: the
#: start taken back).
CHARGE_SHARE = 0.4
CHARGES = (0, 1, 2, 3, 4)

#: Time limits a send sets for its body's "soft" and "hard" endings.
SOFT_LIMIT = 0.4
HARD_LIMIT = 0.6


class Unserializable:
    """An argument the JSON serializer refuses: its publish raises EncodeError."""


@dataclass
class SendPlan:
    seq: int
    at: float  # seconds after the burst starts
    producer: str
    config: str
    key: str
    method: str
    ending: str
    sleep: float
    retry_countdown: float
    countdown: float | None = None
    fault: str | None = None
    task_id: str | None = None
    partner: int | None = None  # the other member of a group
    cost: int = 1  # what a callable cost of lock_limits answers for it
    charge: int | None = None  # the units its body charges a rate it started (None: none)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _pick(rng: random.Random, weights: Mapping[str, float]) -> str:
    names = list(weights)
    return rng.choices(names, [weights[n] for n in names])[0]


def plan_round(
    rng: random.Random,
    configs: Sequence[Config],
    round_no: int,
    *,
    seconds: float,
    sends_per_key: int,
    keys: int,
    producers: Sequence[str],
    first_seq: int,
    endings: Mapping[str, float] = ENDING_WEIGHTS,
    fault_share: float = FAULT_SHARE,
    salt: int = 0,
) -> list[SendPlan]:
    """The sends of one round, ordered by time. Task ids are drawn too, mixed with ``salt``
    (a replay of a seed on the same result store must not meet its earlier ids)."""

    def new_id() -> str:
        return str(uuid.UUID(int=rng.getrandbits(128) ^ salt))

    plans: list[SendPlan] = []
    seq = first_seq
    for config in configs:
        for k in range(keys):
            key = f"r{round_no}k{k}"
            for _ in range(sends_per_key):
                method = _pick(rng, METHOD_WEIGHTS)
                fault = rng.choice(FAULTS) if rng.random() < fault_share else None
                if fault is not None:
                    method = "apply_async"  # its ledger needs the id it would have had
                producer = rng.choice(producers)
                if fault == "broker-down":
                    producer = "dead-broker"
                if producer == "killed" and method in ("delay", "group"):
                    method = "apply_async"  # its ledger needs the id before the call
                countdown = None
                if method in ("apply_async", "send_task") and rng.random() < 0.3:
                    countdown = round(rng.uniform(0.1, 0.8), 3)
                plan = SendPlan(
                    seq=seq, at=round(rng.uniform(0.0, seconds), 3), producer=producer,
                    config=config.name, key=key, method=method, ending=_pick(rng, endings),
                    sleep=round(rng.uniform(0.02, 0.3), 3),
                    retry_countdown=round(rng.uniform(0.1, 0.8), 3), countdown=countdown,
                    fault=fault,
                    task_id=None if method == "delay" and fault is None else new_id(),
                    cost=rng.choice(COSTS),
                    charge=rng.choice(CHARGES) if rng.random() < CHARGE_SHARE else None,
                )  # fmt: skip
                plans.append(plan)
                seq += 1
                if method == "group":
                    partner = SendPlan(
                        **{**plan.to_json(), "seq": seq, "ending": _pick(rng, endings),
                           "task_id": new_id(), "partner": plan.seq}
                    )  # fmt: skip
                    plan.partner = seq
                    plans.append(partner)
                    seq += 1
    plans.sort(key=lambda p: (p.at, p.seq))
    return plans


def _kwargs(plan: SendPlan, run: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "ending": plan.ending, "sleep": plan.sleep, "countdown": plan.retry_countdown, "run": run,
        "cost": plan.cost, "charge": plan.charge,
    }  # fmt: skip
    if plan.fault == "encode":
        kwargs["payload"] = Unserializable()
    return kwargs


def _limits(plan: SendPlan) -> dict[str, float]:
    if plan.ending == "soft":
        return {"soft_time_limit": SOFT_LIMIT}
    if plan.ending == "hard":
        return {"time_limit": HARD_LIMIT}
    return {}


def perform(app: Celery, plan: SendPlan, run: str, partner: SendPlan | None = None) -> list[Send]:
    """Make the send ``plan`` (and its group partner) with ``app``; return what its caller
    got, one :class:`Send` per message."""
    task = app.tasks[plan.config]
    args = (plan.key, plan.seq)
    kwargs = _kwargs(plan, run)
    options: dict[str, Any] = dict(_limits(plan))
    if plan.countdown is not None:
        options["countdown"] = plan.countdown
    sends = [
        Send(plan.seq, plan.producer, plan.config, plan.key, plan.method, plan.ending,
             time.time(), task_id=plan.task_id, countdown=plan.countdown, fault=plan.fault)
    ]  # fmt: skip
    if partner is not None:
        sends.append(
            Send(partner.seq, partner.producer, partner.config, partner.key, "group",
                 partner.ending, sends[0].t_before, task_id=partner.task_id)
        )  # fmt: skip
    try:
        if plan.method == "delay":
            results = [task.delay(*args, **kwargs)]
        elif plan.method == "apply_async":
            results = [task.apply_async(args, kwargs, task_id=plan.task_id, **options)]
        elif plan.method == "send_task":
            results = [app.send_task(plan.config, args, kwargs, task_id=plan.task_id, **options)]
        else:
            assert partner is not None
            members = [
                task.si(p.key, p.seq, **_kwargs(p, run)).set(task_id=p.task_id, **_limits(p))
                for p in (plan, partner)
            ]
            results = list(group(members).apply_async().results)
    except Exception as exc:
        now = time.time()
        for send in sends:
            send.error, send.t_after = type(exc).__name__, now
        return sends
    now = time.time()
    for send, result in zip(sends, results, strict=True):
        send.returned, send.t_after = result.id, now
    return sends
