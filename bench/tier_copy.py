"""The vLLM tier's promotion copies (pool -> primary tier): GB/s vs a plain memcpy.

A promotion moves ``--blocks`` blocks of ``--block-bytes`` from scattered pool slots into
scattered primary-tier chunks (half in runs, half single blocks, like a prefix hit). Each way
is timed ``--reps`` times in this same run, the ways taking turns within each round
(ratios are medians of same-round pairs, so a drifting load on a shared machine cancels):

- ``one_memmove`` (the gated baseline): one plain ``memmove`` of the same total bytes between
  two contiguous buffers, what the memory system gives one big copy;
- ``memmove_pieces``: the same bytes between the same contiguous buffers in block-sized
  ``memmove`` calls (the fair baseline for a copy made of blocks: same bytes, same piece size);
- ``memmove_per_block``: one ``memmove`` per block at the promotion's own scattered addresses
  (the floor of any copy of this job on one thread);
- ``numpy_per_block``: what the tier did before, ``primary[chunk] = pool[slot]`` per block;
- ``torch_per_block``: ``Tensor.copy_`` per block on torch's threads (if torch is installed),
  timed in rounds of its own after the others (its OpenMP threads spin on after a copy and
  would slow the next way down) and scaled to the baseline timed beside it;
- ``block_copier_1t``, ``block_copier_2t`` and ``block_copier``:
  ``kvoffload_client.block_copy.BlockCopier`` (runs merged into one memmove each, GIL released)
  on one thread, on two, and on its default threads (half the cores, 1 to 4: one thread on a
  2-core machine).

Why a single big memmove beats block-sized ones: glibc switches ``memmove`` to non-temporal
stores above ``glibc.cpu.x86_non_temporal_threshold`` (3/4 of the last-level cache per thread
scaled by threads: 192 MiB on the 2-core EPYC with 32 MiB L3 we measure on). Below it, every
destination line is first read for ownership (RFO) and then written back: about 3 bytes of
memory traffic per byte copied instead of 2, so block-sized copies run near 2/3 of the big one,
whatever the Python around them does. ``--nt-threshold BYTES`` reruns this script with
``GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=BYTES`` (a tunable is read at process
start only): with a threshold under the block size the block copies stream too. The record
carries the threshold in force (``ld.so --list-tunables``).

Prints a table and the ratios to both baselines (target: ``block_copier`` >= 0.8x
``one_memmove``), writes ``bench/results/tier_copy.json`` (``--out``). Exit 0 when the target
is met. Run: ``.venv/bin/python bench/tier_copy.py [--nt-threshold 1048576]``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from kvoffload_client.block_copy import BlockCopier  # noqa: E402

from bench import harness  # noqa: E402

TARGET = 0.8
NT_TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
LD_SO = ("/lib64/ld-linux-x86-64.so.2", "/lib/ld-linux-aarch64.so.1")


def nt_threshold() -> int | None:
    """glibc's non-temporal memmove threshold in force for a process started with this
    environment (``ld.so --list-tunables``), or None where that cannot be read."""
    for ld in LD_SO:
        if not os.path.exists(ld):
            continue
        try:
            out = subprocess.run(
                [ld, "--list-tunables"], capture_output=True, text=True, timeout=10
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        m = re.search(re.escape(NT_TUNABLE) + r":\s*(0x[0-9a-fA-F]+|\d+)", out)
        return int(m.group(1), 0) if m else None
    return None


def interleaved(ways: Mapping[str, Callable[[], object]], reps: int) -> dict[str, list[float]]:
    """Seconds of each way per round; the ways take turns within a round, so a load that
    drifts over the run (a shared machine) weighs on every way alike."""
    for fn in ways.values():
        fn()  # warm-up: page faults, thread start
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(reps):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--block-bytes", type=int, default=2 << 20)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--nt-threshold",
        type=int,
        default=None,
        help=f"rerun with GLIBC_TUNABLES={NT_TUNABLE}=BYTES (non-temporal stores above BYTES)",
    )
    ap.add_argument("--out", default=str(harness.RESULTS_DIR / "tier_copy.json"))
    args = ap.parse_args(argv)
    if args.nt_threshold is not None and NT_TUNABLE not in os.environ.get("GLIBC_TUNABLES", ""):
        env = dict(os.environ)
        tun = f"{NT_TUNABLE}={args.nt_threshold}"
        env["GLIBC_TUNABLES"] = f"{env['GLIBC_TUNABLES']}:{tun}" if "GLIBC_TUNABLES" in env else tun
        cmd = [sys.executable, str(Path(__file__).resolve()), *(argv or sys.argv[1:])]
        return subprocess.run(cmd, env=env).returncode
    n, bb = args.blocks, args.block_bytes
    rng = random.Random(0)
    # Every buffer written once before timing: no first-touch page faults in any row.
    pool = np.ones((2 * n, bb), dtype=np.uint8)
    primary = np.ones((2 * n, bb), dtype=np.uint8)
    half = n // 2
    slots = [*range(10, 10 + half), *rng.sample(range(10 + half, 2 * n), n - half)]
    chunks = [*range(5, 5 + half), *rng.sample(range(5 + half, 2 * n), n - half)]
    src = np.ones(n * bb, dtype=np.uint8)
    dst = np.ones(n * bb, dtype=np.uint8)
    copier = BlockCopier(args.threads)
    copier1, copier2 = BlockCopier(1), BlockCopier(2)
    move = ctypes.memmove

    def one_memmove() -> None:
        move(dst.ctypes.data, src.ctypes.data, n * bb)

    def memmove_pieces() -> None:
        d, s = dst.ctypes.data, src.ctypes.data
        for i in range(n):
            move(d + i * bb, s + i * bb, bb)

    def memmove_per_block() -> None:
        d, s = primary.ctypes.data, pool.ctypes.data
        for slot, chunk in zip(slots, chunks, strict=True):
            move(d + chunk * bb, s + slot * bb, bb)

    def numpy_per_block() -> None:
        for s, c in zip(slots, chunks, strict=True):
            primary[c] = pool[s]

    ways: dict[str, Callable[[], None]] = {
        "one_memmove": one_memmove,
        "memmove_pieces": memmove_pieces,
        "memmove_per_block": memmove_per_block,
        "numpy_per_block": numpy_per_block,
    }
    ways["block_copier_1t"] = lambda: copier1.copy(primary, chunks, pool, slots)
    ways["block_copier_2t"] = lambda: copier2.copy(primary, chunks, pool, slots)
    ways["block_copier"] = lambda: copier.copy(primary, chunks, pool, slots)

    nbytes = n * bb
    times = interleaved(ways, args.reps)
    # torch last and apart: its OpenMP threads spin on after each copy and would slow down
    # whichever way ran next in a round.
    torch_threads = None
    try:
        import torch

        tp, tq = torch.from_numpy(pool), torch.from_numpy(primary)
        torch_threads = torch.get_num_threads()

        def torch_per_block() -> None:
            for s, c in zip(slots, chunks, strict=True):
                tq[c].copy_(tp[s])

        alone = interleaved({"one_memmove": one_memmove, "torch": torch_per_block}, args.reps)
        # Its ratios against the baseline timed beside it, in the same rounds.
        times["torch_per_block"] = [
            t * base_now / base_then
            for t, base_now, base_then in zip(
                alone["torch"], times["one_memmove"], alone["one_memmove"], strict=True
            )
        ]
    except ImportError:
        pass
    copier.close()
    copier1.close()
    copier2.close()

    def paired(name: str, ref: str) -> float:
        """Median over rounds of (ref's seconds / name's seconds) in the same round."""
        return statistics.median(r / t for r, t in zip(times[ref], times[name], strict=True))

    secs = {name: statistics.median(t) for name, t in times.items()}
    rows = [
        {
            "method": name,
            "median_s": sec,
            "gb_s": nbytes / sec / 1e9,
            "ratio_to_baseline": paired(name, "one_memmove"),
            "ratio_to_memmove_pieces": paired(name, "memmove_pieces"),
        }
        for name, sec in secs.items()
    ]
    threshold = nt_threshold()
    print(
        f"promotion of {n} blocks x {bb} B ({nbytes / 1e6:.0f} MB), median of {args.reps}; "
        f"block_copier threads {copier.threads}; glibc non-temporal threshold "
        f"{'unknown' if threshold is None else f'{threshold} B'}"
        f"{' (GLIBC_TUNABLES)' if 'GLIBC_TUNABLES' in os.environ else ''}"
    )
    print(f"{'method':<20}{'median ms':>11}{'GB/s':>8}{'x one memmove':>15}{'x pieces':>10}")
    for r in rows:
        print(
            f"{r['method']:<20}{r['median_s'] * 1e3:>11.2f}{r['gb_s']:>8.2f}"
            f"{r['ratio_to_baseline']:>15.2f}{r['ratio_to_memmove_pieces']:>10.2f}"
        )
    ratio = paired("block_copier", "one_memmove")
    ok = ratio >= TARGET
    print(
        f"block_copier: {ratio:.2f}x one plain memmove (target >= {TARGET}x): "
        f"{'PASS' if ok else 'MISS'}; {paired('block_copier', 'memmove_pieces'):.2f}x "
        "block-sized memmoves (ratios: medians of same-round pairs)"
    )
    record: dict[str, Any] = {
        "benchmark": "tier_copy",
        "machine": harness.machine(threads=copier.threads, torch_threads=torch_threads),
        "blocks": n,
        "block_bytes": bb,
        "reps": args.reps,
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "nt_threshold_bytes": threshold,
        "rows": rows,
        "target": TARGET,
        "gated_on": "one_memmove",
        "ok": ok,
    }
    harness.write_results(Path(args.out), record)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
