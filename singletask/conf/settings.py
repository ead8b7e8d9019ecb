"""Settings read from the Celery app's configuration, and their validation.

Every setting is optional. Each ``singletask_lock_*`` setting is the app-wide default of the
task attribute of the same name without the prefix; a task attribute always wins.

The settings, their defaults and bounds are listed once, in the configuration reference
(docs/configuration.rst), which ``tests/docs/test_docs_reference.py`` checks against
:data:`DEFAULTS`.

Settings are looked up with ``app.conf.get``, so Django's ``CELERY_`` namespace works
(``CELERY_SINGLETASK_BACKEND_URL``), and so do old-style upper-case names
(``SINGLETASK_BACKEND_URL``). They are deliberately *not* registered with
``app.add_defaults``, which would shadow values from ``config_from_object``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from ..backends import backend_class, check_url
from ..backends.urls import check_table, mask_url
from ..exceptions import ConfigurationError
from ..protocol.slots import check_limit
from .limits import (
    MAX_SECONDS,
    MIN_RATE_INTERVAL,
    LimitsSetting,
    check_limits_setting,
    parse_rate,
)

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "BACKEND_ERROR_POLICIES",
    "COALESCE",
    "DEFAULTS",
    "MAX_COUNT",
    "MAX_SECONDS",
    "POLICIES",
    "SCOPES",
    "Settings",
    "check_backend_error_policy",
    "check_bool",
    "check_coalesce",
    "check_count",
    "check_limit",
    "check_policy",
    "check_rate",
    "check_scope",
    "check_seconds",
]

#: What an execution that finds its key held does: the three things a locked-out execution
#: can do, and "replace", which preempts the holder (see :mod:`singletask.execution.replace`).
POLICIES: Final = ("skip", "retry", "raise", "replace")

#: Which arguments a coalescing key's follow-up runs with: the first call's, or the latest's.
COALESCE: Final = ("first", "latest")

#: Where a task's duplicates are stopped: only when they execute, already when they are sent,
#: or sent and collapsed into one follow-up run.
SCOPES: Final = ("execution", "queue", "coalesce")

#: What an execution does when the lock store cannot be reached as it starts.
BACKEND_ERROR_POLICIES: Final = ("retry", "run")

#: The largest retry count any option or setting takes.
MAX_COUNT: Final = 1000

#: Library defaults of the settings, by setting name.
DEFAULTS: Final[dict[str, Any]] = {
    "singletask_backend_url": None,
    "singletask_backend_transport_options": None,
    "singletask_backend_table": None,
    "singletask_key_prefix": "singletask:",
    "singletask_lock_policy": "skip",
    "singletask_lock_scope": "execution",
    "singletask_lock_queue_ttl": 3600.0,
    "singletask_lock_ttl": 30.0,
    "singletask_lock_renew": True,
    "singletask_lock_max_hold": None,
    "singletask_lock_retry_countdown": 10.0,
    "singletask_lock_retry_max": 30,
    "singletask_lock_on_backend_error": "retry",
    "singletask_lock_backend_retry_max": 10,
    "singletask_send_events": None,
    "singletask_limits": None,
    "singletask_limit_turns": True,
}


def _check_choice(value: object, choices: Sequence[str], what: str, where: str) -> str:
    """Return ``value`` if it is one of ``choices``; else raise ConfigurationError naming
    ``where`` and listing them."""
    if value not in choices:
        raise ConfigurationError(
            f"{where}: unknown {what} {value!r}; use one of {', '.join(map(repr, choices))}"
        )
    return str(value)


def check_policy(value: object, where: str) -> str:
    """Return ``value`` if it is a known policy; else raise ConfigurationError naming ``where``."""
    return _check_choice(value, POLICIES, "lock policy", where)


def check_scope(value: object, where: str) -> str:
    """Return ``value`` if it is a known lock scope; else raise ConfigurationError."""
    return _check_choice(value, SCOPES, "lock scope", where)


def check_coalesce(value: object, where: str) -> str:
    """Return ``value`` if it is a ``lock_coalesce`` choice; else raise ConfigurationError."""
    return _check_choice(value, COALESCE, "follow-up choice", where)


def check_backend_error_policy(value: object, where: str) -> str:
    """Return ``value`` if it is ``"retry"`` or ``"run"``; else raise ConfigurationError."""
    return _check_choice(
        value, BACKEND_ERROR_POLICIES, "policy for an unreachable lock store", where
    )


def check_bool(value: object, where: str) -> bool:
    """Return ``value`` if it is a bool; else raise ConfigurationError."""
    if not isinstance(value, bool):
        raise ConfigurationError(f"{where}: expected True or False, got {value!r}")
    return value


def check_seconds(
    value: object, where: str, *, allow_zero: bool = False, maximum: float = MAX_SECONDS
) -> float:
    """Return ``value`` as float seconds: a finite number > 0 (or >= 0 with ``allow_zero``)
    and at most ``maximum``.

    Raises:
        ConfigurationError: It is not; the message names ``where`` and the bounds.
    """
    low = "0" if allow_zero else "more than 0"
    bounds = f"from {low} to {maximum:.0f} seconds ({maximum / 86400:g} days)"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigurationError(f"{where}: expected a number of seconds {bounds}, got {value!r}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ConfigurationError(f"{where}: must be {bounds}, got {value!r}")
    if value > maximum:
        raise ConfigurationError(
            f"{where}: must be at most {maximum:.0f} seconds ({maximum / 86400:g} days), "
            f"got {value!r}"
        )
    return float(value)


def check_count(value: object, where: str, *, maximum: int = MAX_COUNT) -> int:
    """Return ``value`` if it is a whole number from 0 to ``maximum``.

    Raises:
        ConfigurationError: It is not; the message names ``where`` and the bounds.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= maximum:
        raise ConfigurationError(
            f"{where}: expected a whole number from 0 to {maximum} (at most {maximum}), "
            f"got {value!r}"
        )
    return value


