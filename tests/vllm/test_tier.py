"""Engines sharing blocks through kvoffload, driven through vLLM's TieringOffloadingManager.

Each engine is vLLM's own manager built by vLLM's spec factory from a kv-transfer config that
names ``kvoffload_client.vllm`` by ``module_path``, against a real ``kvoffload serve`` on a Unix
socket.
Bytes are compared: a chunk's bytes are a function of its key and the engine's model.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from kvoffload_client.client import KVOffloadClient
from kvoffload_client.vllm import M_CALLS, KVOffloadTier, map_pool, namespace_digest, service_key
from vllm.v1.kv_offload.base import ReqContext

from tests.vllm.conftest import leases, serve, tracked
from testsupport.server import ServerProcess
from testsupport.vllm_sim import (
    BYTES_PER_BLOCK,
    TWO_GROUPS,
    SimEngine,
    chunk_bytes,
    keys_of,
    kv_transfer_config,
)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    flags = ("--log-format", "json", "--log-level", "info")  # the call lines, as JSON
    with serve(tmp_path_factory.mktemp("tier"), *flags).serving() as s:
        yield s


def config(srv, **tier):
    return kv_transfer_config(f"unix://{srv.uds}", cpu_chunks=16, **tier)


def test_second_engine_loads_first_engines_prefix_and_restart_gets_it_back(srv):
    keys = keys_of(range(100, 112))
    a = SimEngine("t-share-a", config(srv))
    b = SimEngine("t-share-b", config(srv))
    try:
        first = a.run_request("share-a-1", keys)
        assert first.hit_chunks == 0
        a.settle()
        second = b.run_request("share-b-1", keys)
        assert second.hit_chunks == len(keys)
        assert second.loaded == {k: chunk_bytes(k, b.model) for k in keys}
        b.settle()
    finally:
        a.close()
        b.close()
    restarted = SimEngine("t-share-a", config(srv))  # engine A again: a fresh primary tier
    try:
        again = restarted.run_request("share-a-2", keys)
        assert again.hit_chunks == len(keys)
        assert again.loaded == {k: chunk_bytes(k, restarted.model) for k in keys}
        restarted.settle()
    finally:
        restarted.close()
    assert leases(srv) == []
    assert tracked(srv) == 0  # every request the tiers opened was finished


def test_namespaces_do_not_mix(srv):
    keys = keys_of(range(200, 206))
    llama = SimEngine("t-ns-llama", config(srv))
    other = SimEngine("t-ns-other", config(srv), model="sim/other-model")
    labelled = SimEngine("t-ns-label", config(srv, namespace="tenant-b"))
    try:
        llama.run_request("ns-1", keys)
        llama.settle()
        for engine in (other, labelled):
            outcome = engine.run_request(f"ns-{engine.model}-{id(engine)}", keys)
            assert outcome.hit_chunks == 0  # same block hashes, another namespace
            engine.settle()
        # The other model's bytes for the same keys are stored now; llama's stay its own.
        fresh = SimEngine("t-ns-llama-2", config(srv))
        try:
            back = fresh.run_request("ns-2", keys)
            assert back.hit_chunks == len(keys)
            assert back.loaded == {k: chunk_bytes(k, fresh.model) for k in keys}
            assert all(v != chunk_bytes(k, other.model) for k, v in back.loaded.items())
            fresh.settle()
        finally:
            fresh.close()
    finally:
        for engine in (llama, other, labelled):
            engine.close()
    assert leases(srv) == []


def test_a_hybrid_model_with_two_kv_cache_groups_shares_both_with_their_own_bytes(srv):
    """A hybrid model (sliding-window layers in blocks of 16 tokens, full attention in blocks of
    32): engine B loads what engine A stored for each group, every chunk byte-compared, the two
    groups' keys never confused; a one-group engine of the same model shares none of them (its
    key namespace differs: the groups are part of it)."""
    window = keys_of(range(300, 306), salt=b"hybrid", group=0)
    full = keys_of(range(300, 303), salt=b"hybrid", group=1)
    a = SimEngine("t-hybrid-a", config(srv), groups=TWO_GROUPS)
    b = SimEngine("t-hybrid-b", config(srv), groups=TWO_GROUPS)
    plain = SimEngine("t-hybrid-one-group", config(srv))
    try:
        assert a.tiers[0]._shared.prefix != plain.tiers[0]._shared.prefix
        for group, keys in ((0, window), (1, full)):
            first = a.run_request(f"hybrid-a-{group}", keys)
            assert first.hit_chunks == 0
            a.settle()
            second = b.run_request(f"hybrid-b-{group}", keys)
            assert second.hit_chunks == len(keys), f"group {group}"
            assert second.loaded == {k: chunk_bytes(k, b.model) for k in keys}, f"group {group}"
            b.settle()
        # The same block hash in the other group is another block: its bytes are its own.
        assert chunk_bytes(window[0], a.model) != chunk_bytes(keys_of([300], b"hybrid", 1)[0])
        # Both groups' keys in one request: each loads its own group's bytes.
        both = b.run_request("hybrid-b-both", [*window[:2], *full[:2]])
        assert both.hit_chunks == 4
        assert both.loaded == {k: chunk_bytes(k, b.model) for k in both.loaded}
        b.settle()
        alone = plain.run_request("hybrid-plain", window)
        assert alone.hit_chunks == 0, "a one-group engine shares no hybrid engine's blocks"
        plain.settle()
    finally:
        for engine in (a, b, plain):
            engine.close()
    assert leases(srv) == []


def test_pool_block_size_must_equal_chunk_stride(tmp_path: Path):
    with (
        serve(tmp_path, "--block-bytes", "8192").serving() as wrong,
        pytest.raises(ValueError, match=r"8192 bytes.*4096 bytes"),
    ):
        SimEngine("t-stride", kv_transfer_config(f"unix://{wrong.uds}", cpu_chunks=4))


def test_one_step_one_call(srv):
    """However many requests look up in a step, the tier makes one batch call for it."""
    engine = SimEngine("t-calls", config(srv))
    try:
        tier = engine.tiers[0]

        def calls() -> int:
            return int(tier.counters.values.get((M_CALLS, "batch"), 0))

        ctxs = [ReqContext(req_id=f"calls-{i}") for i in range(8)]
        prefixes = [keys_of(range(300 + 10 * i, 310 + 10 * i)) for i in range(8)]
        for ctx in ctxs:
            engine.start(ctx)
        before = calls()
        for ctx, keys in zip(ctxs, prefixes, strict=True):
            assert engine.prefix_lookup(keys, ctx) is None  # RETRY: asked in this step's call
        engine.step()
        for _ in range(500):
            if all(engine.prefix_lookup(k, c) == 0 for k, c in zip(prefixes, ctxs, strict=True)):
                break
            time.sleep(0.01)
        assert [engine.prefix_lookup(k, c) for k, c in zip(prefixes, ctxs, strict=True)] == [0] * 8
        assert calls() - before == 1
        for ctx in ctxs:
            engine.finish(ctx)
        engine.step()
    finally:
        engine.close()


def test_request_id_reaches_the_service_exemplars_and_log(srv):
    keys = keys_of(range(400, 404))
    engine = SimEngine("t-reqid", config(srv))
    try:
        engine.run_request("cmpl-trace-7f3a-0", keys, kv_transfer_params={"trace": "yes"})
        engine.settle()
    finally:
        engine.close()
    metrics = httpx.get(
        f"{srv.url}/metrics", headers={"accept": "application/openmetrics-text"}, timeout=10
    ).text
    assert 'req_id="cmpl-trace-7f3a-0"' in metrics
    lines = [json.loads(line) for line in srv.log().splitlines() if line.startswith("{")]
    steps = [ln for ln in lines if ln.get("route") == "/v1/batch"]
    assert any("cmpl-trace-7f3a-0" in ln.get("req_ids", ()) for ln in steps)


def test_kv_events_and_stats_reach_vllm(srv):
    """The service's stored events of this namespace come out of vLLM's ``take_events`` as
    kvoffload-owned events, and the tier's counters out of vLLM's ``get_stats``."""
    keys = keys_of(range(600, 604))
    engine = SimEngine("t-events", config(srv, events_interval_s=0.05))
    try:
        engine.run_request("events-1", keys)
        engine.settle()
        stored: set[bytes] = set()
        for _ in range(200):
            engine.step()
            with engine.manager.lock:
                for event in engine.manager.take_events():
                    if event.ownership == "kvoffload" and not event.removed:
                        stored.update(event.keys)
            if stored >= set(keys):
                break
            time.sleep(0.02)
        assert stored >= set(keys)
        with engine.manager.lock:
            stats = engine.manager.get_stats()
        reported = stats.data["data"]
        assert reported[M_CALLS][("batch",)] >= 1
        assert set(KVOffloadTier.build_metric_definitions({})) >= set(reported) & {
            name for name in reported if "kvoffload" in name
        }
    finally:
        engine.close()


def test_key_another_writer_is_storing_is_retried_then_hit(srv):
    """A key whose store is in flight in the service answers RETRY, then HIT once stored."""
    keys = keys_of(range(700, 703))
    reader = SimEngine("t-pending", config(srv))
    writer = KVOffloadClient(uds=str(srv.uds))
    try:
        prefix = namespace_digest(None, reader.spec.config, BYTES_PER_BLOCK)
        skeys = [service_key(prefix, k) for k in keys]
        writer.start_request("pending-writer")
        slots = writer.prepare_store("pending-writer", skeys).slots
        ctx = ReqContext(req_id="pending-reader")
        reader.start(ctx)
        assert reader.prefix_lookup(keys, ctx) is None
        reader.step()
        time.sleep(0.1)
        reader.step()
        assert reader.prefix_lookup(keys, ctx) is None  # still asked: the store is pending
        pool = map_pool(writer, None, timeout_s=5.0)
        for key, slot in zip(keys, slots, strict=True):
            pool.blocks[slot] = np.frombuffer(chunk_bytes(key, reader.model), dtype=np.uint8)
        writer.complete_store("pending-writer", skeys)
        writer.finish_request("pending-writer")
        hits = None
        for _ in range(300):
            reader.step()
            hits = reader.prefix_lookup(keys, ctx)
            if hits is not None:
                break
            time.sleep(0.005)
        assert hits == len(keys)
        assert reader.load(keys, ctx) == {k: chunk_bytes(k, reader.model) for k in keys}
        reader.finish(ctx)
        reader.step()
        reader.settle()
    finally:
        writer.close()
        reader.close()


def test_reset_cache_drains_jobs_in_flight(srv):
    """vLLM's ``reset_cache`` (sleep, weight update) drains the tier: every job it submitted is
    reported before the primary tier is reset, whatever state the job was in."""
    engine = SimEngine("t-reset", config(srv))
    try:
        for n in range(5):
            engine.run_request(f"reset-{n}", keys_of(range(800 + 10 * n, 806 + 10 * n)))
            with engine.manager.lock:
                engine.manager.reset_cache()  # raises if a job were left unreported
                engine.manager.on_reset_flushed()
        engine.settle()
    finally:
        engine.close()
    assert leases(srv) == []
