"""``HostCopyWorker`` (``kvoffload_client.vllm.cpu``) against vLLM's own shared host region and
load/store specs, byte for byte: where each engine block lands in the host tier (chunks of
several blocks, a group that starts mid-chunk, several groups and tensors, a layer whose page is
shorter than the tensor's), loads back, and what it refuses. Needs vLLM (any supported release,
CPU build or not) and torch, no engine.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kvoffload_client.vllm.cpu import HostCopyWorker
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

BLOCKS = 8  # engine blocks per tensor
CHUNKS = 4  # host chunks
PER_CHUNK = 2  # engine blocks per chunk
PAGES = (4096, 8192)  # bytes of one block, per tensor
ROW = sum(PAGES) * PER_CHUNK  # one chunk row of the host region (page aligned)


class Setup:
    def __init__(self, refs: list[list[tuple[int, int]]]) -> None:
        gen = torch.Generator().manual_seed(7)
        self.tensors = [
            torch.randint(-128, 128, (BLOCKS, page), dtype=torch.int8, generator=gen)
            for page in PAGES
        ]
        self.engine_id = f"kvoffload-host-copy-{uuid.uuid4().hex[:8]}"
        self.region = SharedOffloadRegion(
            engine_id=self.engine_id,
            num_chunks=CHUNKS,
            rank=0,
            kv_bytes_per_chunk=ROW,
            cpu_page_size=ROW,
        )
        caches = CanonicalKVCaches(
            tensors=[CanonicalKVCacheTensor(t, t.shape[1]) for t in self.tensors],
            group_data_refs=[[CanonicalKVCacheRef(i, size) for i, size in g] for g in refs],
        )
        self.worker = HostCopyWorker(caches, PER_CHUNK, self.region)

    def host(self, chunk: int, tensor: int, sub: int) -> bytes:
        """The host tier's bytes of one engine block: chunk row, tensor slot, sub-block."""
        base = self.region.base_tensor.numpy()
        start = chunk * ROW + sum(PAGES[:tensor]) * PER_CHUNK + sub * PAGES[tensor]
        return bytes(base[start : start + PAGES[tensor]])

    def block(self, tensor: int, block: int) -> bytes:
        return self.tensors[tensor][block].numpy().tobytes()

    def close(self) -> None:
        self.worker.shutdown()


@pytest.fixture
def one_group() -> Iterator[Setup]:
    setup = Setup([[(0, PAGES[0]), (1, PAGES[1])]])
    yield setup
    setup.close()


def test_a_store_lands_each_block_at_its_sub_block_and_a_load_brings_it_back(
    one_group: Setup,
) -> None:
    s = one_group
    # Request blocks 1..3 (the first starts mid-chunk) from engine blocks 5, 2, 3 into host
    # chunks 3 (its second half) and 0 (both halves).
    store = GPULoadStoreSpec([5, 2, 3], group_sizes=[3], block_indices=[1])
    assert s.worker.submit_store(11, store, CPULoadStoreSpec([3, 0]))
    for tensor in (0, 1):
        assert s.host(3, tensor, 1) == s.block(tensor, 5)
        assert s.host(0, tensor, 0) == s.block(tensor, 2)
        assert s.host(0, tensor, 1) == s.block(tensor, 3)
        assert s.host(3, tensor, 0) == bytes(PAGES[tensor])  # untouched
    [result] = s.worker.get_finished()
    assert (result.job_id, result.success, result.transfer_size) == (11, True, 3 * sum(PAGES))
    assert s.worker.get_finished() == []

    load = GPULoadStoreSpec([7, 6, 0], group_sizes=[3], block_indices=[1])
    assert s.worker.submit_load(12, CPULoadStoreSpec([3, 0]), load, expedited=True)
    s.worker.wait({12})
    for tensor in (0, 1):
        assert s.block(tensor, 7) == s.block(tensor, 5)
        assert s.block(tensor, 6) == s.block(tensor, 2)
        assert s.block(tensor, 0) == s.block(tensor, 3)
    assert [r.job_id for r in s.worker.get_finished()] == [12]


