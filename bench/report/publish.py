"""The results as the docs' Performance page shows them: ``results.rst``, which
``--publish-docs`` copies to ``docs/_static/performance/results.rst.inc``.

The page is narrow, so the widest tables are published in parts (:data:`PAGE_PARTS`), and a
figure is kept on one line with its range and unit.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from bench.report.report import Table, environment_lines, summary_lines, tables

#: The tables published in parts, by the start of their title: each part is (its name, its
#: columns), shown with the variant column. The Markdown report keeps them whole.
PAGE_PARTS: dict[str, list[tuple[str, list[str]]]] = {
    "Lock overhead per execution": [
        ("time", ["lock taken at", "µs per execution", "added µs over plain"]),
        ("requests", ["round trips", "commands sent", "commands run in scripts"]),
    ],
    "Throughput of a prefork worker": [
        ("rate", ["tasks/s", "of plain"]),
        ("cost per task", ["µs per task in the pool process", "µs to publish one"]),
    ],
    "Duplicates of one key": [
        (
            "turned away in process",
            ["µs to turn a duplicate away", "round trips", "duplicate raises"],
        ),
        (
            "on a real worker",
            [
                "max overlap via delay() (bodies run of published)",
                "max overlap via send_task() (bodies run of published)",
            ],
        ),
    ],
    "Scale": [
        ("memory", ["bytes per held lock", "keys per held lock", "left per released lock"]),
        ("speed", ["acquire+release /s while held", "same, empty database", "ratio"]),
    ],
}


def page_parts(table: Table) -> list[Table]:
    """``table`` as the docs' page shows it: whole, or in the parts :data:`PAGE_PARTS` says."""
    title, header, rows = table
    for start, parts in PAGE_PARTS.items():
        if title.startswith(start):
            out: list[Table] = []
            for name, columns in parts:
                picked = [0, *(header.index(column) for column in columns)]
                out.append(
                    (
                        f"{title}: {name}",
                        [header[i] for i in picked],
                        [[row[i] for i in picked] for row in rows],
                    )
                )
            return out
    return [table]


def _unbroken(text: str) -> str:
    """``text`` with each figure kept on one line with its range and unit: a no-break space
    before "(" and "%"/"s", a word joiner after the range's dash."""
    text = re.sub(r"(\d) \((\d)", "\\1\u00a0(\\2", text)
    text = re.sub(r"(\d)\u2013(\d)", "\\1\u2013\u2060\\2", text)
    return re.sub(r"([\d)]) (%|s\b)", "\\1\u00a0\\2", text)


def _rst_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = [f".. list-table:: {title}", "   :header-rows: 1", ""]
    for row in [header, *rows]:
        for index, cell in enumerate(row):
            text = _unbroken(cell.replace("*", "\\*").replace("`", "\\`")) or " "
            lines.append(f"   {'* -' if index == 0 else '  -'} {text}")
    return "\n".join(lines) + "\n"


def rst(results: dict[str, Any]) -> str:
    parts = [f"* {line}" for line in environment_lines(results)]
    parts += [f"* {line}" for line in summary_lines(results)]
    parts.append("")
    for table in tables(results):
        parts += [_rst_table(*part) for part in page_parts(table)]
    return "\n".join(parts) + "\n"
