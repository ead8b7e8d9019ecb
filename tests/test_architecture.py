"""The package's shape: imports point one way, and no module imports one that imports it back.

The graph is read from the source (every ``import`` statement, including the ones inside
functions and under ``TYPE_CHECKING``), so a circle fails here even where Python would import it
without complaint. docs/architecture.rst draws the layers this test holds the code to.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import singletask

PACKAGE = Path(singletask.__file__).parent

#: The package's face (``singletask`` and ``singletask.task``) and what is built on it. The
#: core, every other module, may import none of them.
ABOVE_THE_CORE = ("singletask", "singletask.task", "singletask.__main__")
#: Packages built on the face: the command line, the demo, and the test helpers with their pytest
#: plugin.
BUILT_ON_TOP = ("singletask.cli", "singletask.demo", "singletask.testing")


def above_the_core(name: str) -> bool:
    return name in ABOVE_THE_CORE or any(
        name == package or name.startswith(package + ".") for package in BUILT_ON_TOP
    )


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(name: str, path: Path) -> Iterator[str]:
    """The package's modules that module ``name`` imports, anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from package import module`` imports the module; ``from module import name``,
            # the module.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                for alias in node.names
            ]
        else:
            continue
        yield from (target for target in targets if target in MODULES)


GRAPH = {name: sorted(set(imported_modules(name, path)) - {name}) for name, path in MODULES.items()}


def find_circle() -> list[str] | None:
    """One import circle of the package (its modules, the first repeated), or None."""
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> list[str] | None:
        if name in trail:
            return [*trail[trail.index(name) :], name]
        if name in done:
            return None
        for target in GRAPH[name]:
            circle = visit(target, [*trail, name])
            if circle is not None:
                return circle
        done.add(name)
        return None

    for name in GRAPH:
        circle = visit(name, [])
        if circle is not None:
            return circle
    return None


def test_the_graph_sees_the_imports() -> None:
    """The reader finds relative, absolute and function-level imports (so the checks bite)."""
    assert "singletask.execution.lifecycle" in GRAPH["singletask.task"]
    assert "singletask.backends" in GRAPH["singletask.conf.runtime"]
    assert "singletask.backends.base" in GRAPH["singletask.lease"]  # imported in a method
    assert "singletask.task" in GRAPH["singletask"]


def test_no_module_of_the_package_is_part_of_an_import_circle() -> None:
    """No chain of imports leads from a module of singletask back to itself."""
    # Given every import of every module of the package
    # When the import graph is searched for a circle
    circle = find_circle()

    # Then there is none
    assert circle is None, "import circle: " + " -> ".join(circle or [])


def test_a_circle_would_be_found() -> None:
    """The search itself finds a circle when there is one."""
    GRAPH["singletask.protocol.keys"].append("singletask.task")
    try:
        circle = find_circle()
    finally:
        GRAPH["singletask.protocol.keys"].remove("singletask.task")
    assert circle is not None
    assert circle[0] == circle[-1]
    assert "singletask.task" in circle


@pytest.mark.parametrize("name", [name for name in MODULES if not above_the_core(name)])
def test_the_core_never_imports_the_task_class_or_what_is_built_on_it(name: str) -> None:
    """Send-time deduplication, the lifecycle, the policies and the recovery depend on the
    options and the backend contract, never on SingletonTask: imports point down."""
    # Given a module of the core
    # Then none of its imports leads up to the face or past it
    assert [target for target in GRAPH[name] if above_the_core(target)] == []


BACKENDS = PACKAGE / "backends"
FAMILIES = ("redis", "sql", "memcached")


def test_each_store_family_is_a_package_of_its_own() -> None:
    """The top of backends/ holds the contract, the registry and the one-module stores; a family
    of modules (a name prefix) is a folder, whose modules lose the prefix."""
    top = sorted(path.stem for path in BACKENDS.glob("*.py"))
    assert top == ["__init__", "base", "django", "holders", "memory", "urls"]
    for family in FAMILIES:
        assert (BACKENDS / family / "__init__.py").is_file()
        prefixed = [p.name for p in (BACKENDS / family).glob(f"{family}_*.py")]
        assert prefixed == [], f"backends/{family}/ modules keep the family prefix: {prefixed}"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_store_family_imports_no_other_family(family: str) -> None:
    """A family's modules import their own family, the contract and the bottom layer: never
    another family (the django:// store, which hands over to Redis or memcached, is the one
    module that may)."""
    prefix = f"singletask.backends.{family}"
    others = [f"singletask.backends.{other}" for other in FAMILIES if other != family]
    for name in [name for name in MODULES if name == prefix or name.startswith(prefix + ".")]:
        assert [t for t in GRAPH[name] if t.startswith(tuple(others))] == [], name
