"""CUDA transfer backend: streams per direction, one event per job and device, staged copies.

A host block interleaves every tensor's part of a device block, so for any one tensor the host
side of a run of slots is strided, and torch cannot copy strided host memory to or from a GPU
without an unpinned temporary. The backend therefore stages through device memory:

- store: for each chunk of the job's blocks (sorted by host slot), one ``index_select`` per
  tensor gathers the blocks into a device staging buffer laid out exactly like host blocks,
  then one ``cudaMemcpyAsync`` per run of consecutive host slots moves the run to the pool;
- load: the mirror image (host runs into staging, then one ``index_copy_`` per tensor).

So the PCIe copies are as large as the runs of host slots allow, whatever the order of the
device blocks, and the launches per chunk are (tensors + slot runs), never (tensors x blocks).
Device-to-device traffic for the gather is cheap next to PCIe. Runs are split at the pool's
pinned-chunk boundaries. A cache whose tensors span several GPUs (tensor-parallel ranks) gets a
staging buffer per GPU and copies of each GPU's share of a host block.

Stores and loads have their own stream on each device, loads at the higher priority, and are
issued by one thread, loads first. Every job records one event per device it touches; the
thread polls each in-flight job's events independently, so a slow job never hides later ones.
A job not yet issued fails at its deadline without running. An issued job that passes its
deadline has failed (``"deadline"``), but its copies cannot be cancelled: it is reported when
they end, so no host slot, pin or device block is released while a DMA may still write into it
(meanwhile the service's tracker still lists it as running, and ``/readyz`` reports a transfer
past its deadline). Tensors of
a cache on the CPU are copied with ``memmove`` on the issuing thread (``transfer.cpu_copy``).

The engine must have finished writing blocks (synchronised its streams) before asking to store
them; the service cannot order its streams after another process's work.

Importable without CUDA; constructing the worker needs it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from transfer.cpu_copy import CopyAborted, copy_on_cpu
from transfer.errors import InvalidJobError
from transfer.host_pool import HostPool
from transfer.kv_cache import KVCacheRegistry, RegisteredCache
from transfer.worker import CopyPlan, HeldJob, OnFinished, QueueingWorker

__all__ = ["DEFAULT_STAGING_BYTES", "CudaTransferWorker", "StagedCopier", "find_cuda_memcpy"]

log = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 64 << 20
LOAD_PRIORITY = -1  # lower is higher in CUDA; out-of-range values are clamped by torch
STORE_PRIORITY = 0
_WORD_DTYPES = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


@dataclass(frozen=True, slots=True)
class _Segment:
    tensor: int  # index into cache.tensors
    staging_offset: int  # bytes, inside a staging row
    nbytes: int  # outer * inner_bytes
    host_offset: int
    outer: int
    inner_bytes: int
    num_blocks: int


@dataclass(frozen=True, slots=True)
class _Geometry:
    """How one device's tensors of a cache sit in a staging row and in a host block."""

    segments: tuple[_Segment, ...]
    row_bytes: int  # staging row: this device's share of a host block
    groups: tuple[tuple[int, int, int], ...]  # (host_offset, staging_offset, nbytes) contiguous
    word: int  # bytes per element used by the gather/scatter kernels


def _geometry(cache: RegisteredCache, tensor_ids: list[int]) -> _Geometry:
    segments = []
    offset = 0
    for t in tensor_ids:
        lay = cache.layouts[t]
        segments.append(
            _Segment(
                t,
                offset,
                lay.bytes_per_block,
                lay.host_offset,
                lay.outer,
                lay.inner_bytes,
                lay.num_blocks,
            )
        )
        offset += lay.bytes_per_block
    groups: list[list[int]] = []
    for s in segments:
        if groups and groups[-1][0] + groups[-1][2] == s.host_offset:
            groups[-1][2] += s.nbytes
        else:
            groups.append([s.host_offset, s.staging_offset, s.nbytes])
    word = 1
    for size, _dtype in _WORD_DTYPES:
        if all(
            s.inner_bytes % size == 0
            and s.staging_offset % size == 0
            and cache.tensors[s.tensor].data_ptr() % size == 0
            and cache.tensors[s.tensor].numel() % size == 0
            for s in segments
        ) and (offset % size == 0):
            word = size
            break
    return _Geometry(tuple(segments), offset, tuple((g[0], g[1], g[2]) for g in groups), word)


