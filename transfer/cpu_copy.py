"""Block copies between host-memory cache tensors and the host pool, by raw ``memmove``.

Used by the CPU backend for whole jobs and by the CUDA backend for the tensors of a cache that
live on the CPU. A block moves as ``outer`` contiguous pieces per tensor (see
``transfer.kv_cache``), each copied with one ``memmove`` between raw addresses. ``memmove``
runs without the GIL, costs well under a microsecond to call, and copies at memory speed;
per-piece torch ``copy_`` on views costs several microseconds of dispatch per call and fancy
indexing far more. Every address is derived from a block or slot that ``make_plan`` checked
against the cache and pool sizes; callers hold references to the pool and cache tensors while
copying, so no mapping can go away underneath.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable

import torch

from transfer.kv_cache import RegisteredCache
from transfer.worker import CopyPlan

__all__ = ["CHECK_BYTES", "CopyAborted", "copy_on_cpu"]

CHECK_BYTES = 8 << 20
"""Bytes copied between two deadline / abort checks (also the CPU backend's chunk size)."""

_memmove = ctypes.memmove


class CopyAborted(Exception):
    """Raised inside a copy loop that must stop (deadline passed or shutdown)."""


def _pieces(cache: RegisteredCache, only_cpu: bool) -> list[tuple[int, int, int]]:
    """``(device_base, inner_bytes, host_offset)`` per piece of a block, in host order.

    Piece k of tensor t for device block b lives at ``device_base + b * inner_bytes``.
    """
    out = []
    for lay, tensor in zip(cache.layouts, cache.tensors, strict=True):
        if only_cpu and lay.device != "cpu":
            continue
        base = tensor.data_ptr()
        stride = lay.num_blocks * lay.inner_bytes
        for k in range(lay.outer):
            out.append((base + k * stride, lay.inner_bytes, lay.host_offset + k * lay.inner_bytes))
    return out


def copy_on_cpu(
    plan: CopyPlan,
    pool_tensor: torch.Tensor,
    *,
    begin: int = 0,
    end: int | None = None,
    deadline: float = float("inf"),
    abort: Callable[[], bool] | None = None,
    only_cpu: bool = False,
) -> None:
    """Copy pairs ``[begin, end)`` of ``plan`` between host-memory tensors and the pool.

    Raises ``CopyAborted`` when ``deadline`` (monotonic) passes or ``abort()`` returns true;
    both are checked every few megabytes. ``only_cpu`` skips tensors that are not on the CPU
    (mixed caches on a GPU node).
    """
    pieces = _pieces(plan.cache, only_cpu)
    if not pieces:
        return
    blocks = plan.device_blocks
    slots = plan.host_slots
    stop = len(blocks) if end is None else end
    bb = pool_tensor.shape[1]
    host_base = pool_tensor.data_ptr()
    store = plan.store
    move = _memmove
    # Bytes between deadline checks, counted in pairs so the inner loop stays lean.
    check_every = max(1, CHECK_BYTES // max(1, sum(p[1] for p in pieces)))
    monotonic = time.monotonic
    if len(pieces) == 1 and pieces[0][1] == bb:
        # One piece spanning the whole host block: runs of consecutive slots and blocks are
        # contiguous on both sides, so each run is one memmove.
        dev_base, n, _off = pieces[0]
        i = begin
        while i < stop:
            j = i + 1
            while (
                j < stop
                and j - i < check_every
                and slots[j] == slots[j - 1] + 1
                and blocks[j] == blocks[j - 1] + 1
            ):
                j += 1
            host = host_base + slots[i] * bb
            dev = dev_base + blocks[i] * n
            if store:
                move(host, dev, (j - i) * n)
            else:
                move(dev, host, (j - i) * n)
            i = j
            if monotonic() > deadline or (abort is not None and abort()):
                raise CopyAborted
        return
    for start in range(begin, stop, check_every):
        for i in range(start, min(stop, start + check_every)):
            host = host_base + slots[i] * bb
            b = blocks[i]
            if store:
                for dev_base, n, off in pieces:
                    move(host + off, dev_base + b * n, n)
            else:
                for dev_base, n, off in pieces:
                    move(dev_base + b * n, host + off, n)
        if monotonic() > deadline or (abort is not None and abort()):
            raise CopyAborted
