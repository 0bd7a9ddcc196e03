"""``kvoffload_client.block_copy``: the vLLM tier's batched, threaded block copies move the right
rows."""

from __future__ import annotations

import random

import numpy as np
import pytest
from kvoffload_client.block_copy import PARALLEL_MIN_BYTES, BlockCopier, _runs


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("row", [64, PARALLEL_MIN_BYTES // 8])  # below and above the cutoff
def test_copies_every_row_to_its_place(threads: int, row: int) -> None:
    rng = random.Random(row + threads)
    src = np.random.default_rng(1).integers(0, 256, (40, row), dtype=np.uint8)
    dst = np.zeros((50, row), dtype=np.uint8)
    # Runs and scattered rows on both sides.
    dst_rows = [*range(3, 13), *rng.sample(range(20, 50), 15)]
    src_rows = [*range(20, 30), *rng.sample(range(0, 20), 15)]
    copier = BlockCopier(threads)
    try:
        copier.copy(dst, dst_rows, src, src_rows)
    finally:
        copier.close()
    for d, s in zip(dst_rows, src_rows, strict=True):
        assert np.array_equal(dst[d], src[s])
    untouched = sorted(set(range(50)) - set(dst_rows))
    assert not dst[untouched].any()


def test_runs_merge_rows_consecutive_on_both_sides() -> None:
    assert _runs([4, 5, 6, 9, 10], [1, 2, 7, 8, 9]) == [(4, 1, 2), (6, 7, 1), (9, 8, 2)]


def test_rows_are_checked() -> None:
    copier = BlockCopier(1)
    a = np.zeros((4, 8), dtype=np.uint8)
    with pytest.raises(IndexError, match="source row 4 out of"):
        copier.copy(a, [0], a, [4])
    with pytest.raises(ValueError, match="row shapes differ"):
        copier.copy(a, [0], np.zeros((4, 16), dtype=np.uint8), [0])
