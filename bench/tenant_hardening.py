"""What the tenant hardening (issue #31) costs an engine's calls: calls per second with tenants
on, this tree against a baseline commit, in the same run.

Two real ``kvoffload serve`` processes with the same tenants file, one from this working tree
(*after*) and one from a ``git worktree`` of ``--baseline`` (*before*, by default the commit
before the hardening), each on its own ports and Unix socket, started and warmed alike. A
client then alternates rounds between them (before, after, after, before, ...) so that the
machine's drift falls on both alike, in three shapes of call:

- ``keep-alive``: ``POST /v1/requests/{id}/lookup`` of 32 keys on one kept-alive connection
  (what an engine's scheduler does every step);
- ``new connection``: the same call on a fresh connection each time (what the connection
  guard sees most of: one timer and one peer count per connection);
- ``batch``: ``POST /v1/batch`` of 16 lookups on one connection.

Every call carries the tenant's token and namespace. Per shape: the median calls/s of each
side over the rounds, and after / before (target >= 0.97x).

Run: ``.venv/bin/python bench/tenant_hardening.py`` (``--quick``: fewer calls and rounds).
Prints the table and writes ``bench/results/tenant_hardening.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402

BASELINE = "773a039"
TOKEN = "bench-hardening-token-0000000001"
NAMESPACE = "n1"
KEYS = [f"{i:032x}" for i in range(32)]
HEADERS = {"Authorization": f"Bearer {TOKEN}", "X-KVOffload-Namespace": NAMESPACE}


@contextmanager
def baseline_tree(rev: str) -> Iterator[Path]:
    """A detached worktree of ``rev`` (removed afterwards)."""
    where = Path(tempfile.mkdtemp(prefix="kvo-baseline-"))
    where.rmdir()
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(where), rev], check=True
    )
    try:
        yield where
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)], check=False
        )


@contextmanager
def serving(tree: Path, work: Path, name: str) -> Iterator[str]:
    """``kvoffload serve`` from ``tree`` with one tenant; its base URL."""
    port, admin = harness.free_port(), harness.free_port()
    tenants = work / f"tenants-{name}.toml"
    tenants.write_text(f'[tenants.bench]\ntokens = ["{TOKEN}"]\nnamespaces = {{ n1 = 4096 }}\n')
    os.chmod(tenants, 0o600)
    argv = [sys.executable, "-m", "app.cli", "serve", "--port", str(port)]
    argv += ["--admin-port", str(admin), "--tenants", str(tenants), "--device", "cpu"]
    argv += ["--num-blocks", "4096", "--block-bytes", "4096", "--log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    env["PYTHONPATH"] = str(tree)  # its own packages first (the client is shared)
    log = (work / f"serve-{name}.log").open("wb")
    proc = subprocess.Popen(argv, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"{name} did not start: {(work / f'serve-{name}.log').read_text()}"
                )
            time.sleep(0.1)
        httpx.put(f"{url}/v1/requests/bench", json={}, headers=HEADERS).raise_for_status()
        yield url
    finally:
        harness.stop_server(proc)
        log.close()


def keep_alive(url: str, calls: int) -> float:
    with httpx.Client(base_url=url, headers=HEADERS) as c:
        started = time.perf_counter()
        for _ in range(calls):
            c.post("/v1/requests/bench/lookup", json={"keys": KEYS}).raise_for_status()
        return calls / (time.perf_counter() - started)


def new_connection(url: str, calls: int) -> float:
    """Raw sockets: an ``httpx.Client`` per call would measure its own setup, not the call."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"keys": KEYS}).encode()
    head = (
        f"POST /v1/requests/bench/lookup HTTP/1.1\r\nHost: {host}\r\n"
        + "".join(f"{k}: {v}\r\n" for k, v in HEADERS.items())
        + f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    started = time.perf_counter()
    for _ in range(calls):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(head + body)
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        if not answer.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"lookup answered {answer[:200]!r}")
    return calls / (time.perf_counter() - started)


def batch(url: str, calls: int) -> float:
    ops = [{"op": "lookup", "req_id": "bench", "keys": KEYS} for _ in range(16)]
    with httpx.Client(base_url=url, headers=HEADERS) as c:
        started = time.perf_counter()
        for _ in range(calls):
            c.post("/v1/batch", json={"ops": ops}).raise_for_status()
        return calls / (time.perf_counter() - started)


SHAPES: dict[str, Callable[[str, int], float]] = {
    "keep-alive": keep_alive,
    "new connection": new_connection,
    "batch": batch,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=BASELINE, help="the commit measured as before")
    parser.add_argument("--calls", type=int, default=2000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per side and shape")
    parser.add_argument("--quick", action="store_true", help="300 calls, 2 rounds")
    parser.add_argument("--out", type=Path, default=harness.RESULTS_DIR)
    args = parser.parse_args(argv)
    calls, rounds = (300, 2) if args.quick else (args.calls, args.rounds)
    work = Path(tempfile.mkdtemp(prefix="kvo-hardening-"))
    rows: list[dict[str, Any]] = []
    try:
        with (
            baseline_tree(args.baseline) as old_tree,
            serving(old_tree, work, "before") as before,
            serving(ROOT, work, "after") as after,
        ):
            sides = {"before": before, "after": after}
            for shape, run in SHAPES.items():
                run(before, calls // 4)  # warm both alike
                run(after, calls // 4)
                got: dict[str, list[float]] = {"before": [], "after": []}
                for r in range(rounds):
                    order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
                    for side in order:
                        got[side].append(run(sides[side], calls))
                b, a = statistics.median(got["before"]), statistics.median(got["after"])
                rows.append(
                    {
                        "shape": shape,
                        "before_calls_s": round(b, 1),
                        "after_calls_s": round(a, 1),
                        "after_vs_before": round(a / b, 3),
                        "rounds": got,
                    }
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    head = "{:<16} {:>14} {:>14} {:>14}"
    print(
        f"calls/s with tenants on, {calls} calls a round, median of {rounds} alternating rounds; "
        f"before = {args.baseline}, after = this tree"
    )
    print(head.format("shape", "before", "after", "after/before"))
    for row in rows:
        print(
            head.format(
                row["shape"],
                f"{row['before_calls_s']:.0f}",
                f"{row['after_calls_s']:.0f}",
                f"{row['after_vs_before']:.3f}x",
            )
        )
    record = harness.machine(baseline=args.baseline, calls=calls, rounds=rounds, rows=rows)
    harness.write_results(args.out / "tenant_hardening.json", record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
