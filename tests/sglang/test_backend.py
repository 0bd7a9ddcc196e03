"""kvoffload as SGLang's HiCache L3 backend, inside SGLang 0.5.23's own code (``make
test-sglang``).

SGLang's real device and host pools (``MHATokenToKVPool`` on the CPU, ``MHATokenToKVPoolHost``
in each layout it offers), its ``dynamic`` backend factory and its ``HiCacheController``
(backup thread, prefetch threads, a world-size-1 gloo group) against a real ``kvoffload
serve`` on 127.0.0.1 with a disk tier, restarted and killed by the tests.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from kvoffload_client.client import KVOffloadAdminClient, KVOffloadClient
from kvoffload_client.sglang.store import PageStore, StoreConfig

from testsupport import sglang_pools as P
from testsupport.polling import until
from testsupport.server import TOKEN, ServerProcess

POOL_BLOCKS = 16
ROOT = Path(__file__).resolve().parents[2]


class Service:
    """``kvoffload serve`` with 8 KiB blocks, a 16-block pool and a disk tier below it."""

    def __init__(self, work: Path, *more: str) -> None:
        self.work = work
        self.flags = [
            "--block-bytes", str(P.PAGE_BYTES),
            "--num-blocks", str(POOL_BLOCKS),
            "--disk-dir", str(work / "disk"),
            "--disk-bytes", str(8 << 20),
            "--disk-admit-after", "1",
            *more,
        ]  # fmt: skip
        self.proc = ServerProcess(work, *self.flags).start()

    @property
    def url(self) -> str:
        return f"unix://{self.proc.uds}"

    def stats(self) -> dict[str, Any]:
        with KVOffloadAdminClient(self.proc.admin_url, token=TOKEN) as admin:
            return admin.stats()

    def restart(self) -> None:
        assert self.proc.stop() == 0, self.proc.log()
        self.proc = ServerProcess(self.work, *self.flags).start()

    def clear(self) -> None:
        with KVOffloadAdminClient(self.proc.admin_url, token=TOKEN) as admin:
            admin.clear_cache()


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = Service(tmp_path_factory.mktemp("sglang"))
    try:
        yield svc
    finally:
        svc.proc.stop()


@pytest.mark.parametrize("v1", [True, False], ids=["v1", "legacy"])
@pytest.mark.parametrize("layout", P.LAYOUTS)
def test_pages_round_trip_in_every_host_layout(service: Service, layout: str, v1: bool) -> None:
    pools = P.make_pools(layout, seed=1)
    be = P.backend(pools, P.extra_config(service.url, v1=v1))
    keys = P.page_keys(P.tokens(seed=hash((layout, v1)) % 1000, pages=4))
    src = torch.arange(0, 4 * P.PAGE)
    dst = torch.arange(8 * P.PAGE, 12 * P.PAGE)
    assert be.batch_exists(keys) == 0
    if v1:
        assert be.batch_set_v1(keys, src) == [True] * 4
    else:
        values = [pools.host.get_data_page(int(src[i * P.PAGE])) for i in range(4)]
        assert be.batch_set(keys, values) is True
    assert be.batch_exists(keys) == 4
    assert be.batch_exists([*keys[:2], "f" * 64, keys[3]]) == 2
    assert P.page_bytes(pools.host, dst) != P.page_bytes(pools.host, src)
    if v1:
        assert be.batch_get_v1(keys, dst) == [True] * 4
    else:
        targets = [pools.host.get_dummy_flat_data_page() for _ in keys]
        got = be.batch_get(keys, targets)
        assert all(t is not None for t in got)
        for i, page in enumerate(targets):
            pools.host.set_from_flat_data_page(int(dst[i * P.PAGE]), page)
    assert P.page_bytes(pools.host, dst) == P.page_bytes(pools.host, src)
    counters = be.counters
    assert counters["store_pages"] == 4
    assert counters["load_pages"] == 4
    assert not [k for k in counters if k.startswith("faults_")]
    stats = be.get_stats()
    assert stats.backup_pgs == [4]
    assert stats.prefetch_pgs == [4]
    assert be.get_stats().backup_pgs == []  # drained: SGLang logs each call's figures once
    be.close()


def test_cache_controller_writes_back_and_prefetches(service: Service) -> None:
    pools = P.make_pools("page_first", seed=2)
    ctl = P.Controller(pools, P.extra_config(service.url))
    try:
        assert type(ctl.backend).__name__ == "KVOffloadStorage"
        ids = P.tokens(seed=20, pages=4)
        written = pools.host.alloc(4 * P.PAGE)
        assert ctl.write(written, ids) == 4 * P.PAGE
        done, loaded = ctl.prefetch("req-1", ids)
        assert done == 4 * P.PAGE
        assert loaded is not None
        assert P.page_bytes(pools.host, loaded) == P.page_bytes(pools.host, written)
        # A prompt that shares the first two pages only: two pages' hit.
        other = ids[: 2 * P.PAGE] + P.tokens(seed=21, pages=2)
        done, loaded = ctl.prefetch("req-2", other)
        assert done == 2 * P.PAGE
    finally:
        ctl.close()


def test_a_second_cache_gets_the_first_ones_pages(service: Service) -> None:
    first = P.make_pools("page_first", seed=3)
    ctl = P.Controller(first, P.extra_config(service.url))
    ids = P.tokens(seed=30, pages=3)
    written = first.host.alloc(3 * P.PAGE)
    try:
        assert ctl.write(written, ids) == 3 * P.PAGE
    finally:
        ctl.close()
    second = P.make_pools("page_first", seed=4)  # other bytes everywhere
    ctl = P.Controller(second, P.extra_config(service.url))
    try:
        done, loaded = ctl.prefetch("req-3", ids)
        assert done == 3 * P.PAGE
        assert loaded is not None
        assert P.page_bytes(second.host, loaded) == P.page_bytes(first.host, written)
    finally:
        ctl.close()


def test_tp_ranks_and_layouts_keep_their_own_pages(service: Service) -> None:
    keys = P.page_keys(P.tokens(seed=40, pages=2))
    src = torch.arange(0, 2 * P.PAGE)
    rank0 = P.backend(P.make_pools("page_first", seed=5), P.extra_config(service.url), 0, 2)
    rank1 = P.backend(P.make_pools("page_first", seed=6), P.extra_config(service.url), 1, 2)
    layer_first = P.backend(P.make_pools("layer_first", seed=7), P.extra_config(service.url))
    assert rank0.batch_set_v1(keys, src) == [True, True]
    assert rank1.batch_exists(keys) == 0
    assert layer_first.batch_exists(keys) == 0
    assert rank1.batch_set_v1(keys, src) == [True, True]
    dst = torch.arange(4 * P.PAGE, 6 * P.PAGE)
    for be in (rank0, rank1):
        assert be.batch_get_v1(keys, dst) == [True, True]
        assert P.page_bytes(be.mem_pool_host, dst) == P.page_bytes(be.mem_pool_host, src)
    for be in (rank0, rank1, layer_first):
        be.close()


def _vllm_keys() -> ModuleType:
    """The vLLM tier's key module, loaded from its file: it imports only the standard library,
    but its package imports vLLM, which this environment does not have."""
    path = ROOT / "client" / "kvoffload_client" / "vllm" / "keys.py"
    spec = importlib.util.spec_from_file_location("vllm_tier_keys", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_vllm_engine_and_an_sglang_engine_on_one_service_never_share_keys(
    service: Service,
) -> None:
    """The same 32 hash bytes under vLLM's key scheme and SGLang's are two blocks."""
    vkeys = _vllm_keys()
    model = SimpleNamespace(name=P.MODEL, dtype="float16")
    par = SimpleNamespace(world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1)
    spec_config = SimpleNamespace(
        model=model,
        parallel=par,
        worker_kv_bytes_per_block=P.PAGE_BYTES,
        cache=SimpleNamespace(blocks_per_chunk=1, tokens_per_hash=P.PAGE),
        groups=[SimpleNamespace(group_id=0, tokens_per_block=P.PAGE)],
        replicated_layout=False,
        canonical_layout=True,
        kv_cache_layout="NHD",
    )
    keys = P.page_keys(P.tokens(seed=50, pages=1))
    vllm_key = vkeys.service_key(vkeys.namespace_digest(None, spec_config, P.PAGE_BYTES),
                                 bytes.fromhex(keys[0]))  # fmt: skip
    pools = P.make_pools("page_first", seed=8)
    be = P.backend(pools, P.extra_config(service.url))
    # vLLM's block: its own bytes in a pool slot, through the same engine API.
    with KVOffloadClient(uds=str(service.proc.uds)) as client:
        client.start_request("vllm-1")
        stored = client.prepare_store("vllm-1", [vllm_key])
        client.complete_store("vllm-1", stored.keys_to_store, success=True)
        client.finish_request("vllm-1")
        client.start_request("vllm-2")
        assert client.lookup("vllm-2", [vllm_key]).results == ["hit"]
    assert be.batch_exists(keys) == 0
    src = torch.arange(0, P.PAGE)
    assert be.batch_set_v1(keys, src) == [True]
    dst = torch.arange(P.PAGE, 2 * P.PAGE)
    assert be.batch_get_v1(keys, dst) == [True]
    assert P.page_bytes(pools.host, dst) == P.page_bytes(pools.host, src)
    with KVOffloadClient(uds=str(service.proc.uds)) as client:
        client.start_request("vllm-3")
        assert client.lookup("vllm-3", [vllm_key]).results == ["hit"]
    be.close()


def test_pages_survive_a_restart_of_kvoffload_with_a_disk_tier(service: Service) -> None:
    pools = P.make_pools("page_first", seed=9)
    be = P.backend(pools, P.extra_config(service.url))
    kept = P.page_keys(P.tokens(seed=60, pages=4))
    src = torch.arange(0, 4 * P.PAGE)
    assert be.batch_set_v1(kept, src) == [True] * 4
    assert be.batch_exists(kept) == 4  # asked for twice: the disk's admission lets them in
    # Two pool-fuls of other pages push them out of the 16-block pool, onto the disk.
    for seed in (61, 62):
        more = P.page_keys(P.tokens(seed=seed, pages=POOL_BLOCKS))
        assert be.batch_set_v1(more, torch.arange(0, POOL_BLOCKS * P.PAGE)) == [True] * 16

    def on_disk() -> bool | None:
        disk = service.stats()["tiers"]["disk"]
        return True if disk["demotions"]["written"] >= 4 else None

    until("the first pages written to disk", on_disk, within_s=30)
    service.restart()
    # The backend maps the new service's pool by itself (its first answers name a new pool).
    dst = torch.arange(20 * P.PAGE, 24 * P.PAGE)
    until("the restarted service answers", lambda: be.batch_exists(kept) == 4 or None, 10)
    assert be.batch_get_v1(kept, dst) == [True] * 4
    assert P.page_bytes(pools.host, dst) == P.page_bytes(pools.host, src)
    be.close()


def test_a_killed_kvoffload_is_misses_with_correct_bytes_then_recovers(service: Service) -> None:
    pools = P.make_pools("layer_first", seed=10)
    be = P.backend(pools, P.extra_config(service.url))
    keys = P.page_keys(P.tokens(seed=70, pages=2))
    src = torch.arange(0, 2 * P.PAGE)
    dst = torch.arange(6 * P.PAGE, 8 * P.PAGE)
    assert be.batch_set_v1(keys, src) == [True, True]
    before = P.page_bytes(pools.host, dst)
    service.proc.kill()
    try:
        assert be.batch_exists(keys) == 0
        assert be.batch_get_v1(keys, dst) == [False, False]
        assert be.batch_set_v1(keys, src) == [False, False]
        assert be.get(keys[0], pools.host.get_dummy_flat_data_page()) is None
        assert P.page_bytes(pools.host, dst) == before  # nothing half-loaded
        faults = {k: v for k, v in be.counters.items() if k.startswith("faults_")}
        assert faults.get("faults_unreachable", 0) >= 1, be.counters
    finally:
        service.proc = ServerProcess(service.work, *service.flags).start()
    # A new service, an empty pool (the killed one's pool pages were never demoted).
    again = P.page_keys(P.tokens(seed=71, pages=2))
    until("writes again", lambda: be.batch_set_v1(again, src) == [True, True] or None, 10)
    assert be.batch_get_v1(again, dst) == [True, True]
    assert P.page_bytes(pools.host, dst) == P.page_bytes(pools.host, src)
    be.close()


def test_a_block_size_that_is_not_the_page_is_refused_at_registration(tmp_path: Path) -> None:
    with ServerProcess(tmp_path).serving() as wrong:  # --block-bytes 4096
        pools = P.make_pools("page_first")
        with pytest.raises(ValueError, match=f"--block-bytes {P.PAGE_BYTES}"):
            P.backend(pools, P.extra_config(f"unix://{wrong.uds}"))


def test_credentials_are_checked_at_registration(tmp_path: Path) -> None:
    pools = P.make_pools("page_first")
    missing = str(tmp_path / "no-such-token")
    with pytest.raises(ValueError, match="'token_file'"):
        P.backend(pools, P.extra_config("unix:///nowhere.sock", token_file=missing))
    tenants = tmp_path / "tenants"
    tenants.mkdir(mode=0o700)
    (tenants / "team.toml").write_text('tokens = ["sglang-token-0123456789abcdef"]\n'
                                        "namespaces = { ns-s = 16 }\n")  # fmt: skip
    (tenants / "team.toml").chmod(0o600)
    with ServerProcess(
        tmp_path, "--block-bytes", str(P.PAGE_BYTES), "--tenants", str(tenants)
    ).serving() as svc:
        url = f"unix://{svc.uds}"
        with pytest.raises(ValueError, match="'token_file'"):
            P.backend(pools, P.extra_config(url))  # no token: refused, naming the setting
        token = tmp_path / "token"
        token.write_text("sglang-token-0123456789abcdef\n")
        token.chmod(0o600)
        be = P.backend(pools, P.extra_config(url, token_file=str(token), service_namespace="ns-s"))
        keys = P.page_keys(P.tokens(seed=80, pages=1))
        assert be.batch_set_v1(keys, torch.arange(0, P.PAGE)) == [True]
        assert be.batch_exists(keys) == 1
        be.close()


def test_a_hybrid_model_s_other_host_pool_is_refused_at_registration(tmp_path: Path) -> None:
    # SGLang's hybrid cache registers its group's pools through v2 after the KV pool: the KV
    # pool (the anchor) again, then e.g. a Mamba state pool, whose pages kvoffload cannot keep.
    pools, other = P.make_pools("page_first"), P.make_pools("layer_first")
    be = P.backend(pools, P.extra_config(f"unix://{tmp_path}/none.sock"))
    be.register_mem_host_pool_v2(pools.host, "full")  # the KV pool itself: kept
    with pytest.raises(ValueError, match=r"host pool 'mamba' \(MHATokenToKVPoolHost"):
        be.register_mem_host_pool_v2(other.host, "mamba")
    assert list(be.registered_pools) == ["full"]
    be.close()


def test_an_unreachable_service_at_registration_is_not_an_error(tmp_path: Path) -> None:
    pools = P.make_pools("page_first")
    be = P.backend(pools, P.extra_config(f"unix://{tmp_path}/none.sock"))
    keys = P.page_keys(P.tokens(seed=90, pages=1))
    assert be.batch_exists(keys) == 0
    assert be.batch_set_v1(keys, torch.arange(0, P.PAGE)) == [False]
    assert be.counters["faults_unreachable"] >= 1
    be.close()


def test_a_store_or_a_load_checks_its_pages_and_counts_what_it_could_not_serve(
    tmp_path: Path,
) -> None:
    store = PageStore(StoreConfig(url=f"unix://{tmp_path}/none.sock"), P.PAGE_BYTES)
    for call in (store.store, store.load):
        with pytest.raises(ValueError, match="2 keys for 1 pages"):
            call([b"a", b"b"], [[]])
        assert call([], []) == []
    assert store.stats() == {}  # no keys: nothing asked of the service, nothing counted
    store.disabled = "disabled by the test"
    assert store.store([b"a", b"b"], [[], []]) == [False, False]
    assert store.load([b"a"], [[]]) == [False]
    assert store.stats() == {"skipped_disabled": 2, "store_skipped": 2, "load_missed": 1}
    store.close()


def test_importing_the_package_imports_no_sglang() -> None:
    code = (
        "import sys, kvoffload_client.sglang, kvoffload_client.sglang.store; "
        "assert 'sglang' not in sys.modules and 'torch' not in sys.modules, 'imported'"
    )
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
