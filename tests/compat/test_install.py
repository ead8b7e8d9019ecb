"""singletask.compat.install(): the old import paths resolve to the compat layer."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest

import singletask.compat
from singletask import ConfigurationError
from singletask.compat import heimdall, once, singleton


@pytest.fixture
def installed() -> Iterator[None]:
    singletask.compat.install()
    yield
    singletask.compat.uninstall()


def test_unchanged_imports_give_the_compat_classes(installed: None) -> None:
    from celery_heimdall import AlreadyQueuedError, HeimdallTask  # type: ignore[import-not-found]
    from celery_once import AlreadyQueued, QueueOnce  # type: ignore[import-not-found]
    from celery_once.backends.redis import Redis  # type: ignore[import-not-found]
    from celery_singleton import DuplicateTaskError, Singleton  # type: ignore[import-not-found]
    from celery_singleton.backends.base import BaseBackend  # type: ignore[import-not-found]

    assert (QueueOnce, AlreadyQueued) == (once.QueueOnce, once.AlreadyQueued)
    assert (Singleton, DuplicateTaskError) == (singleton.Singleton, singleton.DuplicateTaskError)
    assert (HeimdallTask, AlreadyQueuedError) == (
        heimdall.HeimdallTask,
        heimdall.AlreadyQueuedError,
    )
    assert Redis is importlib.import_module("singletask.compat.once.backends.redis").Redis
    assert (
        BaseBackend is importlib.import_module("singletask.compat.singleton.backends").BaseBackend
    )


def test_every_alias_is_a_module_entry(installed: None) -> None:
    for old, new in singletask.compat.ALIASES.items():
        assert sys.modules[old] is sys.modules[new]


def test_uninstall_removes_the_aliases(installed: None) -> None:
    singletask.compat.uninstall()
    assert "celery_once" not in sys.modules


def test_install_one_library_only() -> None:
    singletask.compat.install("celery_once")
    try:
        assert "celery_once" in sys.modules
        assert "celery_singleton" not in sys.modules
    finally:
        singletask.compat.uninstall()
    with pytest.raises(ConfigurationError, match="celery_other"):
        singletask.compat.install("celery_other")


def test_an_old_library_imported_already_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    real = ModuleType("celery_once")
    real.__file__ = "/site-packages/celery_once/__init__.py"
    monkeypatch.setitem(sys.modules, "celery_once", real)
    with pytest.raises(ConfigurationError, match="before it is imported"):
        singletask.compat.install()


def test_a_direct_call_takes_no_lock_and_needs_no_store() -> None:
    """``task(x)`` runs the body as a function, as under the old libraries: no ONCE setting,
    no Redis, no result backend is needed for it."""
    from celery import Celery

    app = Celery("direct", set_as_current=False, broker="memory://")

    @app.task(shared=False, name="d.once", base=once.QueueOnce)
    def once_task(a: int) -> int:
        return a

    @app.task(shared=False, name="d.singleton", base=singleton.Singleton, lock_expiry=5)
    def singleton_task(a: int) -> int:
        return a

    @app.task(
        shared=False, name="d.heimdall", base=heimdall.HeimdallTask, heimdall={"unique": True}
    )
    def heimdall_task(a: int) -> int:
        return a

    assert (once_task(1), singleton_task(2), heimdall_task(3)) == (1, 2, 3)
