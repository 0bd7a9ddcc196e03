"""One namespace's flood of object-tier misses against another's hits (issue #42, finding 3).

Two namespaces' services in one process (one loop, as a server runs them), each with the object
tier over its real store (``transfer.s3.S3Tier``: its threads, batches and budgets) and a
stand-in for the client library whose HEADs take ``--head-ms`` (a gateway under load), no
gateway needed. *alice* looks up 8 keys her namespace holds in the bucket, ``--lookups`` times,
one after another; *bob* keeps ``--flooders`` lookups of 8,192 missing keys in flight, fresh keys
each time (the negative cache never answers them). Counted: alice's lookups that answered
``object`` for every key, before bob's flood, during it, and after it; on this tree (*after*)
and on a ``git worktree`` of ``--baseline`` (*before*), each in its own process, the same run.
Target (after): every lookup of alice answers ``object`` during the flood. Also counted: the
collector's full passes during the flood, and the longest (each one stops every thread of the
process). As ``app.server`` does once it listens, the heap the services started with is frozen
(``gc.freeze()``) before alice's first lookup.

Run: ``.venv/bin/python bench/object_lookup_flood.py`` (``--quick``: fewer lookups). Prints the
table and writes ``bench/results/object_lookup_flood.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


class SlowS3:
    """The client library's calls the store makes, over a dict of object sizes; each HEAD
    takes ``head_s``."""

    def __init__(self, head_s: float) -> None:
        self.sizes: dict[str, int] = {}
        self.head_s = head_s
        self.lock = threading.Lock()

    def head(self, store: Any, path: str) -> dict[str, Any]:
        time.sleep(self.head_s)
        size = self.sizes.get(path)
        if size is None:
            raise FileNotFoundError(path)
        return {"size": size}

    def list_with_delimiter(self, store: Any, prefix: str | None = None) -> dict[str, Any]:
        return {"common_prefixes": [], "objects": []}

    def get(self, store: Any, path: str) -> Any:
        raise FileNotFoundError(path)

    def put(self, store: Any, path: str, data: Any) -> None:
        self.sizes[path] = len(data)

    def delete(self, store: Any, paths: Any) -> None:
        for path in paths:
            self.sizes.pop(path, None)


async def scenario(lookups: int, flooders: int, head_s: float) -> dict[str, Any]:
    """In the child: alice's all-``object`` answers out of ``lookups``, before, during and
    after bob's flood."""
    import transfer.s3
    from app.core.service import Service
    from app.settings import Settings
    from transfer.s3 import MAC_BYTES

    fake = SlowS3(head_s)
    transfer.s3._load_client = lambda: fake
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "secret-example")
    settings = Settings(
        num_blocks=64,
        block_bytes=4096,
        device="cpu",
        max_keys_per_call=8192,
        tiers=["object"],
        object_bucket="kv-cache",
        object_endpoint="http://127.0.0.1:9",
    )
    alice_service = Service(settings, namespace="alice")
    bob_service = Service(settings, namespace="bob")
    async with alice_service.running(), bob_service.running():
        alice, bob = alice_service.tiers, bob_service.tiers
        link = alice.get("object")
        held = [i.to_bytes(8, "big") for i in range(8)]
        for key in held:
            fake.sizes[link.store.path(key)] = settings.block_bytes + MAC_BYTES  # type: ignore[union-attr]
        # As ``app.server`` does once it listens: what exists now (torch, the services) lives
        # as long as the process, and the collector's full passes no longer rescan it.
        gc.collect()
        gc.freeze()

        async def alice_phase() -> int:
            ok = 0
            for i in range(lookups):
                found = await alice.found(held, f"a{i}")
                ok += found == ["object"] * len(held)
                await asyncio.sleep(0.005)
            return ok

        fresh = iter(range(1 << 40))
        stop = asyncio.Event()

        async def flooder() -> None:
            while not stop.is_set():
                keys = [(1 << 62 | next(fresh)).to_bytes(8, "big") for _ in range(8192)]
                await bob.found(keys, "b")

        before = await alice_phase()
        tasks = [asyncio.create_task(flooder()) for _ in range(flooders)]
        await asyncio.sleep(0.5)
        pauses = FullCollections()
        gc.callbacks.append(pauses)
        during = await alice_phase()
        gc.callbacks.remove(pauses)
        stop.set()
        await asyncio.gather(*tasks)
        await asyncio.sleep(settings.object_timeout_s)  # what bob left behind drains
        after = await alice_phase()
    return {
        "before_flood": before,
        "during_flood": during,
        "after_flood": after,
        "full_gc_during": pauses.count,
        "longest_full_gc_ms_during": round(pauses.longest_s * 1000, 1),
    }


class FullCollections:
    """A ``gc.callbacks`` entry: the collector's full passes (generation 2), and the longest
    (every thread of the process waits through one: the loop, every namespace's HEADs)."""

    def __init__(self) -> None:
        self.count = 0
        self.longest_s = 0.0
        self._began = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.count += 1
            self.longest_s = max(self.longest_s, time.perf_counter() - self._began)


def run_side(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    env["PYTHONPATH"] = str(tree)
    argv = [sys.executable, str(Path(__file__).resolve()), "--child"]
    argv += ["--lookups", str(args.lookups), "--flooders", str(args.flooders)]
    argv += ["--head-ms", str(args.head_ms)]
    out = subprocess.run(argv, cwd=tree, env=env, check=True, capture_output=True, text=True)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="HEAD", help="the commit measured as before")
    parser.add_argument("--lookups", type=int, default=400, help="alice's lookups per phase")
    parser.add_argument("--flooders", type=int, default=8, help="bob's lookups in flight")
    parser.add_argument("--head-ms", type=float, default=2.0, help="each HEAD's latency")
    parser.add_argument("--quick", action="store_true", help="100 lookups a phase")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.lookups = 100
    if args.child:
        got = asyncio.run(scenario(args.lookups, args.flooders, args.head_ms / 1000))
        print(json.dumps(got))
        return 0
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench import harness
    from bench.tenant_hardening import baseline_tree

    rows: dict[str, dict[str, Any]] = {}
    with baseline_tree(args.baseline) as old:
        for side, tree in (("before", old), ("after", ROOT)):
            rows[side] = run_side(tree, args)
    n = args.lookups
    print(
        f"alice: {n} lookups a phase of 8 keys her namespace holds in the bucket; bob: "
        f"{args.flooders} lookups of 8192 missing keys in flight; HEAD {args.head_ms} ms; "
        f"before = {args.baseline}"
    )
    head = "{:<7} {:>14} {:>14} {:>14}"
    print(head.format("side", "before flood", "during flood", "after flood"))
    for side, r in rows.items():
        cells = [f"{r[k]}/{n}" for k in ("before_flood", "during_flood", "after_flood")]
        print(head.format(side, *cells))
    print("alice's lookups that answered object for every key; target (after): all, during too")
    for side, r in rows.items():
        if "full_gc_during" in r:
            print(
                f"{side}: {r['full_gc_during']} full collections during the flood, the longest "
                f"{r['longest_full_gc_ms_during']} ms"
            )
    record = harness.machine(
        baseline=args.baseline,
        lookups=n,
        flooders=args.flooders,
        head_ms=args.head_ms,
        rows=rows,
    )
    harness.write_results((args.out or harness.RESULTS_DIR) / "object_lookup_flood.json", record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
