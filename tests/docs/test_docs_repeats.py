"""No user-facing document says the same thing twice: README.md, CHANGELOG.md and every
docs/*.rst page.

A repeat is usually a leftover of merging two branches that each added the same text. The rule
(the same as ``doc_repeats.py``, the tool the issue names, so the two agree):

* Code is not prose: Markdown fenced blocks, and rST literal blocks, code blocks and list
  tables (a line ending in ``::``, a ``code-block::`` or ``list-table::`` and the indented
  lines after it) are left out.
* The rest, whitespace collapsed, is cut into sentences after ``.``, ``!`` or ``?``. A sentence
  of 80 characters or more may appear once per document; sentences are compared on their first
  100 characters. Sentences starting "Keyword arguments" are exempt: the signal docs introduce
  each signal's arguments with the same words on purpose.
* In the Markdown documents, a list item (``-`` or ``*``) of 30 characters or more may appear
  once too, compared on its first 70 characters.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.rst"))]

MARKDOWN_CODE = re.compile(r"```.*?```", flags=re.S)
RST_BLOCK = re.compile(r"(::|code-block::.*|list-table::.*)\n(?:[ \t]+.*\n|\n)+")
LIST_ITEM = re.compile(r"^\s*[-*] (.{30,})$", flags=re.M)
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def prose(text: str) -> str:
    """The text without its code blocks and tables."""
    return RST_BLOCK.sub("\n", MARKDOWN_CODE.sub("", text))


def repeats(text: str, *, markdown: bool) -> dict[str, int]:
    """The sentences (and Markdown list items) the text has more than once, with their count."""
    units: Counter[str] = Counter()
    text = prose(text)
    if markdown:
        units.update("list item: " + item[:70] for item in LIST_ITEM.findall(text))
    for sentence in SENTENCE_END.split(" ".join(text.split())):
        if len(sentence) >= 80 and not sentence.startswith("Keyword arguments"):
            units["sentence: " + sentence[:100]] += 1
    return {unit: count for unit, count in units.items() if count > 1}


LONG = "The lock is a short lease that the holder's process renews while the body runs, always."


def test_a_repeated_long_sentence_is_found():
    assert repeats(f"{LONG} Something else. {LONG}", markdown=False) == {
        f"sentence: {LONG[:100]}": 2
    }


def test_short_sentences_code_blocks_and_tables_may_repeat():
    rst = f"Yes. Yes.\n\nFor example::\n\n    {LONG}\n    {LONG}\n\nDone.\n"
    markdown = f"```python\n# {LONG}\n# {LONG}\n```\n"
    assert repeats(rst, markdown=False) == {}
    assert repeats(markdown, markdown=True) == {}


def test_a_repeated_list_item_of_a_markdown_document_is_found():
    item = "- [lock stores](https://example.org/backends.html)"
    assert repeats(f"{item}\n{item}\n", markdown=True) == {f"list item: {item[2:72]}": 2}


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_the_document_says_nothing_twice(path):
    found = repeats(path.read_text(errors="replace"), markdown=path.suffix == ".md")
    assert not found, "\n".join(f"{count}x {unit}" for unit, count in found.items())
