"""Named limits as configured: the app's ``singletask_limits`` and a task's ``lock_limits`` and
``lock_cost``, validated once.

* ``singletask_limits`` maps a limit's name to its spec, ``{"concurrency": 8}`` (at most 8
  units held at once), ``{"rate": "90000/m"}`` (at most 90,000 units started in any minute) or
  both; or it is a callable ``name -> spec`` (per-tenant limits read from the user's data),
  whose answers each process keeps for :data:`SPEC_CACHE_SECONDS`.
* ``lock_limits`` names the limits an execution takes units of: a sequence of names (1 unit
  each) or a mapping of name to cost, an int or a callable ``(args, kwargs) -> int``. A name
  may be a template over the task's parameters (``"partner:{partner_id}"``): a field that
  names a parameter is filled in with the call's value; braces around anything else are kept
  (a Redis Cluster hash tag, ``"{llm}-requests"``).
* ``lock_cost`` is the units an execution takes of its own key's ``lock_limit``.

:class:`LimitSpec` turns a spec and a cost into the store's :class:`~singletask.backends.base.
Units`; the execution side (:mod:`singletask.execution.units`) does that per call.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import math
import re
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

from ..backends.holders import MAX_UNITS, Units, check_units
from ..exceptions import ConfigurationError, LockKeyError
from ..protocol.keys import KeySpec
from ..protocol.limits import check_name, limit_key

__all__ = [
    "MAX_SECONDS", "SPEC_CACHE_SECONDS", "Cost", "LimitSpec", "NamedLimit", "TaskLimits",
    "check_combination", "check_cost", "check_limits_setting", "check_named", "check_spec",
    "parse_rate",
]  # fmt: skip

#: The largest number of seconds any duration option or setting takes (30 days): far longer
#: than a lease, a reservation or a retry delay should be, and far inside what every lock store
#: can represent as an expiry. (Here, below the settings, for the rates' periods.)
MAX_SECONDS: Final = 30 * 24 * 3600

#: The periods of a rate, in seconds.
RATE_PERIODS: Final = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}

#: A rate as written: a count, ``/``, an optional whole number of periods, and a period.
_RATE = re.compile(r"\s*([^/\s]+)\s*/\s*([0-9]*)\s*([smhd])\s*")

#: The shortest spacing a rate may give two starts.
MIN_RATE_INTERVAL: Final = 0.001


def parse_rate(value: object, where: str) -> tuple[float, float]:
    """Return ``(count, period)`` of a rate written ``"N/m"``, ``"N/10s"``, ``"N/5m"``: a
    number above 0, ``/``, an optional whole number of periods (above 0), and ``s``, ``m``,
    ``h`` or ``d``. The period is in seconds, from 1 ms to 30 days.

    Raises:
        ConfigurationError: It is not such a rate; the message names ``where``.
    """
    found = _RATE.fullmatch(value) if isinstance(value, str) else None
    number, periods = math.nan, 0
    if found is not None:
        with contextlib.suppress(ValueError):
            number = float(found.group(1))
        periods = int(found.group(2) or "1")
    if found is None or not math.isfinite(number) or number <= 0 or periods <= 0:
        raise ConfigurationError(
            f'{where}: expected a rate such as "10/m" or "6/10s": a number above 0, \'/\', '
            f"an optional count of periods, and s, m, h or d, got {value!r}"
        )
    period = periods * RATE_PERIODS[found.group(3)]
    if period > MAX_SECONDS:
        raise ConfigurationError(
            f"{where}: {value!r} counts over {period:g}s; a rate's period may be at most "
            f"{MAX_SECONDS} seconds (30 days)"
        )
    return number, period


#: How long a process keeps what a callable ``singletask_limits`` answered for a name.
SPEC_CACHE_SECONDS: Final = 60.0

#: The most names a process keeps answers of a callable ``singletask_limits`` for.
SPEC_CACHE_SIZE: Final = 4096

#: A cost: units, or a callable of the call's ``(args, kwargs)`` that returns them.
Cost: TypeAlias = int | Callable[[Sequence[Any], Mapping[str, Any]], int]

#: What ``singletask_limits`` holds once checked.
LimitsSetting: TypeAlias = Mapping[str, "LimitSpec"] | Callable[[str], Any]


@dataclass(frozen=True)
class LimitSpec:
    """One named limit's spec.

    Attributes:
        concurrency: Units held at once, or None.
        rate: The rate as written (``"90000/m"``), or None.
        rate_size: Units started per window of ``period``, with ``rate``.
        period: The rate's window in seconds, with ``rate``.
    """

    concurrency: int | None = None
    rate: str | None = None
    rate_size: int | None = None
    period: float | None = None

    def units(self, prefix: str, name: str, cost: int) -> list[Units]:
        """What an execution of ``cost`` units takes of this limit: its concurrency and its
        rate, each its own store record."""
        taken = []
        if self.concurrency is not None:
            taken.append(Units(limit_key(prefix, name), self.concurrency, cost))
        if self.rate_size is not None:
            key = limit_key(prefix, name, rate=True)
            taken.append(Units(key, self.rate_size, cost, self.period))
        return taken

    @property
    def smallest(self) -> int:
        """The smallest of its sizes: no cost above it can ever start."""
        return min(s for s in (self.concurrency, self.rate_size) if s is not None)


def check_spec(value: object, where: str) -> LimitSpec:
    """Return ``value``, a limit's spec (``{"concurrency": N}``, ``{"rate": "N/m"}`` or both),
    checked.

    Raises:
        ConfigurationError: It is not one; the message names ``where``.
    """
    if isinstance(value, LimitSpec):
        return value
    if not isinstance(value, Mapping) or not value:
        raise ConfigurationError(
            f"{where}: a limit is a mapping such as {{'concurrency': 8}} or "
            f"{{'rate': '90000/m'}}, or both, got {value!r}"
        )
    unknown = sorted(str(k) for k in value if k not in ("concurrency", "rate"))
    if unknown:
        raise ConfigurationError(
            f"{where}: unknown key {unknown[0]!r}; a limit has 'concurrency', 'rate' or both"
        )
    concurrency = value.get("concurrency")
    if concurrency is not None:
        check_units(concurrency, f"{where} concurrency")
    rate = value.get("rate")
    size = period = None
    if rate is not None:
        count, period = parse_rate(rate, f"{where} rate")
        if count != int(count) or not 1 <= count <= MAX_UNITS:
            raise ConfigurationError(
                f"{where} rate: {rate!r} starts a whole number of units from 1 to "
                f"{MAX_UNITS} per window"
            )
        size = int(count)
    if concurrency is None and rate is None:
        raise ConfigurationError(f"{where}: give the limit a 'concurrency', a 'rate' or both")
    return LimitSpec(concurrency, rate, size, period)


def check_limits_setting(value: object, where: str) -> LimitsSetting:
    """Return the setting ``singletask_limits`` checked: a mapping of name to spec, or a
    callable ``name -> spec`` (whose answers are checked when they are used).

    Raises:
        ConfigurationError: It is neither, or a name or spec is invalid.
    """
    if callable(value) and not isinstance(value, Mapping):
        return value
    if not isinstance(value, Mapping):
        raise ConfigurationError(
            f"{where}: expected a mapping of limit names to limits, or a callable that "
            f"returns a limit for a name, got {value!r}"
        )
    return {
        check_name(name, where): check_spec(spec, f"{where}[{name!r}]")
        for name, spec in value.items()
    }


def check_cost(value: object, where: str) -> Cost:
    """Return ``value`` if it is a cost: a whole number of units from 1, or a callable.

    Raises:
        ConfigurationError: It is not.
    """
    if callable(value):
        return value
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_UNITS:
        raise ConfigurationError(
            f"{where}: a cost is a whole number of units from 1 to {MAX_UNITS}, or a callable "
            f"(args, kwargs) -> units, got {value!r}"
        )
    return value


def cost_of(cost: Cost, args: Sequence[Any], kwargs: Mapping[str, Any], where: str) -> int:
    """The units of ``cost`` for a call.

    Raises:
        ConfigurationError: A callable cost raised, or returned no whole number from 1.
    """
    if isinstance(cost, int):
        return cost
    try:
        units = cost(args, kwargs)
    except Exception as exc:
        raise ConfigurationError(
            f"{where}: the cost callable raised {type(exc).__name__}: {exc}"
        ) from exc
    return check_units(units, f"{where}: the cost callable's answer")


@dataclass(frozen=True)
class NamedLimit:
    """One entry of a task's ``lock_limits``: a name (or a template over the task's
    parameters) and the cost of an execution."""

    name: str
    cost: Cost
    template: bool


@dataclass(frozen=True)
class TaskLimits:
    """A task's ``lock_limits``, checked against its signature."""

    task: str
    limits: tuple[NamedLimit, ...]
    keys: KeySpec

    @classmethod
    def declared(
        cls, task: str, signature: inspect.Signature | None, value: object, where: str
    ) -> TaskLimits:
        """Read ``lock_limits`` (``where`` names the task and the attribute).

        Raises:
            ConfigurationError: It is not a sequence or mapping of names (and costs), a name is
                named twice or is not a valid template over the task's parameters.
        """
        if isinstance(value, str) or not isinstance(value, Sequence | Mapping) or not value:
            raise ConfigurationError(
                f"{where}: expected a non-empty sequence of limit names, or a mapping of limit "
                f"names to costs, got {value!r}"
            )
        pairs = list(value.items()) if isinstance(value, Mapping) else [(n, 1) for n in value]
        params = set(signature.parameters) if signature is not None else None
        limits, seen = [], set()
        for name, cost in pairs:
            check_name(name, where)
            if name in seen:
                raise ConfigurationError(f"{where}: limit {name!r} is named twice")
            seen.add(name)
            template = _check_template(name, params, where)
            limits.append(NamedLimit(name, check_cost(cost, f"{where}[{name!r}]"), template))
        return cls(task, tuple(limits), KeySpec(task, signature, None, None))

    def named(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[tuple[str, int]]:
        """The names (templates filled in) and costs of one call's limits.

        Raises:
            LockKeyError: A template cannot be filled in with these arguments.
            ConfigurationError: A cost callable failed.
        """
        bound: dict[str, Any] | None = None
        found = []
        for limit in self.limits:
            name = limit.name
            if limit.template:
                if bound is None:
                    bound = self.keys_bind(args, kwargs)
                name = self._fill(name, bound)
            where = f"task {self.task!r} attribute lock_limits[{limit.name!r}]"
            found.append((name, cost_of(limit.cost, args, kwargs, where)))
        return found

    def keys_bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The call's arguments by parameter name, defaults applied."""
        return self.keys._bind(args, kwargs)  # one binder for keys and names

    def _fill(self, template: str, bound: Mapping[str, Any]) -> str:
        parts = []
        try:
            for literal, field, spec, conversion in string.Formatter().parse(template):
                parts.append(literal)
                if field is None:
                    continue
                if _base(field) not in bound:  # a Redis Cluster hash tag: kept as written
                    parts.append("{" + field + "}")
                    continue
                one = "{" + field + (f"!{conversion}" if conversion else "")
                parts.append((one + (f":{spec}" if spec else "") + "}").format(**bound))
            return check_name("".join(parts), "")
        except Exception as exc:
            raise LockKeyError(
                f"task {self.task!r}: the limit name {template!r} of lock_limits cannot be "
                f"filled in with this call's arguments: {type(exc).__name__}: {exc}"
            ) from exc


def _base(field: str) -> str:
    """The parameter a template field reads: ``partner`` of ``partner.id`` or ``partner[0]``."""
    return field.split(".", 1)[0].split("[", 1)[0]


def _check_template(name: str, params: set[str] | None, where: str) -> bool:
    """Whether ``name`` is a template: a field of it names a parameter of the task (braces
    around anything else are kept as written, a Redis Cluster hash tag: ``"{llm}-requests"``).
    """
    try:
        parsed = list(string.Formatter().parse(name))
    except ValueError:
        return False  # unbalanced braces: a name as written
    if params is None:
        return False
    return any(field is not None and _base(field) in params for _, field, _, _ in parsed)


def check_combination(
    where: str,
    *,
    limits: TaskLimits | None,
    cost: Cost | None,
    limit: int | None,
    debounce: float | None,
    scope: str | None,
    policy: str | None,
    rate: str | None = None,
    keyed: bool = False,
) -> None:
    """Refuse task options that cannot go with ``lock_limits`` or ``lock_cost``: a scope but
    "execution", ``lock_debounce``, the policy "replace"; ``lock_cost`` without ``lock_limit``
    or, constant, above it; ``lock_rate`` for a task that holds no key of its own (``keyed``:
    it names ``lock_args`` or ``lock_key``). ``scope`` and ``policy`` are those in effect
    (None: not known yet).

    Raises:
        ConfigurationError: They cannot; the message starts with ``where``.
    """
    keyless = cost is not None or (limits is not None and not keyed and (limit or 1) == 1)
    if rate is not None and keyless:
        attribute = "lock_cost" if cost is not None else "lock_limits"
        raise ConfigurationError(
            f"{where} lock_rate: counts the starts of the task's key, and with {attribute} "
            "an execution holds a key of its message alone; put the rate in a named limit "
            "instead (singletask_limits = {'name': {'rate': '10/m'}}, lock_limits=['name'])"
        )
    for attribute, value in (("lock_limits", limits), ("lock_cost", cost)):
        if value is None:
            continue
        if scope not in (None, "execution"):
            raise ConfigurationError(
                f"{where} {attribute}: cannot go with lock_scope {scope!r} (a key reserved "
                "at send would wait for room it cannot know of); use lock_scope = 'execution'"
            )
        if debounce is not None:
            raise ConfigurationError(
                f"{where} {attribute}: cannot go with lock_debounce; a debounced task takes "
                "one key at a time already"
            )
        if policy == "replace":
            raise ConfigurationError(
                f"{where} {attribute}: an execution refused for want of room has no holder "
                "to preempt; use another lock_policy"
            )
    if cost is not None:
        if limit is None:
            raise ConfigurationError(
                f"{where} lock_cost: counts units of the key's lock_limit, which the task "
                "does not set; set lock_limit (or name a limit in lock_limits)"
            )
        if isinstance(cost, int) and cost > limit:
            raise ConfigurationError(
                f"{where} lock_cost: {cost} units can never fit the key's lock_limit of {limit}"
            )


def check_named(task: str, limits: TaskLimits | None, known: LimitsSetting) -> None:
    """Refuse a name of ``lock_limits`` that the app's ``singletask_limits`` (a mapping) does
    not define, and a constant cost larger than the limit it names (a callable setting's
    limits are known per name, at execution; a template's, per call).

    Raises:
        ConfigurationError: One is refused; the message names the task, the limit and, for
            an unknown name, the closest one defined.
    """
    if limits is None or not isinstance(known, Mapping):
        return
    for limit in limits.limits:
        where = f"task {task!r} attribute lock_limits[{limit.name!r}]"
        spec = known.get(limit.name)
        if spec is None and limit.template:
            continue
        if spec is None:
            close = difflib.get_close_matches(limit.name, list(known), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigurationError(
                f"{where}: no such limit in the setting singletask_limits (it defines "
                f"{', '.join(map(repr, sorted(known))) or 'none'}){hint}"
            )
        if isinstance(limit.cost, int) and limit.cost > spec.smallest:
            raise ConfigurationError(
                f"{where}: a cost of {limit.cost} units can never fit the limit, whose "
                f"size is {spec.smallest}"
            )