#: The periods of a ``lock_rate`` ("N/s", "N/m", "N/h", as Celery's ``rate_limit`` writes them).


def check_rate(value: object, where: str) -> float:
    """Return the seconds between two starts that ``value`` allows (``lock_rate``): a rate as
    :func:`parse_rate` reads it, whose interval (period / N) is from 1 ms to 30 days.

    Raises:
        ConfigurationError: It is not such a rate; the message names ``where``.
    """
    number, period = parse_rate(value, where)
    interval = period / number
    if not MIN_RATE_INTERVAL <= interval <= MAX_SECONDS:
        raise ConfigurationError(
            f"{where}: {value!r} spaces starts by {interval:g}s; a rate may space them by "
            f"{MIN_RATE_INTERVAL:g}s to {MAX_SECONDS} seconds (30 days)"
        )
    return interval


def check_key_prefix(value: object, where: str) -> str:
    """Return ``value`` if it is a string that can be part of a key (valid UTF-8 text)."""
    if not isinstance(value, str):
        raise ConfigurationError(f"{where}: expected a string, got {value!r}")
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise ConfigurationError(
            f"{where}: {value!r} cannot be part of a key ({exc.reason}); use valid text"
        ) from exc
    return value


def _lookup(app: Celery, name: str) -> Any:
    conf = app.conf
    for candidate in (name, name.upper()):
        value = conf.get(candidate)
        if value is not None:
            return value
    return DEFAULTS[name]


