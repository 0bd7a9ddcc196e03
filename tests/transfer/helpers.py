"""Helpers for the transfer tests: shared-memory "device" caches and workers by backend name.

The fixtures that clean up after these live in ``tests.transfer.conftest``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from testsupport.kvref import MIXED_LAYOUT, block_bytes_of, mixed_layout
from testsupport.shm_device import SHM_DIR, Layout, create_shm_file, shm_spec
from transfer import HostPool, KVCacheRegistry, KVCacheSpec, RegisteredCache, create_worker
from transfer.worker import TransferWorker


@dataclass
class ShmCache:
    """A "device" KV cache registered against a pool; on the CPU it lives in /dev/shm files.

    ``flats`` are the live tensors (bytes), ``originals`` their contents when built.
    """

    cache: RegisteredCache
    flats: list[torch.Tensor]
    originals: list[torch.Tensor]
    layout: list[tuple[list[int], str, int]]
    paths: list[str]


def write_shm_tensors(
    prefix: str, layout: Layout, seed: int = 0
) -> tuple[list[str], list[torch.Tensor]]:
    """Files ``/dev/shm/{prefix}-t{i}`` holding random bytes for each tensor of ``layout``,
    and a flat ``uint8`` tensor mapping each (writes go to the file)."""
    gen = torch.Generator().manual_seed(seed)
    paths, flats = [], []
    for i, (shape, dt, _bd) in enumerate(layout):
        path = f"{SHM_DIR}/{prefix}-t{i}"
        nbytes = torch.Size(shape).numel() * getattr(torch, dt).itemsize
        create_shm_file(path, nbytes)
        flat = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        flat.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen))
        paths.append(path)
        flats.append(flat)
    return paths, flats


def build_shm_cache(
    registry: KVCacheRegistry, prefix: str, n: int = 24, seed: int = 0, device: str = "cpu"
) -> ShmCache:
    """A mixed-layout cache of ``n`` device blocks registered in ``registry`` as ``prefix``.

    On the CPU its tensors are /dev/shm files named after ``prefix``; on another device they
    are tensors of the same geometry, registered in-process.
    """
    layout = mixed_layout(n)
    if device != "cpu":
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
    """A worker for one of ``BACKEND_PARAMS``; skips the test when CUDA is needed and absent."""
    if kind.startswith("cuda"):
        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")
        return create_worker(pool, registry, "cuda", on_finished=on_finished)
    if kind == "cpu2":
        return create_worker(pool, registry, "cpu", on_finished=on_finished, copy_threads=2)
    if kind == "faulty-clean":
        return create_worker(pool, registry, "faulty", on_finished=on_finished, copy_threads=1)
    return create_worker(pool, registry, "cpu", on_finished=on_finished, copy_threads=1)