def test_groups_use_their_own_tensors_and_chunks() -> None:
    s = Setup([[(0, PAGES[0])], [(1, PAGES[1])]])
    try:
        # Group 0: blocks 1, 4 from the request's block 0 (one whole chunk, host chunk 2);
        # group 1: block 6 as the request's block 3 (second half of host chunk 1).
        spec = GPULoadStoreSpec([1, 4, 6], group_sizes=[2, 1], block_indices=[0, 3])
        s.worker.submit_store(1, spec, CPULoadStoreSpec([2, 1]))
        assert s.host(2, 0, 0) == s.block(0, 1)
        assert s.host(2, 0, 1) == s.block(0, 4)
        assert s.host(1, 1, 1) == s.block(1, 6)
        assert s.host(2, 1, 0) == bytes(PAGES[1])  # group 0 does not touch tensor 1
        assert s.host(1, 0, 1) == bytes(PAGES[0])
    finally:
        s.close()


def test_only_the_unpadded_page_of_a_layer_is_copied() -> None:
    s = Setup([[(0, 1000), (1, PAGES[1])]])
    try:
        s.worker.submit_store(1, GPULoadStoreSpec([5], [1], [0]), CPULoadStoreSpec([0]))
        assert s.host(0, 0, 0) == s.block(0, 5)[:1000] + bytes(PAGES[0] - 1000)
    finally:
        s.close()


def test_what_a_spec_cannot_address_is_refused(one_group: Setup) -> None:
    s = one_group
    with pytest.raises(IndexError, match="engine block row 8"):
        s.worker.submit_store(1, GPULoadStoreSpec([8], [1], [0]), CPULoadStoreSpec([0]))
    with pytest.raises(IndexError, match="host chunk row 4"):
        s.worker.submit_store(1, GPULoadStoreSpec([0], [1], [0]), CPULoadStoreSpec([4]))
    with pytest.raises(ValueError, match="2 chunks"):
        s.worker.submit_store(1, GPULoadStoreSpec([0, 1], [2], [1]), CPULoadStoreSpec([0]))
    with pytest.raises(ValueError, match="used 1 and 1"):
        s.worker.submit_store(1, GPULoadStoreSpec([0], [1], [0]), CPULoadStoreSpec([0, 1]))
    with pytest.raises(ValueError, match="2 KV cache groups"):
        s.worker.submit_store(1, GPULoadStoreSpec([0, 1], [1, 1], [0, 0]), CPULoadStoreSpec([0]))
    assert s.worker.get_finished() == []


def test_a_tensor_that_is_not_rows_of_bytes_is_refused() -> None:
    region = SharedOffloadRegion(
        engine_id=f"kvoffload-host-copy-{uuid.uuid4().hex[:8]}",
        num_chunks=CHUNKS,
        rank=0,
        kv_bytes_per_chunk=ROW,
        cpu_page_size=ROW,
    )
    try:
        shaped = torch.zeros((BLOCKS, 2, PAGES[0] // 8), dtype=torch.float32)
        caches = CanonicalKVCaches(
            [CanonicalKVCacheTensor(shaped, PAGES[0])], [[CanonicalKVCacheRef(0, PAGES[0])]]
        )
        with pytest.raises(ValueError, match="not a 2-D byte tensor"):
            HostCopyWorker(caches, PER_CHUNK, region)
    finally:
        region.cleanup()


def test_shutdown_releases_the_region_and_refuses_later_transfers() -> None:
    s = Setup([[(0, PAGES[0]), (1, PAGES[1])]])
    path = Path(s.region.mmap_path)
    assert path.exists()
    s.close()
    assert not path.exists()
    with pytest.raises(RuntimeError, match="after shutdown"):
        s.worker.submit_store(1, GPULoadStoreSpec([0], [1], [0]), CPULoadStoreSpec([0]))
