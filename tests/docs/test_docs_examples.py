"""Every Python example in the README, the changelog and the docs compiles, and every name it
imports from singletask exists.

The rules, for a reader adding an example:

* In Markdown (README.md, CHANGELOG.md, docs/*.md), a fenced block marked ``python``, ``py`` or
  ``pycon`` is Python.
* In docs/*.rst, a ``.. code-block::`` (or ``code`` / ``sourcecode``) marked ``python``,
  ``python3``, ``py`` or ``pycon`` is Python. A bare ``::`` literal block, or a code-block
  without a language, is refused: Sphinx highlights it as Python, so Python could hide in one
  unchecked. Name the language instead (``.. code-block:: python``, ``console``, ``text``...).
* A ``pycon`` block is checked on its input lines (``>>>`` and ``...``).
* There is no fragment marker and no skipping: an example that is not valid Python on its own
  (an elided body, an undefined ``app``) is written so that it compiles (``...`` for a body);
  names it uses without importing them are fine, only what it imports from singletask is
  resolved. An attribute of an imported singletask module (``singletask.testing.hold_lock``)
  must exist too.
* A longer example lives in a file under ``examples/`` that a test runs, and the page includes
  it with ``.. literalinclude::``; the included file must be there and be named by a test.
"""

from __future__ import annotations

import ast
import importlib
import re
import textwrap
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARKDOWN = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
RST = sorted((ROOT / "docs").glob("*.rst"))
PYTHON = {"python", "python3", "py", "pycon"}


@dataclass(frozen=True)
class Block:
    """A literal block of a page: where it starts, its language ('' for a bare ``::``)."""

    page: str
    line: int
    language: str
    text: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"

    def source(self) -> str:
        """The block as Python source (the input lines of a pycon block)."""
        if self.language != "pycon":
            return self.text
        lines = [line[4:] for line in self.text.splitlines() if line[:4] in (">>> ", "... ")]
        return "\n".join(lines)


