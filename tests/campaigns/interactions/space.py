"""The option space the interaction campaign draws from, in one table.

:data:`OPTIONS` lists every task option the campaign varies and the values it draws;
:data:`FIXED` the options it sets to one value for every configuration (timings that keep a
round short); :data:`NOT_DRAWN` the ones a task's key needs. Together they name every option of
:data:`singletask.conf.options.ATTRIBUTE_CHECKS`, and
tests/campaigns/interactions/test_interactions.py fails when an option joins ``SingletonTask``
without joining this table (the project's rule: every option added later joins the campaign's
space).

:func:`valid` is the campaign's own statement of which combinations a task accepts; the same
test checks it, combination by combination, against what ``SingletonTask`` accepts when the
task is defined, so the space the generator draws from is exactly the accepted one.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = [
    "FIXED", "LIMITS", "NAMED", "NAMED_SHARE", "NOT_DRAWN", "OPTIONS", "STORES", "Config", "draw",
    "drawn_cost", "names_limits", "size", "space", "valid",
]  # fmt: skip

#: The named limits of the campaign's app (``singletask_limits``, docs/sharing-limits.rst):
#: small, so that they are met, and shared: every configuration that names one takes its units
#: of the same limit as the other configurations of its lock store (each store keeps its own).
LIMITS: Final[dict[str, dict[str, Any]]] = {
    "pool": {"concurrency": 2},
    "budget": {"rate": "6/2s"},
    "gate": {"concurrency": 3, "rate": "8/2s"},
}


def drawn_cost(args: Sequence[Any], kwargs: Mapping[str, Any]) -> int:
    """A callable cost (``lock_limits``): the units the send drew (sends.py: ``cost``)."""
    return int(kwargs.get("cost") or 1)


#: The values of ``lock_limits`` the campaign draws, by the name a configuration carries (its
#: options are JSON): a sequence of names (one unit each), a mapping of constant costs, and
#: mappings with a callable cost that reads the units each send drew (:func:`drawn_cost`).
NAMED: Final[dict[str, Any]] = {
    "pool": ("pool",),
    "budget": {"budget": drawn_cost},
    "pool+budget": {"pool": 1, "budget": 2},
    "gate": {"gate": drawn_cost, "pool": 1},
}

#: The options drawn, and the values each is drawn from (``None``: the option left unset).
#: ``acks_late`` goes with ``reject_on_worker_lost`` (a killed pool child's message is
#: delivered again: the redelivery the lifecycle promises to handle).
OPTIONS: Final[dict[str, tuple[Any, ...]]] = {
    "lock_scope": ("execution", "queue", "coalesce"),
    "lock_policy": ("skip", "retry", "raise", "replace"),
    "lock_limit": (1, 2, 3),
    "lock_rate": (None, "5/s", "2/s"),
    "lock_debounce": (None, 0.5, 1.0, 1.5),
    "lock_debounce_max": (None, 1.5, 3.0),
    "lock_replace_terminate": (False, True),
    "lock_coalesce": ("first", "latest"),
    "acks_late": (False, True),
    # Named limits (docs/sharing-limits.rst): a name of NAMED, and the units an execution takes
    # of its key's own lock_limit.
    "lock_limits": (None, *NAMED),
    "lock_cost": (None, 2),
    # Fair turns (docs/fair-turns.rst): a key's share of a limit's turns, and turns moved ahead.
    "lock_weight": (None, 2.0),
    "lock_priority": (None, 3),
}

#: The options set to one value in every configuration: leases and retries short enough for a
#: round of seconds, budgets large enough that a burst never spends them (but a named limit
#: that other tasks keep full for longer than lock_retry_max retries: see checker.py).
FIXED: Final[dict[str, Any]] = {
    "lock_ttl": 5.0,
    "lock_queue_ttl": 60.0,
    "lock_renew": True,
    "lock_max_hold": None,
    "lock_retry_countdown": 0.3,
    "lock_retry_max": 60,
    "lock_on_backend_error": "retry",
    # Backend retries back off 1, 2, 4, 8 s (plus jitter): four fit in the long run's quiet bound
    # (40 s), so a message still waiting for its next one is never taken for a lost send.
    "lock_backend_retry_max": 4,
}

#: The options of the key: every campaign task has one key argument, ``key``.
NOT_DRAWN: Final[dict[str, Any]] = {"lock_args": ("key",), "lock_key": None}

#: The lock stores a run can use: Redis always; the others in the long run, where installed.
STORES: Final = ("redis", "postgresql", "mysql", "sqlite")


def valid(options: Mapping[str, Any]) -> bool:
    """Whether a task accepts these options (docs/limits.rst): the "queue" and "coalesce"
    scopes keep one queued message per key, so they go with neither a ``lock_limit`` above 1
    nor ``lock_debounce``; ``lock_debounce_max`` bounds a ``lock_debounce``, and is at least
    it. ``lock_policy = "replace"`` (docs/policies.rst) preempts the running execution: it goes
    with the "execution" scope only, and without ``lock_rate``; ``lock_replace_terminate`` goes
    with it alone. ``lock_coalesce = "latest"`` goes with the "coalesce" scope only ("first",
    the default, is the only choice of every other scope: :meth:`Config.task_options` sets the
    option only for "coalesce"). Named limits (docs/sharing-limits.rst): ``lock_limits`` and
    ``lock_cost`` go with the "execution" scope only, without ``lock_debounce`` and without
    "replace"; ``lock_cost`` goes without ``lock_rate``; a constant ``lock_cost`` is at most
    ``lock_limit`` (the campaign's costs fit the
    sizes of :data:`LIMITS`, which the task is bound to). Fair turns (docs/fair-turns.rst):
    ``lock_weight`` and ``lock_priority`` go with named limits only."""
    queueing = options["lock_scope"] != "execution"
    if queueing and (options["lock_limit"] > 1 or options["lock_debounce"] is not None):
        return False
    replace = options["lock_policy"] == "replace"
    named = options["lock_limits"] is not None or options["lock_cost"] is not None
    if named and (queueing or replace or options["lock_debounce"] is not None):
        return False
    turns = options["lock_weight"] is not None or options["lock_priority"] is not None
    if turns and not named:
        return False
    if options["lock_cost"] is not None and options["lock_cost"] > options["lock_limit"]:
        return False
    if options["lock_cost"] is not None and options["lock_rate"] is not None:
        return False  # an execution of lock_cost holds a key of its own: no rate to count
    if replace and (queueing or options["lock_rate"] is not None):
        return False
    if options["lock_replace_terminate"] and not replace:
        return False
    if options["lock_coalesce"] == "latest" and options["lock_scope"] != "coalesce":
        return False
    bound = options["lock_debounce_max"]
    if bound is not None:
        debounce = options["lock_debounce"]
        return debounce is not None and bound >= debounce
    return True


def product() -> Iterator[dict[str, Any]]:
    """Every combination of the table's values, accepted or not."""
    names = list(OPTIONS)
    for values in itertools.product(*(OPTIONS[name] for name in names)):
        yield dict(zip(names, values, strict=True))


