"""What a memcached server holds, with the time left before each item expires.

memcached cannot list its keys for a lock store's use, but a test server can be asked for a dump
of its items (``lru_crawler metadump all``: a best-effort listing, complete on an idle server).
Used to check that every item the memcached:// and django:// stores write has an expiry.
"""

from __future__ import annotations

import socket
import time
from typing import Any
from urllib.parse import unquote

import pytest


def memcached_records(port: int, match: str) -> dict[str, float | None]:
    """Every item of the server on ``port`` whose key contains ``match``: ``{key: seconds left}``,
    ``None`` for an item that never expires."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"lru_crawler metadump all\r\n")
        data = b""
        while not data.endswith(b"END\r\n"):
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("memcached closed the metadump")
            data += chunk
    now = time.time()
    found: dict[str, float | None] = {}
    for line in data.decode().splitlines():
        fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
        key = unquote(fields.get("key", ""))
        if match in key:
            expires = int(fields["exp"])
            found[key] = None if expires < 0 else expires - now
    return found


def inspect_memcached(
    backend: Any, request: pytest.FixtureRequest, match: str
) -> dict[str, float | None]:
    """An inspector of the contract suite's expiry check, for the ``memcached`` and
    ``django-memcached`` params (both use the session's memcached server)."""
    return memcached_records(request.getfixturevalue("memcached_server").port, match)
