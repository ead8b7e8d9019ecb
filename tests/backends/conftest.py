"""Fixtures the SQL store tests share (test_sql.py, test_sql_faults.py): each test names its
server with the ``sql_store`` parameter (``postgresql`` or ``mysql``, tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from singletask.backends import backend_from_url

SqlStore = tuple[str, str]


@pytest.fixture
def kind(sql_store: SqlStore) -> str:
    """``postgresql`` or ``mysql``: the server of the test's ``sql_store``."""
    return "postgresql" if sql_store[0].startswith("postgresql") else "mysql"


@pytest.fixture
def store(sql_store: SqlStore) -> Iterator[Any]:
    """A store on the test's own table of its ``sql_store``, closed after the test."""
    url, table = sql_store
    backend = backend_from_url(url, table=table)
    yield backend
    backend.close()
