"""The CUDA backend's staged gather/scatter, run on the CPU to check its index arithmetic.

``StagedCopier`` is device-agnostic; on the CPU its copies are synchronous, so the bytes it
writes can be compared with the reference geometry without a GPU.
"""

from __future__ import annotations

import ctypes
import random

import pytest
import torch

from tests.transfer.helpers import mixed_block_bytes
from tests.transfer.kvref import device_block, host_block, mixed_layout
from transfer import KVCacheRegistry
from transfer.cuda_worker import StagedCopier, find_cuda_memcpy
from transfer.worker import make_plan

N = 32
SLOTS = 48


@pytest.fixture
def world(make_pool):
    pool = make_pool(SLOTS, mixed_block_bytes(N), pin=False)
    registry = KVCacheRegistry(pool)
    gen = torch.Generator().manual_seed(7)
    layout = mixed_layout(N)
    tensors = [
        torch.randint(-1000, 1000, shape, generator=gen).to(getattr(torch, dt))
        for shape, dt, _bd in layout
    ]
    cache = registry.register_tensors("staged", tensors, [bd for _s, _d, bd in layout])
    originals = [f.clone() for f in cache.tensors]
    return pool, cache, layout, originals


class FakeMemcpy:
    """Plays cudaMemcpyAsync on host memory (a memmove), optionally failing from a call on."""

    def __init__(self, fail_from: int | None = None) -> None:
        self.fail_from = fail_from
        self.calls = 0
        self.kinds: set[int] = set()

    def __call__(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> int:
        self.calls += 1
        if self.fail_from is not None and self.calls >= self.fail_from:
            return 1  # cudaErrorInvalidValue
        self.kinds.add(kind)
        ctypes.memmove(dst, src, nbytes)
        return 0


@pytest.mark.parametrize("staging_bytes", [1, 3 * 1024, 1 << 20])
@pytest.mark.parametrize("split_every", [None, 4])
@pytest.mark.parametrize("tensor_groups", [[[0, 1, 2, 3]], [[0, 2], [1, 3]], [[3], [0, 1, 2]]])
@pytest.mark.parametrize("raw", ["torch", "raw", "raw-failing"])
def test_staged_round_trip(world, staging_bytes, split_every, tensor_groups, raw) -> None:
    """Any chunking, run splitting, split of tensors over "devices" and copy path (torch, raw
    cudaMemcpyAsync, raw falling back to torch) moves the same bytes."""
    pool, cache, layout, originals = world
    rng = random.Random(staging_bytes + (split_every or 0) + len(tensor_groups))
    blocks = rng.sample(range(N), 20)
    # Half the slots in runs, half scattered, so both copy shapes are exercised.
    slots = list(range(5, 15)) + rng.sample(range(20, SLOTS), 10)
    fakes = {"torch": None, "raw": FakeMemcpy(), "raw-failing": FakeMemcpy(fail_from=3)}
    fake = fakes[raw]
    copiers = [StagedCopier(torch.device("cpu"), staging_bytes, fake) for _ in tensor_groups]
    plan = make_plan("store", cache, SLOTS, blocks, slots)
    for copier, ids in zip(copiers, tensor_groups, strict=True):
        copier.issue(plan, pool.tensor, ids, split_every=split_every)
    for b, s in zip(blocks, slots, strict=True):
        assert torch.equal(pool.tensor[s], host_block(originals, layout, b))
    for flat in cache.tensors:
        flat.zero_()
    targets = rng.sample(range(N), 20)
    plan = make_plan("load", cache, SLOTS, targets, slots)
    for copier, ids in zip(copiers, tensor_groups, strict=True):
        copier.issue(plan, pool.tensor, ids, split_every=split_every)
    for t, b in zip(targets, blocks, strict=True):
        for flat, orig, (shape, dt, bd) in zip(cache.tensors, originals, layout, strict=True):
            size = getattr(torch, dt).itemsize
            assert torch.equal(
                device_block(flat, shape, size, bd, t), device_block(orig, shape, size, bd, b)
            )
    if raw == "raw":
        assert fake is not None
        assert fake.kinds == {1, 2}  # both directions went the raw way


def test_find_cuda_memcpy_without_a_cuda_runtime(monkeypatch) -> None:
    if torch.cuda.is_available():
        assert find_cuda_memcpy() is not None
    else:
        assert find_cuda_memcpy() is None
    monkeypatch.setenv("KVOFFLOAD_CUDA_RAW_MEMCPY", "0")
    assert find_cuda_memcpy() is None


def test_geometry_groups_and_word_size(world) -> None:
    _pool, cache, _layout, _originals = world
    copier = StagedCopier(torch.device("cpu"))
    full = copier.geometry(cache, [0, 1, 2, 3])
    assert full.row_bytes == cache.block_bytes
    assert full.groups == ((0, 0, cache.block_bytes),)
    assert full.word == 4  # the float32 pieces are 20 bytes: 4-byte words fit everything
    split = copier.geometry(cache, [0, 2])
    lay = cache.layouts
    assert split.groups == (
        (0, 0, lay[0].bytes_per_block),
        (lay[2].host_offset, lay[0].bytes_per_block, lay[2].bytes_per_block),
    )


def test_runs_split_at_boundaries(world) -> None:
    _pool, cache, _layout, _originals = world
    slots = [0, 1, 2, 3, 4, 5, 9, 10, 12]
    plan = make_plan("store", cache, SLOTS, list(range(len(slots))), slots)
    assert plan.slot_runs() == [(0, 0, 6), (6, 9, 2), (8, 12, 1)]
    assert plan.slot_runs(4) == [(0, 0, 4), (4, 4, 2), (6, 9, 2), (8, 12, 1)]
    assert plan.slot_runs(None, 2, 5) == [(2, 2, 3)]


def test_plan_sorts_pairs_by_slot(world) -> None:
    _pool, cache, _layout, _originals = world
    plan = make_plan("store", cache, SLOTS, [5, 6, 7, 8], [12, 10, 11, 3])
    assert plan.host_slots == [3, 10, 11, 12]
    assert plan.device_blocks == [8, 6, 7, 5]
    assert plan.slot_runs() == [(0, 3, 1), (1, 10, 3)]
    assert plan.slot_runs(split_every=11) == [(0, 3, 1), (1, 10, 1), (2, 11, 2)]
    assert plan.nbytes == 4 * cache.block_bytes


def test_staging_bytes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="staging_bytes must be positive"):
        StagedCopier(torch.device("cpu"), 0)
