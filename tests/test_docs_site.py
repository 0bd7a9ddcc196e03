"""The documentation site builds with ``mkdocs build --strict`` (a broken link, a missing
anchor or a page left out of the nav fails), and its command line reference is the parser's
own ``--help`` (``docs/tools/cli_reference.py --check``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
