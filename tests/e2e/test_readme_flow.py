"""The README's engine flow runs as written against a real `kvoffload serve` and prints what the
README says it prints, on a first run and on a second one against the same service (which finds
the blocks the first stored). Only the address and the shared-memory file's name are changed,
textually, so the test neither needs port 8000 nor collides with a run of the README by hand."""

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


def test_readme_engine_flow_runs_as_written_twice(tmp_path: Path) -> None:
    blocks = fenced_blocks("Using it from an engine")
    code = next(body for lang, body in blocks if lang == "python")
    printed = blocks[[body for _, body in blocks].index(code) + 1][1]
    assert printed == "Lookup(results=['hit', 'hit'], hit_prefix=2)\ndone\n"
    cache_file = Path(f"/dev/shm/kvoffload-test-readme-{os.getpid()}")
    server = ServerProcess(tmp_path, "--block-bytes", "65536", "--num-blocks", "64")
    with server.serving():
        for old, new in (
            ("http://127.0.0.1:8000", server.url),
            ("/dev/shm/engine0-kv", str(cache_file)),
        ):
            assert code.count(old) == 1, old
            code = code.replace(old, new)
        try:
            for run in ("first", "second"):
                done = subprocess.run(
                    [sys.executable, "-c", code],
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                    timeout=120,
                    check=False,
                )
                assert done.returncode == 0, (run, done.stderr)
                assert done.stdout == printed, run
                assert not cache_file.exists(), f"the {run} run removes its cache file"
            # Cache control, on the keys the flow stored.
            hint = next(b for lang, b in blocks if lang == "python" and "kv.retain(" in b)
            hint_printed = blocks[[b for _, b in blocks].index(hint) + 1][1]
            assert hint_printed == "session-42 True 2\n2\n"
            assert hint.count("http://127.0.0.1:8000") == 1
            done = subprocess.run(
                [sys.executable, "-c", hint.replace("http://127.0.0.1:8000", server.url)],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            assert done.returncode == 0, done.stderr
            assert done.stdout == hint_printed
        finally:
            cache_file.unlink(missing_ok=True)  # a failed run must not leave it behind
