"""kvoffload's host pool as a vLLM CPU engine's only host tier: ``KVOffloadSpec``.

With ``kvoffload_client.vllm.cpu`` a block goes engine -> vLLM's host tier -> kvoffload's pool
and back the same way: two copies, and a hit waits for the promotion into vLLM's host tier
before vLLM's load. This spec makes kvoffload's pool vLLM's host tier itself: the scheduler's
``OffloadingManager`` is kvoffload's (``KVOffloadManager``: lookups, pins and reservations in
the service) and the worker (``PoolCopyWorker``) copies between the engine's KV cache and the
pool mapped into the engine (over the pool socket, as the tier maps it): one copy each way.
Name it in ``kv_connector_extra_config``::

    "spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload_client.vllm.direct",
    "url": "unix:///run/kvoffload/engine.sock", "namespace": "llama-3.1-8b"

Keys, the pool's block size (vLLM's chunk row stride) and a block's bytes are the tier's, so
engines on this spec and engines on the tier share blocks.

What vLLM's interface asks of a host tier, and how it is met:

- **A load cannot fail.** vLLM's worker asserts every transfer's success, and ``prepare_load``
  must return where the blocks are. So a key answers HIT only once it is *pinned* for the
  request: the step's lookups go out in one call at the step's end, and the keys the service
  answered ``hit`` are pinned (``prepare_load``) in a second call right after; the next step
  reads HIT with the slot in hand. A pinned slot keeps its bytes even if the service dies: the
  engine's mapping keeps the pool's memory, so a load already promised is still copied right.
  The pins of a request that waits are touched every ``lease_renew_s`` (30 s), so that the
  service's lease TTL never frees a slot vLLM was promised.
- **A store can be refused** (``prepare_store`` answers None): on a fault, a full pool or a
  refusal, vLLM skips the blocks, counted in ``stores_dropped_blocks``.
- **Calls are synchronous, on the scheduler thread**: the two lookup calls of a step with new
  lookups and one ``prepare_store`` call per request with blocks to store, each bounded by
  ``timeout_s`` (0.5 s). Completions, touches and finishes ride along with the next call. After
  a fault the service is not asked for ``retry_interval_s`` (doubling to 16 times): lookups
  answer MISS and stores are skipped, so a dead service costs the engine one timeout, not one a
  step.
- **A restarted service has a new pool**: answers carry its id (``X-KVOffload-Pool``), each
  spec names the pool its slots are in, and the worker maps a new pool when a spec names one
  (keeping the one before until the step's transfers are done). Requests are started again in
  the new service; completions meant for the old pool are dropped.

Not offered here (the tier has them): KV events through vLLM (the service publishes its own,
see the routers page) and the engine-side metrics beyond the tier's counters.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.utils.math_utils import round_up
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    LookupResult,
    OffloadingConfig,
    OffloadingEvent,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from kvoffload_client.attach import MappedPool, map_pool
from kvoffload_client.client import Batch, KVOffloadClient, OpResult
from kvoffload_client.vllm.cpu import HostCopyWorker, Rows
from kvoffload_client.vllm.direct_link import ServiceLink
from kvoffload_client.vllm.keys import namespace_digest, service_key
from kvoffload_client.vllm.state import (
    M_FAULTS,
    M_LOADS_FAILED,
    M_STORES_DROPPED,
    METRIC_DEFINITIONS,
    PENDING_WAIT_S,
    PREFETCH_DEADLINE_S,
    Counters,
    block_size_refusal,
    not_yet,
    sendable_params,
    service_client,
)

__all__ = ["KVOffloadManager", "KVOffloadSpec", "PoolCopyWorker", "PoolSlots"]

log = logging.getLogger("kvoffload.vllm_direct")

_HIT, _MISS, _RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY


class PoolSlots(BlockIDsLoadStoreSpec):  # type: ignore[misc,unused-ignore]
    """Slots of the kvoffload pool ``pool_id`` (``block_ids``: one slot a chunk)."""

    def __init__(self, block_ids: list[int], pool_id: str | None) -> None:
        super().__init__(block_ids)
        self.pool_id = pool_id

    @staticmethod
    def medium() -> str:
        return "CPU"


@dataclass(frozen=True)
class Settings:
    """The spec's keys in ``kv_connector_extra_config`` (every other key is refused)."""

    url: str = "unix:///run/kvoffload/engine.sock"
    namespace: str | None = None
    pool_socket: str | None = None
    token_file: str | None = None
    service_namespace: str | None = None
    timeout_s: float = 0.5
    connect_timeout_s: float = 0.5
    retry_interval_s: float = 0.5
    prefetch_deadline_s: float = PREFETCH_DEADLINE_S
    max_transfer_params_bytes: int = 16384
    max_keys_per_op: int = 8192
    max_ops_per_call: int = 1024
    lease_renew_s: float = 30.0

    #: vLLM's own keys of an offloading connector, read by vLLM, not by this spec.
    VLLM_KEYS = frozenset(
        ("spec_name", "spec_module_path", "offload_prompt_only", "self_describing_kv_events")
    )

    @classmethod
    def of(cls, extra: Mapping[str, Any]) -> Settings:
        """The settings in ``extra``; ``ValueError`` naming an unknown key or a bad value."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - known - cls.VLLM_KEYS)
        if unknown:
            raise ValueError(
                f"KVOffloadSpec: unknown key(s) {unknown} in kv_connector_extra_config; its keys "
                f"are {sorted(known)}"
            )
        values = {k: extra[k] for k in known if k in extra}
        settings = cls(**values)
        for name in ("timeout_s", "connect_timeout_s", "retry_interval_s", "lease_renew_s"):
            value = getattr(settings, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"KVOffloadSpec: {name} must be a number > 0, got {value!r}")
        for name in ("max_keys_per_op", "max_ops_per_call", "max_transfer_params_bytes"):
            value = getattr(settings, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVOffloadSpec: {name} must be an integer > 0, got {value!r}")
        deadline = settings.prefetch_deadline_s
        if not (isinstance(deadline, int | float) and math.isfinite(deadline) and deadline >= 0):
            raise ValueError(
                f"KVOffloadSpec: prefetch_deadline_s must be a number >= 0, got {deadline!r}"
            )
        return settings

    def client(self) -> tuple[KVOffloadClient, str | None]:
        """A client of the service and the pool socket's path."""
        return service_client(
            self.url,
            pool_socket=self.pool_socket,
            token_file=self.token_file,
            service_namespace=self.service_namespace,
            timeout_s=self.timeout_s,
            connect_timeout_s=self.connect_timeout_s,
        )


