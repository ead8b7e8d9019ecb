"""celery-once's key helpers, giving the same key strings (``qo_<task>_<arg>-<value>...``).

Users' tests and clean-up code read these keys (``qo_<app>.*`` patterns), so they are kept
byte for byte: arguments bound to the task's signature (defaults are *not* applied), sorted by
name, each value through ``str()`` after :func:`force_string` (dicts with their keys sorted).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from typing import Any

from ...exceptions import ConfigurationError

__all__ = [
    "force_string",
    "import_backend",
    "items_sorted_by_key",
    "kwargs_to_list",
    "order_dict_to_string",
    "queue_once_key",
]


def import_backend(config: Mapping[str, Any]) -> Any:
    """A new backend object from ``{"backend": "<dotted path>", "settings": {...}}``."""
    path = config.get("backend")
    if not isinstance(path, str) or "." not in path:
        raise ConfigurationError(
            f"ONCE['backend'] must be the dotted path of a backend class, got {path!r}"
        )
    module_name, _, class_name = path.rpartition(".")
    backend_class = getattr(importlib.import_module(module_name), class_name)
    return backend_class(config.get("settings", {}))


def items_sorted_by_key(kwargs: Mapping[Any, Any]) -> list[tuple[Any, Any]]:
    return sorted(kwargs.items(), key=lambda item: item[0])


def order_dict_to_string(d: Mapping[Any, Any]) -> str:
    """``str()`` of a dict of these items, in this order."""
    return "{" + ", ".join(f"{key!r}: {value!r}" for key, value in d.items()) + "}"


def force_string(value: Any) -> Any:
    """A dict as a string with its keys sorted (recursively); lists element by element."""
    if isinstance(value, dict):
        return order_dict_to_string(
            {force_string(k): force_string(v) for k, v in items_sorted_by_key(value)}
        )
    if isinstance(value, list):
        return [force_string(element) for element in value]
    return value


def kwargs_to_list(kwargs: Mapping[str, Any]) -> list[str]:
    """``{"b": 2, "a": 1}`` -> ``["a-1", "b-2"]``."""
    return [f"{key}-{force_string(value)}" for key, value in items_sorted_by_key(kwargs)]


def queue_once_key(
    name: str, kwargs: Mapping[str, Any], restrict_to: Iterable[str] | None = None
) -> str:
    """The lock key of task ``name`` for these bound arguments (only ``restrict_to``'s, if
    given)."""
    chosen = kwargs if restrict_to is None else {key: kwargs[key] for key in restrict_to}
    return "_".join(["qo", str(force_string(name)), *kwargs_to_list(chosen)])
