"""The docs read on any screen: no line of README.md, docs/ or the add-on's docs over 200
characters outside code blocks (a table row that long is a paragraph in a cell: a list reads better)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LONGEST = 200


def test_no_docs_line_is_over_200_characters_outside_code_blocks():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "addon").glob("*.md"))]
    long = []
    for page in pages:
        code = False
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if line.startswith("```"):
                code = not code
            elif not code and len(line) > LONGEST:
                long.append(f"{page.relative_to(ROOT)}:{number} ({len(line)} characters)")
    assert len(pages) > 5 and not long, long
