"""The link thread: one ``/v1/batch`` per bundle of scheduler steps (the protocol is
``kvoffload_client.vllm.protocol``), the mapped pool, faults and their back-off, and the KV
events of this namespace followed while vLLM's KV events are on."""

from __future__ import annotations

import collections
import logging
import queue
import time
from collections.abc import Sequence
from typing import Any

import httpx
from vllm.v1.kv_offload.base import Medium, OffloadingEvent, OffloadKey

from kvoffload_client.attach import MappedPool, map_pool
from kvoffload_client.client import (
    Batch,
    KVOffloadAuthError,
    KVOffloadClient,
    KVOffloadError,
    KVOffloadPermissionError,
)
from kvoffload_client.pool_socket import PoolShareError
from kvoffload_client.vllm.copier import Copier
from kvoffload_client.vllm.protocol import BatchProtocol, Pending
from kvoffload_client.vllm.state import (
    M_CALLS,
    M_FAULTS,
    M_PREFETCHES,
    M_STORES_DROPPED,
    OWNERSHIP,
    Done,
    ProbeRef,
    Shared,
    Step,
    block_size_refusal,
)

log = logging.getLogger("kvoffload.vllm_tier")


class Link(BatchProtocol):
    """The link thread: one ``/v1/batch`` per bundle of steps. It owns the mapped pool, which
    requests the service knows, and the ops carried to the next call."""

    def __init__(self, shared: Shared, copier: Copier) -> None:
        self.shared = shared
        self.copier = copier
        self.client = shared.client
        self.pool: MappedPool | None = None
        self.started: set[str] = set()
        self.params: dict[str, dict[str, Any] | None] = {}
        self.copying: collections.Counter[str] = collections.Counter()  # copies per request
        self.aborts: set[str] = set()  # outcome unknown: abort once none of its copies runs
        self.finishes: list[str] = []  # finishes not delivered yet
        # Keys answered "pending" (another engine's store in flight), asked again next call.
        self.reask: dict[str, list[ProbeRef]] = {}
        # Keys answered "disk" or "remote" (in a lower tier): a prepare-load asks the
        # service to bring them into the pool (its answer, 409, is expected); they are asked
        # again as pending. A prepare-load that pins (they were in already) is undone.
        self.promote: dict[str, list[bytes]] = {}
        self.unpin: dict[str, list[bytes]] = {}
        # The requests whose first lookup was sent (with ``prefetch_deadline_s`` > 0, it
        # asked the service to prefetch what lies below the pool).
        self.prefetched: set[str] = set()
        self.backoff = shared.retry_interval_s
        self.busy = False  # a call is being built or is in flight
        self.events = EventFollower(shared)

    def has_unsent(self) -> bool:
        """Work the engine should keep stepping for (while the service answers)."""
        if self.shared.incident.active:
            return False
        return (
            self.busy
            or not self.shared.inbox.empty()
            or bool(self.shared.done or self.finishes or self.aborts or self.reask or self.unpin)
        )

    def connect(self, refuse_mismatch: bool = False) -> bool:
        """Map the pool if not mapped; False when it cannot be. A pool whose block size is not
        vLLM's chunk row stride disables the tier for good (raises with ``refuse_mismatch``:
        at start, so the engine refuses to start with the reason)."""
        if self.pool is not None:
            return True
        shared = self.shared
        if shared.disabled is not None:
            return False
        try:
            pool = map_pool(
                self.client,
                shared.pool_socket,
                timeout_s=5.0,
                token=self.client.current_token(),
                namespace=shared.service_namespace,
            )
        except (KVOffloadAuthError, KVOffloadPermissionError) as exc:
            self.fault(*self.refusal(exc), refused=True)
            return False
        except PoolShareError as exc:
            if exc.reason is None:
                self.fault("unreachable", f"cannot map the pool ({exc})")
            else:
                self.fault("pool_refused", f"the pool socket refused: {exc.reason}", refused=True)
            return False
        except Exception as exc:  # whatever the way to the pool failed with: a fault
            self.fault("unreachable", f"cannot map the pool ({type(exc).__name__}: {exc})")
            return False
        finally:
            shared.counters.add(M_CALLS, "pool")
        stride = shared.block_size_bytes
        if pool.block_bytes != stride:
            message = block_size_refusal(pool.block_bytes, stride)
            if refuse_mismatch:
                raise ValueError(message)
            shared.disabled = message
            log.error("kvoffload tier disabled: %s", message)
            return False
        self.pool = pool
        return True

    def fault(self, reason: str, message: str, refused: bool = False) -> None:
        """Count a fault, log it once per incident (``refused``: the service refused the
        engine's credentials, an error), and back off (doubling, up to 16 times
        ``retry_interval_s``)."""
        shared = self.shared
        shared.counters.add(M_FAULTS, reason)
        shared.incident.fail(message, refused)
        shared.down_until = time.monotonic() + self.backoff
        self.backoff = min(self.backoff * 2, 16 * shared.retry_interval_s)

    def run(self) -> None:
        shared = self.shared
        stop = False
        while not stop:
            try:
                items: list[Step | None] = [shared.inbox.get(timeout=0.2)]
            except queue.Empty:
                items = [Step()]  # idle: deliver ended copies' completions and finishes
            self.busy = True
            while not shared.inbox.empty():
                items.append(shared.inbox.get_nowait())
            step = Step()
            for item in items:
                if item is None:
                    stop = True
                else:
                    step.merge(item)
            try:
                self.exchange(step, final=stop)
                self.events.poll(self.client)
            except Exception:
                log.exception("kvoffload tier: link step failed")
                self.fault("internal", "internal error in the tier's link thread")
            finally:
                self.busy = False

    def send(self, batch: Batch, pending: list[Pending]) -> None:
        shared = self.shared
        shared.counters.add(M_CALLS, "batch")
        try:
            results = self.client.batch(batch)
        except httpx.TimeoutException as exc:
            self.fail_batch(pending, "timeout", f"timed out ({type(exc).__name__})")
            return
        except (httpx.HTTPError, OSError) as exc:
            self.fail_batch(pending, "unreachable", f"unreachable ({type(exc).__name__}: {exc})")
            return
        except (KVOffloadAuthError, KVOffloadPermissionError) as exc:
            self.fail_batch(pending, *self.refusal(exc), refused=True)
            return
        except KVOffloadError as exc:
            reason = "http_5xx" if exc.status >= 500 else f"http_{exc.status}"
            self.fail_batch(pending, reason, f"answered {exc.status} {exc.code}")
            return
        except (ValueError, KeyError, TypeError) as exc:
            self.fail_batch(pending, "bad_answer", f"answered something unreadable ({exc})")
            return
        if len(results) != len(pending):
            self.fail_batch(pending, "bad_answer", "answered a batch of the wrong length")
            return
        pool = self.pool
        stale = pool is not None and not pool.still_current(self.client.last_pool_id)
        if stale:
            self.fault("restarted", "the service restarted with a new host pool")
            self.pool = None
            # The old service's requests are gone; the ones this call started are the new
            # service's (their lookups' answers stand, and keys it is bringing up from a tier
            # below are asked again under them).
            self.started = {
                p.req_id
                for res, p in zip(results, pending, strict=True)
                if p.kind == "start" and res.ok
            }
            shared.down_until = 0.0  # the new service answers: map its pool and go on
            self.connect()
        else:
            self.backoff = shared.retry_interval_s
            shared.incident.ok(shared.counters.values.get((M_STORES_DROPPED, ""), 0))
        for res, p in zip(results, pending, strict=True):
            self.on_result(res, p, stale)

    def release(self, req_id: str, load: bool, skeys: Sequence[bytes]) -> None:
        """Queue the completion that gives back what the service reserved (store: a failed
        complete-store; load: complete-load), without a copy."""
        if skeys and self.pool is not None:
            self.copying[req_id] += 1
            self.shared.done.append(
                Done(req_id, load, list(skeys), self.pool.pool_id, success=False)
            )

    def fail_step(self, step: Step) -> None:
        """The service cannot be asked now: lookups miss, jobs fail."""
        shared = self.shared
        for refs in step.lookups.values():
            for _, probe in refs:
                probe.result = False
        for t in (*step.stores, *step.loads):
            shared.finish_job(t.job, False)

    @staticmethod
    def refusal(exc: KVOffloadError) -> tuple[str, str]:
        """The fault reason and message of a 401 / 403 answer."""
        reason = "unauthenticated" if exc.status == 401 else "forbidden"
        return reason, f"the service refused this engine's credentials ({exc})"

    def fail_batch(
        self, pending: list[Pending], reason: str, message: str, refused: bool = False
    ) -> None:
        """A call failed with an unknown outcome: lookups miss, jobs fail, requests whose
        reservations may exist are aborted later, undelivered finishes are carried."""
        self.fault(reason, message, refused)
        shared = self.shared
        for p in pending:
            if p.kind == "lookup":
                for _, probe in p.probes:
                    probe.result = False
                if p.prefetching:
                    shared.counters.add(M_PREFETCHES, "failed")
            elif p.kind in ("store", "load", "promote", "complete", "abort"):
                if p.holder is not None and p.holder.transfer.job is not None:
                    shared.finish_job(p.holder.transfer.job, False)
                self.aborts.add(p.req_id)
                self.started.discard(p.req_id)
            elif p.kind == "finish":
                self.finishes.append(p.req_id)
            elif p.kind == "start":
                self.started.discard(p.req_id)
        if len(self.finishes) > 100_000:  # the service's lease TTL frees what was never said
            del self.finishes[:50_000]


