"""CUDA transfer backend: a copy stream per GPU and direction, chunked issue, no busy poll.

How bytes move is ``transfer.cuda_copy``'s business (copy-engine DMA straight between device
memory and the pinned pool, or a staged path where the runtime cannot be called directly).
This module decides *when*:

- One issuing thread queues a job chunk by chunk on its stream. Loads and stores have their
  own stream on each GPU, loads at the higher priority; between two chunks of a store a queued
  load goes first. Each stream has at most ``max_inflight_bytes`` queued and not finished
  (at least one chunk), so a long store cannot fill the copy engine ahead of a load.
- Every chunk records a blocking-sync event. One completion thread per stream waits on its
  events in order (``Event.synchronize``: the GIL is released and the thread sleeps in the
  driver), so nothing polls; a job ends when its last chunk's event has fired.
- Ordering against the engine: a job may carry ``wait_event``, a CUDA IPC event handle the
  engine recorded after the kernels that wrote (for a store) or last read (for a load) those
  blocks; the job's streams wait on it before the first copy. Without it the service can only
  order after its own default stream, which orders nothing against another process.
- Deadlines: a job not yet issued fails at its deadline without running; a job partly issued
  stops issuing; copies already queued cannot be cancelled, so the job is reported (failed,
  ``"deadline"``) only when they end: no host slot, pin or device block is released while a DMA
  may still touch it.
- A sticky CUDA error (the context is poisoned: illegal address, launch failure, ECC, ...) is
  fatal: ``fatal`` says why, every held job fails, new jobs are refused, and the service
  reports not ready and exits for its supervisor to restart it (``app.core.service``).
- ``shutdown`` gives running jobs the grace, then waits (bounded by ``sync_timeout_s``) for
  every stream's queued copies to end; ``quiesced`` tells whether they did, and the service
  unpins the pool only then (``HostPool.close(unpin=...)``).
- The pool must be pinned: pageable memory turns every DMA into a synchronous staged copy.
  An unpinned pool is refused unless ``allow_pageable`` (``--allow-pageable-pool``).

Tensors of a cache on the CPU are copied with ``memmove`` on the issuing thread
(``transfer.cpu_copy``). Importable without CUDA; constructing the worker needs it (or the
fakes the tests install).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from transfer.cpu_copy import CopyAborted, copy_on_cpu
from transfer.cuda_copy import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_STAGING_BYTES,
    DirectCopier,
    StagedCopier,
    find_cuda_memcpy,
)
from transfer.cudart import STICKY_CODES, CudaCallError, RawCuda, find_raw_cuda
from transfer.errors import InvalidJobError
from transfer.host_pool import HostPool
from transfer.kv_cache import KVCacheRegistry, RegisteredCache
from transfer.worker import HeldJob, OnFinished, QueueingWorker

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_INFLIGHT_BYTES",
    "DEFAULT_STAGING_BYTES",
    "CudaTransferWorker",
    "StagedCopier",
    "find_cuda_memcpy",
    "is_sticky_cuda_error",
    "poisoned",
]

log = logging.getLogger(__name__)

DEFAULT_INFLIGHT_BYTES = 64 << 20
LOAD_PRIORITY = -1  # lower is higher in CUDA; out-of-range values are clamped by torch
STORE_PRIORITY = 0
PAGEABLE_FLAG = "--allow-pageable-pool"

# Errors after which the CUDA context is unusable (cudaError_t 700-719 and kin): every later
# call fails the same way, so only a new process recovers.
_STICKY = (
    "illegal memory access",
    "illegal address",
    "unspecified launch failure",
    "launch failure",
    "misaligned address",
    "illegal instruction",
    "hardware stack error",
    "uncorrectable ecc",
    "ecc error",
    "invalid program counter",
    "invalid address space",
    "launch timed out",
    "cudaerrorlaunchfailure",
    "cudaerrorillegaladdress",
    "device-side assert",
)
# A poisoned context cannot close a CUDA IPC mapping: torch's deleter synchronizes a stream and
# closes the handle inside a destructor, and the error it gets there aborts the process. So
# once poisoned, every registered cache is kept here until the process exits (``kvoffload
# serve`` then leaves with ``os._exit``, skipping the interpreter's clean-up of them).
_KEPT_AFTER_POISON: list[Any] = []
_POISONED = threading.Event()
_WORKERS: weakref.WeakSet[CudaTransferWorker] = weakref.WeakSet()  # poisoned together


def poisoned() -> bool:
    """True once a worker of this process saw a sticky CUDA error: the process must not run
    the interpreter's clean-up (it would free the kept mappings), but leave with ``os._exit``."""
    return _POISONED.is_set()


