"""The project's documents stay inside the repository: no link or path points outside it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [
    p
    for p in ROOT.rglob("*.md")
    if not {".venv", "node_modules", ".git", ".pytest_cache"} & set(p.relative_to(ROOT).parts)
]
LINK = re.compile(r"\]\(([^)#\s]+)")


def test_documents_were_found() -> None:
    assert ROOT / "README.md" in DOCS
    assert ROOT / "docs" / "api.md" in DOCS


def test_no_document_points_outside_the_repository() -> None:
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        assert "../shared" not in text, doc
        assert "DESIGN.md" not in text, doc
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # a URL, not a file
                continue
            resolved = (doc.parent / target).resolve()
            assert resolved.is_relative_to(ROOT), f"{doc}: {target} is outside the repository"
