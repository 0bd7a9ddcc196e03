"""Fake CUDA for the CPU tests of the CUDA backend: streams, events and raw copy calls.

``FakeRaw`` plays the raw runtime (``transfer.cudart.RawCuda``) on host memory: its 2D and
batched copies are ``memmove`` loops, it counts calls, and it can be told to fail, so the direct
copier's address arithmetic and fallbacks are checked byte for byte without a GPU.
``install`` replaces ``torch.cuda`` and the worker's seams: streams and device guards do
nothing, and events fire when the test opens a gate (or raise a chosen error).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import weakref
from typing import Any

import pytest
import torch

from transfer import cuda_worker
from transfer.cuda_copy import StagedCopier
from transfer.cudart import RawCuda


class FakeRaw:
    """Raw CUDA calls on host memory; ``fail_batch`` / ``fail_2d_from`` make them refuse."""

    def __init__(self, batch: bool = True, fail_batch: bool = False) -> None:
        self.batch_calls = 0
        self.calls_2d = 0
        self.memcpy_calls = 0
        self.last_error_resets = 0
        self.fail_batch = fail_batch
        self.fail_2d_from: int | None = None
        self.batch_code = 1  # what a refused batch returns (CUDA_ERROR_INVALID_VALUE)
        self.code_2d = 1  # what a refused 2D copy returns (cudaErrorInvalidValue)
        self.streams: set[int] = set()
        self.has_batch = batch
        self.bound: list[int] = []  # cudaSetDevice calls: the devices threads were bound to

    def memcpy(self, dst: int, src: int, n: int, kind: int, stream: int) -> int:
        self.memcpy_calls += 1
        ctypes.memmove(dst, src, n)
        return 0

    def memcpy2d(
        self,
        dst: int,
        dpitch: int,
        src: int,
        spitch: int,
        width: int,
        height: int,
        kind: int,
        stream: int,
    ) -> int:
        self.calls_2d += 1
        self.streams.add(stream)
        if self.fail_2d_from is not None and self.calls_2d >= self.fail_2d_from:
            return self.code_2d
        assert width <= dpitch
        assert width <= spitch
        for r in range(height):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)
        return 0

    def batch(self, dsts: int, srcs: int, sizes: int, count: int, stream: int) -> int:
        self.batch_calls += 1
        self.streams.add(stream)
        if self.fail_batch:
            return self.batch_code
        arr = ctypes.c_uint64 * count
        d, s, z = arr.from_address(dsts), arr.from_address(srcs), arr.from_address(sizes)
        for i in range(count):
            ctypes.memmove(d[i], s[i], z[i])
        return 0

    def get_last_error(self) -> int:
        self.last_error_resets += 1
        return 0

    def set_device(self, index: int) -> int:
        self.bound.append(index)
        return 0

    def raw(self) -> RawCuda:
        return RawCuda(
            self.memcpy,
            self.memcpy2d,
            self.batch if self.has_batch else None,
            self.get_last_error,
            set_device=self.set_device,
        )


class FakeStream:
    cuda_stream = 7

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.waits = 0
        self.waited_events: list[Any] = []

    def wait_stream(self, other: Any) -> None:
        self.waits += 1

    def wait_event(self, event: Any) -> None:
        self.waited_events.append(event)


class FakeEvent:
    """Fires when ``gate`` is set; ``error`` (if set) is raised by ``synchronize``."""

    gate = threading.Event()
    error: BaseException | None = None
    recorded = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        FakeEvent.recorded += 1

    def synchronize(self) -> None:
        FakeEvent.gate.wait()
        if FakeEvent.error is not None:
            raise FakeEvent.error

    def query(self) -> bool:
        return FakeEvent.gate.is_set()


class World:
    """What ``install`` set up: the fake raw runtime, the events, the IPC events opened."""

    def __init__(self, raw: FakeRaw | None) -> None:
        self.raw = raw
        self.events = FakeEvent
        self.ipc_opened: list[tuple[int, bytes]] = []


def install(monkeypatch: pytest.MonkeyPatch, raw: FakeRaw | None, devices: int = 1) -> World:
    """Fake ``torch.cuda`` for the worker; ``raw`` None: the staged (torch) copy path."""
    FakeEvent.gate = threading.Event()
    FakeEvent.gate.set()
    FakeEvent.error = None
    FakeEvent.recorded = 0
    world = World(raw)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "default_stream", lambda index: FakeStream())
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(cuda_worker, "_new_stream", lambda index, priority: FakeStream())
    monkeypatch.setattr(cuda_worker, "_new_event", FakeEvent)
    # A fake poisoning stays in this test: the process-wide flag and kept caches are its own.
    monkeypatch.setattr(cuda_worker, "_POISONED", threading.Event())
    monkeypatch.setattr(cuda_worker, "_KEPT_AFTER_POISON", [])
    monkeypatch.setattr(cuda_worker, "_WORKERS", weakref.WeakSet())

    def open_ipc(index: int, handle: bytes) -> FakeEvent:
        world.ipc_opened.append((index, handle))
        return FakeEvent()

    monkeypatch.setattr(cuda_worker, "_open_ipc_event", open_ipc)
    monkeypatch.setattr(cuda_worker, "find_raw_cuda", lambda: None if raw is None else raw.raw())
    # The staged copier works on the CPU whatever device it is given.
    monkeypatch.setattr(
        cuda_worker,
        "StagedCopier",
        lambda device, staging, memcpy, side: StagedCopier(torch.device("cpu"), staging, memcpy),
    )
    return world
