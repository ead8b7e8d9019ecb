"""``singletask web`` serves the lock page with the standard library: :func:`make_server`.

A threading :mod:`wsgiref` server: one thread per request (a page polls every few seconds), its
request log on the ``singletask.web`` logger (DEBUG) rather than standard error.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import socketserver
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from .app import LockPage

__all__ = ["LOOPBACK_NAMES", "is_loopback", "make_server"]

logger = logging.getLogger("singletask.web")

#: The host names a page served on a loopback address answers to (see ``LockPage(hosts=)``).
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)


def make_server(page: LockPage, address: str, port: int) -> WSGIServer:
    """A server of ``page`` bound to ``address:port`` (port 0: a free one); call its
    ``serve_forever()``.

    Raises:
        OSError: The address cannot be bound.
    """
    server = (_Server6 if ":" in address else _Server)((address, port), _Handler)
    server.set_app(page)
    return server


def is_loopback(address: str) -> bool:
    """Whether ``address`` reaches this host only (127.0.0.0/8, ::1, "localhost")."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False