def is_sticky_cuda_error(exc: BaseException) -> bool:
    """True when ``exc`` reports an error that poisons the CUDA context for good: a raw call's
    code (``CudaCallError``), torch's ``AcceleratorError.error_code``, or torch's message."""
    if isinstance(exc, CudaCallError):
        return exc.sticky
    if getattr(exc, "error_code", None) in STICKY_CODES:
        return True
    text = str(exc).lower()
    return any(s in text for s in _STICKY)


def _new_stream(index: int, priority: int) -> Any:
    return torch.cuda.Stream(device=index, priority=priority)  # type: ignore[no-untyped-call]


def _new_event() -> Any:
    """A blocking-sync event: ``synchronize`` sleeps in the driver instead of spinning."""
    return torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]


def _open_ipc_event(index: int, handle: bytes) -> Any:
    """The engine's interprocess event (``cudaIpcOpenEventHandle``) on GPU ``index``."""
    device = torch.device("cuda", index)
    return torch.cuda.Event.from_ipc_handle(device, handle)  # type: ignore[no-untyped-call]


def _device_index(device: str) -> int:
    index = torch.device(device).index
    return 0 if index is None else index


@dataclass
class _Lane:
    """One GPU: per direction (store?) a stream, its copier and its completion queue."""

    index: int
    streams: dict[bool, Any]
    copiers: dict[bool, DirectCopier | StagedCopier]
    done: dict[bool, queue.SimpleQueue[Any]]
    threads: list[threading.Thread]
    inflight: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})  # bytes
    events: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})  # not fired


@dataclass
class _Active:
    """A job being issued or waiting for its queued chunks to end."""

    job_id: int
    entry: HeldJob
    store: bool
    started: bool = False
    parts: list[tuple[_Lane, Iterator[int]]] = field(default_factory=list)
    part: int = 0
    pending: int = 0  # chunks queued whose event has not fired
    issued_all: bool = False
    error: str | None = None


