"""The documented engine flows run as written against a real `kvoffload serve` and print what the
pages say they print: the README's short example, and the walkthrough of
``docs/getting-started.md`` ("Using it from an engine": the flow, on a first run and on a second
one against the same service, which finds the blocks the first stored; then cache control on
the keys it stored). Only the address and the shared-memory file's name are changed, textually,
so the test neither needs port 8000 nor collides with a run of the pages by hand."""

from __future__ import annotations

import os
from pathlib import Path

from tests.docs_blocks import block, printed_after, run_block
from tests.e2e.server import ServerProcess

URL = "http://127.0.0.1:8000"


def test_the_engine_flows_run_as_written(tmp_path: Path) -> None:
    code = block("getting-started.md", "engine-flow")
    printed = printed_after("getting-started.md", "engine-flow")
    assert printed == "Lookup(results=['hit', 'hit'], hit_prefix=2)\ndone\n"
    hint = block("getting-started.md", "retain")
    hint_printed = printed_after("getting-started.md", "retain")
    assert hint_printed == "session-42 True 2\n2\n"
    short = block("README.md", "readme-engine")
    cache_file = Path(f"/dev/shm/kvoffload-test-docs-{os.getpid()}")
    server = ServerProcess(tmp_path, "--block-bytes", "65536", "--num-blocks", "64")
    with server.serving():
        try:
            # The README's example, twice: its keys are new on every run.
            for attempt in ("first", "second"):
                done = run_block(short, {URL: server.url, "/dev/shm/readme-kv": str(cache_file)})
                assert done.returncode == 0, (attempt, done.stderr)
                assert done.stdout == "2\ndone\n", attempt
                assert not cache_file.exists(), f"the {attempt} run removes its cache file"
            for attempt in ("first", "second"):
                done = run_block(code, {URL: server.url, "/dev/shm/engine0-kv": str(cache_file)})
                assert done.returncode == 0, (attempt, done.stderr)
                assert done.stdout == printed, attempt
                assert not cache_file.exists(), f"the {attempt} run removes its cache file"
            # Cache control, on the keys the flow stored.
            done = run_block(hint, {URL: server.url})
            assert done.returncode == 0, done.stderr
            assert done.stdout == hint_printed
        finally:
            cache_file.unlink(missing_ok=True)  # a failed run must not leave it behind
