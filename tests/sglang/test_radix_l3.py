"""SGLang 0.5.23's own radix-cache L3 produce and consume flow through kvoffload (``make
test-sglang``).

SGLang ships a test kit for its unified radix cache
(``sglang.test.kits.unified_radix_cache.storage.UnifiedRadixCacheStorageFixtures``). Its L3
steps are called here as they are: ``_l3_produce`` (a real ``UnifiedRadixCache`` with HiCache
inserts a prefix, backs it up device to host, then writes it back to L3 through its
``HiCacheController``), ``_l3_consumer`` (a fresh cache: new device pool, host pool and
controller), ``_consume_prefetch`` (``prefetch_from_storage``, then the scheduler's event pump:
the backend's ``batch_exists``, then ``batch_get``) and ``_load_back_node`` (host to device).

Three kit methods are replaced in ``Kit``, and why:

- ``_init_hicache``: the kit's L3 steps ask for SGLang's ``file`` backend. The kit's own
  ``_init_hicache`` still runs; only the ``ServerArgs`` it builds are redirected to the
  ``dynamic`` backend loading ``kvoffload_client.sglang`` (the extra config of docs/sglang.md),
  with the ``direct`` I/O backend and the ``layer_first`` host layout (the one pair whose
  device<->host copy is a single function, ``transfer_kv_direct``; see the CPU patches).
- ``_fill_full_kv`` / ``_snapshot_full_kv``: the kit's write a constant into layer 0 only;
  these write and read random K and V in every layer, so the comparison is per layer and token.

CPU patches (``cpu_patches``), each the least that lets SGLang's code run without CUDA:

- ``fixtures.get_device``: the kit asks SGLang's platform for an accelerator; there is none.
- ``pool_host.common._cuda_host_register``: HiCache pins its host pool with cudaHostRegister.
- ``pool_host.mha.transfer_kv_direct``: bound from ``sgl_kernel`` on CUDA only (undefined on
  CPU); stood in for by the plain torch index copy it performs.

The consumer runs in this process or, in one test, in a second OS process
(``python -c`` calling ``consume_in_subprocess``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import unittest
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import sglang.srt.mem_cache.pool_host.common as host_common
import sglang.srt.mem_cache.pool_host.mha as host_mha
import torch
from kvoffload_client.client import KVOffloadAdminClient
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
from sglang.srt.server_args import ServerArgs
from sglang.test.kits.unified_radix_cache import fixtures as kit_fixtures
from sglang.test.kits.unified_radix_cache import mixins as kit_mixins
from sglang.test.kits.unified_radix_cache.config import CacheConfig
from sglang.test.kits.unified_radix_cache.storage import UnifiedRadixCacheStorageFixtures

from testsupport import sglang_pools as P
from testsupport.server import ROOT, TOKEN, ServerProcess

PAGES = 3
# Same page as testsupport/sglang_pools.py: 16 tokens, 2 layers, 2 heads of 32, fp16: 8 KiB.
CONFIG = CacheConfig(
    page_size=P.PAGE,
    components=(ComponentType.FULL,),
    num_layers=P.LAYERS,
    head_num=P.HEADS,
    head_dim=P.HEAD_DIM,
    dtype=P.DTYPE,
)


def _transfer_kv_direct(
    src_layers: list[torch.Tensor],
    dst_layers: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """``sgl_kernel.kvcacheio.transfer_kv_direct`` on CPU: each layer's rows at
    ``src_indices`` copied to ``dst_indices`` (the kernel batches by ``page_size``; the
    result is the same)."""
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_indices] = src[src_indices]


@contextlib.contextmanager
def cpu_patches() -> Iterator[None]:
    """The three CPU stand-ins of the module docstring, undone on exit."""
    with contextlib.ExitStack() as stack:
        # No accelerator: SGLang's platform raises; the pools are CPU tensors.
        stack.enter_context(mock.patch.object(kit_fixtures, "get_device", return_value="cpu"))
        # Pinning registers host memory with CUDA; plain CPU memory needs nothing.
        stack.enter_context(
            mock.patch.object(host_common, "_cuda_host_register", return_value=None)
        )
        # The module binds the name from sgl_kernel only under CUDA or ROCm.
        stack.enter_context(
            mock.patch.object(host_mha, "transfer_kv_direct", _transfer_kv_direct, create=True)
        )
        yield


def _dynamic_server_args(**kwargs: Any) -> ServerArgs:
    """The kit's ``ServerArgs`` for its file backend, turned to the dynamic one (kvoffload),
    the ``direct`` I/O backend and the ``layer_first`` host layout."""
    assert kwargs["hicache_storage_backend"] == "file", kwargs
    kwargs.update(
        hicache_storage_backend="dynamic",
        hicache_io_backend="direct",
        hicache_mem_layout="layer_first",
    )
    return ServerArgs(**kwargs)


class Kit(UnifiedRadixCacheStorageFixtures, unittest.TestCase):  # type: ignore[misc]  # SGLang is untyped
    """SGLang's kit bound to one kvoffload service (``extra``: the backend's extra config).

    A ``TestCase`` only for the kit's ``assert*``, ``fail`` and ``addCleanup``; call
    ``doCleanups`` when done (it stops the controllers' threads)."""

    __test__ = False  # a TestCase subclass: pytest would collect it
    cfg = CONFIG

    def __init__(self, extra: dict[str, Any]) -> None:
        super().__init__()
        self.extra = extra

    def _init_hicache(self, cache: Any, **kwargs: Any) -> None:
        """The kit's HiCache setup of ``cache`` (its ``storage_dir``, the file backend's
        directory, stays unused), on kvoffload through the dynamic backend; fails unless
        the controller's backend is ``KVOffloadStorage``."""
        kwargs["storage_extra"] = {**self.extra, **(kwargs.get("storage_extra") or {})}
        with mock.patch.object(kit_mixins, "ServerArgs", _dynamic_server_args):
            super()._init_hicache(cache, **kwargs)
        backend = cache.cache_controller.storage_backend
        assert type(backend).__name__ == "KVOffloadStorage", type(backend)
        # The kit only stops the storage threads; SGLang's detach also closes the backend
        # (its service connections). Runs first: cleanups run last-in, first-out.
        self.addCleanup(cache.cache_controller.detach_storage_backend)

    def _fill_full_kv(self, allocator: Any, indices: torch.Tensor, marker: int) -> None:
        pool = self._get_full_kv_pool(allocator)
        generator = torch.Generator().manual_seed(marker)
        for layer in range(pool.start_layer, pool.start_layer + pool.layer_num):
            for buffer in (pool.get_key_buffer(layer), pool.get_value_buffer(layer)):
                shape = (len(indices), *buffer.shape[1:])
                buffer[indices] = torch.randn(shape, generator=generator).to(buffer.dtype)

    def _snapshot_full_kv(
        self, allocator: Any, indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``indices``, ``[layer, token, head, dim]`` each."""
        pool = self._get_full_kv_pool(allocator)
        layers = range(pool.start_layer, pool.start_layer + pool.layer_num)
        k = torch.stack([pool.get_key_buffer(i)[indices].clone() for i in layers])
        v = torch.stack([pool.get_value_buffer(i)[indices].clone() for i in layers])
        return k, v


@dataclass
class Consumed:
    """What a fresh cache got for a prompt: tokens found in L3 and now on its host, the pages
    its backend loaded, and the K and V loaded back to its device (None without a hit)."""

    host_hit: int
    load_pages: int
    kv: tuple[torch.Tensor, torch.Tensor] | None


def produce(kit: Kit, storage_dir: Path, seq: list[int], marker: int) -> tuple[Any, Any]:
    """The kit's producer: ``seq`` inserted with random KV from ``marker``, written to L3;
    the producer's K and V."""
    expected: tuple[Any, Any] = kit._l3_produce(str(storage_dir), seq, marker=marker)
    return expected


def consume(kit: Kit, storage_dir: Path, seq: list[int], rid: str) -> Consumed:
    """The kit's consumer: a fresh cache prefetches ``seq`` from L3, then loads the hit back
    to its device."""
    cache, allocator, _ = kit._l3_consumer(str(storage_dir))
    kit._consume_prefetch(cache, seq, CacheRequestHandle(rid, 0))
    match = kit_fixtures.match_prefix(cache, seq)
    assert match.device_prefix_len == 0  # nothing of it was on this cache's device
    load_pages = int(cache.cache_controller.storage_backend.counters.get("load_pages", 0))
    if match.host_hit_length == 0:
        return Consumed(0, load_pages, None)
    kit._load_back_node(cache, match.last_host_node)
    on_device = kit_fixtures.match_prefix(cache, seq).last_device_node
    kv = kit._snapshot_full_kv(allocator, cache.path_device_indices(on_device))
    return Consumed(int(match.host_hit_length), load_pages, kv)


def consume_in_subprocess(extra_json: str, storage_dir: str, seq_json: str, out: str) -> None:
    """``consume`` in this (second) process, under the CPU patches; its result saved to
    ``out`` with ``torch.save``."""
    kit = Kit(json.loads(extra_json))
    try:
        with cpu_patches():
            got = consume(kit, Path(storage_dir), json.loads(seq_json), "second-process")
    finally:
        kit.doCleanups()
    torch.save({"host_hit": got.host_hit, "load_pages": got.load_pages, "kv": got.kv}, out)


class Service:
    """``kvoffload serve`` with SGLang's 8 KiB pages as blocks."""

    def __init__(self, work: Path) -> None:
        self.proc = ServerProcess(work, "--block-bytes", str(P.PAGE_BYTES)).start()
        self.extra = P.extra_config(f"unix://{self.proc.uds}")

    def counters(self) -> dict[str, int]:
        with KVOffloadAdminClient(self.proc.admin_url, token=TOKEN) as admin:
            got: dict[str, int] = admin.stats()["counters"]
            return got

    def clear(self) -> None:
        with KVOffloadAdminClient(self.proc.admin_url, token=TOKEN) as admin:
            admin.clear_cache()


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = Service(tmp_path_factory.mktemp("radix-l3"))
    try:
        yield svc
    finally:
        svc.proc.stop()


@pytest.fixture
def kit(service: Service) -> Iterator[Kit]:
    made = Kit(service.extra)
    try:
        with cpu_patches():
            yield made
    finally:
        made.doCleanups()


def _delta(after: dict[str, int], before: dict[str, int], name: str) -> int:
    return after[name] - before[name]


def _assert_same_kv(got: tuple[torch.Tensor, torch.Tensor] | None, expected: Any) -> None:
    assert got is not None
    for name, g, e in zip("KV", got, expected, strict=True):
        assert g.shape == (P.LAYERS, PAGES * P.PAGE, P.HEADS, P.HEAD_DIM), (name, g.shape)
        for layer in range(P.LAYERS):
            for token in range(PAGES * P.PAGE):
                assert torch.equal(g[layer, token], e[layer, token]), (name, layer, token)


def test_a_second_radix_cache_prefetches_the_first_ones_pages_through_kvoffload(
    service: Service, kit: Kit, tmp_path: Path
) -> None:
    seq = kit._make_seq(1000, PAGES)
    before = service.counters()
    expected = produce(kit, tmp_path, seq, marker=11)
    written = service.counters()
    assert _delta(written, before, "stores_completed") == PAGES
    got = consume(kit, tmp_path, seq, "second-cache")
    read = service.counters()
    assert got.host_hit == PAGES * P.PAGE
    assert got.load_pages == PAGES
    assert _delta(read, written, "lookup_hit") >= PAGES
    assert _delta(read, written, "loads") >= 1
    _assert_same_kv(got.kv, expected)
    assert list(tmp_path.iterdir()) == []  # nothing went to SGLang's file backend


@pytest.mark.parametrize("how", ["cleared", "other namespace"])
def test_without_the_pages_in_kvoffload_the_second_cache_gets_no_l3_hit(
    service: Service, kit: Kit, tmp_path: Path, how: str
) -> None:
    seq = kit._make_seq(2000 if how == "cleared" else 3000, PAGES)
    produce(kit, tmp_path, seq, marker=12)
    if how == "cleared":
        service.clear()
    else:
        kit.extra = {**kit.extra, "namespace": "another-model"}
    before = service.counters()
    got = consume(kit, tmp_path, seq, f"no-hit-{how}")
    after = service.counters()
    assert got.host_hit == 0
    assert got.load_pages == 0
    assert got.kv is None
    assert _delta(after, before, "lookup_hit") == 0
    assert _delta(after, before, "loads") == 0


def test_a_second_process_gets_the_first_ones_pages_through_kvoffload(
    service: Service, kit: Kit, tmp_path: Path
) -> None:
    seq = kit._make_seq(4000, PAGES)
    expected = produce(kit, tmp_path, seq, marker=13)
    out = tmp_path.parent / f"{tmp_path.name}-consumed.pt"
    code = (
        "import sys, warnings\n"
        "from testsupport import sglang_stubs as stubs\n"
        "stubs.install()\n"
        "with warnings.catch_warnings():\n"
        "    warnings.simplefilter('ignore')\n"
        "    from tests.sglang.test_radix_l3 import consume_in_subprocess\n"
        "consume_in_subprocess(*sys.argv[1:])\n"
    )
    args = [json.dumps(service.extra), str(tmp_path), json.dumps(seq), str(out)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    got = torch.load(out, weights_only=True)
    assert got["host_hit"] == PAGES * P.PAGE
    assert got["load_pages"] == PAGES
    _assert_same_kv(got["kv"], expected)
