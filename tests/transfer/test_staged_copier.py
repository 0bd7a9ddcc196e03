"""The CUDA backend's copiers, run on the CPU to check their address arithmetic.

``StagedCopier`` is device-agnostic; on the CPU its copies are synchronous. ``DirectCopier``
calls the raw CUDA entry points, played here by ``FakeRaw`` (``memmove`` on host memory). So
the bytes either writes can be compared with the reference geometry without a GPU.
"""

from __future__ import annotations

import ctypes
import random
from typing import Any

import pytest
import torch

from tests.transfer.fake_cuda import FakeRaw
from tests.transfer.helpers import mixed_block_bytes
from testsupport.kvref import device_block, host_block, mixed_layout
from transfer import KVCacheRegistry
from transfer.cuda_copy import DirectCopier, StagedCopier, find_cuda_memcpy
from transfer.cudart import CudaCallError, find_raw_cuda
from transfer.worker import make_plan

N = 32
SLOTS = 48
STREAM = 7  # a stream handle as the worker passes (the batch call refuses the NULL stream, 0)


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
@pytest.mark.parametrize(
    "raw", ["torch", "raw", "raw-failing", "direct-batch", "direct-2d", "direct-batch-failing"]
)
def test_staged_round_trip(world, staging_bytes, split_every, tensor_groups, raw) -> None:
    """Any chunking, run splitting, split of tensors over "devices" and copy path (staged:
    torch, raw cudaMemcpyAsync, raw falling back to torch; direct: one batch per chunk, 2D
    copies, a refused batch falling back to 2D) moves the same bytes."""
    pool, cache, layout, originals = world
    rng = random.Random(staging_bytes + (split_every or 0) + len(tensor_groups))
    blocks = rng.sample(range(N), 20)
    # Half the slots in runs, half scattered, so both copy shapes are exercised.
    slots = list(range(5, 15)) + rng.sample(range(20, SLOTS), 10)
    fakes = {"torch": None, "raw": FakeMemcpy(), "raw-failing": FakeMemcpy(fail_from=3)}
    fake = fakes.get(raw)
    direct = FakeRaw(batch=raw != "direct-2d", fail_batch=raw == "direct-batch-failing")
    shared = direct.raw()  # one runtime for every copier, as in the worker
    copiers: list[Any] = [
        DirectCopier(shared, staging_bytes)
        if raw.startswith("direct")
        else StagedCopier(torch.device("cpu"), staging_bytes, fake)
        for _ in tensor_groups
    ]

    def issue(plan: Any) -> None:
        for copier, ids in zip(copiers, tensor_groups, strict=True):
            for _ in copier.chunks(plan, pool.tensor, ids, STREAM, split_every=split_every):
                pass

    plan = make_plan("store", cache, SLOTS, blocks, slots)
    issue(plan)
    for b, s in zip(blocks, slots, strict=True):
        assert torch.equal(pool.tensor[s], host_block(originals, layout, b))
    for flat in cache.tensors:
        flat.zero_()
    targets = rng.sample(range(N), 20)
    plan = make_plan("load", cache, SLOTS, targets, slots)
    issue(plan)
    for t, b in zip(targets, blocks, strict=True):
        for flat, orig, (shape, dt, bd) in zip(cache.tensors, originals, layout, strict=True):
            size = getattr(torch, dt).itemsize
            assert torch.equal(
                device_block(flat, shape, size, bd, t), device_block(orig, shape, size, bd, b)
            )
    if raw == "raw":
        assert fake is not None
        assert fake.kinds == {1, 2}  # both directions went the raw way
    if raw == "direct-batch":
        assert direct.calls_2d == 0
        assert direct.batch_calls > 0
    if raw == "direct-batch-failing":
        assert direct.batch_calls == 1  # refused once, then 2D for good
        assert direct.last_error_resets == 1  # the refusal's error was cleared


# vLLM-like: 80 tensors [2, N, 16, 8, 128] bf16 (K and V of each layer, block_dim 1); the
# launch count does not depend on the inner size, so the test keeps it small.
VLLM_TENSORS = 80


@pytest.mark.parametrize(
    ("path", "launches"),
    [
        ("staged", 1 + 2 * VLLM_TENSORS + 1),  # index upload, 2 kernels per tensor, 1 DMA
        ("direct-2d", VLLM_TENSORS),  # one DMA per tensor, no kernel
        ("direct-batch", 1),  # one batched DMA call for the whole chunk
    ],
)
def test_launches_per_block_of_a_vllm_like_layout(make_pool, path, launches) -> None:
    n = 8
    inner = [16, 8]  # stands for [16, 8, 128]
    pool = make_pool(4, VLLM_TENSORS * 2 * 16 * 8 * 2, pin=False)
    registry = KVCacheRegistry(pool)
    tensors = [torch.zeros([2, n, *inner], dtype=torch.bfloat16) for _ in range(VLLM_TENSORS)]
    cache = registry.register_tensors("vllm", tensors, [1] * VLLM_TENSORS)
    plan = make_plan("store", cache, 4, [5], [2])
    fake = FakeRaw(batch=path == "direct-batch")
    copier: Any = (
        StagedCopier(torch.device("cpu")) if path == "staged" else DirectCopier(fake.raw())
    )
    for _ in copier.chunks(plan, pool.tensor, list(range(VLLM_TENSORS)), STREAM):
        pass
    assert copier.launches == launches


