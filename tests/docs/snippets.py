"""The fenced code blocks of the README and docs/, as a newcomer would copy them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
FENCE = re.compile(r"^( *)```(\w*)[^\n]*\n(.*?)^\1```", re.S | re.M)


@dataclass(frozen=True)
class Snippet:
    doc: Path
    line: int
    lang: str
    text: str

    def __str__(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line} ({self.lang or 'plain'})"


def snippets(lang: str | None = None, docs: tuple[Path, ...] = DOCS) -> list[Snippet]:
    """Every fenced block (its indentation removed), optionally only those of one language."""
    found = []
    for doc in docs:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            indent = len(m.group(1))
            body = "\n".join(line[indent:] for line in m.group(3).splitlines())
            found.append(Snippet(doc, text.count("\n", 0, m.start()) + 1, m.group(2), body + "\n"))
    return [s for s in found if lang is None or s.lang == lang]


def snippet_containing(needle: str, lang: str = "python", doc: Path = ROOT / "README.md") -> Snippet:
    """The one block of ``doc`` in ``lang`` that contains ``needle``."""
    (found,) = [s for s in snippets(lang, (doc,)) if needle in s.text]
    return found
