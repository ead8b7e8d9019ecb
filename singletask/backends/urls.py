"""Lock store URLs: the one helper that masks their secrets, and strict checks of their parts
(the port, the query options, the SQL stores' ``table``).

Every message, log line and exception text singletask writes that contains a URL passes it
through :func:`mask_url` first, so a password never leaves the process in an error. The checks
are strict: a port out of range, or a query option that is unknown, repeated or empty, is
refused here, up front, with :class:`~singletask.ConfigurationError`. Each store family parses
its own URLs with them (the Redis ones: :func:`singletask.backends.redis.options.parse_redis_url`).

This module sits at the bottom of the import graph: it imports only :mod:`singletask.exceptions`.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, unquote, urlsplit

from ..exceptions import ConfigurationError

__all__ = [
    "MASK", "SECRET_OPTIONS", "SECRET_WORDS", "TABLE_NAME", "TABLE_SCHEMES", "check_port",
    "check_table", "is_secret_option", "mask_url", "query_options",
]  # fmt: skip

#: Query options whose value is a secret, masked like a password: those of the drivers of every
#: store family (libpq's ``password``, ``sslpassword``, ``oauth_client_secret`` and its SCRAM
#: keys; PyMySQL's ``password``, ``passwd``, ``ssl_key_password``; redis-py's ``password``,
#: ``ssl_password``; the Sentinel connections' ``sentinel_password``) and the usual others. An
#: option is compared by its name percent-decoded and in lower case (``SSL%70assword`` is
#: ``sslpassword``), and any name containing one of :data:`SECRET_WORDS` is masked too.
SECRET_OPTIONS = frozenset(
    {
        "password", "passwd", "pwd", "pass", "secret", "token", "auth", "apikey", "api_key",
        "sslpassword", "ssl_password", "ssl_key_password", "sentinel_password",
        "oauth_client_secret", "scram_client_key", "scram_server_key",
    }
)  # fmt: skip
#: Words that make any query option whose (decoded, lower-case) name contains them a secret.
SECRET_WORDS = ("password", "passwd", "passphrase", "secret", "token", "credential")

#: A query option's name and its ``=``: after ``?`` or ``&`` (or ``;``, which older parsers took
#: for ``&``).
_OPTION = re.compile(r"[?&;](?P<name>[^=&;?#\s]+)=")

#: What a masked secret is replaced with.
MASK = "**"


def mask_url(url: object) -> str:
    """``url`` as text with its password, and the value of every secret query option (see
    ``SECRET_OPTIONS`` and ``SECRET_WORDS``), replaced by ``**``.

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
    return _mask_options(text)


def is_secret_option(name: str) -> bool:
    """Whether the query option ``name`` (as written in a URL) has a secret value: by its name
    percent-decoded, in lower case (see :data:`SECRET_OPTIONS`)."""
    decoded = unquote(name).strip().lower()
    return decoded in SECRET_OPTIONS or any(word in decoded for word in SECRET_WORDS)


def _mask_options(text: str) -> str:
    """``text`` with the value of every secret query option replaced by :data:`MASK`: up to the
    next ``&`` (a driver such as libpq reads ``;`` and ``#`` as part of the value), or the end."""
    out: list[str] = []
    done = 0
    for match in _OPTION.finditer(text):
        if match.start() < done or not is_secret_option(match.group("name")):
            continue  # inside a value masked already, or no secret
        end = text.find("&", match.end())
        out += (text[done : match.end()], MASK)
        done = len(text) if end == -1 else end
    return "".join(out) + text[done:]


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


#: URL schemes of the stores that keep locks in a table (setting ``singletask_backend_table``).
TABLE_SCHEMES = frozenset(
    {"postgresql", "postgres", "postgresql+psycopg", "mysql", "mariadb", "mysql+pymysql"}
)

#: What a table name may be: ``table`` or ``schema.table``, each part as :func:`check_table` says.
TABLE_NAME = re.compile(r"(?:[a-z_][a-z0-9_]{0,47}\.)?[a-z_][a-z0-9_]{0,47}")


def check_table(name: object, where: str = "option table") -> str:
    """Return ``name`` if it is a usable table name (``table`` or ``schema.table``).

    Lower-case letters, digits and underscores only (at most 48 of them per part), so the name
    means the same unquoted in PostgreSQL and MySQL, on every filesystem.

    Raises:
        ConfigurationError: It is not.
    """
    if not isinstance(name, str) or not TABLE_NAME.fullmatch(name):
        raise ConfigurationError(
            f"{where}: expected a table name such as 'singletask_locks' or 'myschema.locks' "
            f"(lower-case letters, digits and '_', at most 48 per part), got {name!r}"
        )
    return name
