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

import itertools
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = ["FIXED", "NOT_DRAWN", "OPTIONS", "STORES", "Config", "draw", "space", "valid"]

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
}

#: The options set to one value in every configuration: leases and retries short enough for a
#: round of seconds, budgets large enough that a burst never spends them.
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
    option only for "coalesce")."""
    queueing = options["lock_scope"] != "execution"
    if queueing and (options["lock_limit"] > 1 or options["lock_debounce"] is not None):
        return False
    replace = options["lock_policy"] == "replace"
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


def space() -> list[dict[str, Any]]:
    """Every combination a task accepts: what the generator draws from."""
    return [options for options in product() if valid(options)]


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
        parts.append("acks_late" if o["acks_late"] else "acks_early")
        return f"{self.name}[{' '.join(parts)} store={self.store}]"

    def task_options(self) -> dict[str, Any]:
        """The keyword arguments of ``app.task`` for this configuration."""
        options = {k: v for k, v in {**FIXED, **NOT_DRAWN, **self.options}.items() if v is not None}
        options["reject_on_worker_lost"] = bool(self.options["acks_late"])
        if self.options["lock_scope"] != "coalesce" and options["lock_coalesce"] == "first":
            del options["lock_coalesce"]  # the default: only "coalesce" takes the option
        return options

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


def draw(rng: random.Random, count: int, stores: Sequence[str] = ("redis",)) -> list[Config]:
    """``count`` configurations drawn from :func:`space`, without repeats while there are
    combinations left; the ``stores`` (of :data:`STORES`) take turns, the first one first, so
    each carries some (the draws of the options do not depend on them)."""
    accepted = space()
    picks = rng.sample(range(len(accepted)), min(count, len(accepted)))
    return [Config(n, accepted[i], stores[n % len(stores)]) for n, i in enumerate(picks)]


def find(options: Mapping[str, Any]) -> dict[str, Any]:
    """The combination of :func:`space` that has ``options`` (the others at their first
    value): a targeted scenario names its combination this way, and it must be drawable."""
    wanted = {name: values[0] for name, values in OPTIONS.items()}
    wanted.update(options)
    if wanted not in space():
        raise ValueError(f"not in the accepted space: {wanted}")
    return wanted
