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
import contextlib
import os
import random
import secrets
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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
    TransferWorker,
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


@dataclass
class Bench:
    """A host pool of ``n`` blocks, a registered shm cache of ``tensors`` tensors over ``n``
    device blocks, the plain contiguous tensor of the same bytes (the baseline) and a CPU
    worker with ``threads`` copy threads."""

    pool: HostPool
    cache_id: str
    worker: TransferWorker
    contiguous: torch.Tensor

    def job(self, direction: str, blocks: list[int], slots: list[int]) -> Callable[[], None]:
        """A function that runs one ``direction`` job of ``blocks`` <-> ``slots`` to its end."""

        def go() -> None:
            job = TransferJob(direction, self.cache_id, blocks, slots, 600.0)  # type: ignore[arg-type]
            [result] = self.worker.wait([self.worker.submit(job)], timeout=600)
            if not result.ok:
                raise RuntimeError(f"{direction} failed: {result.reason}")

        return go

    def baselines(self) -> list[tuple[str, Callable[[], object]]]:
        """The plain contiguous copies into and out of the pool: ``bstore`` and ``bload``."""
        flat = self.pool.tensor.view(-1)
        contiguous = self.contiguous
        return [
            ("bstore", lambda: flat.copy_(contiguous)),
            ("bload", lambda: contiguous.copy_(flat)),
        ]


@contextlib.contextmanager
def bench_setup(
    prefix: str, n: int, block_bytes: int, tensors: int, threads: int
) -> Iterator[Bench]:
    """The ``Bench`` for one size; every file and the pool are gone after it."""
    per_tensor = block_bytes // tensors
    paths = [f"/dev/shm/{prefix}-t{i}" for i in range(tensors)]
    base_path = f"/dev/shm/{prefix}-baseline"
    pool = HostPool.create(n, block_bytes, pin=False)
    try:
        for p in paths:
            shm_tensor(p, n * per_tensor)
        contiguous = shm_tensor(base_path, n * block_bytes)
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
        try:
            yield Bench(pool, cache.cache_id, worker, contiguous)
        finally:
            worker.shutdown()
            registry.close()
    finally:
        pool.close()
        for p in [*paths, base_path]:
            if os.path.exists(p):
                os.unlink(p)


def time_paired(
    steps: list[tuple[str, Callable[[], object]]], reps: int, threads: int
) -> dict[str, list[float]]:
    """Seconds of each step per repetition. Each repetition runs every step back to back
    (paired), so load from elsewhere on the machine hits them alike; one warm-up first."""
    timed: dict[str, list[float]] = {name: [] for name, _ in steps}
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _name, fn in steps:
            fn()
        for _ in range(reps):
            for name, fn in steps:
                start = time.perf_counter()
                fn()
                timed[name].append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return timed


def paired_ratio(timed: dict[str, list[float]], base: str, name: str) -> float:
    """Median of the paired ratios baseline time / step time (1.0: as fast as the baseline)."""
    return statistics.median(b / t for b, t in zip(timed[base], timed[name], strict=True))


def run_size(block_bytes: int, total: int, threads: int, reps: int, prefix: str) -> dict[str, Any]:
    n = max(8, total // block_bytes)
    total = n * block_bytes
    with bench_setup(prefix, n, block_bytes, TENSORS, threads) as bench:
        rng = random.Random(block_bytes)
        blocks = rng.sample(range(n), n)
        slots = rng.sample(range(n), n)
        store, load = bench.job("store", blocks, slots), bench.job("load", blocks, slots)
        bstore, bload = bench.baselines()
        timed = time_paired([("store", store), bstore, ("load", load), bload], reps, threads)
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
        "store_ratio": paired_ratio(timed, "bstore", "store"),
        "load_ratio": paired_ratio(timed, "bload", "load"),
    }


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
    slots = fresh_slots(n)
    rng = random.Random(block_bytes)
    layouts = {
        "contiguous": (list(range(n)), slots),
        "descending": (list(range(n)), slots[::-1]),
        "scattered": (rng.sample(range(n), n), rng.sample(range(n), n)),
    }
    with bench_setup(prefix, n, block_bytes, 1, threads) as bench:
        steps = bench.baselines()
        for order, (blocks, to) in layouts.items():
            steps.append((f"store-{order}", bench.job("store", blocks, to)))
            steps.append((f"load-{order}", bench.job("load", blocks, to)))
        timed = time_paired(steps, reps, threads)
    gbs = total / 1e9
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
            "store_ratio": paired_ratio(timed, "bstore", f"store-{order}"),
            "load_ratio": paired_ratio(timed, "bload", f"load-{order}"),
        }
        for order in ORDERS
    ]


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