class KVOffloadSpec(OffloadingSpec):  # type: ignore[misc,unused-ignore]
    """kvoffload's pool as the engine's host tier (module docstring). The chunk row stride and
    its layout are vLLM's host region's (``CPUOffloadingSpec``): each worker's part of a chunk
    row is its tensors' pages, one after the other, at ``rank * page``."""

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.settings = Settings.of(self.extra_config)
        world = config.parallel.world_size
        self.cpu_page_size_per_worker = config.worker_kv_bytes_per_block * self.blocks_per_chunk
        self.kv_bytes_per_chunk = round_up(
            self.cpu_page_size_per_worker * world, CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT
        )
        self._manager: KVOffloadManager | None = None
        self._worker: PoolCopyWorker | None = None

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        """The tier's counters (see ``kvoffload_client.vllm``)."""
        return dict(METRIC_DEFINITIONS)

    def get_manager(self) -> KVOffloadManager:
        if self._manager is None:
            self._manager = KVOffloadManager(self)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> PoolCopyWorker:
        if self._worker is None:
            self._worker = PoolCopyWorker(self, kv_caches)
        return self._worker


# --------------------------------------------------------------------------- worker side


class PoolCopyWorker(HostCopyWorker):
    """``HostCopyWorker`` whose host side is the kvoffload pool mapped into this process.

    A spec naming a pool other than the mapped one (the service restarted) maps the current
    pool; the pool before stays mapped until ``get_finished`` (the end of the step's
    transfers), so a load the scheduler pinned in it before the restart is still copied from
    its bytes. A spec naming a pool that is neither raises: that slot is not addressable.
    """

    def __init__(self, spec: KVOffloadSpec, kv_caches: CanonicalKVCaches) -> None:
        super().__init__(kv_caches, spec.blocks_per_chunk, None)
        self._settings = spec.settings
        self._stride = spec.kv_bytes_per_chunk
        self._offset = spec.config.parallel.rank * spec.cpu_page_size_per_worker
        self._client, self._pool_socket = spec.settings.client()
        self._pools: dict[str, tuple[MappedPool, list[Rows]]] = {}
        self._current: str | None = None
        self._map()  # at start: a wrong block size refuses the engine

    def _map(self) -> None:
        pool = map_pool(
            self._client,
            self._pool_socket,
            timeout_s=5.0,
            token=self._client.current_token(),
            namespace=self._settings.service_namespace,
        )
        if pool.block_bytes != self._stride:
            raise ValueError(block_size_refusal(pool.block_bytes, self._stride))
        base = int(pool.blocks.ctypes.data) + self._offset
        self._pools[pool.pool_id] = (pool, self.host_rows(base, self._stride, pool.num_blocks))
        self._current = pool.pool_id

    def host_for(self, host_spec: BlockIDsLoadStoreSpec) -> list[Rows]:
        pool_id = getattr(host_spec, "pool_id", None)
        if pool_id is None or pool_id == self._current:
            return self._pools[self._current][1] if self._current else []
        if pool_id not in self._pools:
            self._map()
        try:
            return self._pools[pool_id][1]
        except KeyError:
            raise RuntimeError(
                f"kvoffload pool {pool_id} is not mapped (the service restarted twice within a "
                "step?)"
            ) from None

    def get_finished(self) -> list[TransferResult]:
        # The step's transfers are copied: pools before the current one are let go.
        for pool_id in [p for p in self._pools if p != self._current]:
            del self._pools[pool_id]
        return super().get_finished()

    def shutdown(self) -> None:
        self._pools.clear()
        self._client.close()
        super().shutdown()