MemcpyAsync = Callable[[int, int, int, int, int], int]
"""``cudaMemcpyAsync(dst, src, nbytes, kind, stream) -> cudaError_t``."""
_H2D = 1  # cudaMemcpyHostToDevice
_D2H = 2  # cudaMemcpyDeviceToHost


def find_cuda_memcpy() -> MemcpyAsync | None:
    """``cudaMemcpyAsync`` of the CUDA runtime torch itself loaded, or None.

    Calling it through ctypes costs about a microsecond; a torch ``copy_`` of two slices costs
    several (slicing, dispatch, checks), which matters when a job is many scattered
    single-slot copies. Only the exact library already mapped into this process is used (found
    in ``/proc/self/maps``), so it shares torch's runtime state; a torch built with a static
    runtime has none, and the staged copier then copies through torch. Setting
    ``KVOFFLOAD_CUDA_RAW_MEMCPY=0`` turns the raw path off.
    """
    if os.environ.get("KVOFFLOAD_CUDA_RAW_MEMCPY", "1") == "0":
        return None
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({ln.split()[-1] for ln in f if "/libcudart.so" in ln})
    except OSError:
        return None
    for path in paths:
        try:
            fn = ctypes.CDLL(path).cudaMemcpyAsync
        except (OSError, AttributeError):
            continue
        fn.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        fn.restype = ctypes.c_int
        memcpy: MemcpyAsync = fn
        return memcpy
    return None


def _word_dtype(word: int) -> torch.dtype:
    return next(dt for size, dt in _WORD_DTYPES if size == word)


