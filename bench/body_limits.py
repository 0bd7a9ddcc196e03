"""Oversized and junk bodies: how long the event loop stalls, and how much the server's peak RSS
grows, while ``kvoffload serve`` (default limits) answers them; against an idle baseline
measured in the same run.

Per scenario and round: a fresh server (so its ``VmHWM`` growth is the scenario's own), one
client polling ``GET /livez`` back to back on a keep-alive connection, first for an idle
window (the baseline: the longest ``/livez`` wait with nothing else to do), then while another
connection posts the scenario's body. *Stall* is the longest ``/livez`` wait while the body was
in flight, i.e. how long every other caller of the service waited. Figures are medians over
the rounds.

Scenarios:

- ``batch_200k_ops``: ``POST /v1/batch`` of 200k small ops (7.6 MB, under the 8 MiB limit);
- ``batch_int_flood`` / ``batch_str_flood``: 8 MiB batches whose ops are ``1`` / ``""``;
- ``lookup_8mib``: an 8 MiB lookup body (over the lookup route's cap, under the global limit);
- ``params_1mib``: ``PUT /v1/requests/r`` with 1 MiB of ``kv_transfer_params``;
- ``lookup_max``: the largest legitimate lookup (8192 keys of 64 bytes), for reference.

``--src DIR`` serves from another source tree with this venv, e.g. the last commit:
``git archive HEAD | tar -x -C /tmp/base`` then ``--src /tmp/base`` (its JSON goes to
``--out``). Run from the repository root: ``.venv/bin/python bench/body_limits.py [--quick]``.
Writes ``bench/results/body_limits.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402
from testsupport import procfs  # noqa: E402

RESULTS = harness.RESULTS_DIR / "body_limits.json"
IDLE_S = 0.5
JSON_TYPE = {"content-type": "application/json"}


@dataclass(frozen=True)
class Scenario:
    """One body to post and where."""

    name: str
    method: str
    path: str
    body: Callable[[], bytes]
    needs_request: bool = False


def _ops_body() -> bytes:
    op = {"op": "touch", "req_id": "r", "keys": []}
    return json.dumps({"ops": [op] * 200_000}, separators=(",", ":")).encode()


def _flood(item: bytes) -> Callable[[], bytes]:
    def body() -> bytes:
        n = ((8 << 20) - 64) // (len(item) + 1)
        return b'{"ops":[' + b",".join([item] * n) + b"]}"

    return body


def _lookup_8mib() -> bytes:
    n = ((8 << 20) - 64) // 131
    return json.dumps({"keys": ["ab" * 64] * n}, separators=(",", ":")).encode()


def _params_1mib() -> bytes:
    return json.dumps({"kv_transfer_params": {"blob": "x" * (1 << 20)}}).encode()


def _lookup_max() -> bytes:
    keys = [i.to_bytes(64, "big").hex() for i in range(8192)]
    return json.dumps({"keys": keys}, separators=(",", ":")).encode()


SCENARIOS = (
    Scenario("batch_200k_ops", "POST", "/v1/batch", _ops_body),
    Scenario("batch_int_flood", "POST", "/v1/batch", _flood(b"1")),
    Scenario("batch_str_flood", "POST", "/v1/batch", _flood(b'""')),
    Scenario("lookup_8mib", "POST", "/v1/requests/r/lookup", _lookup_8mib, needs_request=True),
    Scenario("params_1mib", "PUT", "/v1/requests/r", _params_1mib),
    Scenario("lookup_max", "POST", "/v1/requests/r/lookup", _lookup_max, needs_request=True),
)


class Server:
    """``kvoffload serve`` from ``src`` on free ports, default limits, CPU pool."""

    def __init__(self, src: Path, workdir: Path) -> None:
        self.port = harness.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
        env["PYTHONPATH"] = str(src)
        argv = [sys.executable, "-m", "app.cli", "serve", "--port", str(self.port)]
        argv += ["--admin-port", str(harness.free_port()), "--device", "cpu"]
        argv += ["--log-level", "error"]
        self.log = (workdir / f"serve-{self.port}.log").open("wb")
        self.proc = subprocess.Popen(argv, cwd=src, env=env, stdout=self.log, stderr=self.log)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("kvoffload serve exited early")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError("kvoffload serve not ready")

    def stop(self) -> None:
        harness.stop_server(self.proc)
        self.log.close()


async def _poll_until(client: httpx.AsyncClient, done: Awaitable[Any]) -> list[float]:
    """``/livez`` waits, back to back, until ``done`` completes."""
    task = asyncio.ensure_future(done)
    waits: list[float] = []
    while not task.done():
        start = time.perf_counter()
        await client.get("/livez")
        waits.append(time.perf_counter() - start)
    await task
    return waits


async def _one_round(src: Path, workdir: Path, scenario: Scenario, body: bytes) -> dict[str, Any]:
    server = Server(src, workdir)
    try:
        server.wait_ready()
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=60) as poller,
            httpx.AsyncClient(base_url=server.url, timeout=60) as poster,
        ):
            if scenario.needs_request:
                await poster.put("/v1/requests/r", json={})
            await poller.get("/livez")
            idle = await _poll_until(poller, asyncio.sleep(IDLE_S))
            before = procfs.proc_status(server.proc.pid)["VmHWM"]
            outcome: dict[str, Any] = {}

            async def post() -> None:
                start = time.perf_counter()
                try:
                    r = await poster.request(
                        scenario.method, scenario.path, content=body, headers=JSON_TYPE
                    )
                    outcome["answer"] = f"{r.status_code} {_code(r)}"
                except httpx.TransportError as exc:  # hung up on before the body was sent
                    outcome["answer"] = f"closed by server ({type(exc).__name__})"
                outcome["post_s"] = time.perf_counter() - start

            busy = await _poll_until(poller, post())
            growth = procfs.proc_status(server.proc.pid)["VmHWM"] - before
        return {
            "answer": outcome["answer"],
            "post_s": outcome["post_s"],
            "stall_s": max(busy),
            "idle_s": max(idle),
            "hwm_growth_mib": growth / 1024,
        }
    finally:
        server.stop()


def _code(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "ok"


def run(src: Path, rounds: int) -> list[dict[str, Any]]:
    """Every scenario, ``rounds`` times each (interleaved), reduced to medians."""
    bodies = {s.name: s.body() for s in SCENARIOS}
    runs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in SCENARIOS}
    with tempfile.TemporaryDirectory(prefix="kvobench-limits-") as tmp:
        for _ in range(rounds):
            for s in SCENARIOS:
                runs[s.name].append(asyncio.run(_one_round(src, Path(tmp), s, bodies[s.name])))
    rows = []
    for s in SCENARIOS:
        got = runs[s.name]
        rows.append(
            {
                "scenario": s.name,
                "route": f"{s.method} {s.path}",
                "body_bytes": len(bodies[s.name]),
                "answers": sorted({g["answer"] for g in got}),
                **{
                    key: statistics.median(g[key] for g in got)
                    for key in ("post_s", "stall_s", "idle_s", "hwm_growth_mib")
                },
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds instead of 5")
    parser.add_argument("--src", default=str(ROOT), help="source tree to serve from")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    rounds = 3 if args.quick else 5
    started = time.perf_counter()
    rows = run(Path(args.src).resolve(), rounds)
    elapsed = time.perf_counter() - started

    print(f"kvoffload serve from {args.src}, default limits, median of {rounds} rounds")
    header = (
        f"{'scenario':<16} {'body MB':>7} {'answer':<24} {'post s':>7} {'stall ms':>9} "
        f"{'idle ms':>8} {'x idle':>7} {'+HWM MiB':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        ratio = r["stall_s"] / r["idle_s"] if r["idle_s"] else float("inf")
        print(
            f"{r['scenario']:<16} {r['body_bytes'] / 1e6:>7.2f} {'/'.join(r['answers']):<24.24} "
            f"{r['post_s']:>7.3f} {r['stall_s'] * 1e3:>9.1f} {r['idle_s'] * 1e3:>8.2f} "
            f"{ratio:>7.0f} {r['hwm_growth_mib']:>8.1f}"
        )
    print(f"({elapsed:.1f} s)")
    harness.write_results(
        Path(args.out),
        {
            "benchmark": "body_limits",
            "src": str(args.src),
            "rounds": rounds,
            "machine": harness.machine(),
            "seconds": elapsed,
            "results": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
