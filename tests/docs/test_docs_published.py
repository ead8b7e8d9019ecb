"""Every link the README and the package metadata give points at something that exists, and the
README's commands are those CI runs (issue 42).

singletask has no public home yet (no PyPI upload, no published documentation), so:

* the README links the documentation's sources by paths relative to it (``docs/install.rst``),
  each of which must be a file of the source tree, and links no address outside it;
* the package metadata names no URL (``[project.urls]``): an entry goes there only with an
  address that exists, listed in ``PUBLIC`` below after checking it;
* the README's test command works on a fresh virtualenv, whose pip may predate ``--group``
  (25.1): it brings pip up to date first, and ``.ci/run`` runs that very line.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import singletask

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - pytest needs tomli before Python 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = (ROOT / "README.md").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

#: Addresses checked to exist that the metadata or the README may give (none yet).
PUBLIC: set[str] = set()

#: The targets of the README's Markdown links and autolinks.
LINKS = sorted(
    set(re.findall(r"\]\(([^)\s]+)\)", README)) | set(re.findall(r"<(https?://[^>]+)>", README))
)


def test_the_scan_finds_the_readme_links() -> None:
    assert "docs/install.rst" in LINKS, LINKS


@pytest.mark.parametrize("target", LINKS)
def test_a_readme_link_names_a_file_of_the_source_tree_or_a_checked_address(target: str) -> None:
    if re.match(r"[a-z]+:", target):
        assert target in PUBLIC, f"README.md links {target}, not known to exist"
    else:
        assert (ROOT / target.partition("#")[0]).is_file(), f"README.md links {target}: no file"


def test_the_readme_names_no_address_outside_the_tree() -> None:
    addresses = set(re.findall(r"https?://[^\s)>\]\"'`]+", README))
    assert {a for a in addresses if "localhost" not in a} <= PUBLIC, addresses


def test_the_package_metadata_names_only_checked_addresses() -> None:
    urls = PYPROJECT["project"].get("urls", {})
    assert set(urls.values()) <= PUBLIC, urls


def test_the_changelog_page_shows_the_changelog_file() -> None:
    page = DOCS / "changelog.md"
    included = re.findall(r"^```\{include\}\s*(\S+)", page.read_text(), re.M)
    assert [(DOCS / path).resolve() for path in included] == [ROOT / "CHANGELOG.md"]


def test_the_changelog_links_pages_of_the_docs_which_the_build_checks() -> None:
    """The changelog links ``docs/<page>.rst``, which the include makes the page's own link."""
    changelog = (ROOT / "CHANGELOG.md").read_text()
    targets = re.findall(r"\]\(([^)]+)\)", changelog)
    assert targets, "the scan is broken"
    for target in targets:
        if re.match(r"[a-z]+:", target):
            assert target in PUBLIC or "keepachangelog.com" in target or "semver.org" in target
        else:
            assert (ROOT / target.partition("#")[0]).is_file(), f"CHANGELOG.md links {target}"
    include = (DOCS / "changelog.md").read_text()
    assert ":relative-docs: docs/" in include, "the links would not resolve inside Sphinx"


@pytest.mark.parametrize("source", ["README.md", "docs/install.rst"])
def test_the_files_to_install_are_those_this_version_builds(source: str) -> None:
    """A wheel or sdist a page tells to install is the one ``python -m build`` makes here."""
    text = (ROOT / source).read_text()
    names = re.findall(r"singletask-([^-\s]+?)(?:-py3-none-any\.whl|\.tar\.gz)", text)
    assert names, "the scan is broken"
    assert set(names) == {singletask.__version__}, names


def readme_command(comment: str) -> str:
    """The README's shell line that ends with ``# <comment>``, without the comment."""
    found = re.findall(rf"^(python -m pip .+?)\s+# {comment}$", README, re.M)
    assert len(found) == 1, found
    return found[0]


def test_the_readme_test_command_brings_pip_up_to_date_before_using_a_group() -> None:
    command = readme_command("tests")
    assert command.startswith("python -m pip install -U pip && "), command
    assert command.index("-U pip") < command.index("--group"), command


def test_ci_runs_the_readme_test_command_as_written() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(rf"^{re.escape(readme_command('tests'))}$", ci, re.M), readme_command("tests")


def test_read_the_docs_builds_these_docs_as_html_with_their_dependency_group() -> None:
    config = (ROOT / ".readthedocs.yaml").read_text()
    assert re.search(r"^version: 2$", config, re.M)
    assert re.search(r"^sphinx:\n(?:  .*\n)*  configuration: docs/conf\.py$", config, re.M)
    assert re.search(r"^  builder: html$", config, re.M)
    assert re.search(r"^      - python -m pip install --group docs$", config, re.M)
    assert "docs" in PYPROJECT["dependency-groups"]


def test_the_tools_of_contributors_are_no_extras_of_the_package() -> None:
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    assert extras.isdisjoint(PYPROJECT["dependency-groups"]), extras


def test_the_redis_extra_brings_what_a_redis_broker_needs() -> None:
    """kombu 5.7's Redis transport imports ``packaging``, which Celery's own ``redis`` extra
    brings (issue 42: the worker and the producer died with ModuleNotFoundError)."""
    redis = PYPROJECT["project"]["optional-dependencies"]["redis"]
    assert any(re.match(r"celery\[redis\]", requirement) for requirement in redis), redis
