"""The documentation site builds with ``mkdocs build --strict`` (a broken link, a missing
anchor or a page left out of the nav fails), its command line reference is the parser's own
``--help`` (``docs/tools/cli_reference.py --check``), the README stays a short entry point, and
every code block of the hand-written pages is run by a test or says why not
(``docs/architecture.md``, "Code blocks in the docs")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests import docs_blocks

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200


def test_the_cli_reference_is_the_parser_s_help() -> None:
    done = subprocess.run(
        [sys.executable, "docs/tools/cli_reference.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    mkdocs = Path(sys.executable).with_name("mkdocs")
    assert mkdocs.exists(), "mkdocs is in the dev extra: make setup installs it"
    done = subprocess.run(
        [str(mkdocs), "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "cli" / "index.html").exists()


def test_the_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move text into docs/"


def test_every_runnable_block_is_run_by_a_test_or_says_why_not() -> None:
    tests = {p: p.read_text(encoding="utf-8") for p in (ROOT / "tests").rglob("*.py")}
    unmarked, unrun = [], []
    for page in docs_blocks.HAND_WRITTEN:
        for block in docs_blocks.blocks(page):
            if block.lang not in docs_blocks.RUNNABLE:
                continue
            where = f"{page}:{block.line} ({block.lang})"
            if block.marker is None:
                unmarked.append(where)
            elif block.marker[0] == "not run":
                assert block.marker[1], f"{where}: say why it is not run"
            elif not any(f'"{block.marker[1]}"' in t and f'"{page}"' in t for t in tests.values()):
                unrun.append(f"{where}: block {block.marker[1]!r}")
    assert not unmarked, (
        f"blocks with neither <!-- block: NAME --> nor <!-- not run: ... -->: {unmarked}"
    )
    assert not unrun, f"no test under tests/ reads these blocks (docs_blocks.block): {unrun}"


def test_block_names_are_unique_per_page() -> None:
    for page in docs_blocks.HAND_WRITTEN:
        names = [
            b.marker[1] for b in docs_blocks.blocks(page) if b.marker and b.marker[0] == "block"
        ]
        assert len(names) == len(set(names)), page


def test_the_manager_example_runs_as_written() -> None:
    """``docs/api.md``, "The manager (Python)": the manager on its own, in this process."""
    code = docs_blocks.block("api.md", "manager-example")
    exec(compile(code, "docs/api.md", "exec"), {})


def test_the_marker_finder_sees_what_precedes_a_block() -> None:
    text = (
        "a\n\n<!-- block: x -->\n```python\nprint(1)\n```\n\n"
        "<!-- not run: why -->\n```bash\nls\n```\n"
    )
    found = docs_blocks.blocks("README.md", text)
    assert [(b.lang, b.body, b.marker) for b in found] == [
        ("python", "print(1)\n", ("block", "x")),
        ("bash", "ls\n", ("not run", "why")),
    ]
