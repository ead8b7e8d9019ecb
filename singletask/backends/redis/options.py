"""What the Redis deployments share: TLS, socket and replica-wait options, password masking,
the parts of the URLs redis-py does not parse (Sentinel's and Cluster's), and the strict check
of the URLs it does (:func:`parse_redis_url`: ``redis://``, ``rediss://``, ``unix://``).

They come from the URL's query string (``rediss://host?ssl_cert_reqs=required&...``) or from the
setting ``singletask_backend_transport_options``, as Celery's Redis result backend reads them
from ``result_backend_transport_options``; a key given in both places takes the URL's value.
"""

from __future__ import annotations

import inspect
import math
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit

from ...exceptions import ConfigurationError
from ..base import MAX_LEASE
from ..urls import mask_url, query_options

__all__ = [
    "RETENTION_OPTIONS",
    "SOCKET_OPTIONS",
    "TLS_OPTIONS",
    "ReplicaWait",
    "connection_options",
    "mask",
    "parse_redis_url",
    "retentions",
    "tls_options",
    "to_bool",
    "url_address",
    "url_credentials",
    "url_db",
    "url_query",
]

#: TLS options: certificate checking, CA bundle, client certificate and key, host name check.
TLS_OPTIONS: Final = (
    "ssl_cert_reqs",
    "ssl_ca_certs",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_check_hostname",
)

#: Socket options, by name, with the function that checks (and converts) a value.
SOCKET_OPTIONS: Final[dict[str, type]] = {
    "socket_timeout": float,
    "socket_connect_timeout": float,
    "socket_keepalive": bool,
    "health_check_interval": int,
}

#: The transport options of how long a released key keeps its last fencing token and its
#: completion marker (see docs/store-redis.rst, "What a released key keeps").
RETENTION_OPTIONS: Final = ("fence_retention", "marker_retention")

#: The transport option of how the plain acquire writes a lock: ``"string"`` (the default, one
#: string record) or ``"hash"`` (a hash, as singletask 0.3.0 and earlier write and read it: for
#: a rolling upgrade from those versions; see docs/store-redis.rst, "The lock record").
RECORD_OPTION: Final = "lock_record"
RECORD_LAYOUTS: Final = ("string", "hash")

#: The longest retention accepted, in seconds: the longest duration the scripts take.
MAX_RETENTION: Final = MAX_LEASE

_CERT_REQS: Final = {
    "required": ssl.CERT_REQUIRED,
    "cert_required": ssl.CERT_REQUIRED,
    "optional": ssl.CERT_OPTIONAL,
    "cert_optional": ssl.CERT_OPTIONAL,
    "none": ssl.CERT_NONE,
    "cert_none": ssl.CERT_NONE,
}

_TRUE: Final = {"1", "true", "yes", "on"}
_FALSE: Final = {"0", "false", "no", "off"}


def mask(url: str) -> str:
    """``url`` with every password replaced by ``**``, for messages and reprs: singletask's one
    masking helper, :func:`singletask.backends.urls.mask_url` (it handles several ``;``-separated
    Sentinel URLs and a cluster URL's comma-separated host list too)."""
    return mask_url(url)


