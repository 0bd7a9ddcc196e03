"""The batch protocol of the link thread: what one ``POST /v1/batch`` carries for a bundle of
scheduler steps (``exchange``: completions first, aborts, unpins, promotions, lookups, store
and load reservations, touches, finishes), and how each op's answer is acted on
(``on_result``). ``Link`` (``kvoffload_client.vllm.link``) adds the connection, the thread and
the faults.

Keys a lookup answers a lower tier for (``disk``, ``remote``, ...) are looked up again in the
next call, which the pending keys make the link send at the next step anyway. A request's first
lookup (``prefetched``) carries ``prefetch_deadline_s``: the service starts bringing the keys a
tier below holds up in that same call, and holds them until a load pins them (vLLM's load of
the request) or the deadline passes; its answer names the prefetch (``prefetch_id``). Keys a
lower tier answers for anywhere else (a later lookup, a lookup whose prefetch the service did
not start: past its bound, counted ``refused``; prefetches off with ``prefetch_deadline_s`` 0)
are promoted in the next call by a prepare-load whose 409 is expected (and whose pins, when it
pins, are undone)."""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload_client.attach import MappedPool
from kvoffload_client.client import Batch, OpResult
from kvoffload_client.vllm.copier import Copier
from kvoffload_client.vllm.keys import service_key
from kvoffload_client.vllm.state import (
    M_FAULTS,
    M_PREFETCHES,
    PENDING_WAIT_S,
    Copy,
    Probe,
    ProbeRef,
    Shared,
    Step,
    Transfer,
    in_lower_tier,
    in_parts,
    not_yet,
    sendable_params,
)


@dataclass
class Pending:
    """What an op in a batch was for, to act on its result."""

    kind: str  # start, lookup, promote, store, load, touch, complete, finish, abort
    req_id: str
    prefetching: bool = False  # a lookup that asked the service to prefetch
    probes: Sequence[ProbeRef] = ()
    holder: Holder | None = None
    skeys: Sequence[bytes] = ()


class Holder:
    """A store or load job, sent as one op or, above the op key limit, as several: it is
    copied once every part answered, whole or not at all."""

    def __init__(self, transfer: Transfer, parts: int) -> None:
        self.transfer = transfer
        self.parts = parts
        self.answered = 0
        self.failed = False
        self.copies: list[Copy] = []

    def answer(self, link: BatchProtocol, copy: Copy | None) -> None:
        """Record one part's answer (None: it failed); at the last one, queue the copy or fail
        the job and release what the other parts reserved."""
        self.answered += 1
        if copy is None:
            self.failed = True
        else:
            self.copies.append(copy)
        if self.answered < self.parts:
            return
        t = self.transfer
        shared = link.shared
        if self.failed:
            shared.finish_job(t.job, False)
            for c in self.copies:
                link.release(t.req_id, t.job.load, c.skeys)
            return
        slots = [s for c in self.copies for s in c.slots]
        if not slots:
            shared.finish_job(t.job, True, 0.0, 0)  # every key was already stored
            return
        merged = Copy(
            t,
            self.copies[0].pool,
            slots,
            [ch for c in self.copies for ch in c.chunks],
            [k for c in self.copies for k in c.skeys],
        )
        link.copying[t.req_id] += 1
        link.copier.put(merged)


