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
side over the rounds, and the median CPU time the server spent per call (all its threads,
``/proc/<pid>/task/*/schedstat``), which leaves out the client's share of the machine. The
ratios (after / before calls/s, before / after CPU per call; target >= 0.97x) are the median
of each round's own ratio: a round runs both sides back to back, so the machine's drift
(calls/s of one code against itself swings by 10% between rounds on a 2-core VM) falls on
both alike. ``--baseline HEAD`` measures the same code on both sides: the noise floor.
The servers run on the last core, the client on the others, where the machine has two or more.

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


def cpu_ns(pid: int) -> int:
    """CPU time process ``pid`` has spent, all its threads, in ns."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
    return total


@contextmanager
def serving(tree: Path, work: Path, name: str, cores: set[int]) -> Iterator[tuple[str, int]]:
    """``kvoffload serve`` from ``tree`` with one tenant, on ``cores``; its base URL and
    pid."""
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
    os.sched_setaffinity(proc.pid, cores)
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
        yield url, proc.pid
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


Rounds = dict[str, dict[str, list[float]]]  # side -> {"calls_s": [...], "cpu_us": [...]}


def measure(
    run: Callable[[str, int], float],
    sides: dict[str, tuple[str, int]],
    calls: int,
    rounds: int,
    into: Rounds,
) -> None:
    """One shape on every side, ``rounds`` rounds appended to ``into``: calls/s and the
    server's CPU time per call, each round running the sides back to back in a rotating
    order."""
    names = list(sides)
    for url, _ in sides.values():
        run(url, calls // 4)  # warm all alike
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            url, pid = sides[name]
            spent = cpu_ns(pid)
            into[name]["calls_s"].append(run(url, calls))
            into[name]["cpu_us"].append((cpu_ns(pid) - spent) / calls / 1000)


def summary(shape: str, got: Rounds) -> dict[str, Any]:
    """Medians, and the medians of each round's own ratios (a ratio of medians would keep the
    machine's drift between rounds)."""

    def med(side: str, what: str) -> float:
        return round(statistics.median(got[side][what]), 1)

    def paired(xs: list[float], ys: list[float]) -> float:
        return round(statistics.median(x / y for x, y in zip(xs, ys, strict=True)), 3)

    return {
        "shape": shape,
        "before_calls_s": med("before", "calls_s"),
        "after_calls_s": med("after", "calls_s"),
        "before_cpu_us": med("before", "cpu_us"),
        "after_cpu_us": med("after", "cpu_us"),
        "after_vs_before": paired(got["after"]["calls_s"], got["before"]["calls_s"]),
        "cpu_before_vs_after": paired(got["before"]["cpu_us"], got["after"]["cpu_us"]),
        "control_vs_after": paired(got["control"]["calls_s"], got["after"]["calls_s"]),
        "rounds": got,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=BASELINE, help="the commit measured as before")
    parser.add_argument("--calls", type=int, default=400, help="calls per round")
    parser.add_argument("--rounds", type=int, default=8, help="rounds per session and shape")
    parser.add_argument("--sessions", type=int, default=3, help="fresh servers this many times")
    parser.add_argument("--quick", action="store_true", help="300 calls, 2 rounds, 1 session")
    parser.add_argument("--out", type=Path, default=harness.RESULTS_DIR)
    args = parser.parse_args(argv)
    calls, rounds, sessions = (
        (300, 2, 1) if args.quick else (args.calls, args.rounds, args.sessions)
    )
    work = Path(tempfile.mkdtemp(prefix="kvo-hardening-"))
    sides_named = ("before", "after", "control")
    got: dict[str, Rounds] = {
        shape: {n: {"calls_s": [], "cpu_us": []} for n in sides_named} for shape in SHAPES
    }
    servers, client = harness.split_cores()
    os.sched_setaffinity(0, client)
    try:
        with baseline_tree(args.baseline) as old_tree:
            # Fresh processes each session: one process's own luck (its memory layout) is a
            # bias of a few percent that rounds cannot average out, sessions can.
            for session in range(sessions):
                with (
                    serving(old_tree, work, f"before{session}", servers) as before,
                    serving(ROOT, work, f"after{session}", servers) as after,
                    serving(ROOT, work, f"control{session}", servers) as control,
                ):
                    sides = {"before": before, "after": after, "control": control}
                    for shape, run in SHAPES.items():
                        measure(run, sides, calls, rounds, got[shape])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [summary(shape, got[shape]) for shape in SHAPES]
    head = "{:<15} {:>9} {:>9} {:>8} {:>8} {:>13} {:>12} {:>13}"
    print(
        f"tenants on, {calls} calls a round, {rounds} rounds in each of {sessions} sessions of "
        f"fresh servers (a round runs every side back to back); before = {args.baseline}, "
        "after = this tree, control = this tree again"
    )
    columns = ("before/s", "after/s", "bef us", "aft us", "after/before", "cpu bef/aft")
    print(head.format("shape", *columns, "control/after"))
    for row in rows:
        print(
            head.format(
                row["shape"],
                f"{row['before_calls_s']:.0f}",
                f"{row['after_calls_s']:.0f}",
                f"{row['before_cpu_us']:.0f}",
                f"{row['after_cpu_us']:.0f}",
                f"{row['after_vs_before']:.3f}x",
                f"{row['cpu_before_vs_after']:.3f}x",
                f"{row['control_vs_after']:.3f}x",
            )
        )
    print(
        "/s: calls per second, us: the server's CPU time per call (medians over rounds); "
        "ratios: the median of each round's own ratio (target >= 0.97x); control/after: "
        "the same code in two processes, the noise floor"
    )
    record = harness.machine(
        baseline=args.baseline, calls=calls, rounds=rounds, sessions=sessions, rows=rows
    )
    harness.write_results(args.out / "tenant_hardening.json", record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