def to_bool(value: object, where: str) -> bool:
    """``value`` as a bool: True/False, or one of the usual strings; else ConfigurationError."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise ConfigurationError(f"{where}: expected true or false, got {value!r}")


def _number(value: object, kind: type, where: str) -> Any:
    if isinstance(value, bool):
        raise ConfigurationError(f"{where}: expected a number, got {value!r}")
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ConfigurationError(f"{where}: expected a number, got {value!r}") from None
    if not math.isfinite(number) or number < 0:
        raise ConfigurationError(f"{where}: expected a number >= 0, got {value!r}")
    return number


def retentions(
    values: Mapping[str, Any], where: str, defaults: tuple[float, float]
) -> tuple[float, float]:
    """``fence_retention`` and ``marker_retention`` of ``values`` in seconds (``defaults`` when
    absent), checked: 0 (nothing kept) or from 1 second to a year."""
    out: list[float] = []
    for name, default in zip(RETENTION_OPTIONS, defaults, strict=True):
        if name not in values:
            out.append(default)
            continue
        what = f"{where}: option {name}"
        seconds = float(_number(values[name], float, what))
        if seconds != 0 and not 1 <= seconds <= MAX_RETENTION:
            raise ConfigurationError(
                f"{what}: expected 0 (nothing kept) or seconds from 1 to {MAX_RETENTION:.0f} "
                f"(a year), got {values[name]!r}"
            )
        out.append(seconds)
    return out[0], out[1]


def record_layout(values: Mapping[str, Any], where: str) -> str:
    """The ``lock_record`` of ``values`` (``"string"`` when absent), checked."""
    layout = values.get(RECORD_OPTION, RECORD_LAYOUTS[0])
    if layout not in RECORD_LAYOUTS:
        raise ConfigurationError(
            f"{where}: option {RECORD_OPTION}: expected one of {', '.join(RECORD_LAYOUTS)}, "
            f"got {layout!r}"
        )
    return str(layout)


def tls_options(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The redis-py keyword arguments for the TLS options in ``values`` (others are ignored).

    ``ssl_cert_reqs`` takes ``required``, ``optional`` or ``none`` (any case, with or without
    ``CERT_``), or an :class:`ssl.VerifyMode`; paths are kept as given.

    Raises:
        ConfigurationError: A value is invalid; the message names the option.
    """
    out: dict[str, Any] = {}
    for name in TLS_OPTIONS:
        if name not in values:
            continue
        value = values[name]
        what = f"{where}: option {name}"
        if name == "ssl_cert_reqs":
            if isinstance(value, ssl.VerifyMode):
                out[name] = value
            elif isinstance(value, str) and value.lower() in _CERT_REQS:
                out[name] = _CERT_REQS[value.lower()]
            else:
                raise ConfigurationError(
                    f"{what}: expected 'required', 'optional' or 'none', got {value!r}"
                )
        elif name == "ssl_check_hostname":
            out[name] = to_bool(value, what)
        elif not isinstance(value, str) or not value:
            raise ConfigurationError(f"{what}: expected a file path, got {value!r}")
        else:
            out[name] = value
    return out


