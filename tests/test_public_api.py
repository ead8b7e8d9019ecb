"""The public surface of the package: names, typing marker."""

from __future__ import annotations

import importlib.resources

import pytest

import singletask


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
