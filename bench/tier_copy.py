"""The vLLM tier's promotion copies (pool -> primary tier): GB/s vs a plain memcpy.

A promotion moves ``--blocks`` blocks of ``--block-bytes`` from scattered pool slots into
scattered primary-tier chunks (half in runs, half single blocks, like a prefix hit). Three
ways, each the median of ``--reps`` repetitions in this same run:

- ``baseline``: one plain ``memmove`` of the same total bytes between two contiguous buffers
  (what the memory system gives one copy);
- ``numpy_per_block``: what the tier did before, ``primary[chunk] = pool[slot]`` per block;
- ``block_copier``: ``app.block_copy.BlockCopier`` (runs merged, a few threads, no GIL).

Prints a table and the ratio to the baseline (target: block_copier >= 0.8x), writes
``bench/results/tier_copy.json``. Run: ``.venv/bin/python bench/tier_copy.py``.
"""

from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from app.block_copy import BlockCopier  # noqa: E402
from bench import harness  # noqa: E402

TARGET = 0.8


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up: page faults, thread start
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--block-bytes", type=int, default=2 << 20)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    n, bb = args.blocks, args.block_bytes
    rng = random.Random(0)
    pool = np.ones((2 * n, bb), dtype=np.uint8)
    primary = np.zeros((2 * n, bb), dtype=np.uint8)
    half = n // 2
    slots = [*range(10, 10 + half), *rng.sample(range(10 + half, 2 * n), n - half)]
    chunks = [*range(5, 5 + half), *rng.sample(range(5 + half, 2 * n), n - half)]
    src = np.ones(n * bb, dtype=np.uint8)
    dst = np.zeros(n * bb, dtype=np.uint8)
    copier = BlockCopier(args.threads)

    def baseline() -> None:
        ctypes.memmove(dst.ctypes.data, src.ctypes.data, n * bb)

    def numpy_per_block() -> None:
        for s, c in zip(slots, chunks, strict=True):
            primary[c] = pool[s]

    def block_copier() -> None:
        copier.copy(primary, chunks, pool, slots)

    nbytes = n * bb
    rows = []
    base_s = median_seconds(baseline, args.reps)
    for name, fn in (
        ("baseline", baseline),
        ("numpy_per_block", numpy_per_block),
        ("block_copier", block_copier),
    ):
        sec = base_s if name == "baseline" else median_seconds(fn, args.reps)
        rows.append(
            {
                "method": name,
                "median_s": sec,
                "gb_s": nbytes / sec / 1e9,
                "ratio_to_baseline": base_s / sec,
            }
        )
    copier.close()
    print(f"promotion of {n} blocks x {bb} B ({nbytes / 1e6:.0f} MB), median of {args.reps}")
    print(f"{'method':<18}{'median ms':>11}{'GB/s':>8}{'x baseline':>12}")
    for r in rows:
        print(
            f"{r['method']:<18}{r['median_s'] * 1e3:>11.2f}{r['gb_s']:>8.2f}"
            f"{r['ratio_to_baseline']:>12.2f}"
        )
    ratio = rows[2]["ratio_to_baseline"]
    ok = ratio >= TARGET
    print(
        f"block_copier: {ratio:.2f}x a plain memcpy (target >= {TARGET}x): "
        f"{'PASS' if ok else 'MISS'}"
    )
    harness.write_results(
        harness.RESULTS_DIR / "tier_copy.json",
        {
            "benchmark": "tier_copy",
            "machine": harness.machine(threads=copier.threads),
            "blocks": n,
            "block_bytes": bb,
            "reps": args.reps,
            "rows": rows,
            "target": TARGET,
            "ok": ok,
        },
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
