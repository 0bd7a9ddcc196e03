"""The CUDA backend's control flow (issue, event polling, deadlines, shutdown) on the CPU.

``torch.cuda`` is replaced by fakes: streams and device guards do nothing, and events complete
when the test opens a gate. The staged copies run on the CPU, so the bytes are real.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any

import pytest
import torch

from tests.transfer.helpers import mixed_block_bytes
from tests.transfer.kvref import host_block, mixed_layout
from transfer import KVCacheRegistry, TransferJob, cuda_worker
from transfer.cuda_worker import CudaTransferWorker, StagedCopier

N = 24
SLOTS = 32


class FakeStream:
    cuda_stream = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.waits = 0

    def wait_stream(self, other: Any) -> None:
        self.waits += 1


class FakeEvent:
    gate = threading.Event()
    recorded = 0

    def record(self, stream: Any) -> None:
        FakeEvent.recorded += 1

    def query(self) -> bool:
        return FakeEvent.gate.is_set()


@pytest.fixture
def fake_cuda(monkeypatch):
    FakeEvent.gate = threading.Event()
    FakeEvent.gate.set()
    FakeEvent.recorded = 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "default_stream", lambda index: FakeStream())
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(cuda_worker, "_new_stream", lambda index, priority: FakeStream())
    monkeypatch.setattr(cuda_worker, "find_cuda_memcpy", lambda: None)
    # The copier works on the CPU whatever device it is given.
    monkeypatch.setattr(
        cuda_worker,
        "StagedCopier",
        lambda device, staging, memcpy: StagedCopier(torch.device("cpu"), staging, memcpy),
    )
    return FakeEvent


@pytest.fixture
def world(fake_cuda, make_pool):
    pool = make_pool(SLOTS, mixed_block_bytes(N), pin=False)
    registry = KVCacheRegistry(pool)
    gen = torch.Generator().manual_seed(3)
    layout = mixed_layout(N)
    tensors = [
        torch.randint(-50, 50, shape, generator=gen).to(getattr(torch, dt))
        for shape, dt, _bd in layout
    ]
    real = registry.register_tensors("gpu", tensors, [bd for _s, _d, bd in layout])
    # Label the tensors as living on cuda:0 (they are CPU tensors under the fakes).
    cache = dataclasses.replace(
        real,
        device="cuda:0",
        layouts=tuple(dataclasses.replace(lay, device="cuda:0") for lay in real.layouts),
    )
    registry._caches[cache.cache_id] = cache
    workers: list[CudaTransferWorker] = []

    def make(**kwargs: Any) -> CudaTransferWorker:
        w = CudaTransferWorker(pool, registry, poll_interval_s=0.001, **kwargs)
        workers.append(w)
        return w

    originals = [t.clone() for t in cache.tensors]
    yield pool, cache, layout, originals, make
    fake_cuda.gate.set()
    for w in workers:
        w.shutdown(timeout=5)


def test_round_trip_through_the_issuing_thread(world) -> None:
    pool, cache, layout, originals, make = world
    w = make(staging_bytes=1000)  # several chunks per job
    blocks, slots = [4, 9, 1, 17, 23], [30, 2, 3, 4, 11]
    jid = w.submit(TransferJob("store", cache.cache_id, blocks, slots, 30.0))
    [r] = w.wait([jid], timeout=30)
    assert r.ok, r.reason
    for b, s in zip(blocks, slots, strict=True):
        assert torch.equal(pool.tensor[s], host_block(originals, layout, b))
    for t in cache.tensors:
        t.zero_()
    jid = w.submit(TransferJob("load", cache.cache_id, blocks, slots, 30.0))
    [r] = w.wait([jid], timeout=30)
    assert r.ok, r.reason
    for b in blocks:
        assert torch.equal(
            host_block(list(cache.tensors), layout, b), host_block(originals, layout, b)
        )
    assert FakeEvent.recorded == 2  # one event per job (one device)
    assert w.raw_memcpy is False


def test_an_issued_job_past_its_deadline_is_reported_failed_only_when_its_copies_end(
    world, fake_cuda
) -> None:
    """Copies on a stream cannot be cancelled: reporting the job before they end would free
    its slots (or the engine's device blocks) under a running DMA."""
    _pool, cache, _layout, _originals, make = world
    w = make()
    fake_cuda.gate.clear()  # the "GPU" does not finish
    slow = w.submit(TransferJob("store", cache.cache_id, [0], [0], 0.05))
    assert w.wait([slow], timeout=0.5) == []  # well past its deadline: not reported yet
    assert [job_id for job_id, _age in w.in_flight()] == [slow]
    fake_cuda.gate.set()  # the copies end
    [r] = w.wait([slow], timeout=30)
    assert (r.ok, r.reason) == (False, "deadline")  # failed all the same: it was too late
    assert w.in_flight() == []
    quick = w.submit(TransferJob("store", cache.cache_id, [1], [1], 30.0))
    [r] = w.wait([quick], timeout=30)
    assert r.ok


def test_later_jobs_are_not_hidden_by_a_slow_one(world, fake_cuda) -> None:
    _pool, cache, _layout, _originals, make = world
    w = make()
    fake_cuda.gate.clear()
    first = w.submit(TransferJob("store", cache.cache_id, [0], [0], 30.0))
    second = w.submit(TransferJob("load", cache.cache_id, [5], [5], 30.0))
    assert w.wait([first, second], timeout=0.05) == []
    fake_cuda.gate.set()
    results = w.wait([first, second], timeout=30)
    assert sorted(r.job_id for r in results) == [first, second]


def test_shutdown_fails_what_the_gpu_never_finished(world, fake_cuda) -> None:
    _pool, cache, _layout, _originals, make = world
    w = make()
    fake_cuda.gate.clear()
    ids = [w.submit(TransferJob("store", cache.cache_id, [i], [i], 60.0)) for i in range(3)]
    w.shutdown(timeout=0.2)
    results = w.poll_finished()
    assert sorted(r.job_id for r in results) == ids
    assert {(r.ok, r.reason) for r in results} == {(False, "shutdown")}


def test_issue_errors_fail_the_job(world, monkeypatch) -> None:
    _pool, cache, _layout, _originals, make = world
    w = make()

    def boom(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(StagedCopier, "issue", boom)
    jid = w.submit(TransferJob("store", cache.cache_id, [0], [0], 30.0))
    [r] = w.wait([jid], timeout=30)
    assert not r.ok
    assert r.reason == "copy failed: RuntimeError: CUDA error: out of memory"


def test_refuses_caches_on_missing_gpus(world) -> None:
    _pool, cache, _layout, _originals, make = world
    w = make()
    far = dataclasses.replace(
        cache, layouts=tuple(dataclasses.replace(lay, device="cuda:3") for lay in cache.layouts)
    )
    with pytest.raises(ValueError, match=r"cuda:3, which this worker cannot reach \(1 GPUs\)"):
        w._check_cache(far)
