"""The links to the published documentation point at pages the docs build.

The package metadata (``[project.urls]`` of pyproject.toml), the README and the changelog link
pages of https://singletask.readthedocs.io as ``<Documentation URL>/en/latest/<page>.html``.
Sphinx's html builder makes ``<page>.html`` of ``docs/<page>.rst`` (or ``.md``) when a toctree
lists the page, and Read the Docs runs that build from ``.readthedocs.yaml`` (without the file it
builds nothing). So a link is good when its page has a source in docs/ that a toctree lists,
and the Read the Docs configuration builds these docs with that builder.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - pytest needs tomli before Python 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
URLS: dict[str, str] = PYPROJECT["project"]["urls"]
PUBLISHED = URLS["Documentation"].rstrip("/") + "/en/latest/"


def toctree_entries() -> set[str]:
    """Every page a ``.. toctree::`` of the docs lists."""
    entries = set()
    for page in DOCS.glob("*.rst"):
        for block in re.findall(r"^\.\. toctree::\n((?:[ \t]+.*\n|\n)+)", page.read_text(), re.M):
            entries.update(
                line.strip()
                for line in block.splitlines()
                if line.strip() and not line.strip().startswith(":")
            )
    return entries


def built_page(url: str) -> str:
    """The docs page a link to the published docs shows (its source's name, without suffix)."""
    assert url.startswith(PUBLISHED), f"{url} is not under {PUBLISHED}"
    page, _, _ = url.removeprefix(PUBLISHED).partition("#")
    assert page.endswith(".html"), f"{url} does not name an html page"
    return page.removesuffix(".html")


def assert_the_docs_build(page: str) -> None:
    sources = [DOCS / f"{page}{suffix}" for suffix in (".rst", ".md")]
    assert any(source.is_file() for source in sources), f"docs/ has no source of {page}.html"
    assert page in toctree_entries(), f"no toctree lists {page}, so {page}.html is not built"


def test_the_changelog_of_the_package_metadata_is_a_page_the_docs_build():
    assert_the_docs_build(built_page(URLS["Changelog"]))


def test_the_changelog_page_shows_the_changelog_file():
    page = DOCS / f"{built_page(URLS['Changelog'])}.md"
    included = re.findall(r"^```\{include\}\s*(\S+)", page.read_text(), re.M)
    assert [(DOCS / path).resolve() for path in included] == [ROOT / "CHANGELOG.md"]


LINKS = sorted(
    {
        (source, url.rstrip(".,"))
        for source in ("README.md", "CHANGELOG.md")
        for url in re.findall(re.escape(PUBLISHED) + r"[^\s)>\]\"'`]*", (ROOT / source).read_text())
    }
)


def test_the_readme_links_the_published_pages():
    assert any(source == "README.md" for source, _ in LINKS), "the scan is broken"


@pytest.mark.parametrize(("source", "url"), LINKS, ids=[f"{s}: {u}" for s, u in LINKS])
def test_a_link_to_the_published_docs_names_a_page_the_docs_build(source, url):
    assert_the_docs_build(built_page(url))


def test_read_the_docs_builds_these_docs_as_html_with_their_dependency_group():
    config = (ROOT / ".readthedocs.yaml").read_text()
    assert re.search(r"^version: 2$", config, re.M)
    assert re.search(r"^sphinx:\n(?:  .*\n)*  configuration: docs/conf\.py$", config, re.M)
    assert re.search(r"^  builder: html$", config, re.M)
    assert re.search(r"^      - python -m pip install --group docs$", config, re.M)
    assert "docs" in PYPROJECT["dependency-groups"]


def test_the_tools_of_contributors_are_no_extras_of_the_package():
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    assert extras.isdisjoint(PYPROJECT["dependency-groups"]), extras
