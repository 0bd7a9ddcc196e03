"""Issue #21, item 4: a legitimate ``receive_pool`` while idle connections hold the pool socket.

A tenant-mode ``PoolShareServer`` (the service's pool socket with tenants) runs on a uvloop
loop of its own thread; its pool is an anonymous file. Then, per scenario, ``--idle``
connections are opened that never send anything, and ``--calls`` legitimate ``receive_pool``
calls (with a token) are timed one after the other while they stay open:

- ``none``: no idle connection (the floor);
- ``one_peer``: the idle connections come from this process (one peer);
- ``many_peers``: each comes from a process of its own (``--idle`` peers).

The server's request deadline is set to ``--deadline-s`` (30 s, longer than the run), so the
idle connections are as an attacker who reconnects keeps them: never timed out meanwhile.

``--src DIR`` imports the service from another source tree (e.g. the commit before the fix:
``git archive BASE | tar -x -C /tmp/base``), so both figures come from the same script. Prints
a table (latency median, p99 and max in ms, failures); writes ``bench/results/pool_idle.json``
(or ``--out``). Run from the repository root: ``.venv/bin/python bench/pool_idle.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

TOKEN = "pool-idle-token-0123456789"
_IDLE_CHILD = (
    "import socket, sys, time\n"
    "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
    "s.connect(sys.argv[1])\n"
    "print('up', flush=True)\n"
    "sys.stdin.read()\n"
)


def run(idle: int, calls: int, deadline_s: float) -> list[dict[str, Any]]:
    """Every scenario's figures."""
    import uvloop
    from kvoffload_client.pool_socket import PoolShareError, SharedPool, receive_pool

    from app.pool_share import PoolShareServer

    class Refused(Exception):
        reason = "unknown_token"

    fd = os.memfd_create("pool", os.MFD_CLOEXEC)
    os.ftruncate(fd, 16 * 4096)
    pool = SharedPool(fd, "pool-1", 16, 4096)

    def current(request: dict[str, Any]) -> SharedPool:
        if request["token"] != TOKEN:
            raise Refused
        return pool

    where = tempfile.mkdtemp(prefix="kvo-bench-")
    path = os.path.join(where, "pool")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    loop = uvloop.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = PoolShareServer(sock, current, read_request=True, request_timeout_s=deadline_s)

    async def start() -> None:
        server.start()

    asyncio.run_coroutine_threadsafe(start(), loop).result(5)
    results = []
    try:
        for scenario in ("none", "one_peer", "many_peers"):
            held: list[socket.socket] = []
            children: list[subprocess.Popen[str]] = []
            try:
                if scenario == "one_peer":
                    for _ in range(idle):
                        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                        conn.connect(path)
                        held.append(conn)
                elif scenario == "many_peers":
                    for _ in range(idle):
                        child = subprocess.Popen(
                            [sys.executable, "-c", _IDLE_CHILD, path],
                            stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE,
                            text=True,
                        )
                        children.append(child)
                    for child in children:
                        assert child.stdout is not None
                        child.stdout.readline()
                time.sleep(0.2)  # the server has accepted them all
                times, failures = [], 0
                errors: dict[str, int] = {}
                for _ in range(calls):
                    t0 = time.perf_counter()
                    try:
                        got = receive_pool(path, timeout_s=5, token=TOKEN)
                    except PoolShareError as exc:
                        failures += 1
                        key = str(exc).split(": ", 1)[-1][:60]
                        errors[key] = errors.get(key, 0) + 1
                        continue
                    times.append((time.perf_counter() - t0) * 1000)
                    os.close(got.fd)
            finally:
                for conn in held:
                    conn.close()
                for child in children:
                    child.kill()
                    child.wait()
            times.sort()
            results.append(
                {
                    "scenario": scenario,
                    "idle": 0 if scenario == "none" else idle,
                    "calls": calls,
                    "served": len(times),
                    "failures": failures,
                    "errors": errors,
                    "median_ms": round(statistics.median(times), 3) if times else None,
                    "p99_ms": round(times[int(0.99 * (len(times) - 1))], 3) if times else None,
                    "max_ms": round(times[-1], 3) if times else None,
                }
            )
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
        os.close(fd)
        os.unlink(path)
        os.rmdir(where)
    return results


def main() -> None:
    """Parse the flags, measure, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--idle", type=int, default=70)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--deadline-s", type=float, default=30.0)
    parser.add_argument("--src", type=Path, default=None, help="import the service from here")
    parser.add_argument("--label", default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    root = (args.src or Path(__file__).resolve().parent.parent).resolve()
    sys.path.insert(0, str(root))
    label = args.label or ("this tree" if args.src is None else str(args.src))
    rows = run(args.idle, args.calls, args.deadline_s)
    print(f"{label}: {args.calls} receive_pool calls per scenario")
    print(
        f"{'scenario':<11} {'idle':>5} {'served':>7} {'failed':>7} {'median ms':>10} "
        f"{'p99 ms':>8} {'max ms':>8}"
    )
    for r in rows:

        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v:.3f}"

        print(
            f"{r['scenario']:<11} {r['idle']:>5} {r['served']:>7} {r['failures']:>7} "
            f"{ms(r['median_ms']):>10} {ms(r['p99_ms']):>8} {ms(r['max_ms']):>8}"
        )
        if r["errors"]:
            print(f"  errors: {r['errors']}")
    out = args.out or Path(__file__).resolve().parent / "results" / "pool_idle.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"label": label, "src": str(root), "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
