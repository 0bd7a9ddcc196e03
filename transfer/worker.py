"""Transfer workers: execute copy jobs between registered device KV caches and the host pool.

Primitives (every backend, one contract, one test suite):

- ``submit(job) -> job_id``: validate first (``InvalidJobError``, ``UnknownCacheError``,
  ``WorkerClosedError``), then queue; never blocks on a copy. A *store* copies device blocks
  ``device_blocks[i]`` into host slots ``host_slots[i]``; a *load* copies the other way.
  Destinations must be distinct (a store may not write one slot twice, a load one device block
  twice). An empty job is valid and finishes at once.
- ``poll_finished()``: results of jobs that finished since the last call, non-blocking. Each
  result is handed out exactly once, by ``poll_finished`` or by ``wait``.
- ``wait(job_ids, timeout)``: block until every listed job still held by the worker has
  finished or ``timeout`` seconds pass; return the results of the listed jobs that have
  finished (in the order listed) and hand them out, so ``poll_finished`` will not return them.
  Ids that are unknown or whose result was already handed out are ignored (not waited for).
- ``in_flight()``: ``(job_id, age_seconds)`` of every job not finished yet, oldest first.
- ``shutdown(timeout)``: refuse new jobs, fail queued jobs (``ok=False``, reason
  ``"shutdown"``), give running copies up to ``timeout`` seconds, fail what remains with
  ``"shutdown"``, and release threads, streams and buffers. Results stay pollable. Idempotent.

- ``drop_cache(cache_id, reason)``: fail the cache's queued jobs (its registration's lease
  ended); its running jobs end on their own and keep its mappings alive until then.
- ``fatal``: None, or why the worker can never copy again (a poisoned CUDA context; the
  service then reports not ready and exits). ``quiesced``: after ``shutdown``, whether every
  queued copy ended (only then may the pool be unpinned).

A job's optional ``wait_event`` (a CUDA IPC event handle) orders its copies after the engine's
kernels; it is refused (``InvalidJobError`` naming ``wait_event``) for a cache without a CUDA
tensor.

Deadlines: every job carries ``deadline_s`` (relative to submission). A job that raises or
passes its deadline finishes with ``ok=False`` and a reason (``"deadline"``, the error text).
A job is reported only once nothing of it runs any more: the CPU backend stops a copy between
chunks at its deadline; the CUDA backend cannot cancel copies it has queued on a stream, so such
a job is reported when they end (failed, if past its deadline). So nothing hangs forever short
of a GPU that never completes its work, and no slot or device block is given back under a copy.
Failed loads leave the destination device blocks in an undefined state; failed stores leave the
host slots undefined (the manager drops those blocks).

``JobResult.seconds`` is the wall time from ``submit`` to the job's end (queueing included);
``bytes`` is what the job moves when it succeeds (``len(blocks) * block_bytes``), else 0.

``on_finished`` (optional, given at construction) is called from a worker thread, without the
worker's lock, whenever one or more jobs finish. Keep it cheap and thread-safe, e.g.
``lambda: loop.call_soon_threadsafe(event.set)``.

This module holds the contract (``TransferWorker``), its types (``TransferJob``, ``JobResult``,
the validated ``CopyPlan`` built by ``make_plan``) and the machinery the backends share
(``WorkerBase``: ids, results, ``wait``, deadlines, callbacks; ``QueueingWorker``: the load and
store queues). It imports no backend. The backends, ``cpu`` (``transfer.cpu_worker``), ``cuda``
(``transfer.cuda_worker``) and the fault-injecting wrapper over either
(``transfer.faulty_worker``), are chosen by ``create_worker`` (``transfer.backends``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from transfer.errors import InvalidJobError, WorkerClosedError
from transfer.host_pool import HostPool
from transfer.kv_cache import KVCacheRegistry, RegisteredCache

__all__ = [
    "MAX_JOB_BLOCKS",
    "CopyPlan",
    "Direction",
    "HeldJob",
    "JobResult",
    "OnFinished",
    "QueueingWorker",
    "TransferJob",
    "TransferWorker",
    "WorkerBase",
    "make_plan",
]

log = logging.getLogger(__name__)

Direction = Literal["store", "load"]
OnFinished = Callable[[], None]
MAX_JOB_BLOCKS = 1 << 20
IPC_EVENT_HANDLE_BYTES = 64  # sizeof(cudaIpcEventHandle_t)


@dataclass(frozen=True, slots=True)
class TransferJob:
    """One copy request. ``store``: device -> host; ``load``: host -> device."""

    direction: Direction
    cache_id: str
    device_blocks: list[int]
    host_slots: list[int]
    deadline_s: float
    req_id: str = ""
    wait_event: bytes | None = None
    """A CUDA IPC event handle (64 bytes) the engine recorded after the kernels that wrote (a
    store) or last read (a load) these blocks; the copies wait on it. CUDA caches only."""


@dataclass(frozen=True, slots=True)
class JobResult:
    """How a job ended. ``reason`` is None on success."""

    job_id: int
    ok: bool
    bytes: int
    seconds: float
    reason: str | None


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """A validated job: pairs sorted by host slot (runs of slots become adjacent)."""

    store: bool
    cache: RegisteredCache
    device_blocks: list[int]
    host_slots: list[int]
    nbytes: int

    def slot_runs(
        self, split_every: int | None = None, begin: int = 0, end: int | None = None
    ) -> list[tuple[int, int, int]]:
        """``(first_index, first_slot, length)`` for each run of consecutive host slots among
        pairs ``[begin, end)``.

        With ``split_every``, a run never crosses a multiple of it (pinned-chunk boundary).
        """
        slots = self.host_slots
        runs: list[tuple[int, int, int]] = []
        n = len(slots) if end is None else end
        i = begin
        while i < n:
            j = i + 1
            while j < n and slots[j] == slots[j - 1] + 1:
                if split_every and slots[j] % split_every == 0:
                    break
                j += 1
            runs.append((i, slots[i], j - i))
            i = j
        return runs


def _int_list(values: object, what: str) -> list[int]:
    if not isinstance(values, list | tuple):
        raise InvalidJobError(f"{what} must be a list of integers")
    if not all(type(v) is int for v in values):
        bad = next(v for v in values if type(v) is not int)
        raise InvalidJobError(f"{what} must hold integers, got {bad!r:.40}")
    return list(values)


def make_plan(
    direction: str,
    cache: RegisteredCache,
    pool_blocks: int,
    device_blocks: Sequence[int],
    host_slots: Sequence[int],
) -> CopyPlan:
    """Validate a job against its cache and the pool; ``InvalidJobError`` names the problem."""
    if direction not in ("store", "load"):
        raise InvalidJobError(f"direction must be 'store' or 'load', got {direction!r:.40}")
    blocks = _int_list(device_blocks, "device_blocks")
    slots = _int_list(host_slots, "host_slots")
    n = len(blocks)
    if n != len(slots):
        raise InvalidJobError(
            f"device_blocks and host_slots differ in length ({n} != {len(slots)})"
        )
    if n > MAX_JOB_BLOCKS:
        raise InvalidJobError(f"a job moves at most {MAX_JOB_BLOCKS} blocks, got {n}")
    if n:
        lo, hi = min(blocks), max(blocks)
        if lo < 0 or hi >= cache.num_blocks:
            bad = lo if lo < 0 else hi
            raise InvalidJobError(
                f"device block {bad} out of range [0, {cache.num_blocks}) of cache {cache.cache_id}"
            )
        lo, hi = min(slots), max(slots)
        if lo < 0 or hi >= pool_blocks:
            bad = lo if lo < 0 else hi
            raise InvalidJobError(f"host slot {bad} out of range [0, {pool_blocks})")
    store = direction == "store"
    dest, dest_name = (slots, "host slot") if store else (blocks, "device block")
    if len(set(dest)) != n:
        seen: set[int] = set()
        dup = next(v for v in dest if v in seen or seen.add(v))  # type: ignore[func-returns-value]
        raise InvalidJobError(f"{direction} writes {dest_name} {dup} more than once")
    order = sorted(range(n), key=slots.__getitem__)
    return CopyPlan(
        store=store,
        cache=cache,
        device_blocks=[blocks[i] for i in order],
        host_slots=[slots[i] for i in order],
        nbytes=n * cache.block_bytes,
    )


def _check_wait_event(handle: object, cache: RegisteredCache) -> None:
    if not isinstance(handle, bytes) or len(handle) != IPC_EVENT_HANDLE_BYTES:
        raise InvalidJobError(
            f"wait_event must be a {IPC_EVENT_HANDLE_BYTES}-byte CUDA IPC event handle"
        )
    if not any(d.startswith("cuda") for d in cache.devices):
        raise InvalidJobError(
            f"wait_event orders copies after a CUDA event, but cache {cache.cache_id} has no "
            "CUDA tensor (its copies need no event: the engine's writes are already visible)"
        )


class TransferWorker(ABC):
    """The worker contract; see the module docstring."""

    #: The backend's name (``cpu``, ``cuda``, ``faulty``), as the start log says it.
    backend: str

    @abstractmethod
    def submit(self, job: TransferJob) -> int: ...

    @abstractmethod
    def poll_finished(self) -> list[JobResult]: ...

    @abstractmethod
    def wait(self, job_ids: Iterable[int], timeout: float) -> list[JobResult]: ...

    @abstractmethod
    def in_flight(self) -> list[tuple[int, float]]: ...

    @abstractmethod
    def shutdown(self, timeout: float = 5.0) -> None: ...

    @property
    def fatal(self) -> str | None:
        """Why this worker can never copy again (the CUDA backend's sticky errors), or None."""
        return None

    @property
    def quiesced(self) -> bool:
        """After ``shutdown``: True when no copy can still touch the pool (safe to unpin)."""
        return True

    def drop_cache(self, cache_id: str, reason: str) -> list[int]:
        """Fail the queued jobs of ``cache_id``; the ids of its jobs still running."""
        return []

    def __enter__(self) -> TransferWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class HeldJob:
    """A job the worker holds: accepted, not yet reported. ``deadline`` is monotonic."""

    __slots__ = ("deadline", "job", "plan", "submitted")

    def __init__(self, job: TransferJob, plan: CopyPlan, now: float) -> None:
        self.job = job
        self.plan = plan
        self.submitted = now
        self.deadline = now + job.deadline_s


class WorkerBase(TransferWorker):
    """Bookkeeping shared by the backends: ids, results, ``wait``, deadlines, callbacks.

    Backends implement ``_accept`` (queue an accepted entry; called under the lock) and
    ``_stop`` (the shutdown sequence), and report outcomes through ``_finish``. ``_finish`` is
    first-wins, so a deadline and a completion racing for one job report it once.
    """

    backend = "base"

    def __init__(
        self, pool: HostPool, registry: KVCacheRegistry, on_finished: OnFinished | None
    ) -> None:
        self.pool = pool
        self.registry = registry
        self._on_finished = on_finished
        self._cond = threading.Condition()
        self._next_id = 1
        self._held: dict[int, HeldJob] = {}
        self._done: dict[int, JobResult] = {}
        self._closed = False
        self._shutdown_done = False

    # ---------------------------------------------------------------- submission

    def validate(self, job: TransferJob) -> CopyPlan:
        """Check ``job`` against the registry and the pool without queueing it."""
        if not isinstance(job, TransferJob):
            raise InvalidJobError(f"expected a TransferJob, got {type(job).__name__}")
        d = job.deadline_s
        finite = isinstance(d, int | float) and not isinstance(d, bool) and math.isfinite(d)
        if not finite or d <= 0:
            raise InvalidJobError(f"deadline_s must be a positive number of seconds, got {d!r}")
        cache = self.registry.get(job.cache_id)
        plan = make_plan(
            job.direction, cache, self.pool.num_blocks, job.device_blocks, job.host_slots
        )
        self._check_cache(cache)
        if job.wait_event is not None:
            _check_wait_event(job.wait_event, cache)
        return plan

    def _check_cache(self, cache: RegisteredCache) -> None:
        """Backends refuse caches on devices they cannot reach."""

    def drop_cache(self, cache_id: str, reason: str) -> list[int]:
        """Fail the queued jobs of ``cache_id`` with ``reason`` (its lease ended); the ids of
        its jobs still running, which end on their own and hold its mappings until then."""
        with self._cond:
            mine = [j for j, e in self._held.items() if e.plan.cache.cache_id == cache_id]
            queued = self._unqueue_locked(set(mine))
        self._finish((j, False, reason) for j in queued)
        with self._cond:
            return [j for j in mine if j in self._held]

    def _unqueue_locked(self, job_ids: set[int]) -> list[int]:
        """Remove those of ``job_ids`` that are queued, not started; return them."""
        return []

    def submit(self, job: TransferJob) -> int:
        plan = self.validate(job)
        with self._cond:
            if self._closed:
                why = f" ({self.fatal})" if self.fatal else ""
                raise WorkerClosedError(f"{self.backend} transfer worker is shut down{why}")
            job_id = self._next_id
            self._next_id += 1
            entry = HeldJob(job, plan, time.monotonic())
            self._held[job_id] = entry
            self._accept(job_id, entry)
            self._cond.notify_all()
        return job_id

    @abstractmethod
    def _accept(self, job_id: int, entry: HeldJob) -> None: ...

    # ---------------------------------------------------------------- completion

    def _finish(self, outcomes: Iterable[tuple[int, bool, str | None]]) -> int:
        """Report ``(job_id, ok, reason)`` outcomes; returns how many were new."""
        now = time.monotonic()
        reported = 0
        with self._cond:
            for job_id, ok, reason in outcomes:
                entry = self._held.pop(job_id, None)
                if entry is None:
                    continue  # already reported (deadline and completion raced)
                nbytes = entry.plan.nbytes if ok else 0
                self._done[job_id] = JobResult(
                    job_id, ok, nbytes, now - entry.submitted, None if ok else reason
                )
                reported += 1
            if reported:
                self._cond.notify_all()
        if reported and self._on_finished is not None:
            try:
                self._on_finished()
            except Exception:
                log.exception("on_finished callback failed")
        return reported

    def poll_finished(self) -> list[JobResult]:
        with self._cond:
            out = list(self._done.values())
            self._done.clear()
        return out

    def wait(self, job_ids: Iterable[int], timeout: float) -> list[JobResult]:
        end = time.monotonic() + max(0.0, timeout)
        with self._cond:
            wanted = [j for j in dict.fromkeys(job_ids) if j in self._held or j in self._done]
            while any(j in self._held for j in wanted):
                remaining = end - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return [self._done.pop(j) for j in wanted if j in self._done]

    def in_flight(self) -> list[tuple[int, float]]:
        now = time.monotonic()
        with self._cond:
            return [(j, now - e.submitted) for j, e in self._held.items()]

    def _expired_locked(self, ids: Iterable[int], now: float) -> list[int]:
        """Those of ``ids`` still held whose deadline has passed (call under the lock)."""
        held = self._held
        return [j for j in ids if j in held and held[j].deadline <= now]

    def _next_deadline_locked(self, ids: Iterable[int]) -> float | None:
        held = self._held
        deadlines = [held[j].deadline for j in ids if j in held]
        return min(deadlines) if deadlines else None

    # ---------------------------------------------------------------- shutdown

    def shutdown(self, timeout: float = 5.0) -> None:
        with self._cond:
            if self._shutdown_done:
                return
            self._closed = True
            self._cond.notify_all()
        try:
            self._stop(max(0.0, timeout))
        finally:
            with self._cond:
                leftover = list(self._held)
                self._shutdown_done = True
            self._finish((j, False, "shutdown") for j in leftover)

    @abstractmethod
    def _stop(self, timeout: float) -> None: ...

    @property
    def closed(self) -> bool:
        return self._closed


class QueueingWorker(WorkerBase):
    """A backend that runs accepted jobs from two FIFO queues, loads before stores.

    Loads go first because an engine waits on them to run its next step, while a store only
    frees device memory later. ``_pop_locked`` (called under the lock) hands out the next
    runnable job and moves queued jobs already past their deadline to ``expired``.
    """

    def __init__(
        self, pool: HostPool, registry: KVCacheRegistry, on_finished: OnFinished | None
    ) -> None:
        super().__init__(pool, registry, on_finished)
        self._loads: deque[int] = deque()
        self._stores: deque[int] = deque()

    def _accept(self, job_id: int, entry: HeldJob) -> None:
        (self._loads if entry.job.direction == "load" else self._stores).append(job_id)

    def _unqueue_locked(self, job_ids: set[int]) -> list[int]:
        out = [j for q in (self._loads, self._stores) for j in q if j in job_ids]
        for q in (self._loads, self._stores):
            kept = [j for j in q if j not in job_ids]
            q.clear()
            q.extend(kept)
        return out

    def _pop_locked(self, now: float, expired: list[int]) -> tuple[int, HeldJob] | None:
        """Next runnable job, loads first; queued jobs past their deadline go to ``expired``."""
        for queue in (self._loads, self._stores):
            while queue:
                job_id = queue.popleft()
                entry = self._held.get(job_id)
                if entry is None:
                    continue  # already reported (expired while queued)
                if entry.deadline <= now:
                    expired.append(job_id)
                    continue
                return job_id, entry
        return None
