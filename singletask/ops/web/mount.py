"""The lock page under a path of another WSGI application (Django's or Flask's): :func:`mount`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ...exceptions import ConfigurationError
from .app import Environ, StartResponse

__all__ = ["mount"]

WSGIApp = Callable[[Environ, StartResponse], Iterable[bytes]]


def mount(site: WSGIApp, path: str, page: Any) -> WSGIApp:
    """A WSGI application that sends the requests under ``path`` (such as ``"/locks"``) to
    ``page`` and every other request to ``site``.

    ``page`` sees the path after ``path`` as its ``PATH_INFO`` and ``path`` added to its
    ``SCRIPT_NAME``, as a WSGI server mounting it there would do.

    Raises:
        ConfigurationError: ``path`` does not start with "/" or ends with one.
    """
    if not isinstance(path, str) or not path.startswith("/") or path.endswith("/"):
        raise ConfigurationError(
            f"mount: path {path!r} must start with '/' and not end with one, e.g. '/locks'"
        )

    def application(environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        info = environ.get("PATH_INFO") or ""
        if info == path or info.startswith(path + "/"):
            environ = {
                **environ,
                "SCRIPT_NAME": environ.get("SCRIPT_NAME", "") + path,
                "PATH_INFO": info[len(path) :],
            }
            return page(environ, start_response)  # type: ignore[no-any-return]
        return site(environ, start_response)

    return application
