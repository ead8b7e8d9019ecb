"""The contract on docs/store-custom.rst names every abstract method of the store base class,
and only methods that exist (issue 42: ``claim_next`` and ``clear_next`` were missing, so a
store written from the page could not be instantiated).

An entry of the contract is a definition-list term that starts with the method's name in
literal text: ````acquire(key, token, ttl, ...)````, in the section "The contract".
"""

from __future__ import annotations

import re
from pathlib import Path

from singletask.backends.base import LockBackend

PAGE = Path(__file__).resolve().parents[2] / "docs" / "store-custom.rst"


def contract_entries() -> list[str]:
    """The method names the contract section's entries start with, in page order."""
    text = PAGE.read_text()
    start = text.index("\nThe contract\n~~~~")
    end = text.index("\n~~~~", start + len("\nThe contract\n~~~~") + 1)
    section = text[start:end]
    # A term: a line at the left margin starting with ``name(``; its body is indented.
    return re.findall(r"^``([a-z_]+)\(", section, re.M)


def test_the_scan_finds_the_contract() -> None:
    entries = contract_entries()
    assert {"from_url", "acquire", "release", "iter_locks"} <= set(entries), entries


def test_every_abstract_method_of_the_base_class_is_on_the_page() -> None:
    missing = sorted(set(LockBackend.__abstractmethods__) - set(contract_entries()))
    assert missing == [], f"docs/store-custom.rst's contract omits the abstract {missing}"


def test_every_method_the_page_names_exists_on_the_base_class() -> None:
    entries = contract_entries()
    unknown = [name for name in entries if not callable(getattr(LockBackend, name, None))]
    assert unknown == [], f"docs/store-custom.rst's contract names no LockBackend method {unknown}"


def test_each_method_has_one_entry() -> None:
    entries = contract_entries()
    assert sorted(entries) == sorted(set(entries)), entries