@dataclass(frozen=True)
class Settings:
    """The app-wide singletask settings, validated. Build with :meth:`from_app`.

    The lock store's URL is found and checked only when :attr:`backend_url` is read, that is
    when a process first needs the lock store: a producer that never touches it (the default
    ``"execution"`` scope) needs no lock store configured.
    """

    key_prefix: str
    lock_policy: str
    lock_scope: str
    lock_queue_ttl: float
    lock_ttl: float
    lock_renew: bool
    lock_max_hold: float | None
    lock_retry_countdown: float
    lock_retry_max: int
    lock_on_backend_error: str
    lock_backend_retry_max: int
    #: ``singletask_backend_transport_options``: Sentinel master name, TLS, the replica wait...
    #: (kept out of the repr: ``sentinel_kwargs`` may hold a password)
    backend_transport_options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    #: The table of a SQL lock store, checked as a name (``singletask_backend_table``).
    backend_table: str | None = None
    #: The lock store's URL as configured (unchecked), or None when not set. (Not in the repr:
    #: it may hold a password.)
    backend_setting: object = field(default=None, repr=False)
    #: The broker URL setting, the default lock store when it is Redis.
    broker_setting: object = field(default=None, repr=False)
    #: A lock store URL given to :meth:`from_app` (the store is given by other means).
    given_backend_url: str | None = field(default=None, repr=False)
    #: ``singletask_send_events``: None follows the worker (``-E``), True/False force it.
    send_events: bool | None = None
    #: ``singletask_limits``: the named limits by name, or a callable name -> limit.
    limits: LimitsSetting = field(default_factory=dict)
    #: ``singletask_limit_turns``: executions that retry until a limit has room wait in its
    #: line, and take their turns (False: whichever retry comes back first takes the room).
    limit_turns: bool = True
    #: Celery's ``worker_send_task_events`` (what ``-E`` turns on), read with the settings: a
    #: producer tells by it whether the workers report the wait of a send
    #: (:func:`singletask.observe.report.reports_wait`), without reading Celery's
    #: configuration on every send.
    worker_events: bool = False

    def backend_options(self) -> dict[str, Any]:
        """Keyword options for :func:`~singletask.backends.backend_from_url` from the settings.

        Raises:
            ConfigurationError: ``singletask_backend_table`` is set for a store without tables
                (or the lock store's URL is not usable, see :attr:`backend_url`).
        """
        options: dict[str, Any] = {}
        if self.backend_table is not None:
            url = self.backend_url
            options["table"] = backend_class(url).check_table_option(
                url, self.backend_table, "setting singletask_backend_table"
            )
        if self.backend_transport_options:
            options["transport_options"] = self.backend_transport_options
        return options

    @property
    def backend_url(self) -> str:
        """The lock store's URL: the one given to :meth:`from_app`, else
        ``singletask_backend_url``, else a Redis broker's URL.

        Raises:
            ConfigurationError: Neither gives a usable URL; the message names the setting, says
                what is wrong with it and masks any password.
        """
        if self.given_backend_url is not None:
            return self.given_backend_url
        if self.backend_setting is not None:
            url, where = self.backend_setting, "setting singletask_backend_url"
            if not isinstance(url, str) or "://" not in url:
                raise ConfigurationError(
                    f"{where}: {mask_url(url)!r} is not a URL (no '://'); write one such as "
                    "'redis://localhost:6379/1'"
                )
        else:
            url = _redis_broker(self.broker_setting)
            where = "setting broker_url (the lock store, as singletask_backend_url is not set)"
            if url is None:
                shown = mask_url(_first_broker(self.broker_setting))
                raise ConfigurationError(
                    "setting singletask_backend_url is not set and the broker "
                    f"({shown}) is not Redis: set app.conf.singletask_backend_url, e.g. to "
                    "'redis://localhost:6379/1'"
                )
        try:
            check_url(url)
        except ConfigurationError as exc:
            raise type(exc)(f"{where}: {exc}") from exc
        return url

    @classmethod
    def from_app(cls, app: Celery, *, backend_url: str | None = None) -> Settings:
        """Read and validate the settings of ``app`` (the lock store's URL is checked only when
        :attr:`backend_url` is read).

        Args:
            app: The Celery app.
            backend_url: Report this as the lock store's URL instead of looking one up: the
                store is given by other means, as in :mod:`singletask.testing`. The settings
                of the store itself (``singletask_backend_url``, ``singletask_backend_table``)
                are then not read.

        Raises:
            ConfigurationError: A setting is invalid.
        """

        def setting(name: str, check: Callable[[object, str], Any]) -> Any:
            return check(_lookup(app, name), f"setting {name}")

        given = backend_url is not None
        return cls(
            key_prefix=setting("singletask_key_prefix", check_key_prefix),
            lock_policy=setting("singletask_lock_policy", check_policy),
            lock_scope=setting("singletask_lock_scope", check_scope),
            lock_queue_ttl=setting("singletask_lock_queue_ttl", check_seconds),
            lock_ttl=setting("singletask_lock_ttl", check_seconds),
            lock_renew=setting("singletask_lock_renew", check_bool),
            lock_max_hold=setting(
                "singletask_lock_max_hold", lambda v, w: None if v is None else check_seconds(v, w)
            ),
            lock_retry_countdown=setting(
                "singletask_lock_retry_countdown",
                lambda v, w: check_seconds(v, w, allow_zero=True),
            ),
            lock_retry_max=setting("singletask_lock_retry_max", check_count),
            lock_on_backend_error=setting(
                "singletask_lock_on_backend_error", check_backend_error_policy
            ),
            lock_backend_retry_max=setting("singletask_lock_backend_retry_max", check_count),
            backend_transport_options=setting(
                "singletask_backend_transport_options", _check_options
            ),
            backend_table=None if given else _backend_table(app),
            backend_setting=None if given else _lookup(app, "singletask_backend_url"),
            broker_setting=app.conf.get("broker_url") or app.conf.get("BROKER_URL"),
            given_backend_url=backend_url,
            send_events=setting(
                "singletask_send_events", lambda v, w: None if v is None else check_bool(v, w)
            ),
            limits=setting(
                "singletask_limits", lambda v, w: {} if v is None else check_limits_setting(v, w)
            ),
            limit_turns=setting("singletask_limit_turns", check_bool),
            worker_events=bool(app.conf.get("worker_send_task_events")),
        )


def _check_options(value: object, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        # (the value itself is not shown: it may hold a password)
        raise ConfigurationError(
            f"{where}: expected a dict of option names to values, got a {type(value).__name__}"
        )
    return dict(value)


def _backend_table(app: Celery) -> str | None:
    table = _lookup(app, "singletask_backend_table")
    return None if table is None else check_table(table, "setting singletask_backend_table")


def _first_broker(broker: object) -> object:
    first = broker[0] if isinstance(broker, list | tuple) and broker else broker
    return first.split(";")[0].strip() if isinstance(first, str) else first


def _redis_broker(broker: object) -> str | None:
    """The first broker URL if it is a Redis one, else None."""
    first = _first_broker(broker)
    if isinstance(first, str) and first.split("://", 1)[0].lower() in ("redis", "rediss"):
        return first
    return None
