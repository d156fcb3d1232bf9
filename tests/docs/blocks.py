"""The fenced code blocks of the README and of every page under docs/, with the marker each
carries: an HTML comment on the last non-blank line before the fence.

Markers (a block with none is run by its language's rule, see test_code_blocks.py):

``<!-- fragment: why -->``       not runnable on purpose (a server command, your own keys);
                                 a Python fragment must still parse
``<!-- compat-test: NAME -->``   a gateway the compat suite (tests/compat) serves and drives
``<!-- same-as: PATH -->``       the text of a file of the repository that a test runs
``<!-- file: NAME -->``          saved as NAME and served by uvicorn (the README's gateway)
``<!-- run-with: SERVER -->``    a shell block run against SERVER: ``demo`` or a ``file:`` NAME
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tests.support import ROOT

PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")))
FENCE = re.compile(r"^```([\w-]*)\s*$")
MARKER = re.compile(r"^<!--\s*([\w-]+)(?::\s*(.*?))?\s*-->$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    marker: str | None  # "fragment", "compat-test", "same-as", "file", "run-with"
    argument: str | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    previous = ""  # the last non-blank line before this one
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            if lines[i].strip():
                previous = lines[i].strip()
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marker = MARKER.match(previous)
        found.append(
            Block(
                page,
                i + 1,
                opening.group(1),
                "\n".join(lines[i + 1 : end]) + "\n",
                marker.group(1) if marker else None,
                marker.group(2) if marker else None,
            )
        )
        previous, i = "", end + 1
    return found


def all_blocks() -> list[Block]:
    return [block for page in PAGES for block in blocks_of(page)]


def marked(marker: str, argument: str | None = None) -> list[Block]:
    return [
        b
        for b in all_blocks()
        if b.marker == marker and (argument is None or b.argument == argument)
    ]
