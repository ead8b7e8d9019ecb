"""Fixtures of the lock page's tests: a real SQLite lock store, and pages on it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from singletask.backends import backend_from_url
from singletask.backends.base import LockBackend
from singletask.ops.web import LockPage

from .helpers import TOKEN


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tuple[str, LockBackend]]:
    """A SQLite lock store (a real file) and a backend on it."""
    url = f"sqlite:///{tmp_path}/locks.db"
    backend = backend_from_url(url)
    yield url, backend
    backend.close()


@pytest.fixture
def page(store: tuple[str, LockBackend]) -> Iterator[LockPage]:
    instance = LockPage(store[0])
    yield instance
    instance.close()


@pytest.fixture
def releasing(store: tuple[str, LockBackend]) -> Iterator[LockPage]:
    instance = LockPage(store[0], allow_release=True, token=TOKEN)
    yield instance
    instance.close()
