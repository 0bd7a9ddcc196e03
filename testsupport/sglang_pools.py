"""SGLang's own pools, storage config and cache controller, built as its scheduler builds them
(small: 2 layers, 2 heads of 32, fp16, 16-token pages: 8 KiB a page in every layout).

Shared by ``tests/sglang`` and ``bench/sglang_backend.py``. Imports SGLang and torch at module
level: import it only in the SGLang venv (``.venv-sglang``), after ``sglang_stubs.install()``.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str

PAGE = 16
LAYERS = 2
HEADS = 2
HEAD_DIM = 32
DTYPE = torch.float16
PAGE_BYTES = 2 * LAYERS * HEADS * HEAD_DIM * PAGE * DTYPE.itemsize  # K and V: 8192
DEVICE_TOKENS = 512
LAYOUTS = ("layer_first", "page_first", "page_first_direct")
MODEL = "tiny-model"


@dataclass
class Pools:
    device: MHATokenToKVPool
    allocator: TokenToKVPoolAllocator
    host: MHATokenToKVPoolHost


def make_pools(
    layout: str = "page_first",
    seed: int = 0,
    *,
    page: int = PAGE,
    layers: int = LAYERS,
    heads: int = HEADS,
    head_dim: int = HEAD_DIM,
    device_tokens: int = DEVICE_TOKENS,
) -> Pools:
    """SGLang's CPU device pool and its host pool in ``layout`` (twice the device's tokens),
    the host pool filled with random values from ``seed``."""
    device = MHATokenToKVPool(
        device_tokens, page, DTYPE, heads, head_dim, layers, "cpu", enable_memory_saver=False
    )
    allocator = TokenToKVPoolAllocator(
        size=device_tokens, dtype=DTYPE, device="cpu", kvcache=device, need_sort=False
    )
    host = MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2,
        0,
        page,
        layout,
        pin_memory=False,  # no CUDA to register host memory with
        device_capacity_tokens=device.size,
        start_layer=device.start_layer,
        end_layer=device.end_layer,
    )
    generator = torch.Generator().manual_seed(seed)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=generator).to(DTYPE))
    return Pools(device, allocator, host)


def extra_config(url: str, v1: bool = True, **more: Any) -> dict[str, Any]:
    """``--hicache-storage-backend-extra-config`` as docs/sglang.md writes it."""
    return {
        "backend_name": "kvoffload",
        "module_path": "kvoffload_client.sglang",
        "class_name": "KVOffloadStorage",
        "interface_v1": 1 if v1 else 0,
        "url": url,
        "retry_interval_s": 0.05,
        **more,
    }


def storage_config(extra: dict[str, Any], layout: str, tp_rank: int = 0, tp_size: int = 1) -> Any:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=True,
        is_page_first_layout=layout != "layer_first",
        model_name=MODEL,
        extra_config=extra,
    )


def backend(pools: Pools, extra: dict[str, Any], tp_rank: int = 0, tp_size: int = 1) -> Any:
    """The backend as SGLang's ``dynamic`` factory makes it, then registered with the pool."""
    cfg = storage_config(extra, pools.host.layout, tp_rank, tp_size)
    made: HiCacheStorage = StorageBackendFactory.create_backend("dynamic", cfg, pools.host)
    made.register_mem_pool_host(pools.host)
    return made


def page_keys(tokens: list[int]) -> list[str]:
    """SGLang's storage keys of ``tokens``' pages (its SHA-256 chain)."""
    keys: list[str] = get_storage_hash_str(tokens, None, page_size=PAGE)
    return keys


def tokens(seed: int, pages: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    out: list[int] = torch.randint(0, 32000, (pages * PAGE,), generator=generator).tolist()
    return out


def page_bytes(host: MHATokenToKVPoolHost, host_indices: torch.Tensor) -> list[bytes]:
    """Each page's bytes at ``host_indices`` (one page per ``PAGE`` indices)."""
    return [
        host.get_data_page(int(host_indices[i]), flat=True)
        .contiguous()
        .view(torch.uint8)
        .numpy()
        .tobytes()
        for i in range(0, len(host_indices), PAGE)
    ]


def init_gloo() -> None:
    """A world-size-1 gloo group, the one SGLang's controller reduces its hit counts over."""
    if not dist.is_initialized():
        port = 20000 + os.getpid() % 20000
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


class Controller:
    """SGLang's ``HiCacheController`` with the storage backend, driven as its scheduler
    thread drives it: ``write_storage`` to the backup thread, ``prefetch`` to the prefetch
    thread (``batch_exists``), host room for the hit, then the I/O thread (``batch_get_v1``)."""

    def __init__(self, pools: Pools, extra: dict[str, Any]) -> None:
        from sglang.srt.runtime_context import get_parallel

        init_gloo()
        # No parallel config is published outside a scheduler: a single rank, as SGLang's
        # own unit fixtures state it.
        self._parallel = get_parallel().override(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0
        )
        self._parallel.__enter__()
        self.pools = pools
        self.cc = HiCacheController(
            pools.allocator,
            pools.host,
            PAGE,
            dist.group.WORLD,
            threading.Event(),
            io_backend="direct",
            storage_backend="dynamic",
            storage_backend_extra_config=extra,
            model_name=MODEL,
            prefetch_threshold=PAGE,
        )

    @property
    def backend(self) -> Any:
        return self.cc.storage_backend

    def write(self, host_indices: torch.Tensor, token_ids: list[int]) -> int:
        """Back ``token_ids``' pages at ``host_indices`` up to storage; tokens written."""
        self.cc.write_storage(host_indices, token_ids, hash_value=page_keys(token_ids))
        op = self.cc.ack_backup_queue.get(timeout=30)
        done: int = op.completed_tokens
        return done

    def prefetch(self, rid: str, token_ids: list[int]) -> tuple[int, torch.Tensor | None]:
        """Prefetch ``token_ids`` from storage into fresh host pages; (tokens prefetched,
        their host indices)."""
        self.cc.prefetch(rid, token_ids)
        hit = self.cc.prefetch_hit_queue.get(timeout=30)
        if hit.storage_hit_count == 0:
            return 0, None
        hit.host_indices = self.pools.host.alloc(hit.storage_hit_count)
        self.cc.prefetch_buffer.put(hit)
        completed = 0
        while True:
            ack = self.cc.ack_prefetch_queue.get(timeout=30)
            if ack.completed_tokens is not None:
                completed = max(completed, ack.completed_tokens)
            if ack.completed_req:
                return completed, hit.host_indices

    def close(self) -> None:
        self.cc.detach_storage_backend()
        self._parallel.__exit__(None, None, None)
