"""docs/configuration.rst is the one reference of the settings and task options, and it agrees
with the code that validates them.

The reference has two tables: "App settings" (setting, default, meaning) and "Task options"
(option, default, values, app setting used when ``None``). In a default cell, the first inline
literal is the default (a Python literal, compared with the code's value); what follows it
explains it. The code's side is :data:`singletask.config.DEFAULTS` for the settings and the
``lock_*`` class attributes of :class:`~singletask.SingletonTask` for the task options.

So a setting or option added, renamed or removed in the code, or a changed default, fails here
until the reference says the same. Other pages may mention a default in passing ("``lock_ttl``,
30 seconds by default"); such a mention must give the reference's value.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

import pytest

from singletask import SingletonTask
from singletask.config import DEFAULTS, MAX_COUNT, MAX_SECONDS

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "configuration.rst"

LITERAL = re.compile(r"``(.+?)``")


def list_tables(text: str) -> list[list[list[str]]]:
    """Every ``.. list-table::`` of an rST text, as rows of cells (whitespace collapsed)."""
    tables = []
    for match in re.finditer(r"^\.\. list-table::.*\n((?:[ \t]+.*\n|\n)+)", text, flags=re.M):
        rows: list[list[str]] = []
        for line in match.group(1).splitlines():
            if line.startswith("   * - "):
                rows.append([line[len("   * - ") :]])
            elif line.startswith("     - "):
                rows[-1].append(line[len("     - ") :])
            elif rows and line.strip():
                rows[-1][-1] += " " + line.strip()
        tables.append([[" ".join(cell.split()) for cell in row] for row in rows])
    return tables


def reference_table(first_header: str) -> dict[str, dict[str, str]]:
    """The reference's table whose first column is ``first_header``: {name: {column: cell}}."""
    for header, *rows in list_tables(REFERENCE.read_text()):
        if header[0] == first_header:
            for row in rows:
                assert len(row) == len(header), (
                    f"{REFERENCE.name}: a row of {len(row)} cells: {row}"
                )
            return {_literal(row[0]): dict(zip(header, row, strict=True)) for row in rows}
    raise AssertionError(f"{REFERENCE.name} has no table whose first column is {first_header!r}")


def _literal(cell: str) -> str:
    found = LITERAL.search(cell)
    assert found, f"no ``literal`` in the cell {cell!r}"
    return found.group(1)


def documented_default(cell: str) -> object:
    """The value of a default cell: its first inline literal, read as a Python literal."""
    return ast.literal_eval(_literal(cell))


def same_value(documented: object, actual: object) -> bool:
    """Equal, and of the same kind: ``30`` documents ``30.0``, but ``1`` does not document
    ``True`` nor ``"30"`` ``30``."""
    numbers = (int, float)
    if isinstance(documented, bool) or isinstance(actual, bool):
        return documented is actual
    if isinstance(documented, numbers) and isinstance(actual, numbers):
        return documented == actual
    return type(documented) is type(actual) and documented == actual


SETTINGS = reference_table("setting")
OPTIONS = reference_table("option")
#: The task options: the ``lock_*`` class attributes that SingletonTask declares.
CODE_OPTIONS = sorted(name for name in SingletonTask.__annotations__ if name.startswith("lock_"))


def differences(code: Iterable[str], reference: Iterable[str]) -> str:
    """What only the code has and what only the reference has, as a message."""
    only_code, only_reference = (
        sorted(set(code) - set(reference)),
        sorted(set(reference) - set(code)),
    )
    return f"in the code only: {only_code}; in the reference only: {only_reference}"


def test_the_reference_lists_every_setting_of_the_code_and_no_other():
    assert set(SETTINGS) == set(DEFAULTS), differences(DEFAULTS, SETTINGS)


@pytest.mark.parametrize("setting", sorted(DEFAULTS))
def test_the_documented_default_of_each_setting_is_the_codes(setting):
    if setting not in SETTINGS:
        pytest.fail(f"{setting} is not in the reference")
    documented = documented_default(SETTINGS[setting]["default"])
    assert same_value(documented, DEFAULTS[setting]), (
        f"{REFERENCE.name} gives {setting} the default {documented!r}; the code has "
        f"{DEFAULTS[setting]!r}"
    )


