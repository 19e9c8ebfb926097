"""Issue 36: comments and docs point only at files in the repository. A reader of a clone has no
design notes, reference folder or first draft beside it, so "the DESIGN table", "as in the seed" or
a path out of the checkout points at nothing."""

from __future__ import annotations

import re
import subprocess

from tests.docs.snippets import ROOT

OUTSIDE = re.compile(
    r"\.\./shared/|shared/reference|(?-i:\bDESIGN(\.md|'s| table))|\bthe seed\b|\bseed-shaped\b"
    r"|\bsource idea\b|/work/(shared|briefs|main)\b",
    re.IGNORECASE,
)
TEXT = (".py", ".md", ".sh", ".toml", ".txt", ".yaml", ".yml", ".cfg", ".ini", "Makefile")


def test_no_comment_or_doc_points_outside_the_repository() -> None:
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    hits = []
    for name in files:
        if not name.endswith(TEXT) or name == "tests/docs/test_pointers_stay_inside.py":
            continue
        path = ROOT / name
        if not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{name}:{number}: {line.strip()[:100]}")
    assert hits == []
