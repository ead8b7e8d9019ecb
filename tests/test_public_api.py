"""The public surface of the package: names, typing marker."""

from __future__ import annotations

import importlib
import importlib.resources
import re
import sys

import pytest

import singletask
from singletask.backends import backend_class


def test_all_is_sorted() -> None:
    """__all__ is kept sorted, so additions are easy to review."""
    assert singletask.__all__ == sorted(singletask.__all__)
    assert len(set(singletask.__all__)) == len(singletask.__all__)


@pytest.mark.parametrize("name", singletask.__all__)
def test_every_name_in_all_is_importable(name: str) -> None:
    """``from singletask import <name>`` works for every advertised name."""
    namespace: dict[str, object] = {}
    exec(f"from singletask import {name}", namespace)
    assert namespace[name] is getattr(singletask, name)


@pytest.mark.parametrize(
    "name", ["SingletonTask", "TaskLocked", "SingletaskError", "ConfigurationError", "Skipped"]
)
def test_the_fixed_public_names_exist(name: str) -> None:
    """The names users write in their code are exported at the top level."""
    assert name in singletask.__all__
    assert isinstance(getattr(singletask, name), type)


def test_the_version_is_a_string() -> None:
    assert isinstance(singletask.__version__, str)
    assert singletask.__version__


def test_py_typed_is_shipped() -> None:
    """The PEP 561 marker is part of the package, so type checkers use its annotations."""
    marker = importlib.resources.files("singletask").joinpath("py.typed")
    assert marker.is_file()


def test_the_testing_helpers_are_public_and_sorted() -> None:
    """singletask.testing lists its public names, sorted; each is importable from it."""
    import singletask.testing

    names = singletask.testing.__all__
    assert names == sorted(names)
    for name in names:
        assert getattr(singletask.testing, name) is not None
    assert {"hold_lock", "lock_key_for", "isolated_locks", "locks_disabled"} <= set(names)


def test_the_testing_helpers_are_not_in_the_top_level_package() -> None:
    """``import singletask`` in a worker does not bring the test helpers along."""
    assert not set(singletask.__all__) & {"hold_lock", "lock_key_for", "isolated_locks"}


def test_the_pytest_plugin_is_registered_as_singletask() -> None:
    """Installing singletask registers its pytest plugin (``-p no:singletask`` turns it off)."""
    from importlib.metadata import entry_points

    plugins = {ep.name: ep.value for ep in entry_points(group="pytest11")}
    assert plugins.get("singletask") == "singletask.testing.plugin"


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("singletask.backends.memory", "MemoryBackend"),
        ("singletask.backends.django", "DjangoCacheBackend"),
        ("singletask.backends.redis", "RedisBackend"),
        ("singletask.backends.redis", "RedisSentinelBackend"),
        ("singletask.backends.redis", "RedisClusterBackend"),
        ("singletask.backends.memcached", "MemcachedBackend"),
        ("singletask.backends.sql.postgres", "PostgresBackend"),
        ("singletask.backends.sql.mysql", "MySQLBackend"),
        ("singletask.backends.sql.sqlite", "SQLiteBackend"),
    ],
)
def test_the_store_classes_import_from_their_family_package(path: str, name: str) -> None:
    """Each store class imports from the path its docs give, and the registry serves that class."""
    cls = getattr(importlib.import_module(path), name)
    assert cls in {backend_class(url) for url in STORE_URLS}


STORE_URLS = [
    "redis://h",
    "sentinel://h:1",
    "redis+cluster://h:1",
    "postgresql://h/db",
    "mysql://h/db",
    "sqlite:///x.db",
    "memcached://h:1",
    "memory://",
    "django://default",
]


@pytest.mark.parametrize(
    ("old", "name", "new"),
    [
        ("singletask.backends.postgres", "PostgresBackend", "singletask.backends.sql.postgres"),
        ("singletask.backends.mysql", "MySQLBackend", "singletask.backends.sql.mysql"),
        ("singletask.backends.sqlite", "SQLiteBackend", "singletask.backends.sql.sqlite"),
        ("singletask.backends.redis_deploy", "RedisClusterBackend", "singletask.backends.redis"),
        ("singletask.backends.redis_deploy", "RedisSentinelBackend", "singletask.backends.redis"),
    ],
)
def test_a_store_class_still_imports_from_its_path_before_0_3_0(
    old: str, name: str, new: str
) -> None:
    """The old path gives the same class, so isinstance checks and subclasses keep working, and
    warns once with the new path."""
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=re.escape(old) + " is now"):
        moved = importlib.import_module(old)
    assert getattr(moved, name) is getattr(importlib.import_module(new), name)


@pytest.mark.parametrize(
    ("old", "name", "new"),
    [
        ("singletask.config", "Settings", "singletask.conf.settings"),
        ("singletask.options", "TaskOptions", "singletask.conf.options"),
        ("singletask.keys", "KeySpec", "singletask.protocol.keys"),
        ("singletask.slots", "slot_keys", "singletask.protocol.slots"),
        ("singletask.lifecycle", "execute", "singletask.execution.lifecycle"),
        ("singletask.outcomes", "refused", "singletask.execution.outcomes"),
        ("singletask.flower", "format_task", "singletask.observe.flower"),
        ("singletask.inventory", "find_locks", "singletask.ops.inventory"),
        ("singletask.inventory", "find_state", "singletask.ops.inventory"),
        ("singletask.web", "LockPage", "singletask.ops.web"),
        ("singletask.web.asgi", "asgi", "singletask.ops.web.asgi"),
        ("singletask.exporter", "Exporter", "singletask.ops.exporter"),
        ("singletask.cli_locks", "COMMANDS", "singletask.cli.locks"),
    ],
)
def test_a_module_still_imports_from_its_path_before_0_4_0(old: str, name: str, new: str) -> None:
    """0.4.0 laid the package out by send and execution: each old module path gives the new
    module's objects and warns with the new path, until 1.0."""
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=re.escape(old) + " is now " + re.escape(new)):
        moved = importlib.import_module(old)
    assert getattr(moved, name) is getattr(importlib.import_module(new), name)


def test_the_command_line_keeps_its_entry_points() -> None:
    """pyproject names ``singletask.cli:main`` and ``singletask.cli:singletask`` (the console
    script and Celery's ``celery.commands`` plugin): cli/ is a package, they are where they were."""
    import click

    import singletask.cli

    assert callable(singletask.cli.main)
    assert isinstance(singletask.cli.singletask, click.Group)