def _round_trip_direct(world: Any, copier: DirectCopier, stream: int = STREAM) -> None:
    """Store 6 blocks and load them back elsewhere through ``copier``; check every byte."""
    pool, cache, layout, originals = world
    blocks, slots = [3, 9, 4, 20, 21, 22], [7, 8, 30, 31, 32, 2]
    ids = list(range(len(cache.tensors)))
    for _ in copier.chunks(
        make_plan("store", cache, SLOTS, blocks, slots), pool.tensor, ids, stream
    ):
        pass
    for b, s in zip(blocks, slots, strict=True):
        assert torch.equal(pool.tensor[s], host_block(originals, layout, b))
    for flat in cache.tensors:
        flat.zero_()
    targets = [0, 1, 2, 10, 11, 30]
    plan = make_plan("load", cache, SLOTS, targets, slots)
    for _ in copier.chunks(plan, pool.tensor, ids, stream):
        pass
    for t, b in zip(targets, blocks, strict=True):
        for flat, orig, (shape, dt, bd) in zip(cache.tensors, originals, layout, strict=True):
            size = getattr(torch, dt).itemsize
            assert torch.equal(
                device_block(flat, shape, size, bd, t), device_block(orig, shape, size, bd, b)
            )


def test_pieces_further_apart_than_the_max_pitch_are_copied_one_by_one(world) -> None:
    """A K/V half above cudaDevAttrMaxPitch (2 GiB on current GPUs) cannot be one 2D copy:
    those tensors go piece by piece (cudaMemcpyAsync), the others stay 2D."""
    _pool, cache, _layout, _originals = world
    fake = FakeRaw(batch=False)
    split = [lay for lay in cache.layouts if lay.outer > 1]
    assert split, "the mixed layout has tensors with several pieces per block"
    pitch = min(lay.num_blocks * lay.inner_bytes for lay in split)
    copier = DirectCopier(fake.raw(), max_pitch=pitch - 1)
    _round_trip_direct(world, copier)
    assert fake.memcpy_calls == 2 * 6 * sum(lay.outer for lay in split)  # both directions
    assert fake.calls_2d > 0  # the tensors with one piece per block


def test_blocks_larger_than_the_max_pitch_are_copied_one_by_one(world) -> None:
    """A one-piece tensor's 2D copy has the host block as its pitch: a block above the
    device's limit goes piece by piece as well."""
    _pool, cache, _layout, _originals = world
    fake = FakeRaw(batch=False)
    pitches = [lay.num_blocks * lay.inner_bytes for lay in cache.layouts if lay.outer > 1]
    copier = DirectCopier(fake.raw(), max_pitch=min([cache.block_bytes, *pitches]) - 1)
    _round_trip_direct(world, copier)
    assert fake.calls_2d == 0
    assert fake.memcpy_calls == 2 * 6 * sum(lay.outer for lay in cache.layouts)


def test_a_sticky_batch_error_raises_and_keeps_the_batch_call(world) -> None:
    _pool, cache, _layout, _originals = world
    fake = FakeRaw(fail_batch=True)
    fake.batch_code = 700  # CUDA_ERROR_ILLEGAL_ADDRESS: the context is lost
    raw = fake.raw()
    raw.error_name = lambda code: "cudaErrorIllegalAddress"
    raw.driver_error_name = lambda code: "CUDA_ERROR_ILLEGAL_ADDRESS"
    copier = DirectCopier(raw)
    plan = make_plan("store", cache, SLOTS, [1], [1])
    # The batch call is the driver's: its code is named by the driver.
    with pytest.raises(CudaCallError, match=r"returned 700 \(CUDA_ERROR_ILLEGAL_ADDRESS\)") as info:
        next(copier.chunks(plan, _pool.tensor, [0, 1, 2, 3], STREAM))
    assert info.value.sticky
    assert fake.calls_2d == 0  # not retried: nothing works in a lost context
    assert raw.batch is not None


def test_a_batch_refused_with_2d_refused_too_fails_the_chunk_but_keeps_the_batch(world) -> None:
    """Both ways refusing points at the addresses, not at the batch call: it stays on."""
    pool, cache, _layout, _originals = world
    fake = FakeRaw(fail_batch=True)
    fake.fail_2d_from = 1
    raw = fake.raw()
    copier = DirectCopier(raw)
    plan = make_plan("store", cache, SLOTS, [1], [1])
    with pytest.raises(CudaCallError, match="cudaMemcpy2DAsync returned 1"):
        next(copier.chunks(plan, pool.tensor, [0, 1, 2, 3], STREAM))
    assert raw.batch is not None
    assert copier.batch_failures == 1
    fake.fail_batch, fake.fail_2d_from = False, None
    _round_trip_direct(world, copier)  # and the next jobs batch again
    assert fake.batch_calls > 1


def test_the_null_stream_is_never_given_to_the_batch_call(world) -> None:
    fake = FakeRaw()
    _round_trip_direct(world, DirectCopier(fake.raw()), stream=0)
    assert fake.batch_calls == 0
    assert fake.calls_2d > 0
    assert fake.streams == {0}


def test_find_cuda_memcpy_without_a_cuda_runtime(monkeypatch) -> None:
    if torch.cuda.is_available():
        assert find_cuda_memcpy() is not None
    else:
        assert find_cuda_memcpy() is None
        assert find_raw_cuda() is None
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