def socket_options(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The redis-py keyword arguments for the socket options in ``values``, checked."""
    out: dict[str, Any] = {}
    for name, kind in SOCKET_OPTIONS.items():
        if name in values:
            what = f"{where}: option {name}"
            value = values[name]
            out[name] = to_bool(value, what) if kind is bool else _number(value, kind, what)
    return out


def check_keys(values: Mapping[str, Any], allowed: set[str] | frozenset[str], where: str) -> None:
    """Raise ConfigurationError naming every key of ``values`` not in ``allowed``."""
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise ConfigurationError(
            f"{where}: unknown option{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, unknown))}; known: {', '.join(sorted(allowed))}"
        )


def connection_options(transport_options: Mapping[str, Any], url: str) -> dict[str, Any]:
    """The client options of a plain ``redis://``/``rediss://`` URL's transport options.

    Raises:
        ConfigurationError: An option is unknown, invalid, or needs another kind of URL.
    """
    where = f"setting singletask_backend_transport_options for {mask(url)!r}"
    allowed = {*TLS_OPTIONS, *SOCKET_OPTIONS}
    for name in ("master_name", "sentinel_kwargs", "min_other_sentinels"):
        if name in transport_options:
            raise ConfigurationError(f"{where}: {name} needs a sentinel:// URL")
    for name in ReplicaWait.OPTIONS:
        if name in transport_options:
            raise ConfigurationError(
                f"{where}: {name} works with sentinel:// and redis+cluster:// URLs, where a "
                "replica is promoted automatically"
            )
    check_keys(transport_options, {*allowed, *RETENTION_OPTIONS, RECORD_OPTION}, where)
    tls = tls_options(transport_options, where)
    if tls and not url.lower().startswith("rediss://"):
        raise ConfigurationError(f"{where}: TLS options need a rediss:// URL")
    return {**tls, **socket_options(transport_options, where)}


@dataclass(frozen=True)
class ReplicaWait:
    """Redis' ``WAIT replicas timeout`` after each acquisition (the opt-in replica wait).

    Attributes:
        replicas: How many replicas must have the new lock before acquire() returns it.
        timeout: How long to wait for them, in seconds (never 0, which waits forever).
    """

    replicas: int
    timeout: float

    #: Transport options that configure it.
    OPTIONS = ("wait_replicas", "wait_timeout")
    #: Default of ``wait_timeout``, in seconds.
    DEFAULT_TIMEOUT = 0.5

    @classmethod
    def from_options(cls, values: Mapping[str, Any], where: str) -> ReplicaWait | None:
        """The wait ``values`` ask for, or None when ``wait_replicas`` is absent or 0."""
        replicas = values.get("wait_replicas", 0)
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise ConfigurationError(
                f"{where}: option wait_replicas: expected a whole number >= 0, got {replicas!r}"
            )
        timeout = _number(
            values.get("wait_timeout", cls.DEFAULT_TIMEOUT), float, f"{where}: option wait_timeout"
        )
        if timeout <= 0:
            raise ConfigurationError(
                f"{where}: option wait_timeout: must be more than 0 seconds (WAIT with 0 "
                f"blocks forever), got {timeout!r}"
            )
        return cls(replicas, timeout) if replicas else None

    @property
    def command(self) -> tuple[str, int, int]:
        """The WAIT command, its timeout in whole milliseconds (at least 1)."""
        return ("WAIT", self.replicas, max(1, round(self.timeout * 1000)))


# -- URL parts (Sentinel and Cluster URLs, which redis-py does not parse) -----------------


def url_port(text: str, default: int, where: str) -> int:
    try:
        port = int(text) if text else default
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise ConfigurationError(f"{where}: invalid port {text!r}")
    return port


def url_address(text: str, default_port: int, where: str) -> tuple[str, int]:
    """``host[:port]`` or ``[v6 address][:port]`` as (host, port)."""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else rest
    else:
        host, _, port = text.partition(":")
    if not host:
        raise ConfigurationError(f"{where}: a host is missing")
    return host, url_port(port, default_port, where)


def url_credentials(parts: SplitResult) -> dict[str, str]:
    userinfo = parts.netloc.rpartition("@")[0]
    if not userinfo:
        return {}
    user, has_password, password = userinfo.partition(":")
    out = {"username": unquote(user)} if user else {}
    if has_password and password:
        out["password"] = unquote(password)
    return out


def url_db(parts: SplitResult, where: str) -> int:
    path = parts.path.strip("/")
    if not path:
        return 0
    if not path.isdigit():
        raise ConfigurationError(f"{where}: the path must be a database number, got {path!r}")
    return int(path)


def url_query(parts: SplitResult, where: str) -> dict[str, str]:
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    check_keys(query, {*TLS_OPTIONS, *SOCKET_OPTIONS}, f"{where}: URL query")
    return query


# -- One server's URLs (redis://, rediss://, unix://), which redis-py parses leniently ------

#: A URL to show in messages about a bad Redis URL.
REDIS_EXAMPLE = "redis://:password@localhost:6379/1"

#: Plain-text client options a Redis URL may carry besides redis-py's parsed ones (objects such
#: as ``retry`` cannot be written in a URL; ``decode_responses`` would change every reply).
_REDIS_TEXT_OPTIONS = frozenset({"client_name", "lib_name", "lib_version", "encoding"})


def _redis_query_names(connection_class: type) -> frozenset[str]:
    """The query options a Redis URL may carry for ``connection_class``: those redis-py parses,
    and the plain-text and ``ssl_*`` parameters of the connection classes' ``__init__``."""
    from redis import connection

    names = set(getattr(connection, "URL_QUERY_ARGUMENT_PARSERS", {}))
    for cls in connection_class.__mro__:
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        for name in inspect.signature(init).parameters:
            if name in _REDIS_TEXT_OPTIONS or name.startswith("ssl_"):
                names.add(name)
    names.add("max_connections")
    return frozenset(names)


def parse_redis_url(url: str) -> dict[str, Any]:
    """Check a ``redis://``, ``rediss://`` or ``unix://`` URL strictly; return redis-py's options.

    Refused (where redis-py would default silently, or fail only when it first connects): a
    port that is not a number from 1 to 65535, a database that is not a whole number from 0
    (in the path or as ``?db=``), a path with more than the database, a ``unix://`` URL
    without a socket path, and a query option redis-py does not know or cannot parse.

    Raises:
        ConfigurationError: The URL is not valid; the message names the part, masks the
            password and shows the expected form.
    """
    from redis import connection

    shown = mask_url(url)
    scheme, sep, _ = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in ("redis", "rediss", "unix"):
        raise ConfigurationError(
            f"{shown!r} is not a Redis URL: expected redis://, rediss:// or unix://, "
            f"for example {REDIS_EXAMPLE!r}"
        )
    parts = urlsplit(url)
    connection_class: type = {
        "redis": connection.Connection,
        "rediss": connection.SSLConnection,
        "unix": connection.UnixDomainSocketConnection,
    }[scheme]
    query = query_options(url, _redis_query_names(connection_class))
    parsers = getattr(connection, "URL_QUERY_ARGUMENT_PARSERS", {})
    options: dict[str, Any] = {}
    for name, value in query.items():
        parser = parsers.get(name)
        try:
            options[name] = parser(value) if parser else value
        except (TypeError, ValueError):
            raise ConfigurationError(
                f"{shown!r}: query option {name!r} has an invalid value"
            ) from None
    if parts.username:
        options["username"] = unquote(parts.username)
    if parts.password:
        options["password"] = unquote(parts.password)
    if scheme == "unix":
        if parts.netloc and "@" not in parts.netloc:
            # No host here: this is user info cut short by a '/', '?' or '#' in the password,
            # and the rest of it would be read as the socket's path.
            raise ConfigurationError(
                f"{shown!r}: a unix:// URL has no host; write unix://:password@/path/to.sock, "
                "with a '/', '?', '#', '@' or '%' in the password percent-encoded"
            )
        if not parts.path:
            raise ConfigurationError(
                f"{shown!r}: a unix:// URL needs the socket's path, e.g. "
                "'unix:///run/redis/redis.sock?db=1'"
            )
        options["path"] = unquote(parts.path)
    else:
        if parts.hostname:
            options["host"] = unquote(parts.hostname)
        try:
            port = parts.port
        except ValueError:
            port = -1
        if port is not None and not 1 <= port <= 65535:
            raise ConfigurationError(
                f"{shown!r}: the port must be a number from 1 to 65535, e.g. {REDIS_EXAMPLE!r}"
            )
        if port is not None:
            options["port"] = port
        path = unquote(parts.path).strip("/")
        if path:
            if "db" in query:
                raise ConfigurationError(
                    f"{shown!r}: the database is given twice (in the path and as ?db=)"
                )
            options["db"] = _database(path, shown)
    if "db" in options:
        options["db"] = _database(str(options["db"]), shown)
    return options


def _database(text: str, shown: str) -> int:
    if not text.isdigit() or not text.isascii():
        raise ConfigurationError(
            f"{shown!r}: the database must be a whole number from 0 (the path of "
            f"{REDIS_EXAMPLE!r} is database 1)"
        )
    return int(text)