#: The options of fair turns: set only with named limits (:func:`valid`), so :func:`_space`
#: varies them only over the combinations that name limits (the same space, sooner).
TURN_OPTIONS: Final = ("lock_weight", "lock_priority")


def size() -> int:
    """How many combinations the table has, accepted or not."""
    return math.prod(len(values) for values in OPTIONS.values())


@functools.cache
def _space() -> tuple[dict[str, Any], ...]:
    base = {name: values for name, values in OPTIONS.items() if name not in TURN_OPTIONS}
    turns = list(itertools.product(*(OPTIONS[name] for name in TURN_OPTIONS)))
    accepted = []
    for values in itertools.product(*base.values()):
        options = dict(zip(base, values, strict=True))
        for turn in turns if names_limits(options) else [(None,) * len(TURN_OPTIONS)]:
            combination = {**options, **dict(zip(TURN_OPTIONS, turn, strict=True))}
            if valid(combination):
                accepted.append({name: combination[name] for name in OPTIONS})
    return tuple(accepted)


def space() -> list[dict[str, Any]]:
    """Every combination a task accepts: what the generator draws from."""
    return [dict(options) for options in _space()]


@dataclass(frozen=True)
class Config:
    """One drawn configuration: a task of its own, named after its options."""

    index: int
    options: dict[str, Any] = field(hash=False)
    store: str = "redis"

    @property
    def name(self) -> str:
        return f"interactions.c{self.index}"

    def describe(self) -> str:
        o = self.options
        policy = o["lock_policy"] + ("+terminate" if o["lock_replace_terminate"] else "")
        scope = o["lock_scope"] + ("/latest" if o["lock_coalesce"] == "latest" else "")
        parts = [scope, policy, f"limit={o['lock_limit']}"]
        if o["lock_rate"]:
            parts.append(f"rate={o['lock_rate']}")
        if o["lock_debounce"] is not None:
            bound = o["lock_debounce_max"]
            parts.append(f"debounce={o['lock_debounce']}" + (f"/max={bound}" if bound else ""))
        if o.get("lock_limits") is not None:
            parts.append(f"limits={o['lock_limits']}")
        if o.get("lock_cost") is not None:
            parts.append(f"cost={o['lock_cost']}")
        if o.get("lock_weight") is not None:
            parts.append(f"weight={o['lock_weight']}")
        if o.get("lock_priority") is not None:
            parts.append(f"priority={o['lock_priority']}")
        parts.append("acks_late" if o["acks_late"] else "acks_early")
        return f"{self.name}[{' '.join(parts)} store={self.store}]"

    def task_options(self) -> dict[str, Any]:
        """The keyword arguments of ``app.task`` for this configuration."""
        options = {k: v for k, v in {**FIXED, **NOT_DRAWN, **self.options}.items() if v is not None}
        options["reject_on_worker_lost"] = bool(self.options["acks_late"])
        if self.options["lock_scope"] != "coalesce" and options["lock_coalesce"] == "first":
            del options["lock_coalesce"]  # the default: only "coalesce" takes the option
        if "lock_limits" in options:
            options["lock_limits"] = NAMED[options["lock_limits"]]
        return options

    def costs(self, cost: int) -> dict[str, int]:
        """The units an execution takes of each named limit, for a send that drew ``cost``
        (what :data:`NAMED`'s callables answer for it)."""
        named = NAMED.get(self.options.get("lock_limits") or "", ())
        pairs = named.items() if isinstance(named, Mapping) else ((n, 1) for n in named)
        return {name: cost if callable(units) else int(units) for name, units in pairs}

    def rated(self) -> list[str]:
        """The named limits with a rate that an execution of this configuration starts."""
        return [name for name in self.costs(1) if "rate" in LIMITS[name]]

    @property
    def key_units(self) -> int:
        """How many executions of one key may run at once: ``lock_limit``, or with
        ``lock_cost`` as many as their units fit in it."""
        cost = self.options.get("lock_cost")
        return self.options["lock_limit"] // (cost or 1)

    @property
    def rate_interval(self) -> float | None:
        rate = self.options["lock_rate"]
        if rate is None:
            return None
        count, _, unit = rate.partition("/")
        return {"s": 1.0, "m": 60.0, "h": 3600.0}[unit] / float(count)

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "options": self.options, "store": self.store}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Config:
        return cls(int(data["index"]), dict(data["options"]), str(data["store"]))


