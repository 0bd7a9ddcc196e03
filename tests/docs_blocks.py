"""The fenced code blocks of the README and the documentation pages, for the tests that run them.

A block a test runs is named by an HTML comment on the line before it, ``<!-- block: NAME -->``;
one that no test runs says why, ``<!-- not run: REASON -->`` (``docs/architecture.md``, "Code
blocks in the docs"). Tests take a block by its page and name (``block``), the block right after
it when that shows what it prints (``printed_after``), or every block of a section
(``section_blocks``), so moving text between pages changes one argument, not a parser.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The pages written by hand (``docs/cli.md`` is generated from the parser) whose code blocks
#: are held to "run or say why" (``tests/test_docs_site.py``) and whose options must exist
#: (``tests/app/test_cli_synopsis.py``).
HAND_WRITTEN = (
    "README.md",
    "index.md",
    "getting-started.md",
    "architecture.md",
    "api.md",
    "vllm.md",
    "sglang.md",
    "tiers.md",
    "security.md",
    "operations.md",
    "deploy.md",
    "kubernetes.md",
    "metrics.md",
    "alerts.md",
    "production.md",
    "benchmarks.md",
)
#: The blocks held to "run or say why" (``tests/test_docs_site.py``).
RUNNABLE = frozenset({"python", "bash", "sh", "shell", "console"})
_FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
_MARK = re.compile(r"<!--\s*(block|not run):\s*(.*?)\s*-->\s*\Z", re.S)


@dataclass(frozen=True)
class Block:
    """One fenced block: its language (``""`` for none), its text, and its marker, if any:
    ``("block", NAME)`` or ``("not run", REASON)``."""

    lang: str
    body: str
    marker: tuple[str, str] | None
    line: int


def page_path(page: str) -> Path:
    """``README.md`` is the repository's; any other page is under ``docs/``."""
    return ROOT / page if page == "README.md" else ROOT / "docs" / page


def blocks(page: str, text: str | None = None) -> list[Block]:
    """Every fenced block of ``page`` (or of ``text``), in order."""
    if text is None:
        text = page_path(page).read_text(encoding="utf-8")
    found = []
    for match in _FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n")
        last = before[before.rfind("\n") + 1 :]
        mark = _MARK.search(last)
        marker = (mark.group(1), mark.group(2)) if mark else None
        line = text.count("\n", 0, match.start()) + 1
        found.append(Block(match.group(1).lower(), match.group(2), marker, line))
    return found


def _named(page: str, name: str) -> tuple[list[Block], int]:
    every = blocks(page)
    index = [i for i, b in enumerate(every) if b.marker == ("block", name)]
    assert len(index) == 1, f"{page}: {len(index)} blocks named {name!r}"
    return every, index[0]


def block(page: str, name: str) -> str:
    """The text of the block of ``page`` named ``name``."""
    every, i = _named(page, name)
    return every[i].body


def printed_after(page: str, name: str) -> str:
    """The block right after the one named ``name``: what it prints."""
    every, i = _named(page, name)
    assert i + 1 < len(every), f"{page}: nothing after {name!r}"
    return every[i + 1].body


def section(page: str, heading: str) -> str:
    """The text of the section of ``page`` whose heading (any level) is ``heading``, up to the
    next heading of the same or a higher level."""
    text = page_path(page).read_text(encoding="utf-8")
    match = re.search(rf"^(#+) {re.escape(heading)}\n", text, re.M)
    assert match is not None, f"{page}: no section {heading!r}"
    level = len(match.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", re.M)
    # Headings inside fenced blocks (comments of shell or Python code) do not count.
    rest = text[match.end() :]
    for fence in _FENCE.finditer(rest):
        rest = rest[: fence.start()] + " " * (fence.end() - fence.start()) + rest[fence.end() :]
    stop = end.search(rest)
    return text[match.start() : match.end() + (stop.start() if stop else len(rest))]


def section_blocks(page: str, heading: str) -> list[Block]:
    """The fenced blocks of one section of ``page``."""
    return blocks(page, section(page, heading))


def run_block(
    code: str, replacements: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """A documented Python block, with each documented value in ``replacements`` replaced
    (each must appear exactly once, so a page that drifts fails here), run by this interpreter
    from the repository root."""
    for old, new in replacements.items():
        assert code.count(old) == 1, old
        code = code.replace(old, new)
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