# --------------------------------------------------------------------------- scheduler side


@dataclass
class Verdict:
    """One key's lookup for one request: ``hit`` None while asked, then True (pinned at
    ``slot``) or False (miss); ``asked_since``: when a not-yet answer was first read."""

    hit: bool | None = None
    slot: int = -1
    asked_since: float = 0.0


@dataclass
class Request:
    """What the manager keeps of a live request."""

    params: Mapping[str, Any] | None
    verdicts: dict[OffloadKey, Verdict] = field(default_factory=dict)
    asking: list[OffloadKey] = field(default_factory=list)  # not sent yet
    waiting: list[OffloadKey] = field(default_factory=list)  # asked again at the next call
    pool_id: str | None = None  # where its pins are
    stores_pool: str | None = None  # where its last reservation was made
    renewed: float = 0.0  # when the service last heard of its pins
    prefetched: bool = False

    def pinned(self) -> list[OffloadKey]:
        """The keys the service has pinned for the request (its HIT verdicts), in order."""
        return [k for k, v in self.verdicts.items() if v.hit]


class KVOffloadManager(OffloadingManager):  # type: ignore[misc,unused-ignore]
    """vLLM's ``OffloadingManager`` over a kvoffload service (module docstring). Called from
    the scheduler thread only."""

    def __init__(self, spec: KVOffloadSpec) -> None:
        settings = spec.settings
        self._settings = settings
        self._prefix = namespace_digest(settings.namespace, spec.config, spec.kv_bytes_per_chunk)
        self.counters = Counters()
        self._requests: dict[str, Request] = {}
        self._lookups: dict[str, list[OffloadKey]] = {}  # the keys of the call in flight
        client, _ = settings.client()
        self._link = ServiceLink(
            client,
            settings.max_ops_per_call,
            settings.retry_interval_s,
            self.counters,
            self._forget_pins,
        )
        stride = spec.kv_bytes_per_chunk
        block_bytes = self._link.block_bytes()  # None: not answering now (a fault, not a no)
        if block_bytes is not None and block_bytes != stride:
            self._link.client.close()
            raise ValueError(block_size_refusal(block_bytes, stride))

    # ------------------------------------------------------------------ vLLM's interface

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """RETRY until the step's calls answered; HIT only for a key pinned for the request."""
        req = self._request(req_context)
        verdict = req.verdicts.get(key)
        if verdict is None:
            # Past one op's keys: beyond what one lookup asks (a prompt of millions of tokens).
            if self._link.down() or len(req.verdicts) >= self._settings.max_keys_per_op:
                return _MISS
            req.verdicts[key] = Verdict()
            req.asking.append(key)
            return _RETRY
        if verdict.hit is None:
            return _RETRY
        return _HIT if verdict.hit else _MISS

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PoolSlots:
        """The slots the lookups pinned; the request's other pins are given back (vLLM loads
        the prefix it wants in one job)."""
        req = self._requests[req_context.req_id]
        wanted = set(keys)
        slots = []
        for key in keys:
            verdict = req.verdicts.get(key)
            if verdict is None or not verdict.hit:
                raise RuntimeError(f"KVOffloadManager: prepare_load of a key not pinned: {key!r}")
            slots.append(verdict.slot)
        spare = [k for k, v in req.verdicts.items() if v.hit and k not in wanted]
        self._unpin(req_context.req_id, req, spare)
        return PoolSlots(slots, req.pool_id)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        req = self._requests.get(req_context.req_id)
        if req is not None:
            self._unpin(req_context.req_id, req, list(keys))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        if keys and self._link.pool_id is not None:
            self._start(req_context.req_id)
            self._link.later(Batch().touch(req_context.req_id, self._skeys(keys)).ops[0])

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """Reserve slots in the service now (one call); None, counted, when it cannot."""
        keys = list(keys)
        req_id = req_context.req_id
        self._request(req_context)
        if self._link.down() or len(keys) > self._settings.max_keys_per_op:
            self.counters.add(M_STORES_DROPPED, "", len(keys))
            return None
        skeys = self._skeys(keys)
        self._start(req_id)
        results = self._link.call(Batch().prepare_store(req_id, skeys).ops)
        res = None if results is None else results[-1]
        if res is None or not res.ok or res.result is None:
            if res is not None:
                reason = "no_space" if res.status == 507 else f"store_{res.status}"
                self.counters.add(M_FAULTS, reason)
            self.counters.add(M_STORES_DROPPED, "", len(keys))
            return None
        self._requests[req_id].stores_pool = self._link.pool_id
        key_of = dict(zip(skeys, keys, strict=True))
        to_store = [key_of[bytes.fromhex(k)] for k in res.result["keys_to_store"]]
        slots = [int(s) for s in res.result["slots"]]
        return PrepareStoreOutput(
            keys_to_store=to_store,
            store_spec=PoolSlots(slots, self._link.pool_id),
            evicted_keys=[],
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """Sent with the next call; dropped when the reservation was made in a pool the service
        has since replaced (restarted: the reservation went with it)."""
        req = self._requests.get(req_context.req_id)
        if req is not None and req.stores_pool not in (None, self._link.pool_id):
            return
        if keys:
            op = Batch().complete_store(req_context.req_id, self._skeys(keys), success).ops[0]
            self._link.later(op)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._request(req_context)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Pins vLLM did not load are given back, then the request is finished (a store still
        copying stays reserved until its ``complete_store``)."""
        req_id = req_context.req_id
        req = self._requests.pop(req_id, None)
        if req is not None:
            self._unpin(req_id, req, req.pinned())
        self._link.finish(req_id)

    def take_events(self) -> Iterable[OffloadingEvent]:
        return ()

    def on_schedule_end(self, context: Any) -> None:
        """The step's lookups, then the pins of what they hit (module docstring); or the
        queued completions alone."""
        self._renew()
        asking = {r: q for r, q in self._requests.items() if q.asking or q.waiting}
        if not asking:
            if self._link.pending():
                self._link.call([])
            return
        ops: list[dict[str, Any]] = []
        for req_id, req in asking.items():
            keys = req.waiting + req.asking
            req.waiting, req.asking = [], []
            deadline = None
            if not req.prefetched and self._settings.prefetch_deadline_s > 0:
                deadline = self._settings.prefetch_deadline_s
                req.prefetched = True
            self._start(req_id)
            batch = Batch().lookup(req_id, self._skeys(keys), prefetch_deadline_s=deadline)
            ops.append(batch.ops[0])
            self._lookups[req_id] = keys
        results: Sequence[OpResult | None] = self._link.call(ops) or [None] * len(ops)
        hits: dict[str, list[OffloadKey]] = {}
        for req_id, res in zip(list(self._lookups), results, strict=True):
            self._read_lookup(req_id, res, hits)
        self._lookups.clear()
        if hits:
            self._pin(hits)

    def _renew(self) -> None:
        """Touch the pins of requests that wait (vLLM answered HIT, has not loaded yet) every
        ``lease_renew_s``: the service frees the pins of a request silent past its lease TTL
        (``--lease-ttl-s``, 300 s by default), and a slot given back may hold another block by
        the time vLLM loads from it."""
        now = time.monotonic()
        for req_id, req in self._requests.items():
            if req.pool_id is None or now - req.renewed < self._settings.lease_renew_s:
                continue
            pinned = req.pinned()
            if pinned and req.pool_id == self._link.pool_id:
                self._link.later(Batch().touch(req_id, self._skeys(pinned)).ops[0])
                req.renewed = now

    def has_pending_work(self) -> bool:
        return self._link.pending() or any(r.asking or r.waiting for r in self._requests.values())

    def reset_cache(self) -> None:
        """vLLM's prefix-cache reset: this engine's verdicts and pins are dropped (pins given
        back); the service's cache is shared with other engines and is not cleared."""
        for req_id, req in self._requests.items():
            self._unpin(req_id, req, req.pinned())
            req.verdicts.clear()
            req.asking.clear()
            req.waiting.clear()

    def get_stats(self) -> OffloadingConnectorStats | None:
        return self.counters.stats(available=not self._link.down())

    def shutdown(self) -> None:
        """Abort every request this engine opened (one last call), close the connection."""
        self._requests.clear()
        self._link.close()

    # ------------------------------------------------------------------ internals

    def _request(self, ctx: ReqContext) -> Request:
        req = self._requests.get(ctx.req_id)
        if req is None:
            req = self._requests[ctx.req_id] = Request(
                sendable_params(
                    ctx.kv_transfer_params, self._settings.max_transfer_params_bytes, self.counters
                )
            )
        return req

    def _skeys(self, keys: Iterable[OffloadKey]) -> list[bytes]:
        prefix = self._prefix
        return [service_key(prefix, bytes(k)) for k in keys]

    def _start(self, req_id: str) -> None:
        req = self._requests.get(req_id)
        self._link.start(req_id, req.params if req is not None else None)

    def _unpin(self, req_id: str, req: Request, keys: list[OffloadKey]) -> None:
        pinned = [k for k in keys if (v := req.verdicts.get(k)) is not None and v.hit]
        for key in pinned:
            del req.verdicts[key]  # asked again if looked up again
        if pinned and req.pool_id == self._link.pool_id:
            self._link.later(Batch().complete_load(req_id, self._skeys(pinned)).ops[0])

    def _read_lookup(
        self, req_id: str, res: OpResult | None, hits: dict[str, list[OffloadKey]]
    ) -> None:
        """Read one request's lookup answer. Only the run of hits vLLM will load is pinned:
        keys come in vLLM's scan order (a prefix from its start; a sliding window from its
        end), so a miss ends the run (what follows is never loaded: MISS), and a key not ready
        yet (being stored, or coming up from a tier below) holds the hits after it back, all
        asked again at the next call, for up to ``PENDING_WAIT_S``."""
        req = self._requests.get(req_id)
        keys = self._lookups.get(req_id, [])
        if req is None:
            return
        answers = None if res is None or not res.ok or res.result is None else res.result
        if answers is None and res is not None:
            self.counters.add(M_FAULTS, f"lookup_{res.status}")
        now = time.monotonic()
        ended = held = False
        for i, key in enumerate(keys):
            verdict = req.verdicts.get(key)
            if verdict is None:
                continue
            state = None if answers is None else answers["results"][i]
            if ended or not (state == "hit" or not_yet(state)):
                verdict.hit, ended = False, True
            elif state == "hit" and not held:
                hits.setdefault(req_id, []).append(key)
            elif now - (verdict.asked_since or now) < PENDING_WAIT_S:
                verdict.asked_since = verdict.asked_since or now
                req.waiting.append(key)
                held = True
            else:
                verdict.hit, ended = False, True

    def _pin(self, hits: dict[str, list[OffloadKey]]) -> None:
        """Pin what the lookups hit, one ``prepare_load`` a request; a refusal (another
        engine's store evicted a key between the two calls) asks the keys again."""
        ops = [Batch().prepare_load(r, self._skeys(keys)).ops[0] for r, keys in hits.items()]
        results: Sequence[OpResult | None] = self._link.call(ops) or [None] * len(ops)
        for req_id, res in zip(list(hits), results, strict=True):
            req = self._requests.get(req_id)
            keys = hits[req_id]
            if req is None:
                continue
            if res is not None and res.ok and res.result is not None:
                req.pool_id = self._link.pool_id
                req.renewed = time.monotonic()
                for key, slot in zip(keys, res.result["slots"], strict=True):
                    verdict = req.verdicts.setdefault(key, Verdict())
                    verdict.hit, verdict.slot = True, int(slot)
                continue
            if res is not None:
                self.counters.add(M_FAULTS, f"pin_{res.status}")
            now = time.monotonic()
            for key in keys:
                asked = req.verdicts.get(key)
                if asked is None:
                    continue
                if (
                    res is not None
                    and res.status == 409
                    and now - (asked.asked_since or now) < PENDING_WAIT_S
                ):
                    asked.asked_since = asked.asked_since or now
                    req.waiting.append(key)
                else:
                    asked.hit = False
                    self.counters.add(M_LOADS_FAILED)

    def _forget_pins(self) -> None:
        """The service restarted: the old pool's pins went with it. A request vLLM has not
        loaded yet asks again (a load already promised is copied from the old pool's bytes,
        which the worker keeps mapped for the step)."""
        for req in self._requests.values():
            req.prefetched = False
            for key in req.pinned():
                del req.verdicts[key]
            req.pool_id = None
