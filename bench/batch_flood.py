"""One tenant's largest batches against another tenant's lookups (issue #42, finding 10).

A real ``kvoffload serve`` on 127.0.0.1 with two tenants, each with its own namespace. *alice*
sends ``POST /v1/requests/{id}/lookup`` of 32 keys on one kept-alive connection, one call after
another, and times each. *bob* (another process, bodies encoded beforehand) sends the largest
batches the limits allow, back to back: ``--ops`` ops of ``max_keys_per_call`` (8,192) keys of
32 bytes each, cycling prepare_store, complete_store, touch and drop of the same keys (about
6 MB a body, under the 8 MiB cap); with ``--flood demote``, prepare_store, complete_store and
demote, the service given a disk tier (bob's blocks go down to it and are stored again); with
``--flood retain``, prepare_store, complete_store and retain, each op's keys a retention of its
own that lives ``RETAIN_TTL_S`` (made again once expired; past the namespace's bound of retained
blocks, half its pool, the rest are refused after the same counting).
alice's p50 and p99 are taken idle (bob silent) and during the flood, on this tree (*after*)
and on a ``git worktree`` of ``--baseline`` (*before*), the same run, the same machine. Bob's
client runs at the lowest priority on the client core it shares with alice's. Ratio: p99
during the flood over p99 idle. Target (after): p99 during the flood <= 5 ms.

Run: ``.venv/bin/python bench/batch_flood.py`` (``--quick``: fewer calls). Prints the table and
writes ``bench/results/batch_flood.json`` (``batch_flood_<flood>.json`` for the other floods).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402
from bench.harness import split_cores  # noqa: E402
from bench.tenant_hardening import baseline_tree  # noqa: E402

KEYS_PER_OP = 8192
TARGET_P99_MS = 5.0
ALICE = ("bench-alice-token-00000000000001", "a1")
BOB = ("bench-bob-token-000000000000000001", "b1")
POOL_BLOCKS = 1 << 17
LOOKUP_KEYS = [f"{i:064x}" for i in range(32)]
DISK_BYTES = 256 << 20
FLOODS = {
    "stores": ("prepare_store", "complete_store", "touch", "drop"),
    "demote": ("prepare_store", "complete_store", "demote"),
    "retain": ("prepare_store", "complete_store", "retain"),
}
RETAIN_TTL_S = 1.0


def headers(who: tuple[str, str]) -> dict[str, str]:
    return {"Authorization": f"Bearer {who[0]}", "X-KVOffload-Namespace": who[1]}


@contextmanager
def serving(
    tree: Path, work: Path, name: str, cores: set[int], disk: bool = False
) -> Iterator[str]:
    """``kvoffload serve`` from ``tree`` with the two tenants, on ``cores`` (with a disk tier
    under ``work`` when ``disk``); its base URL."""
    port, admin = harness.free_port(), harness.free_port()
    tenants = work / f"tenants-{name}.toml"
    tenants.write_text(
        f'[tenants.alice]\ntokens = ["{ALICE[0]}"]\nnamespaces = {{ {ALICE[1]} = 4096 }}\n'
        f'[tenants.bob]\ntokens = ["{BOB[0]}"]\nnamespaces = {{ {BOB[1]} = {POOL_BLOCKS} }}\n'
    )
    os.chmod(tenants, 0o600)
    argv = [sys.executable, "-m", "app.cli", "serve", "--port", str(port)]
    argv += ["--admin-port", str(admin), "--tenants", str(tenants), "--device", "cpu"]
    argv += ["--num-blocks", str(POOL_BLOCKS), "--block-bytes", "512", "--log-level", "warning"]
    if disk:
        (work / f"disk-{name}").mkdir(mode=0o700)
        argv += ["--disk-dir", str(work / f"disk-{name}"), "--disk-bytes", str(DISK_BYTES)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    env["PYTHONPATH"] = str(tree)
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
        for who in (ALICE, BOB):
            httpx.put(f"{url}/v1/requests/r", json={}, headers=headers(who)).raise_for_status()
        yield url
    finally:
        harness.stop_server(proc)
        log.close()


def bob_bodies(ops: int, flood: str = "stores") -> list[bytes]:
    """The flood's bodies: each of ``FLOODS[flood]``'s ops of the same keys."""
    keys = [[f"{(j << 20) + i:064x}" for i in range(KEYS_PER_OP)] for j in range(ops)]
    out = []
    for op in FLOODS[flood]:
        batch = [
            {"op": op, "req_id": "r", "keys": k, **op_fields(op, j)} for j, k in enumerate(keys)
        ]
        out.append(json.dumps({"ops": batch}).encode())
    return out


def op_fields(op: str, j: int) -> dict[str, Any]:
    """The fields besides ``keys`` of bob's ``op`` number ``j`` in a batch."""
    if op == "complete_store":
        return {"success": True}
    if op == "retain":  # a retention per op, made again once it expires
        return {"ttl_s": RETAIN_TTL_S, "name": f"flood-{j}"}
    return {}


