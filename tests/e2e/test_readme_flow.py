"""The README's engine flow runs as written against a real `kvoffload serve` and prints what the
README says it prints. Only the address and the shared-memory file's name are changed, so the
test neither needs port 8000 nor collides with a run of the README by hand."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.e2e.server import ROOT, ServerProcess

README = ROOT / "README.md"


def fenced_blocks(section: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced block in the README section whose heading is given."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```(\w*)\n(.*?)```", text[start : end if end > 0 else None], re.S)


def test_readme_engine_flow_runs_as_written(tmp_path: Path) -> None:
    blocks = fenced_blocks("Using it from an engine")
    code = next(body for lang, body in blocks if lang == "python")
    printed = blocks[[body for _, body in blocks].index(code) + 1][1]
    cache_file = f"/dev/shm/kvoffload-test-readme-{os.getpid()}"
    server = ServerProcess(tmp_path, "--block-bytes", "65536", "--num-blocks", "64")
    with server.serving():
        for old, new in (
            ("http://127.0.0.1:8000", server.url),
            ("/dev/shm/engine0-kv", cache_file),
        ):
            assert code.count(old) == 1, old
            code = code.replace(old, new)
        done = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert done.returncode == 0, done.stderr
    assert done.stdout == printed
    assert not Path(cache_file).exists(), "the flow removes its cache file"
