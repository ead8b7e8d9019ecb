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
#: Packages built on the face: the command line, the old libraries' APIs (compat), the demo, and
#: the test helpers with their pytest plugin.
BUILT_ON_TOP = ("singletask.cli", "singletask.compat", "singletask.demo", "singletask.testing")


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
FAMILIES = ("redis", "sql", "memcached", "memory")


def test_each_store_family_is_a_package_of_its_own() -> None:
    """The top of backends/ holds the contract (with its values, holders, and the waiting line
    every store keeps the same way, turns), the registry and the one-module stores; a family
    of modules (a name prefix) is a folder, whose modules lose the prefix."""
    top = sorted(path.stem for path in BACKENDS.glob("*.py"))
    assert top == ["__init__", "base", "django", "holders", "turns", "urls"]
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


#: The modules at the top of the package: the public surface (what a user imports) and the
#: moved-paths finder. Everything else lives in a package named for how it works.
TOP_LEVEL = {
    "__init__", "__main__", "_moved", "exceptions", "lease", "policies", "result", "signals",
    "task",
}  # fmt: skip
#: The packages of the package, each answering one "how does it work" (compat: the old
#: libraries' APIs on singletask).
PACKAGES = {
    "backends", "cli", "compat", "conf", "demo", "execution", "observe", "ops", "protocol", "send",
    "testing",
}  # fmt: skip


def test_the_top_level_is_the_public_surface_and_one_package_per_question() -> None:
    """At most ten loose modules at the top (the face: the task class, policies, the lease
    handle, the result, exceptions, signals); send, execution, settings, formats, observation,
    operations and the command line are packages."""
    loose = {path.stem for path in PACKAGE.glob("*.py")}
    packages = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert loose == TOP_LEVEL
    assert len(loose) <= 10
    assert packages == PACKAGES


def test_no_name_prefix_family_outside_a_folder() -> None:
    """A family of modules (``cli_*``, ``postgres_*``) is a folder of its own, whose modules lose
    the prefix: no module's name is another's of the same folder followed by ``_``."""
    for folder in {path.parent for path in MODULES.values()}:
        stems = {path.stem for path in folder.glob("*.py") if not path.stem.startswith("_")}
        prefixed = sorted(s for s in stems for p in stems if s != p and s.startswith(p + "_"))
        assert prefixed == [], f"{folder.relative_to(PACKAGE.parent)}: {prefixed}"


#: The store families below the contract (a URL scheme chooses one through the registry).
STORE_FAMILIES = tuple(
    f"singletask.backends.{name}" for name in ("redis", "sql", "memcached", "memory", "django")
)


@pytest.mark.parametrize("name", [n for n in MODULES if not n.startswith("singletask.backends")])
def test_policy_above_the_stores_never_imports_a_store_family(name: str) -> None:
    """Only the registry (``singletask.backends``) maps a URL scheme to a store class: nothing
    above the contract names a family, so policy never reaches below it."""
    families = [
        target
        for target in GRAPH[name]
        if any(target == family or target.startswith(family + ".") for family in STORE_FAMILIES)
    ]
    assert families == []


def test_send_never_imports_execution() -> None:
    """The two paths share formats and records, but a send never depends on how an execution
    runs: the one arrow between them points from execution/ to send/records.py."""
    sending = [name for name in MODULES if name.startswith("singletask.send")]
    for name in sending:
        assert [t for t in GRAPH[name] if t.startswith("singletask.execution")] == [], name


def private_imports(path: Path) -> list[str]:
    """The underscore names ``path`` imports from another module (dunders and ``_moved``'s
    module aside)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            found += [
                f"{node.module or '.'}.{alias.name}"
                for alias in node.names
                if alias.name.startswith("_") and not alias.name.startswith("__")
            ]
    return found


@pytest.mark.parametrize("name", list(MODULES))
def test_no_module_imports_another_modules_private_names(name: str) -> None:
    """An underscore marks what is private to its module; what another module needs has a
    public name."""
    assert private_imports(MODULES[name]) == []


#: The longest function outside the demo (whose scenes are scripts), in lines.
LONGEST_FUNCTION = 80


def test_no_function_is_longer_than_a_screen() -> None:
    """The main paths read as ladders of short steps (``execution.lifecycle.execute``): no
    function outside the demo is over 80 lines."""
    long = [
        f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for name, path in MODULES.items()
        if not name.startswith("singletask.demo")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (node.end_lineno or node.lineno) - node.lineno + 1 > LONGEST_FUNCTION
    ]
    assert long == []


def test_the_tests_mirror_the_package() -> None:
    """tests/ keeps at most a dozen loose modules (its conftest, the servers the suites share,
    whole-package tests); the rest sit in folders named after the package's (send/,
    execution/, backends/...), with the contract suite and the campaigns in folders of their
    own."""
    tests = Path(__file__).parent
    loose = sorted(path.name for path in tests.glob("*.py"))
    assert len(loose) <= 12, loose
    folders = {path.parent.name for path in tests.glob("*/__init__.py")}
    assert {"send", "execution", "backends", "contract", "campaigns", "ops", "cli"} <= folders
