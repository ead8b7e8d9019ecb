"""A release is one commit: the version it ships and the changelog say the same thing.

``CHANGELOG.md`` has an ``[Unreleased]`` section and one dated section per release. A checkout
whose ``[Unreleased]`` lists changes is not the newest release, so its version is a
pre-release of a later one (``0.4.0.dev0`` after ``0.3.0``); only the commit that releases sets
the version to the newest dated section's and empties ``[Unreleased]``. Once released, a dated
section stays as that commit wrote it (its links may be pointed at where their pages are now):
a later change is listed under ``[Unreleased]``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from packaging.version import Version

import singletask

ROOT = Path(__file__).resolve().parents[2]
CHANGELOG = ROOT / "CHANGELOG.md"
HEADING = re.compile(r"^## \[(?P<name>[^\]]+)\](?: - (?P<date>\d{4}-\d{2}-\d{2}))?$", re.M)
# The 0.3.0 pass rewrote the notes of 0.1.0 and 0.2.0 for a reader of today; from 0.3.0 on, a
# dated section is the one its release commit wrote.
FIRST_FROZEN = Version("0.3.0")


def sections(text: str) -> dict[str, str]:
    """Each section of a changelog by its name (``Unreleased`` or a version), heading included."""
    found = list(HEADING.finditer(text))
    ends = [match.start() for match in found[1:]] + [len(text)]
    return {
        match["name"]: text[match.start() : end] for match, end in zip(found, ends, strict=True)
    }


def words(section: str) -> str:
    """A section without its links' targets: ``[text](target)`` reads ``[text]``."""
    return re.sub(r"\]\([^)]*\)", "]", section)


def releases(text: str) -> list[Version]:
    return [Version(match["name"]) for match in HEADING.finditer(text) if match["date"]]


def test_the_changelog_opens_with_unreleased_then_dated_releases_newest_first() -> None:
    text = CHANGELOG.read_text()
    assert next(match["name"] for match in HEADING.finditer(text)) == "Unreleased"
    dated = releases(text)
    assert dated == sorted(dated, reverse=True)
    assert len(set(dated)) == len(dated)


def test_the_version_is_the_newest_release_only_when_nothing_is_unreleased() -> None:
    text = CHANGELOG.read_text()
    newest = releases(text)[0]
    unreleased = sections(text)["Unreleased"]
    version = Version(singletask.__version__)
    if re.search(r"^- ", unreleased, re.M):
        why = f"[Unreleased] lists changes: the version must be a pre-release after {newest}"
        assert version.is_prerelease, why
        assert version > newest, why
    else:
        assert version == newest


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout


def release_commit(version: Version) -> str:
    """The first commit whose package version is ``version``."""
    commits = git(
        "log",
        "--reverse",
        "--format=%H",
        f'-S__version__ = "{version}"',
        "--",
        "singletask/__init__.py",
    ).split()
    assert commits, f"no commit sets the version to {version}"
    return commits[0]


def frozen_releases() -> list[Version]:
    return [version for version in releases(CHANGELOG.read_text()) if version >= FIRST_FROZEN]


@pytest.mark.parametrize("version", frozen_releases(), ids=str)
def test_a_released_section_is_as_its_release_commit_wrote_it(version: Version) -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        if os.environ.get("CI") == "true":
            pytest.fail("CI runs on a git checkout: the release history must be readable")
        pytest.skip("not a git checkout")
    commit = release_commit(version)
    then = sections(git("show", f"{commit}:CHANGELOG.md"))[str(version)]
    now = sections(CHANGELOG.read_text())[str(version)]
    changed = f"the {version} section changed after its release commit {commit[:7]}"
    assert words(now) == words(then), changed
