"""A task's lock options: declared on the task class, validated once, completed by the app.

:class:`TaskOptions` is built once, when a :class:`~singletask.SingletonTask` subclass is created
(at ``@app.task`` time). It reads the ``lock_*`` attributes, checks every one that is set and
builds the task's :class:`~singletask.protocol.keys.KeySpec`; a bad value raises
:class:`~singletask.ConfigurationError` naming the task and the attribute. An attribute left
``None`` means "use the app's setting". The checks are the validators of
:mod:`singletask.conf.settings`, the same ones the app's ``singletask_*`` settings go through, so
each kind of value is checked, and worded, in one place.

When a task first needs its lock in a process, :meth:`TaskOptions.resolve` fills the attributes
left unset from the app's validated :class:`~singletask.conf.settings.Settings`, giving the task's
:class:`LockOptions`: the one value the execution lifecycle, the policies, send-time
deduplication and the main-process recovery read.
"""

from __future__ import annotations

import difflib
import inspect
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from ..exceptions import ConfigurationError
from ..protocol.keys import KeySpec, run_signature
from .limits import Cost, TaskLimits, check_combination, check_cost, check_named
from .settings import (
    Settings,
    check_backend_error_policy,
    check_bool,
    check_coalesce,
    check_count,
    check_limit,
    check_policy,
    check_rate,
    check_scope,
    check_seconds,
)
from .turns import Priority, Weight, check_priority, check_weight

__all__ = ["ATTRIBUTE_CHECKS", "LockOptions", "TaskOptions"]

logger = logging.getLogger("singletask")


def _seconds(value: float) -> str:
    """``value`` seconds as written, to the millisecond: 2592000, 0.25."""
    return f"{value:.3f}".rstrip("0").rstrip(".")


def _check_countdown(value: object, where: str) -> float:
    return check_seconds(value, where, allow_zero=True)


#: The check of each ``lock_*`` task attribute that takes a plain value (``lock_args`` and
#: ``lock_key`` are checked by :class:`~singletask.protocol.keys.KeySpec` against the task's
#: signature).
ATTRIBUTE_CHECKS: Final[dict[str, Callable[[object, str], object]]] = {
    "lock_policy": check_policy,
    "lock_scope": check_scope,
    "lock_queue_ttl": check_seconds,
    "lock_ttl": check_seconds,
    "lock_renew": check_bool,
    "lock_max_hold": check_seconds,
    "lock_retry_countdown": _check_countdown,
    "lock_retry_max": check_count,
    "lock_on_backend_error": check_backend_error_policy,
    "lock_backend_retry_max": check_count,
    "lock_limit": check_limit,
    "lock_rate": check_rate,
    "lock_debounce": check_seconds,
    "lock_debounce_max": check_seconds,
    "lock_coalesce": check_coalesce,
    "lock_replace_terminate": check_bool,
    "lock_cost": check_cost,
    "lock_weight": check_weight,
    "lock_priority": check_priority,
}

#: The lock scopes a task with ``lock_limit`` above 1 can have. "queue" and "coalesce" keep at
#: most one queued message per key (a reservation, a follow-up): with several holders per key
#: there is no single run for a duplicate to join, so such a combination is refused.
LIMIT_SCOPES: Final = ("execution",)

#: What a store must have for an option in use: the option -> the store's class attribute.
STORE_FEATURES: Final = {
    "limit": ("supports_limit", "keeps one holder per key, so it cannot run {value} at a time"),
    "rate": ("supports_rate", "keeps no rate records, so it cannot count starts"),
    "debounce": ("supports_debounce", "keeps no debounce windows"),
    "coalesce": ("supports_debounce", "keeps no record of a key's latest follow-up"),
    "policy": ("supports_replace", "cannot preempt a holder with a larger fencing token"),
    "limits": ("supports_units", "keeps no named limits"),
    "cost": ("supports_units", "keeps no limits of several units"),
}


#: The task options whose value becomes a lease or reservation in the lock store -> the setting
#: an unset one takes its value from. ``queue_ttl`` counts only for the "queue" and "coalesce"
#: scopes (the only ones that reserve a key when a message is sent).
LEASE_OPTIONS: Final[dict[str, str]] = {
    "ttl": "singletask_lock_ttl",
    "queue_ttl": "singletask_lock_queue_ttl",
}


