"""A vLLM engine's offloading scheduler side, driven the way vLLM 0.33's scheduler drives it.

``SimEngine`` builds vLLM's ``TieringOffloadingManager`` through vLLM's own spec factory from a
``kv_connector_extra_config`` (the dict of ``--kv-transfer-config``'s
``kv_connector_extra_config``) and plays the scheduler's calls: per-key lookups in the pattern
of ``_maximal_prefix_lookup`` (RETRY keeps scanning, MISS stops), ``prepare_store`` /
``complete_store`` of computed chunks, ``prepare_load`` / ``complete_load`` of hits, and
``on_schedule_end`` at the end of every step, all under the manager's lock. The GPU side is
the primary tier's memory itself: a "computed" chunk is written straight into its primary
slot, a "loaded" chunk is read from it.

Shared by ``tests/vllm`` and ``bench/vllm_tier.py``. ``step_tier_ns`` is the time spent inside
the secondary tiers' methods (kvoffload's, or vLLM's own such as ``fs``) on the calling
(scheduler) thread in each step, ``step_calls`` the kvoffload tiers' batch calls made so far at
the end of each step.

Imports vLLM at module level: only the vLLM suites and benchmarks (``tests/vllm``,
``bench/vllm_tier.py``, ``bench/disk_tier.py``'s vLLM arm), in a venv with vLLM, import it.
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvoffload_client.vllm import M_CALLS
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

CALLS = (M_CALLS, "batch")
BYTES_PER_BLOCK = 4096  # one GPU block of the simulated model: the chunk row stride
TIER_METHODS = (
    "lookup",
    "submit_store",
    "submit_load",
    "get_finished_jobs",
    "touch",
    "on_new_request",
    "on_request_finished",
    "on_schedule_end",
    "has_pending_work",
    "take_events",
    "get_stats",
)


def kv_transfer_config(
    url: str, cpu_chunks: int, namespace: str | None = None, **tier: Any
) -> dict[str, Any]:
    """The ``--kv-transfer-config`` an engine is started with (docs/vllm.md's configuration)."""
    tier_config: dict[str, Any] = {
        "type": "KVOffloadTier",
        "module_path": "kvoffload_client.vllm",
        "url": url,
        **tier,
    }
    if namespace is not None:
        tier_config["namespace"] = namespace
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": cpu_chunks * BYTES_PER_BLOCK,
            "secondary_tiers": [tier_config],
        },
    }


ONE_GROUP = (OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),)
#: A hybrid model's two KV-cache groups (gpt-oss style): sliding-window layers in blocks of 16
#: tokens, full-attention layers in blocks of 32.
TWO_GROUPS = (
    OffloadingGroupConfig(
        tokens_per_block=16, layer_names=("l0",), group_id=0, sliding_window_size_in_chunks=4
    ),
    OffloadingGroupConfig(tokens_per_block=32, layer_names=("l1",), group_id=1),
)


def offloading_config(
    engine_id: str,
    extra_config: dict[str, Any],
    model: str = "sim/llama-tiny",
    groups: tuple[OffloadingGroupConfig, ...] = ONE_GROUP,
) -> OffloadingConfig:
    """What vLLM's ``build_offloading_config`` makes for a TP=1 model whose blocks are
    ``BYTES_PER_BLOCK`` bytes, one group of 16 tokens per block unless ``groups`` says else."""
    return OffloadingConfig(
        groups=groups,
        worker_kv_bytes_per_block=BYTES_PER_BLOCK,
        enable_kv_cache_events=True,
        extra_config=extra_config,
        engine_id=engine_id,
        model=OffloadingModelConfig(name=model, dtype="float16", max_model_len=65536),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
        kv_cache_layout="NHD",
    )


