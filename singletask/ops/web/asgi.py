"""The lock page for an ASGI site (FastAPI, Starlette, Django's ``asgi.py``): :func:`asgi`.

A thin adapter of its own rather than a dependency: the page's responses are small and whole,
so a request is read whole, the WSGI application runs in the event loop's default executor (the
store's client blocks) and its response is sent in one body. HTTP only; the ``lifespan``
protocol is answered (nothing to start or stop). The scope's authenticated ``user`` (as
Starlette's ``AuthenticationMiddleware`` sets it) is the ``REMOTE_USER`` the release log names.
"""

from __future__ import annotations

import asyncio
import io
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from .app import Environ, LockPage

__all__ = ["asgi"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_MAX_BODY = 64 * 1024


def asgi(page: LockPage) -> ASGIApp:
    """``page`` as an ASGI 3 application, to mount under a path of an ASGI site (the mount's
    ``root_path`` is where its links point)."""

    async def application(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            raise ValueError(f"the lock page serves HTTP, not {scope['type']!r}")
        body = await _read_body(receive)
        environ = _environ(scope, body)
        loop = asyncio.get_running_loop()
        status, headers, content = await loop.run_in_executor(None, _run, page, environ)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(name.lower().encode(), value.encode()) for name, value in headers],
            }
        )
        await send({"type": "http.response.body", "body": content})

    return application


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size <= _MAX_BODY:  # a larger body is refused by the page (its Content-Length)
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _environ(scope: Scope, body: bytes) -> Environ:
    """The WSGI environ of an ASGI HTTP request (PEP 3333 strings: latin-1 of the bytes)."""
    root = scope.get("root_path", "")
    path = scope["path"]
    if root and path.startswith(root):  # servers and frameworks differ on whether path has it
        path = path[len(root) :]
    client = scope.get("client") or ("", 0)
    server = scope.get("server") or ("localhost", 80)
    environ: Environ = {
        "REQUEST_METHOD": scope["method"],
        "SCRIPT_NAME": root.encode().decode("latin-1"),
        "PATH_INFO": path.encode().decode("latin-1"),
        "QUERY_STRING": scope.get("query_string", b"").decode("latin-1"),
        "SERVER_NAME": str(server[0]),
        "SERVER_PORT": str(server[1]),
        "SERVER_PROTOCOL": f"HTTP/{scope.get('http_version', '1.1')}",
        "REMOTE_ADDR": str(client[0]),
        "CONTENT_LENGTH": str(len(body)),
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": scope.get("scheme", "http"),
        "wsgi.input": io.BytesIO(body),
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": True,
        "wsgi.run_once": False,
    }
    user = scope.get("user")  # Starlette's AuthenticationMiddleware, for the release log
    name = getattr(user, "display_name", "") if getattr(user, "is_authenticated", False) else ""
    if name:
        environ["REMOTE_USER"] = str(name)
    for raw_name, raw_value in scope.get("headers", []):
        name = raw_name.decode("latin-1").upper().replace("-", "_")
        value = raw_value.decode("latin-1")
        if name == "CONTENT_TYPE":
            environ["CONTENT_TYPE"] = value
        elif name == "CONTENT_LENGTH":
            continue  # the body as read
        else:
            key = f"HTTP_{name}"
            environ[key] = f"{environ[key]},{value}" if key in environ else value
    return environ


def _run(page: LockPage, environ: Environ) -> tuple[int, list[tuple[str, str]], bytes]:
    started: list[Any] = []

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        started[:] = [int(status.split(" ", 1)[0]), headers]
        return lambda data: None

    content = b"".join(page(environ, start_response))
    return started[0], started[1], content