@dataclass(frozen=True)
class LockOptions:
    """A task's lock options in effect for its app: every value filled in.

    Attributes:
        name: The task's registered name (part of every key).
        prefix: The app's key prefix.
        keys: How a call's arguments become the key's suffix.
        policy: ``"skip"``, ``"retry"`` or ``"raise"``.
        scope: ``"execution"``, ``"queue"`` or ``"coalesce"``.
        queue_ttl: Seconds a sent message keeps its key reserved.
        ttl: The lease, in seconds.
        renew: Whether the lease is renewed while the body runs.
        max_hold: Seconds after which renewal stops (None: no cap).
        retry_countdown: Seconds between lock retries (plus jitter).
        retry_max: Lock retries before ``TaskLocked``.
        on_backend_error: ``"retry"`` or ``"run"`` when the store is unreachable at start.
        backend_retry_max: Retries while the store is unreachable.
        limit: Executions per lock key at a time (``lock_limit``; 1: the singleton).
        rate: The ``lock_rate`` as written (``"10/m"``), or None.
        rate_interval: Seconds between two starts of a key that ``rate`` allows, or None.
        debounce: Seconds a send waits for a later one (``lock_debounce``), or None.
        debounce_max: The longest a window's first send waits (``lock_debounce_max``), or None.
        coalesce: ``"first"`` or ``"latest"``: whose arguments a coalescing follow-up runs with.
        replace_terminate: With ``lock_policy = "replace"``, whether the preempted execution
            is also revoked with ``terminate=True``.
        limits: The named limits an execution takes units of (``lock_limits``), or None.
        cost: The units an execution takes of its key's ``limit`` (``lock_cost``), or None:
            the key's holders are then counted in units, not in holder slots.
        weight: The key's share of a limit's turns (``lock_weight``), or None: 1.
        priority: Turns an execution waiting for a limit moves ahead (``lock_priority``), or
            None: 0.
    """

    name: str
    prefix: str
    keys: KeySpec
    policy: str
    scope: str
    queue_ttl: float
    ttl: float
    renew: bool
    max_hold: float | None
    retry_countdown: float
    retry_max: int
    on_backend_error: str
    backend_retry_max: int
    limit: int = 1
    rate: str | None = None
    rate_interval: float | None = None
    debounce: float | None = None
    debounce_max: float | None = None
    coalesce: str = "first"
    replace_terminate: bool = False
    limits: TaskLimits | None = None
    cost: Cost | None = None
    weight: Weight | None = None
    priority: Priority | None = None

    @property
    def keyless(self) -> bool:
        """True when executions hold no key of their own, as limits alone hold them back
        (``lock_limits`` without ``lock_args``, ``lock_key`` or ``lock_limit``, or the key's
        ``lock_limit`` counted in units by ``lock_cost``). Each then holds a key no other
        execution takes (:func:`singletask.execution.units.own_key`), for its lease."""
        if self.cost is not None:
            return True
        declared = self.keys.lock_args is not None or self.keys.lock_key is not None
        return self.limits is not None and not declared and self.limit == 1

    def key(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The lock key of a call with these arguments.

        Raises:
            LockKeyError: The key cannot be built from these arguments.
        """
        return self.keys.key(self.prefix, self.name, args, kwargs)


@dataclass(frozen=True)
class TaskOptions:
    """The lock options declared on a task class, validated; ``None`` means "the app's setting".

    Build it with :meth:`from_class`; the field ``x`` holds the task attribute ``lock_x``.
    """

    name: str
    keys: KeySpec
    policy: str | None = None
    scope: str | None = None
    queue_ttl: float | None = None
    ttl: float | None = None
    renew: bool | None = None
    max_hold: float | None = None
    retry_countdown: float | None = None
    retry_max: int | None = None
    on_backend_error: str | None = None
    backend_retry_max: int | None = None
    limit: int | None = None
    rate: str | None = None
    debounce: float | None = None
    debounce_max: float | None = None
    coalesce: str | None = None
    replace_terminate: bool | None = None
    limits: TaskLimits | None = None
    cost: Cost | None = None
    weight: Weight | None = None
    priority: Priority | None = None

    @classmethod
    def from_class(cls, task_cls: type[Any], known: Collection[str] = ()) -> TaskOptions:
        """Read and check the ``lock_*`` attributes of a task class.

        ``known`` names every ``lock_*`` attribute the task class may have (its options and
        its ``lock_*`` methods); any other ``lock_*`` attribute is a misspelt option.

        Raises:
            ConfigurationError: An attribute is invalid or unknown; the message names the task
                and it (and, for an unknown one, the closest known option).
        """
        name = task_cls.__dict__.get("name") or getattr(task_cls, "name", None)
        name = str(name or task_cls.__qualname__)
        where = f"task {name!r} attribute"
        if known:
            _refuse_unknown(task_cls, where, known)
        declared: dict[str, Any] = {}
        for attribute, check in ATTRIBUTE_CHECKS.items():
            value = getattr(task_cls, attribute)
            if value is not None:
                check(value, f"{where} {attribute}")
            declared[attribute.removeprefix("lock_")] = value
        lock_key = inspect.getattr_static(task_cls, "lock_key")
        if isinstance(lock_key, staticmethod | classmethod):
            lock_key = lock_key.__get__(None, task_cls)
        signature = run_signature(task_cls)
        keys = KeySpec(name, signature, task_cls.lock_args, lock_key)
        limits = getattr(task_cls, "lock_limits", None)
        if limits is not None:
            limits = TaskLimits.declared(name, signature, limits, f"{where} lock_limits")
        options = cls(name=name, keys=keys, limits=limits, **declared)
        options._check_combinations(where)
        options._warn_about_time_limit(getattr(task_cls, "time_limit", None))
        return options

    def _check_combinations(self, where: str) -> None:
        """Refuse options that cannot hold together (see the docs' limits page)."""
        queueing = self.scope not in (None, *LIMIT_SCOPES)
        if (self.limit or 1) > 1 and queueing:
            raise ConfigurationError(
                f"{where} lock_scope: {self.scope!r} keeps one queued run per key, which "
                f"cannot go with lock_limit = {self.limit}; use lock_scope = 'execution'"
            )
        if self.debounce is not None and queueing:
            raise ConfigurationError(
                f"{where} lock_scope: {self.scope!r} deduplicates sends, and lock_debounce "
                "collapses them: use one or the other (lock_scope = 'execution')"
            )
        self._check_replace(where)
        self._check_limits(where)
        self._check_turns(where)
        if self.coalesce is not None and self.scope not in (None, "coalesce"):
            raise ConfigurationError(
                f"{where} lock_coalesce: chooses the arguments of a coalescing follow-up, and "
                f"lock_scope is {self.scope!r}; use lock_scope = 'coalesce'"
            )
        if self.debounce_max is not None:
            if self.debounce is None:
                raise ConfigurationError(
                    f"{where} lock_debounce_max: bounds the wait of lock_debounce, which the "
                    "task does not set"
                )
            if self.debounce_max < self.debounce:
                raise ConfigurationError(
                    f"{where} lock_debounce_max: {_seconds(self.debounce_max)}s is shorter "
                    f"than lock_debounce ({_seconds(self.debounce)}s)"
                )

    def _check_limits(
        self, where: str, scope: str | None = None, policy: str | None = None
    ) -> None:
        """Refuse what cannot go with ``lock_limits`` or ``lock_cost`` (``scope``, ``policy``:
        the app's, when the task sets none): :func:`~singletask.conf.limits.check_combination`."""
        check_combination(
            where, limits=self.limits, cost=self.cost, limit=self.limit, debounce=self.debounce,
            scope=self.scope if self.scope is not None else scope,
            policy=self.policy if self.policy is not None else policy, rate=self.rate,
            keyed=self.keys.lock_args is not None or self.keys.lock_key is not None,
        )  # fmt: skip

    def _check_turns(self, where: str) -> None:
        """``lock_weight`` and ``lock_priority`` order the turns of a limit's line: a task
        that takes no limit (``lock_limits``, ``lock_cost``) has none to wait in."""
        if self.limits is not None or self.cost is not None:
            return
        for attribute, value in (("lock_weight", self.weight), ("lock_priority", self.priority)):
            if value is not None:
                raise ConfigurationError(
                    f"{where} {attribute}: orders the turns of executions waiting for a limit, "
                    "and the task takes none; name its limits in lock_limits (or set lock_cost)"
                )

    def _check_replace(self, where: str, scope: str | None = None) -> None:
        """Refuse what cannot go with ``lock_policy = "replace"`` (``scope``: the app's, when
        the task sets none)."""
        scope = self.scope if self.scope is not None else scope
        if self.replace_terminate and self.policy not in (None, "replace"):
            raise ConfigurationError(
                f"{where} lock_replace_terminate: applies to lock_policy = 'replace', and the "
                f"task's lock_policy is {self.policy!r}"
            )
        if self.policy != "replace":
            return
        if scope in ("queue", "coalesce"):
            raise ConfigurationError(
                f"{where} lock_policy: 'replace' preempts the running execution, and lock_scope "
                f"{scope!r} keeps a newer call from being sent at all; use lock_scope = "
                "'execution'"
            )
        if self.rate is not None:
            raise ConfigurationError(
                f"{where} lock_policy: 'replace' preempts a holder, and a start refused by "
                "lock_rate has none to preempt; use another policy with lock_rate"
            )
        if self.renew is False:
            raise ConfigurationError(
                f"{where} lock_policy: 'replace' needs lock_renew: the renewer is how a "
                "preempted execution learns that it was replaced"
            )

    def _warn_about_time_limit(self, time_limit: float | None) -> None:
        if self.renew is False and self.ttl and time_limit and self.ttl <= time_limit:
            logger.warning(
                "task %r: lock_ttl (%ss) is not longer than time_limit (%ss) and lock_renew is "
                "False: the lock can expire while the task still runs",
                self.name,
                self.ttl,
                time_limit,
            )

    def check_store(
        self,
        name: str,
        settings: Settings,
        max_lease: float,
        store: str,
        features: Collection[str] = (),
    ) -> None:
        """Refuse a lease option longer than the lock store accepts (its ``max_lease``), an
        option the store cannot keep (``lock_limit`` above 1, ``lock_rate``,
        ``lock_debounce``: ``features`` names the ``supports_*`` attributes the store has),
        and an app-wide ``singletask_lock_scope`` that cannot go with them.

        Each option of :data:`LEASE_OPTIONS` that the task uses, declared on the task or taken
        from the app's setting, must be at most ``max_lease`` seconds. ``store`` names the store
        in the message (its URL scheme).

        Raises:
            ConfigurationError: An option is longer; the message names the task, the attribute
                (or the setting it came from) and the store.
        """
        scope = settings.lock_scope if self.scope is None else self.scope
        policy = settings.lock_policy if self.policy is None else self.policy
        self._check_app_policy(name, scope, policy)
        used = {
            "limits": "lock_limits" if self.limits is not None else None,
            "cost": self.cost if self.cost is not None else None,
            "limit": self.limit if (self.limit or 1) > 1 else None,
            "rate": self.rate,
            "debounce": self.debounce,
            "coalesce": "'latest'" if self.coalesce == "latest" else None,
            "policy": "'replace'" if policy == "replace" else None,
        }
        for option, value in used.items():
            if value is None:
                continue
            where = f"task {name!r} attribute lock_{option}"
            if option == "policy" and self.policy is None:
                where = f"task {name!r}: setting singletask_lock_policy"
            attribute, refusal = STORE_FEATURES[option]
            if attribute not in features:
                raise ConfigurationError(
                    f"{where}: the {store} lock store {refusal.format(value=value)}; use Redis, "
                    "PostgreSQL, MySQL, SQLite or memory"
                )
            if option in ("limit", "debounce") and scope not in LIMIT_SCOPES:
                raise ConfigurationError(
                    f"{where}: cannot go with the app's singletask_lock_scope {scope!r}; set "
                    "lock_scope = 'execution' on the task"
                )
        check_named(name, self.limits, settings.limits)
        for field_name, setting in LEASE_OPTIONS.items():
            if field_name == "queue_ttl" and scope == "execution":
                continue  # never written to the store
            declared = getattr(self, field_name)
            value = getattr(settings, setting.removeprefix("singletask_"))
            where = f"task {name!r}: setting {setting}"
            if declared is not None:
                value, where = declared, f"task {name!r} attribute lock_{field_name}"
            if value > max_lease:
                raise ConfigurationError(
                    f"{where}: {_seconds(value)}s is longer than the {store} lock store accepts "
                    f"(at most {_seconds(max_lease)}s); use a shorter lease"
                )

    def _check_app_policy(self, name: str, scope: str, policy: str) -> None:
        """Refuse what cannot go with the app's ``singletask_lock_policy`` or
        ``singletask_lock_scope``, where the task sets none (``scope``, ``policy``: in effect)."""
        if self.replace_terminate and policy != "replace":
            raise ConfigurationError(
                f"task {name!r} attribute lock_replace_terminate: applies to lock_policy = "
                f"'replace', and the task's lock_policy is {policy!r} (from the app's setting "
                "singletask_lock_policy); set lock_policy = 'replace' or drop it"
            )
        if self.policy is None and policy == "replace":
            resolved = TaskOptions(**{**self.__dict__, "policy": policy})
            resolved._check_replace(f"task {name!r} (setting singletask_lock_policy)", scope)
        elif self.policy == "replace":
            self._check_replace(f"task {name!r} attribute", scope)
        if self.coalesce is not None and scope != "coalesce":
            raise ConfigurationError(
                f"task {name!r} attribute lock_coalesce: cannot go with the app's "
                f"singletask_lock_scope {scope!r}; set lock_scope = 'coalesce' on the task"
            )
        if self.policy is None or self.scope is None:
            self._check_limits(f"task {name!r} (with the app's settings)", scope, policy)

    def resolve(self, name: str, settings: Settings) -> LockOptions:
        """These options for task ``name`` (its registered name), unset ones from ``settings``."""

        def pick(declared: Any, default: Any) -> Any:
            return default if declared is None else declared

        return LockOptions(
            name=name,
            prefix=settings.key_prefix,
            keys=self.keys,
            policy=pick(self.policy, settings.lock_policy),
            scope=pick(self.scope, settings.lock_scope),
            queue_ttl=float(pick(self.queue_ttl, settings.lock_queue_ttl)),
            ttl=float(pick(self.ttl, settings.lock_ttl)),
            renew=pick(self.renew, settings.lock_renew),
            max_hold=pick(self.max_hold, settings.lock_max_hold),
            retry_countdown=float(pick(self.retry_countdown, settings.lock_retry_countdown)),
            retry_max=pick(self.retry_max, settings.lock_retry_max),
            on_backend_error=pick(self.on_backend_error, settings.lock_on_backend_error),
            backend_retry_max=pick(self.backend_retry_max, settings.lock_backend_retry_max),
            limit=pick(self.limit, 1),
            rate=self.rate,
            rate_interval=check_rate(self.rate, "lock_rate") if self.rate is not None else None,
            debounce=self.debounce,
            debounce_max=self.debounce_max,
            coalesce=pick(self.coalesce, "first"),
            replace_terminate=bool(self.replace_terminate),
            limits=self.limits,
            cost=self.cost,
            weight=self.weight,
            priority=self.priority,
        )


def _refuse_unknown(task_cls: type[Any], where: str, known: Collection[str]) -> None:
    """Refuse a ``lock_*`` attribute that is no option (``lock_polcy = "retry"`` would otherwise
    be ignored, and the task would silently run with the default policy)."""
    unknown = sorted(n for n in dir(task_cls) if n.startswith("lock_") and n not in known)
    if unknown:
        attribute = unknown[0]
        options = [*ATTRIBUTE_CHECKS, "lock_args", "lock_key", "lock_limits"]
        close = difflib.get_close_matches(attribute, options, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else f"; the options are {', '.join(options)}"
        raise ConfigurationError(f"{where} {attribute}: no such option{hint}")
