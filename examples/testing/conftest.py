"""The test settings of the application under test, and singletask's fixtures pointed at it."""

from __future__ import annotations

import pytest
from celery import Celery

import webshop

# No server in the tests: an in-memory broker and result backend (for the worker tests), set
# before anything is sent. The lock store is the singletask_locks fixture's.
webshop.app.conf.update(
    broker_url="memory://",
    result_backend="cache+memory://",
    task_default_queue="shop-tests",
)


@pytest.fixture
def singletask_app() -> Celery:
    """The app whose singleton tasks the ``singletask_locks`` fixture isolates."""
    return webshop.app


@pytest.fixture(autouse=True)
def _forget() -> None:
    webshop.synced.clear()
    webshop.charged.clear()