def markdown_blocks(path: Path) -> list[Block]:
    page = path.relative_to(ROOT).as_posix()
    text = path.read_text()
    found = []
    for match in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```", text, re.M | re.S):
        line = text.count("\n", 0, match.start()) + 1
        found.append(Block(page, line, match.group(1).lower(), match.group(2)))
    return found


#: A directive that holds a literal block, with its language; or a paragraph ending in "::".
RST_OPENER = re.compile(
    r"^(\s*)(?:\.\. (?:code-block|code|sourcecode)::\s*(\S*)\s*$|(?!\.\.).*::\s*$)"
)


def rst_blocks(path: Path) -> list[Block]:
    """The literal blocks of an rST page: code-block directives and bare ``::`` blocks (their
    language is '')."""
    page = path.relative_to(ROOT).as_posix()
    lines = path.read_text().splitlines()
    found = []
    i = 0
    while i < len(lines):
        opener = RST_OPENER.match(lines[i])
        if not opener or not lines[i].strip():
            i += 1
            continue
        language = (opener.group(2) or "").lower()  # '' for a bare '::' or a bare code-block
        j = i + 1
        while j < len(lines) and (not lines[j].strip() or lines[j].strip().startswith(":")):
            j += 1  # blank lines and the directive's options
        if j == len(lines):
            break
        indent = len(lines[j]) - len(lines[j].lstrip())
        if indent <= len(opener.group(1)):
            i = j  # no indented block follows: not a literal block
            continue
        body = []
        while j < len(lines) and (not lines[j].strip() or lines[j].startswith(" " * indent)):
            body.append(lines[j])
            j += 1
        found.append(Block(page, i + 1, language, textwrap.dedent("\n".join(body)).strip("\n")))
        i = j
    return found


BLOCKS = [block for path in MARKDOWN for block in markdown_blocks(path)] + [
    block for path in RST for block in rst_blocks(path)
]
PYTHON_BLOCKS = [block for block in BLOCKS if block.language in PYTHON]


def test_the_scan_finds_the_examples():
    pages = {block.page for block in PYTHON_BLOCKS}
    assert {"README.md", "docs/index.rst", "docs/configuration.rst"} <= pages


def test_every_rst_literal_block_names_its_language():
    bare = [str(block) for block in BLOCKS if block.page.endswith(".rst") and not block.language]
    assert not bare, (
        "bare '::' blocks (Sphinx shows them as Python, unchecked); use '.. code-block:: "
        f"python' (or text, console...) at: {', '.join(bare)}"
    )


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=str)
def test_the_example_compiles(block):
    try:
        compile(block.source(), str(block), "exec", dont_inherit=True)
    except SyntaxError as exc:
        pytest.fail(f"{block}: the example does not compile: {exc}")


def singletask_names(tree: ast.AST) -> tuple[list[str], list[tuple[str, str]], dict[str, str]]:
    """What a module imports from singletask: the modules, the (module, name) pairs of
    ``from ... import``, and the local names bound to singletask modules."""
    modules: list[str] = []
    names: list[tuple[str, str]] = []
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "singletask":
                    modules.append(alias.name)
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        bound["singletask"] = "singletask"
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            module = node.module or ""
            if module.split(".")[0] == "singletask":
                modules.append(module)
                names.extend((module, alias.name) for alias in node.names)
                for alias in node.names:
                    bound[alias.asname or alias.name] = f"{module}.{alias.name}"
    return modules, names, bound


def resolve(dotted: str) -> object:
    """The singletask module of this dotted name, or the attribute of a module it names."""
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError:
        module, _, name = dotted.rpartition(".")
        return getattr(importlib.import_module(module), name)


def attribute_chains(tree: ast.AST, bound: dict[str, str]) -> set[tuple[str, ...]]:
    """``name.attr...`` expressions whose ``name`` is bound to something imported from
    singletask, as (what ``name`` is bound to, attr, ...)."""
    chains = set()
    for node in ast.walk(tree):
        attributes = []
        while isinstance(node, ast.Attribute):
            attributes.append(node.attr)
            node = node.value
        if attributes and isinstance(node, ast.Name) and node.id in bound:
            chains.add((bound[node.id], *reversed(attributes)))
    return chains


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=str)
def test_what_the_example_imports_from_singletask_exists(block):
    try:
        tree = ast.parse(block.source())
    except SyntaxError:
        pytest.skip("does not compile (test_the_example_compiles fails)")
    modules, names, bound = singletask_names(tree)
    missing = []
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError:
            missing.append(module)
    for module, name in names:
        if name != "*" and not hasattr_or_submodule(module, name):
            missing.append(f"{module}.{name}")
    for base, *attributes in sorted(attribute_chains(tree, bound)):
        if base in missing:
            continue
        found = resolve(base)
        for attribute in attributes:
            if not isinstance(found, types.ModuleType):
                break  # an attribute of a class or an object: not checked here
            if not hasattr_or_submodule(found.__name__, attribute):
                missing.append(f"{found.__name__}.{attribute}")
                break
            found = resolve(f"{found.__name__}.{attribute}")
    assert not missing, f"{block}: uses what singletask does not have: {', '.join(missing)}"


def hasattr_or_submodule(module: str, name: str) -> bool:
    if hasattr(importlib.import_module(module), name):
        return True
    try:
        importlib.import_module(f"{module}.{name}")
    except ModuleNotFoundError:
        return False
    return True


# -- examples included from files ---------------------------------------------------------

INCLUDES = [
    (path.relative_to(ROOT).as_posix(), line + 1, target)
    for path in RST
    for line, text in enumerate(path.read_text().splitlines())
    for target in re.findall(r"^\s*\.\. literalinclude::\s*(\S+)", text)
]
TEST_SOURCES = "\n".join(p.read_text() for p in sorted((ROOT / "tests").rglob("test_*.py")))


def test_the_scan_finds_the_included_examples():
    assert any(target.endswith("examples/quickstart.py") for _, _, target in INCLUDES)


@pytest.mark.parametrize(
    ("page", "line", "target"), INCLUDES, ids=[f"{page}:{line}" for page, line, _ in INCLUDES]
)
def test_an_included_example_is_a_file_under_examples_that_a_test_runs(page, line, target):
    path = (ROOT / "docs" / target).resolve()
    assert path.is_file(), f"{page}:{line}: {target} does not exist"
    relative = path.relative_to(ROOT / "examples")  # raises if the file is elsewhere
    top = relative.parts[0].removesuffix(".py")
    assert re.search(rf"[\"'/]{re.escape(top)}(\.py)?[\"'/]", TEST_SOURCES), (
        f"{page}:{line}: no test names examples/{relative.parts[0]}"
    )
