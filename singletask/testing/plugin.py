"""The pytest plugin of singletask: fixtures to test your own singleton tasks.

It is registered through the ``pytest11`` entry point, so installing singletask is enough.
Turn it off with ``-p no:singletask`` (on the command line, or in ``addopts``).

Fixtures:

``singletask_app``
    The Celery app the other fixtures act on. By default Celery's ``celery_app`` when the test
    uses it, else the current app. Override it in your ``conftest.py`` to name your app.

``singletask_locks``
    Gives every SingletonTask of ``singletask_app`` a fresh lock store for the test, and
    records what its tasks do when they find a lock held: an
    :class:`~singletask.testing.IsolatedLocks`. The store is in the test's process, unless
    ``--singletask-backend-url`` (or the ini option ``singletask_backend_url``) names a real
    one, such as ``redis://localhost:6379/15``.

``singletask_locks_disabled``
    Switches singleton locking off for the test (see
    :func:`~singletask.testing.locks_disabled`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from celery import current_app

from . import IsolatedLocks, isolated_locks, locks_disabled

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["singletask_app", "singletask_locks", "singletask_locks_disabled"]

_HELP = (
    "lock store URL (redis://...) for the singletask_locks fixture, instead of a fresh "
    "in-process store per test; each test's keys get a namespace of their own"
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("singletask", "singletask")
    group.addoption("--singletask-backend-url", dest="singletask_backend_url", help=_HELP)
    parser.addini("singletask_backend_url", _HELP, default="")


@pytest.fixture
def singletask_app(request: pytest.FixtureRequest) -> Celery:
    """The app the singletask fixtures act on: ``celery_app`` if the test uses it, else the
    current app. Override it to name yours."""
    if "celery_app" in request.fixturenames:
        app: Celery = request.getfixturevalue("celery_app")
        return app
    current: Celery = current_app._get_current_object()  # type: ignore[attr-defined]
    return current


@pytest.fixture
def singletask_locks(
    request: pytest.FixtureRequest, singletask_app: Celery
) -> Iterator[IsolatedLocks]:
    """A fresh lock store for every SingletonTask of ``singletask_app``, for this test."""
    config = request.config
    url = config.getoption("singletask_backend_url") or config.getini("singletask_backend_url")
    with isolated_locks(singletask_app, url=url or None) as locks:
        yield locks


@pytest.fixture
def singletask_locks_disabled(singletask_app: Celery) -> Iterator[None]:
    """Singleton locking switched off for every SingletonTask of ``singletask_app``."""
    with locks_disabled(singletask_app):
        yield
