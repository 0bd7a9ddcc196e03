"""The documented engine flows run as written against a real `kvoffload serve` and print what the
pages say they print: the README's short example, and the walkthrough of
``docs/getting-started.md`` ("Using it from an engine": the flow, on a first run and on a second
one against the same service, which finds the blocks the first stored; then cache control on
the keys it stored). Only the address and the shared-memory file's name are changed, textually,
so the test neither needs port 8000 nor collides with a run of the pages by hand. The tenants
flow of ``docs/security.md`` ("KV caches with tenants") runs with no change at all."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.docs_blocks import block, printed_after, run_block
from testsupport.server import ServerProcess

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


def test_the_tenants_flow_runs_as_written(tmp_path: Path) -> None:
    """docs/security.md, "KV caches with tenants": the three blocks in one shell, as a user
    without root runs them (the virtual environment on ``PATH``, ``TMPDIR`` a fresh directory):
    a private directory with the tenant's file and token, the service on its Unix socket, the
    engine's registration by descriptor in namespace ``a1``, and the stop, which leaves
    nothing behind."""
    start = block("security.md", "tenants-start")
    engine = block("security.md", "tenant-registration")
    stop = block("security.md", "tenants-stop")
    assert 'namespace="a1"' in engine
    assert "a1 = " in start
    modes = tmp_path / "modes"
    script = "\n".join(
        [
            "set -e",
            # A failed step must not leave the service running (the stop block never runs).
            "trap 'kill $SERVE_PID 2>/dev/null || true' EXIT",
            start,
            f'stat -c %a "$KV_DIR" "$KV_DIR/tenants/demo.toml" "$KV_DIR/engine-token" > {modes}',
            f"python3 - <<'PY'\n{engine}PY",
            stop,
        ]
    )
    runs = tmp_path / "tmp"
    runs.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVOFFLOAD_", "XDG_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["TMPDIR"] = str(runs)
    done = subprocess.run(
        ["bash", "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == "16\n"
    assert modes.read_text().split() == ["700", "600", "600"]
    assert list(runs.iterdir()) == [], "the stop block removes the directory"