class BatchProtocol:
    """Builds a step's batch and reads its answers (module docstring); the state it keeps
    between calls is ``Link``'s."""

    shared: Shared
    copier: Copier
    pool: MappedPool | None
    started: set[str]  # requests the service knows
    params: dict[str, dict[str, Any] | None]
    copying: collections.Counter[str]  # copies running, per request
    aborts: set[str]  # outcome unknown: abort once none of its copies runs
    finishes: list[str]  # finishes not delivered yet
    # Keys answered "pending" (another engine's store in flight), asked again next call.
    reask: dict[str, list[ProbeRef]]
    # Keys answered "disk" or "remote" (in a lower tier): a prepare-load asks the service to
    # bring them into the pool (its answer, 409, is expected); they are asked again as
    # pending. A prepare-load that pins (they were in already) is undone.
    promote: dict[str, list[bytes]]
    unpin: dict[str, list[bytes]]
    # The requests whose first lookup was sent (it carried the prefetch).
    prefetched: set[str]

    def connect(self) -> bool:
        raise NotImplementedError

    def fail_step(self, step: Step) -> None:
        raise NotImplementedError

    def send(self, batch: Batch, pending: list[Pending]) -> None:
        raise NotImplementedError

    def release(self, req_id: str, load: bool, skeys: Sequence[bytes]) -> None:
        raise NotImplementedError

    def exchange(self, step: Step, final: bool = False) -> None:
        """Send one batch for ``step`` and the carried ops; act on each op's result."""
        shared = self.shared
        for req_id, params in step.starts.items():
            self.params.setdefault(req_id, params)
        self.finishes.extend(step.finishes)
        if self.reask:
            finishing = set(self.finishes)
            for req_id, refs in self.reask.items():
                if req_id in self.started and req_id not in finishing:
                    step.lookups.setdefault(req_id, []).extend(refs)
                else:
                    for _, probe in refs:
                        probe.result = False
            self.reask = {}
        backing_off = shared.incident.active and time.monotonic() < shared.down_until
        if (backing_off and not final) or (
            (step.lookups or step.stores or step.loads) and not self.connect()
        ):
            self.fail_step(step)
            return
        pool_id = self.pool.pool_id if self.pool is not None else None
        batch = Batch()
        pending: list[Pending] = []

        def add(kind: str, req_id: str, **what: Any) -> None:
            pending.append(Pending(kind, req_id, **what))

        def begin(req_id: str) -> None:
            if req_id not in self.started:
                self.started.add(req_id)
                batch.start_request(
                    req_id,
                    sendable_params(
                        self.params.get(req_id), self.shared.max_params, self.shared.counters
                    ),
                )
                add("start", req_id)

        # Completions first: they release pins and make stores loadable.
        while self.shared.done:
            d = self.shared.done.popleft()
            self.copying[d.req_id] -= 1
            if self.copying[d.req_id] <= 0:
                del self.copying[d.req_id]
            if d.pool_id != pool_id:
                continue  # meant for a pool that is gone with its service
            for part in in_parts(d.skeys, shared.max_keys):
                if d.load:
                    batch.complete_load(d.req_id, part)
                else:
                    batch.complete_store(d.req_id, part, success=d.success)
                add("complete", d.req_id)
        for req_id in sorted(self.aborts):
            if not self.copying.get(req_id):
                self.aborts.discard(req_id)
                batch.finish_request(req_id, abort=True)
                add("abort", req_id)
        for req_id, skeys in self.unpin.items():
            for part in in_parts(skeys, shared.max_keys):
                batch.complete_load(req_id, part)
                add("complete", req_id)
        self.unpin = {}
        for req_id, skeys in self.promote.items():
            if req_id in self.started:
                for part in in_parts(skeys, shared.max_keys):
                    batch.prepare_load(req_id, part)
                    add("promote", req_id, skeys=part)
        self.promote = {}
        prefix = shared.prefix
        deadline_s = shared.prefetch_deadline_s
        for req_id, refs in step.lookups.items():
            begin(req_id)
            first = deadline_s > 0 and not final and req_id not in self.prefetched
            if first:
                self.prefetched.add(req_id)
            for part in in_parts(refs, shared.max_keys):
                skeys = [service_key(prefix, k) for k, _ in part]
                batch.lookup(req_id, skeys, deadline_s if first else None)
                add("lookup", req_id, probes=part, prefetching=first)
        for kind, transfers in (("store", step.stores), ("load", step.loads)):
            for t in transfers:
                begin(t.req_id)
                skeys = [service_key(prefix, k) for k in t.keys]
                parts = list(in_parts(skeys, shared.max_keys))
                holder = Holder(t, len(parts))
                for part in parts:
                    if kind == "load":
                        batch.prepare_load(t.req_id, part)
                    else:
                        batch.prepare_store(t.req_id, part)
                    add(kind, t.req_id, holder=holder, skeys=part)
        for req_id, keys in step.touches.items():
            if req_id in self.started:
                for part in in_parts(keys, shared.max_keys):
                    batch.touch(req_id, [service_key(prefix, k) for k in part])
                    add("touch", req_id)
        finishes, self.finishes = self.finishes, []
        for req_id in finishes:
            self.params.pop(req_id, None)
            self.prefetched.discard(req_id)
            if req_id in self.started:
                self.started.discard(req_id)
                # At shutdown no copy runs any more: an abort gives back whatever a cancelled
                # copy still held.
                batch.finish_request(req_id, abort=final)
                add("finish", req_id)
        if final:  # shutdown: requests vLLM left open are aborted too
            for req_id in sorted(self.started | self.aborts):
                batch.finish_request(req_id, abort=True)
                add("abort", req_id)
            self.started.clear()
            self.aborts.clear()
            self.prefetched.clear()
        if batch.ops:
            self.send(batch, pending)

    def on_result(self, res: OpResult, p: Pending, stale_pool: bool) -> None:
        shared = self.shared
        if not res.ok and res.status == 404 and p.kind not in ("finish", "abort"):
            self.started.discard(p.req_id)  # the service forgot it (restart, idle TTL)
        if p.kind == "lookup":
            answer = res.result if res.ok and res.result is not None else None
            hits = None if answer is None else answer["results"]
            if hits is None:
                shared.counters.add(M_FAULTS, f"lookup_{res.status}")
                if p.prefetching:
                    shared.counters.add(M_PREFETCHES, "failed")
            # The keys below the pool are on their way up when the lookup's prefetch started.
            coming = p.prefetching and answer is not None and "prefetch_id" in answer
            below = False
            for i, ref in enumerate(p.probes):
                probe = ref[1]
                state = None if hits is None else hits[i]
                if not_yet(state) and self._still_waiting(probe):
                    self.reask.setdefault(p.req_id, []).append(ref)
                    if in_lower_tier(state):
                        below = True
                        if not coming:
                            skey = service_key(shared.prefix, ref[0])
                            self.promote.setdefault(p.req_id, []).append(skey)
                else:
                    probe.result = state == "hit"
            if p.prefetching and below:
                shared.counters.add(M_PREFETCHES, "started" if coming else "refused")
        elif p.kind == "promote":
            if res.ok:  # already in the pool: it pinned them, which nobody will load
                self.unpin.setdefault(p.req_id, []).extend(p.skeys)
            elif res.status != 409:  # 409: not ready yet, being brought in (expected)
                shared.counters.add(M_FAULTS, f"promote_{res.status}")
        elif p.holder is not None:
            self.on_transfer(res, p, p.holder, stale_pool)
        elif not res.ok and not (p.kind in ("finish", "abort") and res.status == 404):
            shared.counters.add(M_FAULTS, f"{p.kind}_{res.status}")

    @staticmethod
    def _still_waiting(probe: Probe) -> bool:
        now = time.monotonic()
        if not probe.pending_since:
            probe.pending_since = now
        return now - probe.pending_since < PENDING_WAIT_S

    def on_transfer(self, res: OpResult, p: Pending, holder: Holder, stale_pool: bool) -> None:
        shared = self.shared
        t = holder.transfer
        load = p.kind == "load"
        if not res.ok or res.result is None:
            shared.counters.add(
                M_FAULTS, "no_space" if res.status == 507 else f"{p.kind}_{res.status}"
            )
            holder.answer(self, None)
            return
        slots = [int(s) for s in res.result["slots"]]
        # A load copies every key it pinned; a store only the keys the service admitted.
        skeys = list(p.skeys) if load else [bytes.fromhex(k) for k in res.result["keys_to_store"]]
        if stale_pool or self.pool is None or t.job.ended:
            # Reserved or pinned in a pool we did not copy against (the service restarted
            # between mapping and answer), or for a job that already ended (deadline, drain):
            # given back without a copy, or by aborting the request when no pool is mapped.
            if self.pool is not None:
                self.release(t.req_id, load, skeys)
            elif skeys:
                self.aborts.add(t.req_id)
            holder.answer(self, None)
            return
        chunk_ids = t.chunk_ids.tolist()
        chunk_of = dict(
            zip([service_key(shared.prefix, k) for k in t.keys], chunk_ids, strict=True)
        )
        chunks = [int(chunk_of[k]) for k in skeys]
        holder.answer(self, Copy(t, self.pool, slots, chunks, skeys))
