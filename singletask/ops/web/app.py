"""The lock page as a WSGI application (:class:`LockPage`); see docs/web.rst.

Routes, relative to where the application is mounted:

* ``GET /``: the page (``assets/index.html``), ``GET /static/<name>``: its script and style;
* ``GET /api/locks?task=&key=``: what the store holds under the key prefix, as JSON;
* ``GET /api/lock?key=``: every holder of one key, and its other records;
* ``POST /api/release``: only when built with ``allow_release=True`` (else 404). It needs the
  token in the ``X-Singletask-Token`` header and a JSON body ``{"key", "holder", "slot"}``: the
  release is owner-checked (:func:`~singletask.ops.inventory.release_lock` with the holder's task
  id).

Everything the page shows is read through :mod:`singletask.ops.inventory`; the lock store's
client is made on the first request in each process (so a forking server gets one per child),
and shared by the requests, which read the store concurrently.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import threading
from collections.abc import Callable, Collection, Iterable, Iterator
from datetime import datetime, timezone
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, quote

from ...backends import backend_from_url, check_url
from ...backends.base import LockBackend
from ...backends.urls import mask_url
from ...exceptions import BackendError, ConfigurationError, UnsupportedOperation
from ..inventory import LockRecord, find_locks, holders_of, release_lock
from .bookkeeping import matches, state_records

__all__ = ["TOKEN_HEADER", "LockPage"]

logger = logging.getLogger("singletask.web")

#: The request header that carries the release token (a header, not a cookie: a page of another
#: site cannot send it).
TOKEN_HEADER = "X-Singletask-Token"
#: The shortest release token accepted.
MIN_TOKEN = 16

StartResponse = Callable[..., Any]
Environ = dict[str, Any]

_ASSETS = {
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "index.html": "text/html; charset=utf-8",
    "icon.svg": "image/svg+xml",
}
#: Every response: the page may load and call its own origin only, and never be framed.
_SECURITY = [
    (
        "Content-Security-Policy",
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    ),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("X-Frame-Options", "DENY"),
]
_STATUS = {
    200: "200 OK", 301: "301 Moved Permanently", 400: "400 Bad Request", 403: "403 Forbidden",
    404: "404 Not Found", 405: "405 Method Not Allowed", 409: "409 Conflict",
    413: "413 Content Too Large", 415: "415 Unsupported Media Type",
    503: "503 Service Unavailable",
}  # fmt: skip
_MAX_BODY = 4096


class LockPage:
    """The live lock page of one lock store, as a WSGI application.

    Args:
        url: The lock store's URL (``redis://...``, ``postgresql://...``, ``sqlite:///...``).
        prefix: The key prefix to list (the app's ``singletask_key_prefix``).
        backend_options: Keyword options for
            :func:`~singletask.backends.backend_from_url` (a table, transport options).
        allow_release: Offer the release of a holder (owner-checked). Off by default: the page
            is then read-only and has no release endpoint.
        token: The release token, at least 16 characters; required with ``allow_release``.
        refresh: Seconds between two reads of the store by an open page.
        limit: At most this many records per list.
        hosts: The host names the page answers to (a request's ``Host`` header, its port
            left out); any other gets 400. ``singletask web`` on a loopback address answers to
            ``127.0.0.1``, ``localhost`` and ``::1`` only, so that a page of another site cannot
            reach it through a DNS name of its own that resolves to 127.0.0.1 (DNS
            rebinding). None (the default): any, for a site that checks it itself.

    Raises:
        ConfigurationError: An argument is not usable (the message names it).
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "singletask:",
        backend_options: dict[str, Any] | None = None,
        allow_release: bool = False,
        token: str | None = None,
        refresh: float = 2.0,
        limit: int = 1000,
        hosts: Collection[str] | None = None,
    ) -> None:
        if not isinstance(url, str) or "://" not in url:
            raise ConfigurationError(f"LockPage: url {mask_url(url)!r} is not a lock store URL")
        try:
            check_url(url)  # the scheme, the driver and the options: before the first request
        except ConfigurationError as exc:
            raise type(exc)(f"LockPage: {exc}") from exc
        if not isinstance(prefix, str) or not prefix:
            raise ConfigurationError(f"LockPage: prefix {prefix!r} must be a non-empty string")
        if allow_release and (not isinstance(token, str) or len(token.strip()) < MIN_TOKEN):
            raise ConfigurationError(
                f"LockPage: allow_release needs a token of at least {MIN_TOKEN} characters"
            )
        if not isinstance(refresh, (int, float)) or not 0.2 <= refresh <= 3600:
            raise ConfigurationError(f"LockPage: refresh {refresh!r} must be 0.2 to 3600 seconds")
        if not isinstance(limit, int) or limit < 1:
            raise ConfigurationError(f"LockPage: limit {limit!r} must be a positive integer")
        if hosts is not None and (
            isinstance(hosts, str) or not all(isinstance(h, str) and h for h in hosts)
        ):
            raise ConfigurationError(f"LockPage: hosts {hosts!r} must be a list of host names")
        self.url = url
        self.where = mask_url(url)
        self.prefix = prefix
        self.backend_options = dict(backend_options or {})
        self.allow_release = allow_release
        self._token = token.strip() if allow_release and token else None
        self.refresh = float(refresh)
        self.limit = limit
        self.hosts = None if hosts is None else frozenset(host.lower() for host in hosts)
        self._backend: LockBackend | None = None
        self._pid = 0
        self._guard = threading.Lock()

    @classmethod
    def from_celery(cls, app: Any, **options: Any) -> LockPage:
        """The page of the lock store a Celery app's settings name (URL, prefix, table and
        transport options); ``options`` as for the constructor.

        Raises:
            ConfigurationError: A setting is invalid.
        """
        from ...conf.settings import Settings

        settings = Settings.from_app(app)
        return cls(
            settings.backend_url,
            prefix=settings.key_prefix,
            backend_options=settings.backend_options(),
            **options,
        )

    # The store -----------------------------------------------------------------------------

    def _store(self) -> LockBackend:
        """The store's client of this process (made on first use, again after a fork).

        Only making it is serialised: the requests then read the store at once, each bounded by
        the store's own timeout, never queued behind another's read (every store's client is
        safe to share between threads: a pool of connections, or one serialised connection).
        """
        with self._guard:
            if self._backend is None or self._pid != os.getpid():
                self._backend = backend_from_url(self.url, **self.backend_options)
                self._pid = os.getpid()
            return self._backend

    def close(self) -> None:
        """Close the store's client (a later request makes a new one)."""
        with self._guard:
            if self._backend is not None and self._pid == os.getpid():
                self._backend.close()
            self._backend = None

    # WSGI ----------------------------------------------------------------------------------

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "GET").upper()
        path = environ.get("PATH_INFO") or ""
        if self.hosts is not None and _host(environ) not in self.hosts:
            return _json(start_response, 400, {"error": "this page does not answer to that host"})
        if path == "":  # mounted at /locks and asked for /locks: relative links need the slash
            where = quote(environ.get("SCRIPT_NAME", "")) + "/"
            return _send(start_response, 301, b"", "text/plain", [("Location", where)])
        read_only = method in ("GET", "HEAD")
        if path == "/api/release" and self.allow_release:
            if method != "POST":
                return _send(start_response, 405, b"", "text/plain", [("Allow", "POST")])
            return self._release(environ, start_response)
        routes: dict[str, Callable[[Environ, StartResponse], Iterable[bytes]]] = {
            "/": self._index,
            "/api/locks": self._locks,
            "/api/lock": self._lock,
        }
        handler = routes.get(path)
        if handler is None and path.startswith("/static/") and path[8:] in _ASSETS:
            handler = self._asset
        if handler is None:
            return _json(start_response, 404, {"error": "not found"})
        if not read_only:
            return _send(start_response, 405, b"", "text/plain", [("Allow", "GET, HEAD")])
        answer = handler(environ, start_response)
        return [b""] if method == "HEAD" else answer  # the headers of a GET, no body

    def _index(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        return _send(start_response, 200, _asset("index.html"), _ASSETS["index.html"])

    def _asset(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        name = environ["PATH_INFO"][8:]
        return _send(start_response, 200, _asset(name), _ASSETS[name])

    def _locks(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        query = _query(environ)
        task, key = query.get("task", "").strip(), query.get("key", "").strip()
        body: dict[str, Any] = self._about()
        try:
            store = self._store()
            body.update(self._list_locks(store, task, key))
            body.update(state_records(store, self.prefix, task=task, key=key, limit=self.limit))
        except BackendError as exc:
            return _json(start_response, 503, {**body, "error": _first_line(exc)})
        return _json(start_response, 200, body)

    def _list_locks(self, store: LockBackend, task: str, key: str) -> dict[str, Any]:
        records: list[dict[str, Any]] = []
        try:
            for record in find_locks(store, self.prefix):
                if matches(record.task, task) and matches(record.key, key):
                    if len(records) >= self.limit:
                        return {"locks": records, "locks_note": f"the first {self.limit} shown"}
                    records.append(record.as_json())
        except UnsupportedOperation as exc:
            return {"locks": None, "locks_note": f"{exc} (look a key up by its name)"}
        return {"locks": records, "locks_note": None}

    def _lock(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        key = _query(environ).get("key", "")
        if not key:
            return _json(start_response, 400, {"error": "give the lock key: ?key=KEY"})
        body = self._about()
        try:
            store = self._store()
            holders = [record.as_json() for record in holders_of(store, key)]
            state = state_records(store, self.prefix, exact=key, limit=self.limit)
        except BackendError as exc:
            return _json(start_response, 503, {**body, "error": _first_line(exc)})
        return _json(start_response, 200, {**body, "key": key, "holders": holders, **state})

    def _about(self) -> dict[str, Any]:
        return {
            "now": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
            "store": self.where,
            "prefix": self.prefix,
            "refresh": self.refresh,
            "release": self.allow_release,
        }

    def _release(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        who = _who(environ)
        given = environ.get("HTTP_" + TOKEN_HEADER.upper().replace("-", "_"), "")
        assert self._token is not None
        if not hmac.compare_digest(given.encode(), self._token.encode()):
            logger.warning("lock page: release refused to %s: %s", who,
                           "wrong token" if given else "no token")  # fmt: skip
            return _json(start_response, 403, {"error": "release refused: wrong or no token"})
        content_type = environ.get("CONTENT_TYPE", "").partition(";")[0].strip().lower()
        if content_type != "application/json":
            return _json(start_response, 415, {"error": "send the request as application/json"})
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = -1
        if not 0 < length <= _MAX_BODY:
            return _json(start_response, 413, {"error": f"a body of 1 to {_MAX_BODY} bytes"})
        try:
            request = _release_request(json.loads(environ["wsgi.input"].read(length)))
        except ValueError as exc:
            return _json(start_response, 400, {"error": str(exc)})
        key, holder, slot = request
        try:
            store = self._store()
            released = release_lock(store, key, holder=holder, slot=slot)
            after = [] if released else holders_of(store, key)
        except BackendError as exc:
            logger.warning("lock page: release of %r asked by %s failed: %s", key, who, exc)
            return _json(start_response, 503, {"error": _first_line(exc)})
        if released is None:
            logger.warning("lock page: release of %r (slot %s) for task %s asked by %s: not "
                           "released, %s", key, slot, holder, who, _state(after))  # fmt: skip
            return _json(
                start_response, 409,
                {"error": f"not released: {_state(after)}", "holders": _json_records(after)},
            )  # fmt: skip
        logger.warning("lock page: lock %r (slot %s) held by task %s released, asked by %s",
                       key, slot, holder, who)  # fmt: skip
        return _json(start_response, 200, {"released": released.as_json()})


def _release_request(data: object) -> tuple[str, str, int]:
    """The key, holder and slot of a release request's body.

    Raises:
        ValueError: The body is not such an object (the message says what is wrong).
    """
    if not isinstance(data, dict):
        raise ValueError('the body must be a JSON object {"key", "holder", "slot"}')
    key, holder, slot = data.get("key"), data.get("holder"), data.get("slot", 0)
    if not isinstance(key, str) or not key:
        raise ValueError('"key" must be the lock key')
    if not isinstance(holder, str) or not holder:
        raise ValueError('"holder" must be the task id of the holder to release')
    if not isinstance(slot, int) or isinstance(slot, bool) or slot < 0:
        raise ValueError('"slot" must be a holder slot: 0 or more')
    return key, holder, slot


def _state(records: list[LockRecord]) -> str:
    if not records:
        return "the lock is not held"
    return "it is held by " + ", ".join(record.describe() for record in records)


def _json_records(records: list[LockRecord]) -> list[dict[str, Any]]:
    return [record.as_json() for record in records]


def _who(environ: Environ) -> str:
    """Who asked: the authenticated user a server in front set (``REMOTE_USER``), and the
    remote address."""
    user = environ.get("REMOTE_USER") or "anonymous"
    return f"{user} at {environ.get('REMOTE_ADDR') or 'an unknown address'}"


def _host(environ: Environ) -> str:
    """The request's host name: its ``Host`` header without the port (an IPv6 address without
    its brackets)."""
    host = str(environ.get("HTTP_HOST") or environ.get("SERVER_NAME") or "").lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if ":" in host else host


def _query(environ: Environ) -> dict[str, str]:
    parsed = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
    return {name: values[0] for name, values in parsed.items()}


def _first_line(exc: Exception) -> str:
    text = str(exc)
    return mask_url(text.splitlines()[0]) if text else type(exc).__name__


def _asset(name: str) -> bytes:
    return (resources.files(__package__) / "assets" / name).read_bytes()


def _json(start_response: StartResponse, status: int, body: object) -> Iterator[bytes]:
    data = json.dumps(body).encode()
    return _send(start_response, status, data, "application/json", [("Cache-Control", "no-store")])


def _send(
    start_response: StartResponse,
    status: int,
    body: bytes,
    content_type: str,
    headers: list[tuple[str, str]] | None = None,
) -> Iterator[bytes]:
    start_response(
        _STATUS[status],
        [
            ("Content-Type", content_type),
            ("Content-Length", str(len(body))),
            *_SECURITY,
            *(headers or []),
        ],
    )
    return iter([body])