def names_limits(options: Mapping[str, Any]) -> bool:
    """Whether a combination takes units of named limits (``lock_limits``, ``lock_cost``)."""
    return options.get("lock_limits") is not None or options.get("lock_cost") is not None


#: The share of a run's configurations drawn among the combinations that name limits (a third
#: of the space): enough of them, on each store, to meet each other in their limits.
NAMED_SHARE = 0.5


def draw(rng: random.Random, count: int, stores: Sequence[str] = ("redis",)) -> list[Config]:
    """``count`` configurations drawn from :func:`space`, without repeats while there are
    combinations left, half of them (:data:`NAMED_SHARE`, rounded down) among those that name
    limits, in a drawn order; the ``stores`` (of :data:`STORES`) take turns, the first one
    first, so each carries some (the draws of the options do not depend on them)."""
    accepted = _space()
    count = min(count, len(accepted))
    named = [i for i, options in enumerate(accepted) if names_limits(options)]
    others = [i for i, options in enumerate(accepted) if not names_limits(options)]
    wanted = min(int(count * NAMED_SHARE), len(named))
    picks = rng.sample(named, wanted) + rng.sample(others, min(count - wanted, len(others)))
    rng.shuffle(picks)
    return [Config(n, dict(accepted[i]), stores[n % len(stores)]) for n, i in enumerate(picks)]


def find(options: Mapping[str, Any]) -> dict[str, Any]:
    """The combination of :func:`space` that has ``options`` (the others at their first
    value): a targeted scenario names its combination this way, and it must be drawable."""
    wanted = {name: values[0] for name, values in OPTIONS.items()}
    wanted.update(options)
    if wanted not in _space():
        raise ValueError(f"not in the accepted space: {wanted}")
    return wanted
