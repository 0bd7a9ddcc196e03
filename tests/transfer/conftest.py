"""Fixtures for the transfer tests: pools, shared-memory "device" caches, workers.

Every file a test creates in /dev/shm carries a unique prefix and is removed at teardown.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from tests.transfer.kvref import MIXED_LAYOUT, block_bytes_of, shapes, shm_spec, unique_prefix
from transfer import HostPool, KVCacheRegistry, KVCacheSpec, RegisteredCache, create_worker
from transfer.worker import TransferWorker


@dataclass
class ShmCache:
    """A CPU "device" KV cache living in /dev/shm files, registered against a pool."""

    cache: RegisteredCache
    flats: list[torch.Tensor]
    originals: list[torch.Tensor]
    layout: list[tuple[list[int], str, int]]
    paths: list[str]


@pytest.fixture
def shm_prefix() -> Iterator[str]:
    prefix = unique_prefix("t")
    yield prefix
    for path in glob.glob(f"/dev/shm/{prefix}*"):
        os.unlink(path)


@pytest.fixture
def make_pool() -> Iterator[Callable[..., HostPool]]:
    pools: list[HostPool] = []

    def make(num_blocks: int, block_bytes: int, **kwargs: object) -> HostPool:
        pool = HostPool.create(num_blocks, block_bytes, **kwargs)  # type: ignore[arg-type]
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()


def write_shm_tensors(
    prefix: str, layout: list[tuple[list[int], str, int]], seed: int = 0
) -> tuple[list[str], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    paths, flats = [], []
    for i, (shape, dt, _bd) in enumerate(layout):
        path = f"/dev/shm/{prefix}-t{i}"
        nbytes = torch.Size(shape).numel() * getattr(torch, dt).itemsize
        flat = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        flat.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen))
        paths.append(path)
        flats.append(flat)
    return paths, flats


@pytest.fixture
def mixed_layout() -> Callable[[int], list[tuple[list[int], str, int]]]:
    def build(n: int) -> list[tuple[list[int], str, int]]:
        return [
            (s, dt, bd)
            for s, (_x, dt, bd) in zip(shapes(MIXED_LAYOUT, n), MIXED_LAYOUT, strict=True)
        ]

    return build


@pytest.fixture
def shm_cache(
    shm_prefix: str, mixed_layout: Callable[[int], list[tuple[list[int], str, int]]]
) -> Callable[..., ShmCache]:
    """Factory: a mixed-layout cache of ``n`` device blocks registered in ``registry``."""
    count = [0]

    def build(
        registry: KVCacheRegistry, n: int = 24, seed: int = 0, device: str = "cpu"
    ) -> ShmCache:
        count[0] += 1
        prefix = f"{shm_prefix}-c{count[0]}"
        layout = mixed_layout(n)
        if device != "cpu":
            # Same geometry in device memory, registered in-process.
            gen = torch.Generator().manual_seed(seed)
            tensors = [
                torch.randint(-100, 100, shape, generator=gen).to(getattr(torch, dt)).to(device)
                for shape, dt, _bd in layout
            ]
            cache = registry.register_tensors(prefix, tensors, [bd for _s, _d, bd in layout])
            flats = list(cache.tensors)
            return ShmCache(cache, flats, [f.clone() for f in flats], layout, [])
        paths, flats = write_shm_tensors(prefix, layout, seed)
        cache = registry.register(KVCacheSpec.from_dict(shm_spec(prefix, paths, layout)))
        return ShmCache(cache, flats, [f.clone() for f in flats], layout, paths)

    return build


def mixed_block_bytes(n: int = 24) -> int:
    return block_bytes_of(MIXED_LAYOUT, n)


BACKEND_PARAMS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cpu2", id="cpu-2-threads"),
    pytest.param("faulty-clean", id="faulty-no-faults"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
    pytest.param("cuda-hostcache", id="cuda-with-shm-cache", marks=pytest.mark.gpu),
]


def build_worker(
    kind: str,
    pool: HostPool,
    registry: KVCacheRegistry,
    on_finished: Callable[[], None] | None = None,
) -> TransferWorker:
    if kind.startswith("cuda"):
        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")
        return create_worker(pool, registry, "cuda", on_finished=on_finished)
    if kind == "cpu2":
        return create_worker(pool, registry, "cpu", on_finished=on_finished, copy_threads=2)
    if kind == "faulty-clean":
        return create_worker(pool, registry, "faulty", on_finished=on_finished, copy_threads=1)
    return create_worker(pool, registry, "cpu", on_finished=on_finished, copy_threads=1)
