"""Every page of the docs is on the index's path, and a new user's path comes first.

The index's toctrees list the pages in the order a reader meets them: getting started (install,
a first task, the policies, a store, deploying, operating, testing), then the other guides, the
reference, and how it works. A page no toctree reaches from the index is built but linked from
nowhere in the navigation; a toctree entry without a page is a dead link. Both are found here,
without running Sphinx.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SUFFIXES = (".rst", ".md")

#: What a new user reads first, in this order: the index's first toctree.
NEW_USER_PATH = [
    "install",
    "quickstart",
    "policies",
    "backends",
    "deployments",
    "operations",
    "testing",
]


def source(page: str) -> Path:
    for suffix in SUFFIXES:
        if (DOCS / f"{page}{suffix}").is_file():
            return DOCS / f"{page}{suffix}"
    raise AssertionError(f"a toctree lists {page!r}, but docs/ has no {page}.rst or {page}.md")


def toctrees(page: str) -> list[list[str]]:
    """The entries of each ``.. toctree::`` of a page, in order."""
    text = source(page).read_text()
    trees = []
    for block in re.findall(r"^\.\. toctree::\n((?:[ \t]+.*\n|[ \t]*\n)+)", text, re.M):
        trees.append(
            [
                line.strip()
                for line in block.splitlines()
                if line.strip() and not line.strip().startswith(":")
            ]
        )
    return trees


def reachable_from(root: str) -> dict[str, str]:
    """Every page a chain of toctrees reaches from ``root``: {page: the page that lists it}."""
    seen = {root: ""}
    todo = [root]
    while todo:
        page = todo.pop()
        for tree in toctrees(page):
            for entry in tree:
                if entry not in seen:
                    seen[entry] = page
                    todo.append(entry)
    return seen


def all_pages() -> set[str]:
    return {
        path.stem
        for suffix in SUFFIXES
        for path in DOCS.glob(f"*{suffix}")
        if not path.name.startswith(("_", "."))
    }


def test_the_scan_finds_the_pages_and_the_toctrees():
    assert {"index", "install", "configuration", "changelog"} <= all_pages()
    assert len(toctrees("index")) >= 3


def test_every_page_is_on_the_index_path():
    orphans = sorted(all_pages() - set(reachable_from("index")))
    assert not orphans, f"no toctree reachable from docs/index.rst lists {orphans}"


def test_every_toctree_entry_is_a_page():
    for page in reachable_from("index"):
        assert source(page).is_file()


def test_a_new_user_path_opens_the_index():
    first = toctrees("index")[0]
    assert first == NEW_USER_PATH, f"the index's first toctree is {first}"


def test_each_page_is_listed_once():
    entries = [entry for page in all_pages() for tree in toctrees(page) for entry in tree]
    twice = sorted({entry for entry in entries if entries.count(entry) > 1})
    assert not twice, f"listed by more than one toctree: {twice}"


def test_the_reference_comes_before_how_it_works():
    captions = re.findall(r"^\s+:caption: (.+)$", source("index").read_text(), re.M)
    assert captions.index("Reference") < captions.index("How it works"), captions
