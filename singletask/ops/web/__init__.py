"""The live lock page (``singletask web``): what the lock store holds, in a browser.

:class:`LockPage` is a WSGI application; :func:`asgi` wraps it for an ASGI site and
:func:`mount` puts it under a path of another WSGI application. ``singletask web`` serves it on
its own (``singletask.ops.web.server``). See docs/web.rst.
"""

from __future__ import annotations

from .app import TOKEN_HEADER, LockPage
from .asgi import asgi
from .mount import mount

__all__ = ["TOKEN_HEADER", "LockPage", "asgi", "mount"]
