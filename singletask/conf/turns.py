"""Fair turns, as a task declares them: ``lock_weight`` and ``lock_priority``.

An execution that waits for room in a limit (``lock_limits``, ``lock_cost``) with
``lock_policy = "retry"`` keeps its place in the limit's line (:mod:`singletask.backends.turns`):
``lock_weight`` is its key's share of the turns, ``lock_priority`` moves it a bounded number of
turns ahead. Each is a constant or a callable ``(args, kwargs) -> value``, as a cost is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

from ..backends.holders import MAX_PRIORITY, MAX_WEIGHT, is_priority, is_weight
from ..exceptions import ConfigurationError

__all__ = ["Priority", "Weight", "check_priority", "check_weight", "priority_of", "weight_of"]

Weight: TypeAlias = float | Callable[[Sequence[Any], Mapping[str, Any]], float]
Priority: TypeAlias = int | Callable[[Sequence[Any], Mapping[str, Any]], int]


def _weight(value: object, where: str) -> float:
    if not is_weight(value):
        raise ConfigurationError(
            f"{where}: a weight is a number above 0 and at most {MAX_WEIGHT:g}, or a callable "
            f"(args, kwargs) -> weight, got {value!r}"
        )
    return float(value)


def _priority(value: object, where: str) -> int:
    if not is_priority(value):
        raise ConfigurationError(
            f"{where}: a priority is a whole number from {-MAX_PRIORITY} to {MAX_PRIORITY}, "
            f"or a callable (args, kwargs) -> priority, got {value!r}"
        )
    return value


def check_weight(value: object, where: str) -> Weight:
    """Return ``value`` if it is a weight (a number in (0, MAX_WEIGHT]) or a callable.

    Raises:
        ConfigurationError: It is not.
    """
    return value if callable(value) else _weight(value, where)


def check_priority(value: object, where: str) -> Priority:
    """Return ``value`` if it is a priority (a whole number within MAX_PRIORITY of 0) or a
    callable.

    Raises:
        ConfigurationError: It is not.
    """
    return value if callable(value) else _priority(value, where)


def _call(
    value: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], where: str
) -> Any:
    try:
        return value(args, kwargs)
    except Exception as exc:
        raise ConfigurationError(
            f"{where}: the callable raised {type(exc).__name__}: {exc}"
        ) from exc


def weight_of(weight: Weight, args: Sequence[Any], kwargs: Mapping[str, Any], where: str) -> float:
    """The weight of a call.

    Raises:
        ConfigurationError: A callable weight raised, or returned no weight.
    """
    if not callable(weight):
        return weight
    return _weight(_call(weight, args, kwargs, where), f"{where}: the callable's answer")


def priority_of(
    priority: Priority, args: Sequence[Any], kwargs: Mapping[str, Any], where: str
) -> int:
    """The priority of a call.

    Raises:
        ConfigurationError: A callable priority raised, or returned no priority.
    """
    if not callable(priority):
        return priority
    return _priority(_call(priority, args, kwargs, where), f"{where}: the callable's answer")