class EventFollower:
    """The service's KV events of this namespace, as vLLM ``OffloadingEvent``s (ownership
    ``kvoffload``): polled by the link thread every ``events_interval_s`` while vLLM's KV events
    are on and the service answers."""

    def __init__(self, shared: Shared) -> None:
        self.shared = shared
        self.after = 0
        self.instance: str | None = None
        self.due = 0.0

    def poll(self, client: KVOffloadClient) -> None:
        shared = self.shared
        if not shared.events_enabled or shared.incident.active:
            return
        now = time.monotonic()
        if now < self.due:
            return
        self.due = now + shared.events_interval_s
        shared.counters.add(M_CALLS, "events")
        try:
            page = client.events(self.after, 1000)
        except (httpx.HTTPError, OSError, KVOffloadError, ValueError, KeyError):
            shared.counters.add(M_FAULTS, "events")
            return
        if self.instance is not None and page.instance != self.instance:
            self.after = 0  # a new service numbers its events from the start
        self.instance = page.instance
        if page.fell_behind:
            shared.counters.add(M_FAULTS, "events_fell_behind")
        self.after = page.next_after
        prefix = shared.prefix
        n = len(prefix)
        for event in page.events:
            if event.type not in ("BlockStored", "BlockRemoved"):
                continue
            keys = [OffloadKey(k[n:]) for k in event.block_hashes if k[:n] == prefix]
            if keys:
                shared.events.append(
                    OffloadingEvent(
                        keys=keys,
                        medium=Medium.CPU,
                        removed=event.type == "BlockRemoved",
                        locality=shared.locality,
                        ownership=OWNERSHIP,
                    )
                )
