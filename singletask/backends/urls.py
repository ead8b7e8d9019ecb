"""Lock store URLs: the one helper that masks their secrets, and strict parsing of Redis URLs.

Every message, log line and exception text singletask writes that contains a URL passes it
through :func:`mask_url` first, so a password never leaves the process in an error. Parsing is
strict: a URL redis-py would accept with a silent default (``redis://host/abc`` is database 0
there) or with an option it only rejects on the first connection is refused here, up front,
with :class:`~singletask.ConfigurationError`.

This module sits at the bottom of the import graph: it imports only :mod:`singletask.exceptions`.
"""

from __future__ import annotations

import inspect
import re
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from ..exceptions import ConfigurationError

__all__ = ["check_port", "mask_url", "parse_redis_url", "query_options"]

#: Query options whose value is a secret, masked like a password.
SECRET_OPTIONS = frozenset(
    {"password", "passwd", "pwd", "secret", "token", "ssl_password", "sentinel_password"}
)

_SECRET_QUERY = re.compile(
    r"(?P<name>[?&;](?:" + "|".join(sorted(SECRET_OPTIONS)) + r")=)[^&;#]*", re.IGNORECASE
)

#: What a masked secret is replaced with.
MASK = "**"

#: A URL to show in messages about a bad Redis URL.
REDIS_EXAMPLE = "redis://:password@localhost:6379/1"


def mask_url(url: object) -> str:
    """``url`` as text with its password, and secret query values, replaced by ``**``.

    Works on anything, never raises: a malformed URL (no ``://``, a bad port) is masked too, and
    so is each of several URLs separated by ``;`` (Sentinel's).
    The user name stays when a password follows it; credentials without a ``:`` are masked
    whole, since they may be a password put in the wrong place. Everything before the last
    ``@`` counts as credentials, so a password containing ``@`` or ``/`` is masked whole.
    """
    text = url if isinstance(url, str) else repr(url)
    if ";" in text and text.count("://") > 1:  # several URLs (Sentinel's, a broker failover list)
        return ";".join(mask_url(part) for part in text.split(";"))
    sep = text.find("://")
    start = sep + 3 if sep != -1 else 0
    at = text.rfind("@", start)
    if at != -1:
        userinfo = text[start:at]
        user, colon, _ = userinfo.partition(":")
        if not colon and sep == -1:
            # No "://": keep what looks like the scheme ("redis//" of "redis//secret@host").
            match = re.match(r"[A-Za-z][A-Za-z0-9+.\-]*[:/]*", userinfo)
            user, colon = (match.group(0), "") if match else ("", "")
            text = f"{text[:start]}{user}{MASK}{text[at:]}"
        else:
            text = f"{text[:start]}{user + ':' if colon else ''}{MASK}{text[at:]}"
    return _SECRET_QUERY.sub(lambda m: f"{m.group('name')}{MASK}", text)


def check_port(url: str) -> int | None:
    """The port of ``url`` (None when it names none), if it is a number from 1 to 65535.

    Raises:
        ConfigurationError: It is not; the message masks the URL's password.
    """
    try:
        port = urlsplit(url).port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise ConfigurationError(f"{mask_url(url)!r}: the port must be a number from 1 to 65535")
    return port


def query_options(url: str, known: frozenset[str] | set[str]) -> dict[str, str]:
    """The query options of ``url``, each at most once and each in ``known``.

    Raises:
        ConfigurationError: An option is unknown, repeated or empty; the message lists the
            known ones and masks the URL.
    """
    query = urlsplit(url).query
    options: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name not in known:
            raise ConfigurationError(
                f"{mask_url(url)!r}: unknown query option {name!r}"
                + (f"; known options: {', '.join(sorted(known))}" if known else "")
            )
        if name in options:
            raise ConfigurationError(f"{mask_url(url)!r}: query option {name!r} is repeated")
        if value == "":
            raise ConfigurationError(f"{mask_url(url)!r}: query option {name!r} has no value")
        options[name] = value
    return options


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
