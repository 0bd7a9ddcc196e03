"""CPU transfer backend bandwidth: store and load GB/s per block size, against a plain copy.

Workload: a "device" KV cache of 4 tensors (``[N, block_bytes / 8]`` float16 each, block_dim 0)
in /dev/shm files, a host pool of the same number of blocks, and one job moving every block,
device blocks and host slots both in random order (so no two blocks are adjacent on either
side: the worst case for coalescing). Block sizes 64 KiB, 256 KiB, 1 MiB, 4 MiB.

Baseline, measured in the same run on the same memory: one contiguous ``copy_`` of the same
total bytes between the pool and a /dev/shm buffer, with torch limited to as many threads as
the worker copies with (``torch.set_num_threads``), so the ratio compares equal CPU budgets.
Each figure is the median of several repetitions after a warm-up. Target: >= 80% of the
baseline at 256 KiB blocks and above.

Contiguous blocks (second table): a cache of one tensor (a host block is then one piece, so a
run of blocks consecutive on both sides is one ``memmove``), N contiguous device blocks stored
into the N slots a fresh ``OffloadManager`` hands out for one batch (ascending: one run), and
loaded back. Against the same baseline, beside the same N blocks in the slot order the manager
used to hand out (descending, so no two pairs are consecutive on both sides) and scattered
(random blocks and slots): what merging runs is worth.

Run: ``.venv/bin/python bench/transfer_bw.py`` (``--quick`` for a smaller run). Prints a table
and writes ``bench/results/transfer_bw.json``.
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

with warnings.catch_warnings():
    # CPU-only torch wheels warn when NumPy is absent; nothing here uses NumPy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch

from bench import harness  # noqa: E402
from manager import ReqContext, create_manager  # noqa: E402
from transfer import (  # noqa: E402
    HostPool,
    KVCacheRegistry,
    KVCacheSpec,
    TransferJob,
    create_worker,
)
from transfer.cpu_worker import default_copy_threads  # noqa: E402

BLOCK_SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20)
CONTIGUOUS_BLOCK_SIZES = (16 << 10, 64 << 10, 256 << 10)
ORDERS = ("contiguous", "descending", "scattered")
TENSORS = 4
TARGET = 0.80
TARGET_FROM = 256 << 10


def shm_tensor(path: str, nbytes: int) -> torch.Tensor:
    t = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    t.fill_(1)  # fault the pages in before timing
    return t


def run_size(block_bytes: int, total: int, threads: int, reps: int, prefix: str) -> dict[str, Any]:
    n = max(8, total // block_bytes)
    total = n * block_bytes
    per_tensor = block_bytes // TENSORS
    paths = [f"/dev/shm/{prefix}-t{i}" for i in range(TENSORS)]
    base_path = f"/dev/shm/{prefix}-baseline"
    pool = HostPool.create(n, block_bytes, pin=False)
    try:
        for p in paths:
            shm_tensor(p, n * per_tensor)
        contiguous = shm_tensor(base_path, total)
        spec = {
            "name": prefix,
            "device": "cpu",
            "tensors": [
                {
                    "shape": [n, per_tensor // 2],
                    "dtype": "float16",
                    "block_dim": 0,
                    "handle": {"kind": "shm", "path": p},
                }
                for p in paths
            ],
        }
        registry = KVCacheRegistry(pool)
        cache = registry.register(KVCacheSpec.from_dict(spec))
        worker = create_worker(pool, registry, "cpu", copy_threads=threads)
        rng = random.Random(block_bytes)
        blocks = rng.sample(range(n), n)
        slots = rng.sample(range(n), n)

        def job(direction: str) -> Callable[[], None]:
            def go() -> None:
                jid = worker.submit(TransferJob(direction, cache.cache_id, blocks, slots, 600.0))  # type: ignore[arg-type]
                [result] = worker.wait([jid], timeout=600)
                if not result.ok:
                    raise RuntimeError(f"{direction} failed: {result.reason}")

            return go

        flat = pool.tensor.view(-1)
        # Each repetition times the job and the baseline back to back (paired), so load from
        # elsewhere on the machine hits both alike; ratios are medians of the paired ratios.
        timed: dict[str, list[float]] = {k: [] for k in ("store", "load", "bstore", "bload")}
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            steps: list[tuple[str, Callable[[], object]]] = [
                ("store", job("store")),
                ("bstore", lambda: flat.copy_(contiguous)),
                ("load", job("load")),
                ("bload", lambda: contiguous.copy_(flat)),
            ]
            for _name, fn in steps:
                fn()  # warm-up
            for _ in range(reps):
                for name, fn in steps:
                    start = time.perf_counter()
                    fn()
                    timed[name].append(time.perf_counter() - start)
        finally:
            torch.set_num_threads(previous)
            worker.shutdown()
            registry.close()
        gbs = total / 1e9
        return {
            "block_bytes": block_bytes,
            "copy_threads": threads,
            "default_threads": threads == default_copy_threads(),
            "blocks": n,
            "total_bytes": total,
            "pieces_per_block": TENSORS,
            "store_gbps": gbs / statistics.median(timed["store"]),
            "load_gbps": gbs / statistics.median(timed["load"]),
            "baseline_store_gbps": gbs / statistics.median(timed["bstore"]),
            "baseline_load_gbps": gbs / statistics.median(timed["bload"]),
            "store_ratio": statistics.median(
                b / t for b, t in zip(timed["bstore"], timed["store"], strict=True)
            ),
            "load_ratio": statistics.median(
                b / t for b, t in zip(timed["bload"], timed["load"], strict=True)
            ),
        }
    finally:
        pool.close()
        for p in [*paths, base_path]:
            if os.path.exists(p):
                os.unlink(p)


def fresh_slots(n: int) -> list[int]:
    """The slots a fresh manager of ``n`` blocks hands out for one batch of ``n`` keys."""
    manager = create_manager(n)
    ctx = ReqContext("bench")
    manager.on_new_request(ctx)
    out = manager.prepare_store([i.to_bytes(8, "big") for i in range(n)], ctx)
    assert out is not None
    return out.slots


def run_contiguous(
    block_bytes: int, total: int, threads: int, reps: int, prefix: str
) -> list[dict[str, Any]]:
    """One row per block order (``ORDERS``): store and load GB/s and ratios to one plain
    contiguous copy of the same bytes, for a one-tensor cache."""
    n = max(8, total // block_bytes)
    total = n * block_bytes
    path = f"/dev/shm/{prefix}-t0"
    base_path = f"/dev/shm/{prefix}-baseline"
    pool = HostPool.create(n, block_bytes, pin=False)
    try:
        shm_tensor(path, total)
        contiguous = shm_tensor(base_path, total)
        spec = {
            "name": prefix,
            "device": "cpu",
            "tensors": [
                {
                    "shape": [n, block_bytes // 2],
                    "dtype": "float16",
                    "block_dim": 0,
                    "handle": {"kind": "shm", "path": path},
                }
            ],
        }
        registry = KVCacheRegistry(pool)
        cache = registry.register(KVCacheSpec.from_dict(spec))
        worker = create_worker(pool, registry, "cpu", copy_threads=threads)
        slots = fresh_slots(n)
        rng = random.Random(block_bytes)
        layouts = {
            "contiguous": (list(range(n)), slots),
            "descending": (list(range(n)), slots[::-1]),
            "scattered": (rng.sample(range(n), n), rng.sample(range(n), n)),
        }

        def job(direction: str, blocks: list[int], to: list[int]) -> Callable[[], None]:
            def go() -> None:
                jid = worker.submit(TransferJob(direction, cache.cache_id, blocks, to, 600.0))  # type: ignore[arg-type]
                [result] = worker.wait([jid], timeout=600)
                if not result.ok:
                    raise RuntimeError(f"{direction} failed: {result.reason}")

            return go

        flat = pool.tensor.view(-1)
        steps: list[tuple[str, Callable[[], object]]] = [
            ("bstore", lambda: flat.copy_(contiguous)),
            ("bload", lambda: contiguous.copy_(flat)),
        ]
        for order, (blocks, to) in layouts.items():
            steps += [(f"store-{order}", job("store", blocks, to))]
            steps += [(f"load-{order}", job("load", blocks, to))]
        timed: dict[str, list[float]] = {name: [] for name, _ in steps}
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for _name, fn in steps:
                fn()  # warm-up
            for _ in range(reps):  # every order and the baseline back to back, paired
                for name, fn in steps:
                    start = time.perf_counter()
                    fn()
                    timed[name].append(time.perf_counter() - start)
        finally:
            torch.set_num_threads(previous)
            worker.shutdown()
            registry.close()
        gbs = total / 1e9

        def ratio(base: str, name: str) -> float:
            return statistics.median(b / t for b, t in zip(timed[base], timed[name], strict=True))

        return [
            {
                "block_bytes": block_bytes,
                "copy_threads": threads,
                "blocks": n,
                "total_bytes": total,
                "order": order,
                "fresh_slots_ascending": slots == list(range(n)),
                "store_gbps": gbs / statistics.median(timed[f"store-{order}"]),
                "load_gbps": gbs / statistics.median(timed[f"load-{order}"]),
                "baseline_store_gbps": gbs / statistics.median(timed["bstore"]),
                "baseline_load_gbps": gbs / statistics.median(timed["bload"]),
                "store_ratio": ratio("bstore", f"store-{order}"),
                "load_ratio": ratio("bload", f"load-{order}"),
            }
            for order in ORDERS
        ]
    finally:
        pool.close()
        for p in (path, base_path):
            if os.path.exists(p):
                os.unlink(p)


def print_contiguous(rows: list[dict[str, Any]], total: int, reps: int) -> None:
    print()
    print(
        f"Contiguous blocks: one-tensor cache, {total >> 20} MiB per job, median of {reps}; "
        "ratio = vs one contiguous copy"
    )
    header = (
        f"{'block':>8} {'thr':>3} {'order':>10} {'store GB/s':>10} {'ratio':>6} "
        f"{'load GB/s':>10} {'ratio':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['block_bytes'] >> 10:>6}Ki {r['copy_threads']:>3} {r['order']:>10} "
            f"{r['store_gbps']:>10.2f} {r['store_ratio']:>6.2f} "
            f"{r['load_gbps']:>10.2f} {r['load_ratio']:>6.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller run")
    parser.add_argument("--out", default=str(harness.RESULTS_DIR / "transfer_bw.json"))
    args = parser.parse_args(argv)
    total = (64 << 20) if args.quick else (256 << 20)
    reps = 3 if args.quick else 9
    cores = os.cpu_count() or 1
    thread_counts = sorted({1, min(cores, 4)})
    prefix = f"kvobench-{os.getpid()}-{secrets.token_hex(3)}"
    rows = []
    started = time.perf_counter()
    contiguous_rows: list[dict[str, Any]] = []
    for threads in thread_counts:
        for size in BLOCK_SIZES:
            rows.append(run_size(size, total, threads, reps, f"{prefix}-{size}-{threads}"))
        for size in CONTIGUOUS_BLOCK_SIZES:
            contiguous_rows += run_contiguous(
                size, total, threads, reps, f"{prefix}-c{size}-{threads}"
            )
    elapsed = time.perf_counter() - started

    print(
        f"CPU transfer backend, {TENSORS} tensors per cache, random block and slot order, "
        f"{total >> 20} MiB per job, median of {reps}"
    )
    header = (
        f"{'block':>8} {'thr':>3} {'store GB/s':>10} {'base':>6} {'ratio':>6} "
        f"{'load GB/s':>10} {'base':>6} {'ratio':>6}  target"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        meets = r["block_bytes"] < TARGET_FROM or min(r["store_ratio"], r["load_ratio"]) >= TARGET
        note = "-" if r["block_bytes"] < TARGET_FROM else ("ok" if meets else "MISS")
        store = (
            f"{r['store_gbps']:>10.2f} {r['baseline_store_gbps']:>6.2f} {r['store_ratio']:>6.2f}"
        )
        load = f"{r['load_gbps']:>10.2f} {r['baseline_load_gbps']:>6.2f} {r['load_ratio']:>6.2f}"
        thr = f"{r['copy_threads']}{'*' if r['default_threads'] else ' '}"
        print(f"{r['block_bytes'] >> 10:>6}Ki {thr:>3} {store} {load}  {note}")
    print("(* = the default copy_threads on this host)")
    print_contiguous(contiguous_rows, total, reps)
    print(f"({elapsed:.1f} s)")

    harness.write_results(
        Path(args.out),
        {
            "benchmark": "transfer_bw",
            "quick": args.quick,
            "target_ratio": TARGET,
            "target_from_block_bytes": TARGET_FROM,
            "machine": harness.machine(torch=torch.__version__),
            "seconds": elapsed,
            "results": rows,
            "contiguous_blocks": contiguous_rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