class StagedCopier:
    """Issues a plan's copies for the tensors on one device through one staging buffer.

    Device-agnostic: on a CUDA device call ``issue`` inside ``torch.cuda.stream(...)`` (the
    copies are then asynchronous on that stream, and the staging buffer is reused safely in
    stream order); on the CPU everything runs synchronously, which is how the tests check the
    index arithmetic without a GPU.
    """

    def __init__(
        self,
        device: torch.device,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        memcpy: MemcpyAsync | None = None,
    ) -> None:
        if staging_bytes <= 0:
            raise ValueError(f"staging_bytes must be positive, got {staging_bytes}")
        self.device = device
        self.staging_bytes = staging_bytes
        self._memcpy = memcpy
        self._buffer: torch.Tensor | None = None
        self._geometry: dict[tuple[str, tuple[int, ...]], _Geometry] = {}

    def _staging(self, nbytes: int) -> torch.Tensor:
        nbytes = (nbytes + 7) // 8 * 8
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None  # free the old one first (stream order keeps it safe)
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._buffer

    def geometry(self, cache: RegisteredCache, tensor_ids: list[int]) -> _Geometry:
        key = (cache.cache_id, tuple(tensor_ids))
        geo = self._geometry.get(key)
        if geo is None:
            if len(self._geometry) > 256:
                self._geometry.clear()
            geo = self._geometry[key] = _geometry(cache, tensor_ids)
        return geo

    def issue(
        self,
        plan: CopyPlan,
        pool_tensor: torch.Tensor,
        tensor_ids: list[int],
        *,
        split_every: int | None = None,
    ) -> None:
        """Queue every copy of ``plan`` that touches ``tensor_ids`` (all on this device)."""
        n = len(plan.device_blocks)
        if n == 0 or not tensor_ids:
            return
        cache = plan.cache
        geo = self.geometry(cache, tensor_ids)
        rows = max(1, min(n, self.staging_bytes // geo.row_bytes))
        buffer = self._staging(rows * geo.row_bytes)
        cuda = self.device.type == "cuda"
        index_cpu = torch.tensor(plan.device_blocks, dtype=torch.int64)
        index = index_cpu.pin_memory().to(self.device, non_blocking=True) if cuda else index_cpu
        wdt = _word_dtype(geo.word)
        w = geo.word
        views = [
            cache.tensors[s.tensor].view(wdt).view(s.outer, s.num_blocks, s.inner_bytes // w)
            for s in geo.segments
        ]
        block_bytes = pool_tensor.shape[1]
        pool_flat = pool_tensor.view(-1)
        full_block = geo.groups == ((0, 0, block_bytes),)
        for i0 in range(0, n, rows):
            i1 = min(n, i0 + rows)
            count = i1 - i0
            stage_w = buffer[: count * geo.row_bytes].view(count, geo.row_bytes).view(wdt)
            idx = index[i0:i1]
            parts = [
                stage_w[:, s.staging_offset // w : (s.staging_offset + s.nbytes) // w].view(
                    count, s.outer, s.inner_bytes // w
                )
                for s in geo.segments
            ]
            if plan.store:
                for view, part in zip(views, parts, strict=True):
                    part.copy_(view.index_select(1, idx).transpose(0, 1))
            copies: list[tuple[int, int, int]] = []  # (pool byte, staging byte, bytes)
            row = geo.row_bytes
            for c0, s0, length in plan.slot_runs(split_every, i0, i1):
                c = c0 - i0
                if full_block:
                    copies.append((s0 * block_bytes, c * row, length * row))
                    continue
                for r in range(length):
                    host_row = (s0 + r) * block_bytes
                    stage_row = (c + r) * row
                    for host_off, stage_off, nbytes in geo.groups:
                        copies.append((host_row + host_off, stage_row + stage_off, nbytes))
            self._move(plan.store, pool_flat, buffer, copies)
            if not plan.store:
                for view, part in zip(views, parts, strict=True):
                    view.index_copy_(1, idx, part.transpose(0, 1))

    def _move(
        self,
        store: bool,
        pool_flat: torch.Tensor,
        stage_flat: torch.Tensor,
        copies: list[tuple[int, int, int]],
    ) -> None:
        """Queue contiguous pool <-> staging copies, raw when possible, else through torch."""
        done = 0
        memcpy = self._memcpy
        if memcpy is not None and copies:
            host_base = pool_flat.data_ptr()
            dev_base = stage_flat.data_ptr()
            stream = (
                torch.cuda.current_stream(self.device).cuda_stream
                if self.device.type == "cuda"
                else 0
            )
            kind = _D2H if store else _H2D
            for host_off, dev_off, nbytes in copies:
                host = host_base + host_off
                dev = dev_base + dev_off
                code = (
                    memcpy(host, dev, nbytes, kind, stream)
                    if store
                    else memcpy(dev, host, nbytes, kind, stream)
                )
                if code != 0:
                    log.warning(
                        "cudaMemcpyAsync returned %d; copying through torch from now on", code
                    )
                    self._memcpy = None
                    break
                done += 1
        for host_off, dev_off, nbytes in copies[done:]:
            host_t = pool_flat[host_off : host_off + nbytes]
            dev_t = stage_flat[dev_off : dev_off + nbytes]
            if store:
                host_t.copy_(dev_t, non_blocking=True)
            else:
                dev_t.copy_(host_t, non_blocking=True)


@dataclass
class _Lane:
    """One GPU: a stream and a staging copier per direction."""

    index: int
    streams: dict[bool, Any]  # store? -> torch.cuda.Stream
    copiers: dict[bool, StagedCopier]


@dataclass
class _Issued:
    entry: HeldJob
    events: list[Any]
    error: str | None  # set when issuing failed part-way; reported once the events drain

    def done(self) -> bool:
        return all(e.query() for e in self.events)


def _new_stream(index: int, priority: int) -> Any:
    return torch.cuda.Stream(device=index, priority=priority)  # type: ignore[no-untyped-call]


def _device_index(device: str) -> int:
    index = torch.device(device).index
    return 0 if index is None else index


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
        poll_interval_s: float = 0.0005,
        raw_memcpy: bool = True,
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("the cuda transfer backend needs CUDA; use backend='cpu'")
        if staging_bytes <= 0:
            raise ValueError(f"staging_bytes must be positive, got {staging_bytes}")
        super().__init__(pool, registry, on_finished)
        self.staging_bytes = staging_bytes
        self._poll_interval = poll_interval_s
        torch.cuda.init()  # type: ignore[no-untyped-call]  # runtime loaded before the lookup
        self._memcpy = find_cuda_memcpy() if raw_memcpy else None
        self._pool_tensor = pool.tensor
        self._split_every = pool.pin_chunk_blocks
        self._lanes: dict[int, _Lane] = {}
        self._issued: dict[int, _Issued] = {}  # touched only by the issuing thread
        self._abandon = False
        self._thread = threading.Thread(
            target=self._run, name="kvoffload-cuda-transfer", daemon=True
        )
        self._thread.start()

    @property
    def raw_memcpy(self) -> bool:
        """True when pool copies go through ``cudaMemcpyAsync`` directly."""
        return self._memcpy is not None

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

    # ---------------------------------------------------------------- the issuing thread

    def _run(self) -> None:
        while True:
            expired: list[int] = []
            with self._cond:
                if self._abandon or (self._closed and not self._issued and not self._queued()):
                    return
                now = time.monotonic()
                picked = self._pop_locked(now, expired)
                if picked is None and not expired:
                    if self._issued:
                        self._cond.wait(self._poll_interval)
                    else:
                        nxt = self._next_deadline_locked(self._queued())
                        self._cond.wait(None if nxt is None else max(0.0, nxt - now))
                        continue
            if expired:
                self._finish((j, False, "deadline") for j in expired)
            if picked is not None:
                self._issue(*picked)
            self._poll()

    def _queued(self) -> list[int]:
        return [*self._loads, *self._stores]

    def _lane(self, index: int) -> _Lane:
        lane = self._lanes.get(index)
        if lane is None:
            with torch.cuda.device(index):
                streams = {
                    True: _new_stream(index, STORE_PRIORITY),
                    False: _new_stream(index, LOAD_PRIORITY),
                }
            device = torch.device("cuda", index)
            copiers = {
                True: StagedCopier(device, self.staging_bytes, self._memcpy),
                False: StagedCopier(device, self.staging_bytes, self._memcpy),
            }
            lane = self._lanes[index] = _Lane(index, streams, copiers)
        return lane

    def _issue(self, job_id: int, entry: HeldJob) -> None:
        plan = entry.plan
        events: list[Any] = []
        error: str | None = None
        by_device: dict[int, list[int]] = {}
        has_cpu = False
        for t, lay in enumerate(plan.cache.layouts):
            if lay.device == "cpu":
                has_cpu = True
            else:
                by_device.setdefault(_device_index(lay.device), []).append(t)
        try:
            if has_cpu:
                copy_on_cpu(plan, self._pool_tensor, deadline=entry.deadline, only_cpu=True)
            for index, tensor_ids in by_device.items():
                lane = self._lane(index)
                stream = lane.streams[plan.store]
                with torch.cuda.device(index), torch.cuda.stream(stream):
                    # Order after work already queued on this process's default stream, so
                    # in-process (embedded) caches see their writes; free for the service.
                    stream.wait_stream(torch.cuda.default_stream(index))
                    try:
                        lane.copiers[plan.store].issue(
                            plan, self._pool_tensor, tensor_ids, split_every=self._split_every
                        )
                    finally:
                        # Recorded even after a partial issue: the job is reported only once
                        # what was queued has drained.
                        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                        event.record(stream)
                        events.append(event)
        except CopyAborted:
            error = "deadline"
        except Exception as exc:
            error = f"copy failed: {type(exc).__name__}: {exc}"
        self._issued[job_id] = _Issued(entry, events, error)

    def _poll(self) -> None:
        now = time.monotonic()
        outcomes: list[tuple[int, bool, str | None]] = []
        for job_id, issued in list(self._issued.items()):
            try:
                done = issued.done()
            except Exception as exc:  # a sticky CUDA error surfaces here
                done = True
                issued.error = issued.error or f"cuda error: {exc}"
            if done:
                del self._issued[job_id]
                outcomes.append((job_id, issued.error is None, issued.error))
            elif issued.entry.deadline <= now and issued.error is None:
                # Copies on a stream cannot be cancelled: the job has failed, but it is
                # reported only when they end. Reporting it now would let the service free
                # its host slots (a store) or unpin them (a load), and let the engine reuse
                # its device blocks, while a DMA still writes into one of them.
                issued.error = "deadline"
        if outcomes:
            self._finish(outcomes)

    def _stop(self, timeout: float) -> None:
        with self._cond:
            queued = self._queued()
            self._loads.clear()
            self._stores.clear()
            self._cond.notify_all()
        self._finish((j, False, "shutdown") for j in queued)
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._cond:
                self._abandon = True
                self._cond.notify_all()
            self._thread.join()
        self._issued.clear()
        self._lanes.clear()