def test_the_reference_lists_every_task_option_of_the_code_and_no_other():
    assert CODE_OPTIONS, "SingletonTask declares no lock_* attribute: the scan is broken"
    assert set(OPTIONS) == set(CODE_OPTIONS), differences(CODE_OPTIONS, OPTIONS)


@pytest.mark.parametrize("option", CODE_OPTIONS)
def test_the_documented_default_of_each_task_option_is_the_codes(option):
    if option not in OPTIONS:
        pytest.fail(f"{option} is not in the reference")
    documented = documented_default(OPTIONS[option]["default"])
    assert same_value(documented, getattr(SingletonTask, option))


@pytest.mark.parametrize("option", CODE_OPTIONS)
def test_a_task_option_names_the_app_setting_it_falls_back_to_exactly_when_there_is_one(option):
    if option not in OPTIONS:
        pytest.fail(f"{option} is not in the reference")
    cell = OPTIONS[option]["app setting used when ``None``"]
    setting = f"singletask_{option}"
    if setting in DEFAULTS:
        assert _literal(cell) == setting
    else:
        assert "singletask_" not in cell, (
            f"{option} has no app setting, but the reference names one"
        )


def test_the_documented_bounds_are_the_validators():
    text = " ".join(REFERENCE.read_text().split())
    assert f"{MAX_SECONDS:,} seconds ({MAX_SECONDS // 86400} days)" in text
    assert f"at most **{MAX_COUNT}**" in text
    for option, row in OPTIONS.items():
        values = row["values"]
        if values.startswith("seconds"):
            assert f"at most {MAX_SECONDS // 86400} days" in values, option
        if values.startswith("a whole number"):
            assert f"from 0 to {MAX_COUNT}" in values, option


# -- defaults mentioned in passing on other pages -------------------------------------------

#: The pages a user reads besides the reference. (CHANGELOG.md is left out: an entry may give a
#: default a version had.) The API page renders SingletonTask's docstring, so it is one too.
PAGES = {
    "README.md": (ROOT / "README.md").read_text(),
    **{
        f"docs/{page.name}": page.read_text()
        for page in sorted((ROOT / "docs").glob("*.rst"))
        if page != REFERENCE
    },
    "SingletonTask docstring (docs/api.rst)": SingletonTask.__doc__ or "",
}

#: A setting or option, in rST or Markdown literal quotes, and the words that follow it up to
#: the next literal or the end of the sentence.
MENTION = re.compile(r"`{1,2}(?:singletask_)?(lock_\w+)`{1,2}((?:[^`.;]|\.(?=\d))*)")
#: A number given as a default in those words: "default 30", "default, 30" or "30 s by default".
DEFAULT_NUMBER = re.compile(
    r"\bdefault:?,? (\d[\d,]*(?:\.\d+)?)|(?<![\w.])(\d[\d,]*(?:\.\d+)?) ?(?:s|seconds)? by default"
)


def numeric_default(name: str) -> float | None:
    value = DEFAULTS.get(f"singletask_{name}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def passing_mentions() -> list[tuple[str, str, str, float]]:
    """(page, name, words, number) for each "``name`` ... N by default" on the pages."""
    found = []
    for page, text in PAGES.items():
        for match in MENTION.finditer(" ".join(text.split())):
            name, words = match.groups()
            number = DEFAULT_NUMBER.search(words)
            if number and numeric_default(name) is not None:
                digits = (number.group(1) or number.group(2)).replace(",", "")
                found.append((page, name, words.strip(), float(digits)))
    return found


def test_the_scan_of_other_pages_finds_the_mentions_it_is_meant_for():
    names = {name for _, name, _, _ in passing_mentions()}
    assert "lock_ttl" in names, "no page says lock_ttl's default in passing: is the scan broken?"


def test_other_pages_mention_only_the_documented_defaults():
    wrong = [
        f"{page}: ``{name}`` {words!r} (the default is {numeric_default(name):g})"
        for page, name, words, number in passing_mentions()
        if number != numeric_default(name)
    ]
    assert not wrong, "\n".join(wrong)
