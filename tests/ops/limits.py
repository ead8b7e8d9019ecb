"""Named limits for the tests of the operator surfaces (``singletask locks --limits``, the lock
page, the exporter): a store that keeps them, reached by URL as an operator reaches it, and
limits taken as an execution takes them (``take_units``).

:data:`UNITS_STORES` names the stores those tests run on. The in-process store is shared with
the commands through a plug-in scheme (``shared-memory://``: the commands refuse
``memory://``, which no other process sees); the Redis and SQLite stores join with one word
each in :data:`UNITS_STORES` once they keep named limits (``supports_units``).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from singletask.backends import BACKEND_ALIASES, backend_from_url
from singletask.backends.base import LockBackend, Units
from singletask.backends.memory import MemoryBackend
from singletask.protocol.limits import limit_key
from singletask.protocol.tokens import execution_token

#: The stores the limit tests of the operator surfaces run on (``supports_units``).
UNITS_STORES = ["memory", "sqlite", "redis"]

#: The window of the rates the tests take: long enough never to run out during a test.
PERIOD = 60.0
#: The lease of the holds the tests take.
LEASE = 30.0


class SharedMemoryBackend(MemoryBackend):
    """The in-process store as a plug-in scheme whose URL names one instance of this process."""

    instance: ClassVar[MemoryBackend]

    @classmethod
    def check_url(cls, url: str) -> None:
        """Any ``shared-memory://`` URL names the instance."""

    @classmethod
    def from_url(cls, url: str, **options: Any) -> MemoryBackend:
        return cls.instance


@contextlib.contextmanager
def units_store(
    kind: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, LockBackend]]:
    """A store of ``kind`` (one of :data:`UNITS_STORES`) that keeps named limits: its URL and
    a backend on it."""
    if kind == "memory":
        shared = MemoryBackend()
        monkeypatch.setitem(BACKEND_ALIASES, "shared-memory", f"{__name__}:SharedMemoryBackend")
        monkeypatch.setattr(SharedMemoryBackend, "instance", shared, raising=False)
        url = "shared-memory://"
    elif kind == "sqlite":
        url = f"sqlite:///{request.getfixturevalue('tmp_path')}/locks.db"
    elif kind == "redis":
        request.getfixturevalue("redis_client")  # fails / skips when the server is missing
        url = request.getfixturevalue("redis_url")
    else:
        raise AssertionError(f"no such store {kind!r}")
    backend = backend_from_url(url)
    assert backend.supports_units, f"{kind} keeps no named limits"
    try:
        yield url, backend
    finally:
        backend.close()


def concurrency(prefix: str, name: str, size: int, units: int) -> Units:
    """``units`` of the concurrency limit ``name`` of size ``size``."""
    return Units(limit_key(prefix, name), size, units)


def rate(prefix: str, name: str, size: int, units: int, period: float = PERIOD) -> Units:
    """``units`` started of the rate ``name``: ``size`` units per ``period`` seconds."""
    return Units(limit_key(prefix, name, rate=True), size, units, period)


def take(backend: LockBackend, task_id: str, task: str, *units: Units) -> str:
    """Take ``units`` as an execution of ``task_id`` (of task ``task``) takes them; returns
    its owner token."""
    token = execution_token(task_id, 0)
    meta = {"task_id": task_id, "task": task}
    assert backend.take_units(token, LEASE, list(units), meta=meta).taken
    return token


def new_id() -> str:
    return str(uuid.uuid4())