class CudaTransferWorker(QueueingWorker):
    """The CUDA backend; see the module docstring."""

    backend = "cuda"

    def __init__(
        self,
        pool: HostPool,
        registry: KVCacheRegistry,
        *,
        on_finished: OnFinished | None = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_inflight_bytes: int = DEFAULT_INFLIGHT_BYTES,
        raw_memcpy: bool = True,
        direct: bool = True,
        allow_pageable: bool = False,
        sync_timeout_s: float = 10.0,
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("the cuda transfer backend needs CUDA; use backend='cpu'")
        for what, value in (
            ("staging_bytes", staging_bytes),
            ("chunk_bytes", chunk_bytes),
            ("max_inflight_bytes", max_inflight_bytes),
        ):
            if value <= 0:
                raise ValueError(f"{what} must be positive, got {value}")
        if not pool.pinned and not allow_pageable:
            raise RuntimeError(
                "the cuda transfer backend needs a pinned host pool and this one could not be "
                f"pinned (see the log); pass {PAGEABLE_FLAG} to run with pageable memory"
            )
        super().__init__(pool, registry, on_finished)
        self.staging_bytes = staging_bytes
        self.chunk_bytes = chunk_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.sync_timeout_s = sync_timeout_s
        torch.cuda.init()  # type: ignore[no-untyped-call]  # runtime loaded before the lookup
        self._raw: RawCuda | None = find_raw_cuda() if raw_memcpy else None
        # The batch call's location hints are left unset: right for pinned and device memory,
        # not for pageable host memory (an unpinned pool copies with 2D calls instead).
        self._batch = self._raw is not None and self._raw.batch is not None and pool.pinned
        self._direct = (
            direct and self._raw is not None and (self._batch or self._raw.memcpy2d is not None)
        )
        self._pool_tensor = pool.tensor
        self._split_every = pool.pin_chunk_blocks
        self._lanes: dict[int, _Lane] = {}
        self._active: dict[bool, _Active | None] = {True: None, False: None}
        self._draining: set[int] = set()  # job ids of _Active fully issued, chunks pending
        self._inflight_jobs: dict[int, _Active] = {}
        self._abandon = False
        self._quiesced = True
        self._fatal: str | None = None
        self._thread = threading.Thread(
            target=self._run, name="kvoffload-cuda-transfer", daemon=True
        )
        self._thread.start()
        _WORKERS.add(self)

    @property
    def raw_memcpy(self) -> bool:
        """True when copies go through the CUDA runtime directly (not through torch)."""
        return self._raw is not None

    @property
    def copy_path(self) -> str:
        """``"batch"``, ``"2d"`` (direct DMA) or ``"staged"``: how chunks are copied."""
        if not self._direct or self._raw is None:
            return "staged"
        return "batch" if self._batch and self._raw.batch is not None else "2d"

    @property
    def fatal(self) -> str | None:
        """Why this worker can never copy again (a sticky CUDA error), or None."""
        return self._fatal

    @property
    def quiesced(self) -> bool:
        """After ``shutdown``: True when every stream's copies ended (the pool may be unpinned)."""
        return self._quiesced

    def _check_cache(self, cache: RegisteredCache) -> None:
        count = torch.cuda.device_count()
        for device in cache.devices:
            if device == "cpu":
                continue
            if not device.startswith("cuda") or _device_index(device) >= count:
                raise InvalidJobError(
                    f"cache {cache.cache_id} has a tensor on {device}, which this worker "
                    f"cannot reach ({count} GPUs)"
                )

    # ---------------------------------------------------------------- lanes

    def _lane(self, index: int) -> _Lane:
        lane = self._lanes.get(index)
        if lane is not None:
            return lane
        with torch.cuda.device(index):
            streams = {
                True: _new_stream(index, STORE_PRIORITY),
                False: _new_stream(index, LOAD_PRIORITY),
            }
            sides = {
                True: _new_stream(index, STORE_PRIORITY),
                False: _new_stream(index, LOAD_PRIORITY),
            }
        copiers: dict[bool, DirectCopier | StagedCopier] = {}
        max_pitch = None
        if self._direct and self._raw is not None and self._raw.max_pitch is not None:
            max_pitch = self._raw.max_pitch(index)
        for store in (True, False):
            if self._direct and self._raw is not None:
                copiers[store] = DirectCopier(
                    self._raw, self.chunk_bytes, max_pitch=max_pitch, batch=self._batch
                )
            else:
                copier = StagedCopier(
                    torch.device("cuda", index),
                    self.staging_bytes,
                    None if self._raw is None else self._raw.memcpy,
                    sides[store],
                )
                if self._raw is not None:
                    copier._clear_error = self._raw.clear_error
                copiers[store] = copier
        done: dict[bool, queue.SimpleQueue[Any]] = {
            True: queue.SimpleQueue(),
            False: queue.SimpleQueue(),
        }
        lane = _Lane(index, streams, copiers, done, [])
        for store in (True, False):
            t = threading.Thread(
                target=self._complete_loop,
                args=(lane, store),
                name=f"kvoffload-cuda-done-{index}-{'store' if store else 'load'}",
                daemon=True,
            )
            lane.threads.append(t)
            t.start()
        self._lanes[index] = lane
        return lane

    # ---------------------------------------------------------------- the issuing thread

    def _run(self) -> None:
        active: _Active | None
        picked: tuple[int, HeldJob] | None
        while True:
            expired: list[int] = []
            with self._cond:
                while True:
                    if self._abandon or self._fatal is not None:
                        return
                    now = time.monotonic()
                    idle = all(a is None for a in self._active.values())
                    if self._closed and idle and not self._loads and not self._stores:
                        return
                    for store, q in ((False, self._loads), (True, self._stores)):
                        if self._active[store] is None and q:
                            picked = self._pop_one_locked(q, now, expired)
                            if picked is not None:
                                active = _Active(picked[0], picked[1], store)
                                self._active[store] = active
                                self._inflight_jobs[picked[0]] = active
                    work = self._choose_locked()
                    if work is not None or expired:
                        break
                    nxt = self._next_deadline_locked([*self._loads, *self._stores])
                    for a in self._active.values():
                        if a is not None:
                            d = a.entry.deadline
                            nxt = d if nxt is None else min(nxt, d)
                    self._cond.wait(None if nxt is None else max(0.001, nxt - now))
            if expired:
                self._finish((j, False, "deadline") for j in expired)
            if work is not None:
                self._step(work)
            # Hold no job while waiting: its plan holds the cache's mappings, and a lapsed
            # registration's GPU memory must go once its jobs ended.
            work = active = picked = None

    def _pop_one_locked(self, q: Any, now: float, expired: list[int]) -> tuple[int, HeldJob] | None:
        while q:
            job_id = q.popleft()
            entry = self._held.get(job_id)
            if entry is None:
                continue
            if entry.deadline <= now:
                expired.append(job_id)
                continue
            return job_id, entry
        return None

    def _choose_locked(self) -> _Active | None:
        """The active job to issue a chunk of: loads first, within each stream's byte cap."""
        now = time.monotonic()
        for store in (False, True):
            active = self._active[store]
            if active is None:
                continue
            if not active.started or active.entry.deadline <= now:
                return active
            if active.part >= len(active.parts):
                return active
            lane = active.parts[active.part][0]
            if lane.inflight[store] == 0 or lane.inflight[store] < self.max_inflight_bytes:
                return active
        return None

    def _start(self, active: _Active) -> None:
        """First step of a job: its CPU tensors, its waits, one chunk generator per GPU."""
        active.started = True
        plan = active.entry.plan
        by_device: dict[int, list[int]] = {}
        has_cpu = False
        for t, lay in enumerate(plan.cache.layouts):
            if lay.device == "cpu":
                has_cpu = True
            else:
                by_device.setdefault(_device_index(lay.device), []).append(t)
        if has_cpu:
            copy_on_cpu(plan, self._pool_tensor, deadline=active.entry.deadline, only_cpu=True)
        wait_event = active.entry.job.wait_event
        ipc_event = None
        if wait_event is not None and by_device:
            first = next(iter(by_device))
            with torch.cuda.device(first):
                ipc_event = _open_ipc_event(first, wait_event)
        for index, tensor_ids in by_device.items():
            lane = self._lane(index)
            stream = lane.streams[active.store]
            with torch.cuda.device(index):
                # Order after this process's default stream (in-process caches see their
                # writes) and after the engine's event (an IPC cache: the only real order).
                stream.wait_stream(torch.cuda.default_stream(index))
                if ipc_event is not None:
                    stream.wait_event(ipc_event)
            gen = lane.copiers[active.store].chunks(
                plan,
                self._pool_tensor,
                tensor_ids,
                stream.cuda_stream,
                split_every=self._split_every,
            )
            active.parts.append((lane, gen))

    def _step(self, active: _Active) -> None:
        """Issue one chunk of ``active`` (or start it, or stop it at its deadline)."""
        store = active.store
        if not active.started:
            try:
                self._start(active)
            except CopyAborted:
                active.error = "deadline"
            except Exception as exc:
                active.error = self._failure(exc)
            if active.error is None:
                return
        elif active.entry.deadline <= time.monotonic():
            active.error = active.error or "deadline"
        if active.error is None and active.part < len(active.parts):
            lane, gen = active.parts[active.part]
            stream = lane.streams[store]
            nbytes: int | None = None
            try:
                with torch.cuda.device(lane.index), torch.cuda.stream(stream):
                    if self._direct and self._raw is not None:
                        self._raw.bind_thread(lane.index)  # the driver's batch call needs it
                    nbytes = next(gen)
            except StopIteration:
                active.part += 1
            except Exception as exc:
                active.error = self._failure(exc)
                nbytes = 0  # what was queued before the error must drain: record an event
            if nbytes is not None:
                try:
                    event = _new_event()
                    event.record(stream)
                except Exception as exc:
                    failure = self._failure(exc)  # checked for a sticky error even so
                    active.error = active.error or failure
                else:
                    with self._cond:
                        lane.inflight[store] += nbytes
                        lane.events[store] += 1
                        active.pending += 1
                    lane.done[store].put((active, event, nbytes))
            if active.error is None and active.part < len(active.parts):
                return
        # Nothing more to issue: the job ends when its queued chunks do.
        outcome = None
        with self._cond:
            active.issued_all = True
            if self._active[store] is active:
                self._active[store] = None
            if active.pending == 0:
                outcome = self._outcome_locked(active)
            self._cond.notify_all()
        if outcome is not None:
            self._finish([outcome])

    def _failure(self, exc: BaseException) -> str:
        reason = f"copy failed: {type(exc).__name__}: {exc}"
        if is_sticky_cuda_error(exc):
            self._poison(reason)
        return reason

    def _outcome_locked(self, active: _Active) -> tuple[int, bool, str | None]:
        self._inflight_jobs.pop(active.job_id, None)
        error = active.error
        if error is None and time.monotonic() > active.entry.deadline:
            error = "deadline"  # it ended, but too late: the engine has given up on it
        return (active.job_id, error is None, error)

    # ---------------------------------------------------------------- completion threads

    def _complete_loop(self, lane: _Lane, store: bool) -> None:
        # On the lane's GPU: a runtime call on a thread with no current device would make a
        # context on GPU 0 (hundreds of MiB) in a process that may not serve GPU 0.
        with torch.cuda.device(lane.index):
            self._complete(lane, store)

    def _complete(self, lane: _Lane, store: bool) -> None:
        q = lane.done[store]
        while True:
            item = q.get()
            if item is None:
                return
            active, event, nbytes = item
            error: str | None = None
            try:
                event.synchronize()  # sleeps in the driver, GIL released
            except Exception as exc:
                error = f"cuda error: {exc}"
                if is_sticky_cuda_error(exc):
                    self._poison(error)
            outcome = None
            with self._cond:
                lane.inflight[store] -= nbytes
                lane.events[store] -= 1
                active.pending -= 1
                if error is not None and active.error is None:
                    active.error = error
                if active.issued_all and active.pending == 0:
                    outcome = self._outcome_locked(active)
                self._cond.notify_all()
            if outcome is not None:
                self._finish([outcome])
            # Let go of the job before waiting for the next chunk (see ``_run``).
            del item, active, event, outcome

    def _poison(self, reason: str) -> None:
        """A sticky error: refuse new jobs, fail queued ones; running ones fail as they end.
        Every other CUDA worker of the process is poisoned too (one context per GPU, shared
        by every namespace), and every cache any of them could drop is kept for good."""
        with self._cond:
            if self._fatal is not None:
                return
            # Before anyone can see ``fatal``: whoever reads it may count on what is kept.
            _POISONED.set()
            # Also the caches only jobs still hold (a lapsed lease's, or those of jobs already
            # reported whose copies a shutdown left queued): the last reference would go
            # when the job ends.
            held = [entry.plan.cache for entry in self._held.values()]
            held += [a.entry.plan.cache for a in self._inflight_jobs.values()]
            _KEPT_AFTER_POISON.extend([*self.registry.list(), *held])
            self._fatal = reason
            self._closed = True  # submit refuses from now on
            queued = [*self._loads, *self._stores]
            self._loads.clear()
            self._stores.clear()
            self._cond.notify_all()
        log.critical("CUDA context is poisoned; the service must restart: %s", reason)
        self._finish((j, False, f"cuda fatal: {reason}") for j in queued)
        for other in list(_WORKERS):
            if other is not self:
                other._poison(f"another worker of this process lost the CUDA context: {reason}")

    # ---------------------------------------------------------------- shutdown

    def _events_left_locked(self) -> int:
        return sum(lane.events[s] for lane in self._lanes.values() for s in (True, False))

    def _stop(self, timeout: float) -> None:
        with self._cond:
            queued = [*self._loads, *self._stores]
            self._loads.clear()
            self._stores.clear()
            self._cond.notify_all()
        self._finish((j, False, "shutdown") for j in queued)
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._cond:
                self._abandon = True  # stop issuing; what is queued on the streams stays
                self._cond.notify_all()
            self._thread.join()
        # Every stream's queued copies must end before the pool is unpinned or any slot or
        # device block is given back: wait for them, bounded (a hung GPU must not hang us).
        # Counted in events, not bytes: a chunk that failed half-issued records one of 0 bytes.
        end = time.monotonic() + max(0.0, self.sync_timeout_s)
        with self._cond:
            while self._events_left_locked():
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            self._quiesced = not self._events_left_locked()
        if not self._quiesced:
            log.error(
                "CUDA copies still queued after %.1fs; the pool stays pinned until exit",
                self.sync_timeout_s,
            )
        for lane in self._lanes.values():
            for store in (True, False):
                lane.done[store].put(None)
        if self._quiesced:
            for lane in self._lanes.values():
                for t in lane.threads:
                    t.join(1.0)
            self._lanes.clear()
