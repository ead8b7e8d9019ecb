"""Settings read from the Celery app's configuration, and their validation.

Every setting is optional. Each ``singletask_lock_*`` setting is the app-wide default of the
task attribute of the same name without the prefix; a task attribute always wins.

===================================  ====================  ====================================
setting                              default               meaning
===================================  ====================  ====================================
``singletask_backend_url``           the broker, if Redis  where locks live
``singletask_backend_table``         ``None``              table of a SQL lock store
``singletask_key_prefix``            ``"singletask:"``     prefix of every lock key
``singletask_lock_policy``           ``"skip"``            ``"skip"``, ``"retry"``, ``"raise"``
``singletask_lock_scope``            ``"execution"``       also ``"queue"`` or ``"coalesce"``
``singletask_lock_queue_ttl``        ``3600``              longest a sent message stays reserved
``singletask_lock_ttl``              ``30``                lease of a lock, in seconds
``singletask_lock_renew``            ``True``              renew the lease while the body runs
``singletask_lock_max_hold``         ``None``              stop renewing after this many seconds
``singletask_lock_retry_countdown``  ``10``                seconds between lock retries
``singletask_lock_retry_max``        ``30``                lock retries before ``TaskLocked``
``singletask_lock_on_backend_error`` ``"retry"``           ``"retry"`` or ``"run"`` unlocked
``singletask_lock_backend_retry_max`` ``10``               store-outage retries before failing
===================================  ====================  ====================================

``singletask_backend_transport_options`` (default ``{}``) holds options of the lock store's
client: a Sentinel master name, TLS files, socket timeouts, the replica wait.

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

from kombu.utils.url import maybe_sanitize_url

from .backends._sql import TABLE_SCHEMES, check_table
from .exceptions import ConfigurationError

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "BACKEND_ERROR_POLICIES",
    "DEFAULTS",
    "POLICIES",
    "SCOPES",
    "Settings",
    "check_backend_error_policy",
    "check_bool",
    "check_count",
    "check_policy",
    "check_scope",
    "check_seconds",
]

#: The three things a locked-out execution can do.
POLICIES: Final = ("skip", "retry", "raise")

#: Where a task's duplicates are stopped: only when they execute, already when they are sent,
#: or sent and collapsed into one follow-up run.
SCOPES: Final = ("execution", "queue", "coalesce")

#: What an execution does when the lock store cannot be reached as it starts.
BACKEND_ERROR_POLICIES: Final = ("retry", "run")

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


def check_seconds(value: object, where: str, *, allow_zero: bool = False) -> float:
    """Return ``value`` as float seconds: a finite number > 0 (or >= 0 with ``allow_zero``)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigurationError(f"{where}: expected a number of seconds, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = "zero or more" if allow_zero else "more than zero"
        raise ConfigurationError(f"{where}: must be {bound} seconds, got {value!r}")
    return float(value)


def check_count(value: object, where: str) -> int:
    """Return ``value`` if it is a whole number >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(f"{where}: expected a whole number >= 0, got {value!r}")
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
    """The app-wide singletask settings, validated. Build with :meth:`from_app`."""

    backend_url: str
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
    backend_table: str | None = None

    def backend_options(self) -> dict[str, Any]:
        """Keyword options for :func:`~singletask.backends.backend_from_url` from the settings."""
        options: dict[str, Any] = {}
        if self.backend_table is not None:
            options["table"] = self.backend_table
        if self.backend_transport_options:
            options["transport_options"] = self.backend_transport_options
        return options

    @classmethod
    def from_app(cls, app: Celery, *, backend_url: str | None = None) -> Settings:
        """Read and validate the settings of ``app``.

        Args:
            app: The Celery app.
            backend_url: Report this as the lock store's URL instead of looking one up: the
                store is given by other means, as in :mod:`singletask.testing`. The settings
                of the store itself (``singletask_backend_url``, ``singletask_backend_table``)
                are then not read.

        Raises:
            ConfigurationError: A setting is invalid, or no backend URL can be found.
        """

        def setting(name: str, check: Callable[[object, str], Any]) -> Any:
            return check(_lookup(app, name), f"setting {name}")

        prefix = _lookup(app, "singletask_key_prefix")
        if not isinstance(prefix, str):
            raise ConfigurationError(
                f"setting singletask_key_prefix: expected a string, got {prefix!r}"
            )
        given = backend_url is not None
        backend_url = backend_url if backend_url is not None else _backend_url(app)
        return cls(
            backend_url=backend_url,
            key_prefix=prefix,
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
            backend_table=None if given else _backend_table(app, backend_url),
        )


def _check_options(value: object, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigurationError(
            f"{where}: expected a dict of option names to values, got {value!r}"
        )
    return dict(value)


def _backend_table(app: Celery, backend_url: str) -> str | None:
    table = _lookup(app, "singletask_backend_table")
    if table is None:
        return None
    scheme = backend_url.split("://", 1)[0].lower()
    if scheme not in TABLE_SCHEMES:
        raise ConfigurationError(
            f"setting singletask_backend_table: the lock store {scheme}:// has no table; the "
            f"setting applies to {', '.join(f'{s}://' for s in sorted(TABLE_SCHEMES))} only"
        )
    return check_table(table, "setting singletask_backend_table")


def _backend_url(app: Celery) -> str:
    url = _lookup(app, "singletask_backend_url")
    if url is not None:
        if not isinstance(url, str) or "://" not in url:
            raise ConfigurationError(
                f"setting singletask_backend_url: expected a URL such as "
                f"'redis://localhost:6379/1', got {url!r}"
            )
        return url
    broker = app.conf.get("broker_url") or app.conf.get("BROKER_URL")
    first = broker[0] if isinstance(broker, list | tuple) and broker else broker
    if isinstance(first, str):
        first = first.split(";")[0].strip()
        if first.split("://", 1)[0].lower() in ("redis", "rediss"):
            return first
    raise ConfigurationError(
        "setting singletask_backend_url is not set and the broker "
        f"({maybe_sanitize_url(first) if isinstance(first, str) else first!r}) is not Redis: "
        "set app.conf.singletask_backend_url, e.g. to 'redis://localhost:6379/1'"
    )