def flood(url: str, bodies: list[bytes], stop: Any, sent: Any) -> None:
    """Bob: the bodies, back to back, until ``stop`` is set."""
    # Bob's client shares the client core with alice's (two cores: the server has the
    # other). At the lowest priority it takes that core only while alice's waits on the
    # server, so alice's figures are the server's and not the client core's scheduling.
    os.nice(19)
    with httpx.Client(base_url=url, headers=headers(BOB), timeout=60) as c:
        while not stop.is_set():
            for body in bodies:
                r = c.post("/v1/batch", content=body, headers={"content-type": "application/json"})
                r.raise_for_status()
                sent.value += 1


def alice_latencies(url: str, calls: int) -> list[float]:
    """Alice: ``calls`` lookups on one connection, each one's latency in ms."""
    out = []
    with httpx.Client(base_url=url, headers=headers(ALICE)) as c:
        for _ in range(calls):
            started = time.perf_counter()
            c.post("/v1/requests/r/lookup", json={"keys": LOOKUP_KEYS}).raise_for_status()
            out.append((time.perf_counter() - started) * 1000)
    return out


def pct(xs: list[float], q: float) -> float:
    return round(statistics.quantiles(xs, n=1000)[int(q * 1000) - 1], 3)


def measure(url: str, bodies: list[bytes], calls: int) -> dict[str, Any]:
    """Alice idle, then during bob's flood."""
    alice_latencies(url, calls // 4)  # warm
    idle = alice_latencies(url, calls)
    ctx = multiprocessing.get_context("spawn")
    stop, sent = ctx.Event(), ctx.Value("i", 0)
    bob = ctx.Process(target=flood, args=(url, bodies, stop, sent))
    bob.start()
    try:
        while sent.value < 1:  # the flood is on
            time.sleep(0.05)
        started = time.perf_counter()
        during = alice_latencies(url, calls)
        seconds = time.perf_counter() - started
    finally:
        stop.set()
        bob.join(120)
    return {
        "idle_p50_ms": pct(idle, 0.5),
        "idle_p99_ms": pct(idle, 0.99),
        "flood_p50_ms": pct(during, 0.5),
        "flood_p99_ms": pct(during, 0.99),
        "flood_max_ms": round(max(during), 3),
        "p99_ratio": round(pct(during, 0.99) / pct(idle, 0.99), 2),
        "bob_batches_s": round(sent.value / seconds, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="HEAD", help="the commit measured as before")
    parser.add_argument("--ops", type=int, default=12, help="ops of 8,192 keys per batch")
    parser.add_argument("--calls", type=int, default=2000, help="alice's lookups per phase")
    parser.add_argument("--quick", action="store_true", help="500 calls a phase")
    parser.add_argument("--flood", choices=sorted(FLOODS), default="stores", help="bob's ops")
    parser.add_argument("--out", type=Path, default=harness.RESULTS_DIR)
    args = parser.parse_args(argv)
    calls = 500 if args.quick else args.calls
    bodies = bob_bodies(args.ops, args.flood)
    servers, client = split_cores()
    os.sched_setaffinity(0, client)
    rows: dict[str, dict[str, Any]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="kvo-flood-") as tmp,
        baseline_tree(args.baseline) as old,
    ):
        for side, tree in (("before", old), ("after", ROOT)):
            with serving(tree, Path(tmp), side, servers, args.flood == "demote") as url:
                rows[side] = measure(url, bodies, calls)
    size = max(len(b) for b in bodies) / 1e6
    print(
        f"alice: lookups of 32 keys, {calls} a phase; bob: batches of {args.ops} ops x "
        f"{KEYS_PER_OP} keys ({size:.1f} MB, {', '.join(FLOODS[args.flood])}), back to back; "
        f"before = {args.baseline}"
    )
    head = "{:<7} {:>9} {:>9} {:>10} {:>10} {:>10} {:>11} {:>9}"
    print(
        head.format(
            "side",
            "idle p50",
            "idle p99",
            "flood p50",
            "flood p99",
            "flood max",
            "p99 ratio",
            "bob b/s",
        )
    )
    for side, r in rows.items():
        print(
            head.format(
                side,
                r["idle_p50_ms"],
                r["idle_p99_ms"],
                r["flood_p50_ms"],
                r["flood_p99_ms"],
                r["flood_max_ms"],
                f"{r['p99_ratio']}x",
                r["bob_batches_s"],
            )
        )
    print(
        f"ms; p99 ratio: during the flood / idle; target (after): flood p99 <= {TARGET_P99_MS} ms"
    )
    record = harness.machine(
        baseline=args.baseline,
        ops=args.ops,
        flood=args.flood,
        keys_per_op=KEYS_PER_OP,
        calls=calls,
        body_mb=round(size, 2),
        rows=rows,
        target_p99_ms=TARGET_P99_MS,
    )
    name = "batch_flood.json" if args.flood == "stores" else f"batch_flood_{args.flood}.json"
    harness.write_results(args.out / name, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
