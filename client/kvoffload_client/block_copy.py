"""Block copies between two row-major ``uint8`` arrays of blocks, batched and threaded.

The vLLM tier moves blocks between vLLM's primary tier and the mapped pool. Copying block by
block with numpy assignment costs a Python-level index and a numpy call per block on one
thread. ``BlockCopier.copy`` instead merges runs of consecutive rows on both sides into one
``memmove`` each (``ctypes.memmove`` releases the GIL), and splits the runs over a few threads
by bytes when there is enough to copy; small copies stay on the caller's thread. Stdlib and
numpy only (the tier's side of the process imports no torch).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = ["BlockCopier", "default_copy_threads", "move_all"]

PARALLEL_MIN_BYTES = 4 << 20
"""Below this many bytes a copy runs on the caller's thread (threads cost more than they win)."""


def default_copy_threads() -> int:
    """Half the cores, between 1 and 4: memory bandwidth saturates with a few threads."""
    return max(1, min(4, (os.cpu_count() or 1) // 2))


def _runs(dst_rows: Sequence[int], src_rows: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(dst_row, src_row, count)`` for each run consecutive on both sides, in order."""
    runs: list[tuple[int, int, int]] = []
    n = len(dst_rows)
    i = 0
    while i < n:
        j = i + 1
        while j < n and dst_rows[j] == dst_rows[j - 1] + 1 and src_rows[j] == src_rows[j - 1] + 1:
            j += 1
        runs.append((dst_rows[i], src_rows[i], j - i))
        i = j
    return runs


class BlockCopier:
    """Copies rows of ``src`` into rows of ``dst`` (same row size) on up to ``threads``."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = default_copy_threads() if threads is None else threads
        if self.threads < 1:
            raise ValueError(f"threads must be positive, got {threads}")
        self._pool = (
            ThreadPoolExecutor(self.threads - 1, thread_name_prefix="kvoffload-block-copy")
            if self.threads > 1
            else None
        )

    def copy(
        self, dst: np.ndarray, dst_rows: Sequence[int], src: np.ndarray, src_rows: Sequence[int]
    ) -> None:
        """``dst[dst_rows[i]] = src[src_rows[i]]`` for every i. Rows are checked against both
        arrays (``IndexError``); both must be C-contiguous 2D ``uint8`` with equal row size."""
        if len(dst_rows) != len(src_rows):
            raise ValueError(f"{len(dst_rows)} destination rows for {len(src_rows)} sources")
        if dst.ndim != 2 or src.ndim != 2 or dst.shape[1] != src.shape[1]:
            raise ValueError(f"row shapes differ: {dst.shape} and {src.shape}")
        if not (dst.flags.c_contiguous and src.flags.c_contiguous):
            raise ValueError("both arrays must be C-contiguous")
        if not len(dst_rows):
            return
        for rows, arr, what in ((dst_rows, dst, "destination"), (src_rows, src, "source")):
            lo, hi = min(rows), max(rows)
            if lo < 0 or hi >= arr.shape[0]:
                raise IndexError(f"{what} row {lo if lo < 0 else hi} out of [0, {arr.shape[0]})")
        row = dst.shape[1]
        dbase, sbase = dst.ctypes.data, src.ctypes.data
        moves = [
            (dbase + d * row, sbase + s * row, c * row) for d, s, c in _runs(dst_rows, src_rows)
        ]
        total = len(dst_rows) * row
        if self._pool is None or total < PARALLEL_MIN_BYTES:
            move_all(moves)
            return
        # Split into about `threads` shares of equal bytes (a long run is cut in pieces).
        share = -(-total // self.threads)
        shares: list[list[tuple[int, int, int]]] = [[]]
        left = share
        for d, s, n in moves:
            while n:
                take = min(n, left)
                shares[-1].append((d, s, take))
                d, s, n, left = d + take, s + take, n - take, left - take
                if left == 0:
                    shares.append([])
                    left = share
        futures = [self._pool.submit(move_all, part) for part in shares[1:] if part]
        move_all(shares[0])
        for f in futures:
            f.result()

    def close(self) -> None:
        """Stop the helper threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def move_all(moves: list[tuple[int, int, int]]) -> None:
    """Run ``(dst, src, nbytes)`` memory moves in order on this thread (``memmove`` releases
    the GIL)."""
    move = ctypes.memmove
    for d, s, n in moves:
        move(d, s, n)
