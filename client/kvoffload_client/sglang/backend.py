"""``KVOffloadStorage``: SGLang's ``HiCacheStorage`` over a kvoffload service (SGLang 0.5.23).

Loaded by SGLang's ``dynamic`` storage backend, which builds it with ``(storage_config,
kwargs)`` and then calls ``register_mem_pool_host(host_pool)``. Imports SGLang, so it
is imported only by SGLang (``kvoffload_client.sglang`` loads it on first use).

- **v1** (``interface_v1: 1``): ``batch_set_v1`` / ``batch_get_v1`` copy each page's regions,
  as ``host_pool.get_page_buffer_meta`` gives them, straight between SGLang's host pool and
  kvoffload's mapped pool.
- **Legacy**: ``set`` / ``batch_set`` take flat page tensors, ``get`` / ``batch_get`` fill the
  tensors SGLang passes (``target_location``); ``exists`` / ``batch_exists`` (leading hits).
  The two keep a ``layer_first`` page's bytes in different orders, so their keys differ.
- No data-path call raises: faults are misses and skipped writes, counted (``counters``) and
  logged once per incident. ``register_mem_pool_host`` refuses a pool whose block size is not
  the page's, and credentials the service refuses (``ValueError`` naming the setting);
  ``register_mem_host_pool_v2`` refuses a hybrid model's other host pools (the v2 methods,
  which move them, are not implemented: kvoffload keeps KV pages only).
- ``get_stats`` answers SGLang's ``StorageMetrics`` (pages and GB/s per call since the last
  call) when ``--enable-cache-report`` style storage metrics are on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvoffload_client.sglang.keys import PageFormat, page_prefix, service_key
from kvoffload_client.sglang.store import PageStore, Region, StoreConfig

log = logging.getLogger("kvoffload.sglang")


class KVOffloadStorage(HiCacheStorage):  # type: ignore[misc]  # SGLang ships no type information
    """A HiCache L3 backend whose pages live in a kvoffload service (module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        extra = storage_config.extra_config or {}
        self.config = StoreConfig.from_extra(extra)
        self.interface = "v1" if bool(extra.get("interface_v1", 0)) else "flat"
        # MLA ranks hold the same KV: one of them writes (SGLang's is_storage_writer).
        self.writer = bool(getattr(storage_config, "is_storage_writer", True))
        self.store: PageStore | None = None
        self.prefix = b""
        self.page_size = 0
        self._metrics_lock = threading.Lock()
        self._metrics: dict[str, list[float]] = {"get": [], "set": [], "get_bw": [], "set_bw": []}

    # ------------------------------------------------------------------ registration

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take SGLang's host pool: the page's size and format, the keys' prefix, and the
        service's pool, whose block size must be the page's (``ValueError`` naming
        ``--block-bytes`` otherwise; an unreachable service is not an error)."""
        super().register_mem_pool_host(mem_pool_host)
        cfg = self.storage_config
        self.page_size = int(mem_pool_host.page_size)
        page_bytes = _page_bytes(mem_pool_host, self.interface)
        tp_rank = None if cfg.is_mla_model else int(cfg.tp_rank)
        fmt = PageFormat(
            label=self.config.namespace or (cfg.model_name or ""),
            model=cfg.model_name or "",
            dtype=str(mem_pool_host.dtype),
            page_size=self.page_size,
            page_bytes=page_bytes,
            layout=str(mem_pool_host.layout),
            interface=self.interface,
            is_mla=bool(cfg.is_mla_model),
            tp_size=int(cfg.tp_size),
            tp_rank=tp_rank,
            pp_size=int(cfg.pp_size),
            pp_rank=int(cfg.pp_rank),
            cp_size=int(cfg.attn_cp_size),
            cp_rank=int(cfg.attn_cp_rank),
        )
        self.prefix = page_prefix(fmt)
        if self.store is not None:
            self.store.close()
        self.store = PageStore(self.config, page_bytes, rank_tag=f"tp{cfg.tp_rank}")
        if not self.store.check_block_size():
            log.warning(
                "kvoffload is not reachable at %s yet: pages miss until it is", self.config.url
            )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: str) -> None:
        """SGLang's hybrid cache registers each host pool of its group here, at attach and
        when it adds one later: the KV pool ``register_mem_pool_host`` took (kept) and the
        model's other state (Mamba or sliding-window states, sparse-attention indexes), which
        SGLang moves with the v2 methods. kvoffload keeps KV pages only, so another pool is
        refused here (``ValueError`` naming it) rather than failing on the data path."""
        if host_pool is getattr(self, "mem_pool_host", None):
            super().register_mem_host_pool_v2(host_pool, host_pool_name)
            return
        raise ValueError(
            f"kvoffload's HiCache backend keeps KV pages only; this model also has the host "
            f"pool {host_pool_name!r} ({type(host_pool).__name__}: a hybrid model's state), "
            "which it cannot store; accepted: models whose cache is KV alone (MHA or MLA), or "
            "another --hicache-storage-backend for this model"
        )

    def _keys(self, keys: Sequence[str]) -> list[bytes]:
        return [service_key(self.prefix, k) for k in keys]

    def _pages(self, host_indices: Any, n: int) -> list[list[Region]] | None:
        """Each of the ``n`` pages' regions from the host pool's page metadata."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if n == 0 or len(ptrs) % n:
            return None
        per = len(ptrs) // n
        return [
            [(int(ptrs[i * per + j]), int(sizes[i * per + j])) for j in range(per)]
            for i in range(n)
        ]

    def _record(self, kind: str, pages: int, seconds: float) -> None:
        if not self.storage_config.enable_storage_metrics or pages == 0:
            return
        gb = pages * (self.store.page_bytes if self.store else 0) / 1e9
        with self._metrics_lock:
            self._metrics[kind].append(pages)
            self._metrics[f"{kind}_bw"].append(gb / seconds if seconds > 0 else 0.0)

    # ------------------------------------------------------------------ v1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """The number of leading ``keys`` kvoffload holds (0 on any fault)."""
        store = self.store
        if store is None or not keys:
            return 0
        try:
            return store.exists_prefix(self._keys(keys))
        except Exception:  # never raise on SGLang's data path
            log.exception("kvoffload batch_exists failed")
            store.counters["faults_internal"] += 1
            return 0

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: Any,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store each key's page from the host pool; per key whether kvoffload holds it."""
        if self.store is not None and not self.writer:
            return [True] * len(keys)
        return self._v1("set", keys, host_indices)

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: Any,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Load each key's page into the host pool; per key whether it was loaded."""
        return self._v1("get", keys, host_indices)

    def _v1(self, kind: str, keys: list[str], host_indices: Any) -> list[bool]:
        """A v1 ``set`` or ``get`` of the pages at ``host_indices``; never raises."""
        store = self.store
        if store is None:
            return [False] * len(keys)
        try:
            pages = self._pages(host_indices, len(keys))
            if pages is None:
                store.counters["faults_internal"] += 1
                return [False] * len(keys)
            start = time.perf_counter()
            move = store.store if kind == "set" else store.load
            done = move(self._keys(keys), pages)
            self._record(kind, sum(done), time.perf_counter() - start)
            return done
        except Exception:  # never raise on SGLang's data path
            log.exception("kvoffload batch_%s_v1 failed", kind)
            store.counters["faults_internal"] += 1
            return [False] * len(keys)

    # ------------------------------------------------------------------ legacy

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store flat page tensors ``values[i]`` under ``keys[i]``; whether all are held."""
        store = self.store
        if store is None or values is None:
            return False
        if not self.writer:
            return True
        try:
            # A flattened layer_first page may be a copy: keep them alive over the copy.
            flat = [_bytes_of(v) for v in values]
            start = time.perf_counter()
            done = store.store(self._keys(keys), [[(t.data_ptr(), t.nbytes)] for t in flat])
            self._record("set", sum(done), time.perf_counter() - start)
            return all(done)
        except Exception:  # never raise on SGLang's data path
            log.exception("kvoffload batch_set failed")
            store.counters["faults_internal"] += 1
            return False

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        """``batch_set`` of one page."""
        return self.batch_set([key], [value])

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> list[Any]:
        """Fill ``target_locations[i]`` (contiguous flat pages) with the page of ``keys[i]``;
        per key the tensor, or None where it was not loaded."""
        store = self.store
        if store is None or target_locations is None:
            return [None] * len(keys)
        try:
            targets = list(target_locations)
            if not all(t.is_contiguous() for t in targets):
                store.counters["faults_internal"] += 1
                return [None] * len(keys)
            start = time.perf_counter()
            done = store.load(self._keys(keys), [[(t.data_ptr(), t.nbytes)] for t in targets])
            self._record("get", sum(done), time.perf_counter() - start)
            return [t if ok else None for t, ok in zip(targets, done, strict=True)]
        except Exception:  # never raise on SGLang's data path
            log.exception("kvoffload batch_get failed")
            store.counters["faults_internal"] += 1
            return [None] * len(keys)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """``batch_get`` of one page."""
        return self.batch_get([key], [target_location])[0]

    def exists(self, key: str) -> bool:
        """Whether kvoffload holds ``key``'s page."""
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------------------ hooks

    def clear(self) -> None:
        """Nothing: kvoffload's pages are shared with other engines of the namespace; an
        operator clears them with ``POST /admin/v1/cache/clear``."""

    @property
    def counters(self) -> dict[str, int]:
        """Faults by reason, pages stored, held, loaded, skipped, missed."""
        return self.store.stats() if self.store is not None else {}

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (pages and GB/s of each get and
        set call), None when storage metrics are off."""
        if not self.storage_config.enable_storage_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._metrics_lock:
            m, self._metrics = self._metrics, {"get": [], "set": [], "get_bw": [], "set_bw": []}
        return StorageMetrics(
            prefetch_pgs=[int(x) for x in m["get"]],
            backup_pgs=[int(x) for x in m["set"]],
            prefetch_bandwidth=m["get_bw"],
            backup_bandwidth=m["set_bw"],
        )

    def close(self) -> None:
        """Close the connection to the service."""
        if self.store is not None:
            self.store.close()


def _page_bytes(mem_pool_host: Any, interface: str) -> int:
    """Bytes of one page as this backend keeps it."""
    page_size = int(mem_pool_host.page_size)
    if interface == "v1":
        # Any index sequence with len() and tolist() will do: no torch import here (the
        # engine side imports none; SGLang's process has it all the same).
        _, sizes = mem_pool_host.get_page_buffer_meta(np.arange(page_size))
        return int(sum(sizes))
    page = mem_pool_host.get_dummy_flat_data_page()
    return int(page.numel() * page.element_size())


def _bytes_of(value: Any) -> Any:
    """``value`` (a torch tensor) made contiguous (a copy only when it is not one)."""
    if not hasattr(value, "contiguous") or not hasattr(value, "data_ptr"):
        raise TypeError(f"a page value must be a tensor, got {type(value).__name__}")
    return value.contiguous()