def chunk_bytes(key: bytes, model: str = "") -> bytes:
    """The KV bytes a model computes for a chunk: a function of the key (and the model)."""
    seed = hashlib.sha256(model.encode() + key).digest()
    return (seed * (BYTES_PER_BLOCK // len(seed) + 1))[:BYTES_PER_BLOCK]


def keys_of(hash_ids: Sequence[int], salt: bytes = b"", group: int = 0) -> list[OffloadKey]:
    """vLLM offload keys (32-byte block hash + group id) of a prefix of hash ids."""
    return [
        make_offload_key(hashlib.sha256(salt + h.to_bytes(8, "big")).digest(), group)
        for h in hash_ids
    ]


@dataclass
class RequestOutcome:
    """What one request got: chunks from the offload tiers, chunks computed, steps waited."""

    req_id: str
    hit_chunks: int
    computed_chunks: int
    steps: int
    loaded: dict[bytes, bytes] = field(default_factory=dict)


class SimEngine:
    """One engine's scheduler-side offloading (see the module docstring)."""

    def __init__(
        self,
        engine_id: str,
        config: dict[str, Any],
        model: str = "sim/llama-tiny",
        groups: tuple[OffloadingGroupConfig, ...] = ONE_GROUP,
    ) -> None:
        extra = config["kv_connector_extra_config"]
        self.model = model
        self.spec = OffloadingSpecFactory.create_spec(
            offloading_config(engine_id, extra, model, groups)
        )
        self.manager: Any = self.spec.get_manager()
        self.primary = memoryview(self.manager.primary_tier.get_kv_memoryview()).cast("B")
        self.tiers = list(self.manager.secondary_tiers)
        self.tier_time_ns = 0
        self.step_tier_ns: list[int] = []
        self.step_calls: list[int] = []  # the tiers' batch calls so far, at each step's end
        self._new_req_ids: list[str] = []
        for tier in self.tiers:
            self._time_methods(tier)

    def _time_methods(self, tier: Any) -> None:
        for name in TIER_METHODS:
            method = getattr(tier, name)
            setattr(tier, name, self._timed(method))

    def _timed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                out = method(*args, **kwargs)
                if hasattr(out, "__next__"):  # a generator's work happens when consumed
                    out = list(out)
                return out
            finally:
                self.tier_time_ns += time.perf_counter_ns() - start

        return wrapper

    # ------------------------------------------------------------------ scheduler calls

    def step(self) -> None:
        """End the scheduler step: ``on_schedule_end`` (the last manager call of a step)."""
        with self.manager.lock:
            self.manager.on_schedule_end(ScheduleEndContext(tuple(self._new_req_ids), ()))
        self._new_req_ids = []
        self.step_tier_ns.append(self.tier_time_ns)
        self.tier_time_ns = 0
        if self.tiers:  # kvoffload tiers' calls (vLLM's own tiers, e.g. ``fs``, count none)
            self.step_calls.append(
                sum(
                    t.counters.snapshot().get(CALLS, 0)
                    for t in self.tiers
                    if hasattr(t, "counters")
                )
            )

    def start(self, ctx: ReqContext) -> None:
        with self.manager.lock:
            self.manager.on_new_request(ctx)

    def finish(self, ctx: ReqContext) -> None:
        with self.manager.lock:
            self.manager.on_request_finished(ctx)

    def prefix_lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> int | None:
        """Leading chunks offloaded and ready, or None when a tier deferred (vLLM's pattern)."""
        hits, deferred = 0, False
        with self.manager.lock:
            for key in keys:
                result = self.manager.lookup(key, ctx)
                if result in (LookupResult.HIT, LookupResult.HIT_PENDING):
                    hits += 1
                    deferred |= result is LookupResult.HIT_PENDING
                elif result is LookupResult.RETRY:
                    deferred = True
                else:
                    break
        return None if deferred else hits

    def load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> dict[bytes, bytes]:
        """Load ready chunks "to the GPU": their bytes, read from their primary slots."""
        with self.manager.lock:
            spec = self.manager.prepare_load(keys, ctx)
            self.manager.touch(keys, ctx)
        data = {k: self.read_chunk(int(c)) for k, c in zip(keys, spec.block_ids, strict=True)}
        with self.manager.lock:
            self.manager.complete_load(keys, ctx)
        return data

    def store(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> int:
        """Offload computed chunks: prepare_store, write their bytes, complete_store. Returns
        how many were written (0 when the primary tier had no room)."""
        with self.manager.lock:
            out = self.manager.prepare_store(keys, ctx)
        if out is None or not out.keys_to_store:
            return 0
        ids = out.store_spec.block_ids
        for key, chunk in zip(out.keys_to_store, ids, strict=True):
            self.write_chunk(int(chunk), chunk_bytes(key, self.model))
        with self.manager.lock:
            self.manager.complete_store(out.keys_to_store, ctx)
        return len(out.keys_to_store)

    def read_chunk(self, chunk: int) -> bytes:
        return bytes(self.primary[chunk * BYTES_PER_BLOCK : (chunk + 1) * BYTES_PER_BLOCK])

    def write_chunk(self, chunk: int, data: bytes) -> None:
        self.primary[chunk * BYTES_PER_BLOCK : (chunk + 1) * BYTES_PER_BLOCK] = data

    # ------------------------------------------------------------------ whole requests

    def run_request(
        self,
        req_id: str,
        keys: Sequence[OffloadKey],
        kv_transfer_params: dict[str, Any] | None = None,
        max_steps: int = 2000,
        on_step: Callable[[], None] | None = None,
        step_s: float = 0.001,
    ) -> RequestOutcome:
        """One request from arrival to finish: look up until no tier defers (one step of
        ``step_s``, the model's forward pass, each time), load the hit prefix, compute and
        store the rest, finish."""
        ctx = ReqContext(req_id=req_id, kv_transfer_params=kv_transfer_params)
        self.start(ctx)
        self._new_req_ids.append(req_id)
        steps = 0
        while True:
            hits = self.prefix_lookup(keys, ctx)
            if hits is not None or steps >= max_steps:
                break
            self.step()
            steps += 1
            if on_step is not None:
                on_step()
            time.sleep(step_s)
        hits = hits or 0
        loaded = self.load(keys[:hits], ctx) if hits else {}
        self.store(keys[hits:], ctx)
        self.finish(ctx)
        self.step()
        return RequestOutcome(req_id, hits, len(keys) - hits, steps, loaded)

    def settle(self, max_steps: int = 2000, pause_s: float = 0.002) -> None:
        """Keep stepping while the manager has pending work (vLLM does the same)."""
        for _ in range(max_steps):
            with self.manager.lock:
                busy = self.manager.has_pending_work()
            if not busy:
                return
            self.step()
            time.sleep(pause_s)

    def close(self) -> None:
        self.primary.release()
        self.manager.shutdown()
