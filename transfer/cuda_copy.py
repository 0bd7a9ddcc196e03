"""How the CUDA backend moves a job's bytes: two copiers over the raw calls of ``transfer.cudart``.

A host block interleaves every tensor's part of a device block (``transfer.kv_cache``), so a
block of a tensor is ``outer`` pieces of ``inner_bytes`` on the device, at a pitch of
``num_blocks * inner_bytes``, and ``outer`` adjacent pieces in the host block. Two copiers:

- ``DirectCopier`` (the default wherever this process's CUDA runtime can be called directly):
  copy-engine DMA straight between the device tensors (in-process or CUDA IPC memory) and the
  pinned pool, no staging buffer and no SM kernel, so the engine's kernels keep every SM.
  Each chunk of a job is **one** ``cuMemcpyBatchAsync`` call over every piece of every block
  where the driver has it (CUDA >= 12.8); else one ``cudaMemcpy2DAsync`` per tensor and block
  (a tensor with ``outer == 1`` merges a run of consecutive blocks and slots into one).
- ``StagedCopier`` (when the runtime cannot be called directly, e.g. a static CUDA build of
  torch): gathers blocks into a device staging buffer with torch ops (``index_select`` per
  tensor, SM kernels), then one copy per run of host slots; loads mirror it. Two staging
  buffers in ping-pong: with ``side_stream`` given (the worker's), the gather of chunk k+1
  runs on it while chunk k's DMA runs on the copy stream, ordered by events.

Launches per chunk (``launches`` counts them, the tests check it): a 2 MiB block of 80
tensors ``[2, N, ...]`` costs the direct copier 1 call per chunk (batch) or 80 DMAs (2D, one
per tensor); the staged copier 160 kernels (two per tensor) plus one DMA per slot run plus
the index upload, which is what every job cost before the direct copier (162 for one block).

Both copiers are generators of chunks (``chunks``): each ``next`` queues one chunk's copies on
the given stream and yields its bytes, so the worker can cap bytes in flight per stream and
slip a load between two chunks of a store. On the CPU (tests) every copy is synchronous.

A raw call that fails (non-zero ``cudaError_t``) clears the thread's last CUDA error
(``cudaGetLastError``) so the next torch call does not trip over it, and raises
``transfer.cudart.CudaCallError`` (code and name; ``sticky`` for the codes that lose the
context). A failed batch is re-issued as 2D copies (rewriting the same bytes); only when those
work is the batch call given up for good (``DirectCopier``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from transfer.cudart import CudaCallError, MemcpyAsync, RawCuda, find_raw_cuda
from transfer.kv_cache import RegisteredCache
from transfer.worker import CopyPlan

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_STAGING_BYTES",
    "DirectCopier",
    "StagedCopier",
    "find_cuda_memcpy",
]

log = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 32 << 20
"""Bytes per staging buffer of the staged copier (two per device and direction)."""
DEFAULT_CHUNK_BYTES = 16 << 20
"""Bytes per chunk of the direct copier: the unit of in-flight accounting and of preemption."""
DEFAULT_MAX_PITCH = (1 << 31) - 1
"""``cudaDevAttrMaxPitch`` of every current NVIDIA GPU, used where the device is not asked."""

H2D = 1  # cudaMemcpyHostToDevice
D2H = 2  # cudaMemcpyDeviceToHost
_WORD_DTYPES = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def find_cuda_memcpy() -> MemcpyAsync | None:
    """``cudaMemcpyAsync`` alone (``find_raw_cuda``'s), or None."""
    raw = find_raw_cuda()
    return None if raw is None else raw.memcpy


# --------------------------------------------------------------------------- geometry


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


def _word_dtype(word: int) -> torch.dtype:
    return next(dt for size, dt in _WORD_DTYPES if size == word)


class _GeometryCache:
    def __init__(self) -> None:
        self._geometry: dict[tuple[str, tuple[int, ...]], _Geometry] = {}

    def geometry(self, cache: RegisteredCache, tensor_ids: list[int]) -> _Geometry:
        key = (cache.cache_id, tuple(tensor_ids))
        geo = self._geometry.get(key)
        if geo is None:
            if len(self._geometry) > 256:
                self._geometry.clear()
            geo = self._geometry[key] = _geometry(cache, tensor_ids)
        return geo


# --------------------------------------------------------------------------- direct DMA


class DirectCopier(_GeometryCache):
    """DMA between device tensors and the pinned pool, no staging; see the module docstring.

    ``raw`` must have ``batch`` or ``memcpy2d``. Chunks hold at most ``chunk_bytes`` of blocks
    (at least one block) and never cross ``split_every`` (a pinned-chunk boundary of the pool:
    one copy must stay inside one ``cudaHostRegister`` range). ``max_pitch`` is the device's
    largest 2D-copy pitch (``cudaDevAttrMaxPitch``; None: unknown, taken as 2 GiB - 1): a
    tensor whose K/V halves lie further apart is copied piece by piece instead. ``batch=False``
    never uses the batch call (a pageable pool: its location hints are left unset here).

    A failed batch call is retried as 2D copies; if those succeed the batch call is what does
    not work here and no copier of ``raw`` uses it again; if they fail too the job fails and
    the batch call stays (the addresses were at fault). A sticky error code raises at once.
    """

    def __init__(
        self,
        raw: RawCuda,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        *,
        max_pitch: int | None = None,
        batch: bool = True,
    ) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        if raw.batch is None and raw.memcpy2d is None:
            raise ValueError("the direct copier needs cuMemcpyBatchAsync or cudaMemcpy2DAsync")
        super().__init__()
        self.raw = raw
        self.chunk_bytes = chunk_bytes
        self.max_pitch = DEFAULT_MAX_PITCH if max_pitch is None else max_pitch
        self.use_batch = batch and raw.batch is not None
        self.batch_failures = 0  # batch calls refused (each retried as 2D copies)
        self.launches = 0  # raw calls issued (batches or 2D copies), for tests and benches

    def chunks(
        self,
        plan: CopyPlan,
        pool_tensor: torch.Tensor,
        tensor_ids: list[int],
        stream: int,
        *,
        split_every: int | None = None,
    ) -> Iterator[int]:
        """Queue ``plan``'s copies for ``tensor_ids`` chunk by chunk; yields bytes per chunk."""
        n = len(plan.device_blocks)
        if n == 0 or not tensor_ids:
            return
        cache = plan.cache
        geo = self.geometry(cache, tensor_ids)
        rows = max(1, min(n, self.chunk_bytes // max(1, geo.row_bytes)))
        block_bytes = pool_tensor.shape[1]
        pool_base = pool_tensor.data_ptr()
        bases = [cache.tensors[s.tensor].data_ptr() for s in geo.segments]
        i0 = 0
        while i0 < n:
            i1 = min(n, i0 + rows)
            if split_every:
                # Never cross a pinned-chunk boundary within one chunk's host range.
                limit = (plan.host_slots[i0] // split_every + 1) * split_every
                i1 = next((i for i in range(i0, i1) if plan.host_slots[i] >= limit), i1)
            blocks = plan.device_blocks[i0:i1]
            slots = plan.host_slots[i0:i1]
            args = (plan.store, geo, bases, pool_base, block_bytes, blocks, slots, stream)
            # The batch call refuses the legacy NULL stream (0); the worker never passes it.
            batch = self.use_batch and self.raw.batch is not None and stream
            code = self._batch(*args) if batch else None
            if code is None:
                self._copy_2d(*args)
            elif code != 0:
                self._batch_failed(code, args)
            yield (i1 - i0) * geo.row_bytes
            i0 = i1

    def _batch_failed(self, code: int, args: tuple[Any, ...]) -> None:
        error = self.raw.failed("cuMemcpyBatchAsync", code, driver=True)
        if error.sticky:
            raise error
        self.batch_failures += 1
        self._copy_2d(*args)  # raises if the chunk cannot be copied either way
        log.warning("%s, but 2D copies work; using cudaMemcpy2DAsync from now on", error)
        self.raw.batch = None  # for every copier of this runtime: the call does not work here

    def _batch(
        self,
        store: bool,
        geo: _Geometry,
        bases: list[int],
        pool_base: int,
        block_bytes: int,
        blocks: list[int],
        slots: list[int],
        stream: int,
    ) -> int:
        """One batched call over every piece of every block; its ``CUresult``."""
        dev_base: list[int] = []
        dev_step: list[int] = []
        host_off: list[int] = []
        sizes: list[int] = []
        for seg, base in zip(geo.segments, bases, strict=True):
            pitch = seg.num_blocks * seg.inner_bytes
            for k in range(seg.outer):
                dev_base.append(base + k * pitch)
                dev_step.append(seg.inner_bytes)
                host_off.append(seg.host_offset + k * seg.inner_bytes)
                sizes.append(seg.inner_bytes)
        # [pairs, pieces] addresses in host order, built without a Python loop over pieces.
        b = torch.tensor(blocks, dtype=torch.int64)[:, None]
        s = torch.tensor(slots, dtype=torch.int64)[:, None]
        dev = torch.tensor(dev_base, dtype=torch.int64) + b * torch.tensor(dev_step)
        host = pool_base + s * block_bytes + torch.tensor(host_off, dtype=torch.int64)
        size = torch.tensor(sizes, dtype=torch.int64).expand(len(blocks), -1).contiguous()
        src, dst = (dev, host) if store else (host, dev)
        src, dst = src.contiguous(), dst.contiguous()
        assert self.raw.batch is not None
        self.launches += 1
        return int(
            self.raw.batch(dst.data_ptr(), src.data_ptr(), size.data_ptr(), size.numel(), stream)
        )

    def _copy_2d(
        self,
        store: bool,
        geo: _Geometry,
        bases: list[int],
        pool_base: int,
        block_bytes: int,
        blocks: list[int],
        slots: list[int],
        stream: int,
    ) -> None:
        memcpy2d = self.raw.memcpy2d
        if memcpy2d is None:
            raise RuntimeError("cuMemcpyBatchAsync failed and cudaMemcpy2DAsync is missing")
        kind = D2H if store else H2D
        n = len(blocks)
        for seg, base in zip(geo.segments, bases, strict=True):
            inner, pitch = seg.inner_bytes, seg.num_blocks * seg.inner_bytes
            # A pitch above the device's limit (a K/V half, or a block, over 2 GiB): piecewise.
            if (pitch if seg.outer > 1 else block_bytes) > self.max_pitch:
                self._copy_pieces(store, seg, base, pool_base, block_bytes, blocks, slots, stream)
                continue
            i = 0
            while i < n:
                j = i + 1
                if seg.outer == 1:  # a run of blocks and slots is one 2D copy
                    while j < n and blocks[j] == blocks[j - 1] + 1 and slots[j] == slots[j - 1] + 1:
                        j += 1
                host = pool_base + slots[i] * block_bytes + seg.host_offset
                dev = base + blocks[i] * inner
                if seg.outer == 1:
                    # rows: blocks; device rows adjacent (pitch inner), host rows a block apart
                    h_pitch, d_pitch, height = block_bytes, inner, j - i
                else:
                    # rows: the outer pieces of one block
                    h_pitch, d_pitch, height = inner, pitch, seg.outer
                self.launches += 1
                if store:
                    code = memcpy2d(host, h_pitch, dev, d_pitch, inner, height, kind, stream)
                else:
                    code = memcpy2d(dev, d_pitch, host, h_pitch, inner, height, kind, stream)
                if code != 0:
                    raise self.raw.failed("cudaMemcpy2DAsync", code)
                i = j

    def _copy_pieces(
        self,
        store: bool,
        seg: _Segment,
        base: int,
        pool_base: int,
        block_bytes: int,
        blocks: list[int],
        slots: list[int],
        stream: int,
    ) -> None:
        """One ``cudaMemcpyAsync`` per outer piece: for a tensor whose 2D copy would need a
        pitch above the device's limit."""
        kind = D2H if store else H2D
        inner, pitch = seg.inner_bytes, seg.num_blocks * seg.inner_bytes
        for block, slot in zip(blocks, slots, strict=True):
            host0 = pool_base + slot * block_bytes + seg.host_offset
            for k in range(seg.outer):
                host, dev = host0 + k * inner, base + k * pitch + block * inner
                self.launches += 1
                if store:
                    code = self.raw.memcpy(host, dev, inner, kind, stream)
                else:
                    code = self.raw.memcpy(dev, host, inner, kind, stream)
                if code != 0:
                    raise self.raw.failed("cudaMemcpyAsync", code)


# --------------------------------------------------------------------------- staged


class StagedCopier(_GeometryCache):
    """Copies through two device staging buffers in ping-pong; see the module docstring.

    Device-agnostic: on a CUDA device run ``chunks`` inside ``torch.cuda.stream(copy_stream)``
    with ``side_stream`` the stream the gathers and scatters run on (None: everything on the
    copy stream, in order); on the CPU everything runs synchronously, which is how the tests
    check the index arithmetic without a GPU.
    """

    def __init__(
        self,
        device: torch.device,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        memcpy: MemcpyAsync | None = None,
        side_stream: Any = None,
    ) -> None:
        if staging_bytes <= 0:
            raise ValueError(f"staging_bytes must be positive, got {staging_bytes}")
        super().__init__()
        self.device = device
        self.staging_bytes = staging_bytes
        self._memcpy = memcpy
        self._clear_error: Callable[[], int] | None = None
        self._side = side_stream
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._free: list[Any] = [None, None]  # event: the buffer's last DMA / scatter ended
        self._next = 0
        self.launches = 0

    def _staging(self, which: int, nbytes: int) -> torch.Tensor:
        nbytes = (nbytes + 7) // 8 * 8
        buf = self._buffers[which]
        if buf is None or buf.numel() < nbytes:
            self._buffers[which] = None  # free the old one first (stream order keeps it safe)
            buf = self._buffers[which] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf

    def issue(
        self,
        plan: CopyPlan,
        pool_tensor: torch.Tensor,
        tensor_ids: list[int],
        *,
        split_every: int | None = None,
    ) -> None:
        """Queue every copy of ``plan`` that touches ``tensor_ids`` (all on this device)."""
        for _ in self.chunks(plan, pool_tensor, tensor_ids, 0, split_every=split_every):
            pass

    def chunks(
        self,
        plan: CopyPlan,
        pool_tensor: torch.Tensor,
        tensor_ids: list[int],
        stream: int,
        *,
        split_every: int | None = None,
    ) -> Iterator[int]:
        """Queue ``plan``'s copies chunk by chunk (one staging buffer each); yields bytes."""
        n = len(plan.device_blocks)
        if n == 0 or not tensor_ids:
            return
        cache = plan.cache
        geo = self.geometry(cache, tensor_ids)
        rows = max(1, min(n, self.staging_bytes // geo.row_bytes))
        cuda = self.device.type == "cuda"
        index_cpu = torch.tensor(plan.device_blocks, dtype=torch.int64)
        index = index_cpu.pin_memory().to(self.device, non_blocking=True) if cuda else index_cpu
        self.launches += 1  # the index upload (a copy on a GPU)
        wdt = _word_dtype(geo.word)
        w = geo.word
        views = [
            cache.tensors[s.tensor].view(wdt).view(s.outer, s.num_blocks, s.inner_bytes // w)
            for s in geo.segments
        ]
        block_bytes = pool_tensor.shape[1]
        pool_flat = pool_tensor.view(-1)
        full_block = geo.groups == ((0, 0, block_bytes),)
        copy_stream = torch.cuda.current_stream(self.device) if cuda else None
        if copy_stream is not None and not stream:
            stream = copy_stream.cuda_stream
        side = self._side if cuda else None
        if side is not None:
            side.wait_stream(copy_stream)  # the index upload, and the caller's waits
        for i0 in range(0, n, rows):
            i1 = min(n, i0 + rows)
            count = i1 - i0
            which = self._next
            self._next ^= 1
            buffer = self._staging(which, count * geo.row_bytes)
            stage_w = buffer[: count * geo.row_bytes].view(count, geo.row_bytes).view(wdt)
            idx = index[i0:i1]
            parts = [
                stage_w[:, s.staging_offset // w : (s.staging_offset + s.nbytes) // w].view(
                    count, s.outer, s.inner_bytes // w
                )
                for s in geo.segments
            ]
            if plan.store:
                with _on(side, self._free[which]):
                    for view, part in zip(views, parts, strict=True):
                        part.copy_(view.index_select(1, idx).transpose(0, 1))
                        self.launches += 2
                _join(copy_stream, side)
            elif self._free[which] is not None and copy_stream is not None:
                copy_stream.wait_event(self._free[which])
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
            self._move(plan.store, pool_flat, buffer, copies, stream)
            if plan.store:
                self._free[which] = _record(copy_stream)
            else:
                landed = _record(copy_stream)
                with _on(side, landed):
                    for view, part in zip(views, parts, strict=True):
                        view.index_copy_(1, idx, part.transpose(0, 1))
                        self.launches += 1
                self._free[which] = _record(side)
            yield count * geo.row_bytes
        if not plan.store:
            _join(copy_stream, side)  # the job's end event follows its last scatter

    def _move(
        self,
        store: bool,
        pool_flat: torch.Tensor,
        stage_flat: torch.Tensor,
        copies: list[tuple[int, int, int]],
        stream: int,
    ) -> None:
        """Queue contiguous pool <-> staging copies, raw when possible, else through torch."""
        done = 0
        memcpy = self._memcpy
        self.launches += len(copies)
        if memcpy is not None and copies:
            host_base = pool_flat.data_ptr()
            dev_base = stage_flat.data_ptr()
            kind = D2H if store else H2D
            for host_off, dev_off, nbytes in copies:
                host = host_base + host_off
                dev = dev_base + dev_off
                code = (
                    memcpy(host, dev, nbytes, kind, stream)
                    if store
                    else memcpy(dev, host, nbytes, kind, stream)
                )
                if code != 0:
                    if self._clear_error is not None:
                        self._clear_error()
                    error = CudaCallError("cudaMemcpyAsync", code)
                    if error.sticky:
                        raise error
                    log.warning("%s; copying through torch from now on", error)
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


class _on:
    """Run the enclosed torch ops on ``stream`` after ``event`` (no-op for a None stream)."""

    def __init__(self, stream: Any, event: Any) -> None:
        self.stream = stream
        self.event = event
        self._ctx: Any = None

    def __enter__(self) -> None:
        if self.stream is None:
            return
        if self.event is not None:
            self.stream.wait_event(self.event)
        self._ctx = torch.cuda.stream(self.stream)
        self._ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)


def _record(stream: Any) -> Any:
    if stream is None:
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(stream)
    return event


def _join(waiter: Any, other: Any) -> None:
    """``waiter`` waits for everything queued on ``other`` so far (None: nothing to do)."""
    if waiter is not None and other is not None:
        waiter.wait_stream(other)
