"""The CUDA backend's control flow on the CPU: chunked issue, completion threads, deadlines,
ordering events, sticky errors, the pinned-pool rule and shutdown.

``torch.cuda`` is replaced by fakes (``tests.transfer.fake_cuda``): streams and device guards
do nothing, events fire when the test opens a gate, and the raw copy calls are ``memmove`` on
host memory, so the bytes are real.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import pytest
import torch

from tests.transfer.fake_cuda import FakeRaw, World, install
from tests.transfer.helpers import mixed_block_bytes
from testsupport.kvref import host_block, mixed_layout
from testsupport.polling import until
from transfer import HostPool, KVCacheRegistry, TransferJob, WorkerClosedError, cuda_worker
from transfer.cuda_copy import DirectCopier, StagedCopier
from transfer.cuda_worker import CudaTransferWorker, is_sticky_cuda_error
from transfer.cudart import CudaCallError
from transfer.errors import InvalidJobError

N = 24
SLOTS = 32
HANDLE = bytes(range(64))
PATHS = ["staged", "batch", "2d"]


def fake_raw(path: str) -> FakeRaw | None:
    return None if path == "staged" else FakeRaw(batch=path == "batch")


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, path: str) -> World:
    return install(monkeypatch, fake_raw(path))


@pytest.fixture
def world(fake, make_pool, monkeypatch):
    pool = make_pool(SLOTS, mixed_block_bytes(N), pin=False)
    # There is no cudaHostRegister here: the pool plays a pinned one (tests that need an
    # unpinned pool set it back).
    monkeypatch.setattr(HostPool, "pinned", property(lambda self: True))
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
        kwargs.setdefault("allow_pageable", True)
        kwargs.setdefault("sync_timeout_s", 5.0)
        w = CudaTransferWorker(pool, registry, **kwargs)
        workers.append(w)
        return w

    originals = [t.clone() for t in cache.tensors]
    yield pool, cache, layout, originals, make
    fake.events.gate.set()
    for w in workers:
        w.shutdown(timeout=5)


def test_round_trip_through_the_issuing_thread(world, fake, path) -> None:
    pool, cache, layout, originals, make = world
    w = make(staging_bytes=1000, chunk_bytes=1000)  # several chunks per job
    assert w.copy_path == path
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
    assert fake.events.recorded >= 4  # an event per chunk, several chunks per job
    if fake.raw is not None:
        assert fake.raw.streams == {7}  # every raw copy went on the lane's stream


def test_an_issued_job_past_its_deadline_is_reported_failed_only_when_its_copies_end(
    world, fake
) -> None:
    """Copies on a stream cannot be cancelled: reporting the job before they end would free
    its slots (or the engine's device blocks) under a running DMA."""
    _pool, cache, _layout, _originals, make = world
    w = make()
    fake.events.gate.clear()  # the "GPU" does not finish
    slow = w.submit(TransferJob("store", cache.cache_id, [0], [0], 0.05))
    until("an event recorded", lambda: fake.events.recorded >= 1, 30)
    assert w.wait([slow], timeout=0.3) == []  # past its deadline: not reported yet
    assert [job_id for job_id, _age in w.in_flight()] == [slow]
    fake.events.gate.set()  # the copies end
    [r] = w.wait([slow], timeout=30)
    assert (r.ok, r.reason) == (False, "deadline")  # failed all the same: it was too late
    assert w.in_flight() == []
    quick = w.submit(TransferJob("store", cache.cache_id, [1], [1], 30.0))
    [r] = w.wait([quick], timeout=30)
    assert r.ok


def test_a_load_goes_ahead_of_a_queued_store_within_the_in_flight_cap(world, fake) -> None:
    """One block per chunk and a cap of one block in flight per stream: while the "GPU" holds
    the store's first chunk, the store issues nothing more, and a load submitted meanwhile is
    issued at once on its own stream."""
    _pool, cache, _layout, _originals, make = world
    bb = cache.block_bytes
    w = make(chunk_bytes=bb, staging_bytes=bb, max_inflight_bytes=bb)
    fake.events.gate.clear()
    store = w.submit(TransferJob("store", cache.cache_id, list(range(6)), list(range(6)), 30.0))
    until("one event recorded", lambda: fake.events.recorded == 1, 30)
    load = w.submit(TransferJob("load", cache.cache_id, [20], [20], 30.0))
    until(
        "two events recorded", lambda: fake.events.recorded == 2, 30
    )  # the load's chunk, not the store's second
    assert w._active[True] is not None
    assert w._active[True].part == 0
    assert w._lanes[0].inflight == {True: bb, False: bb}
    fake.events.gate.set()
    results = {r.job_id: r for r in w.wait([store, load], timeout=30)}
    assert results[store].ok
    assert results[load].ok
    assert fake.events.recorded == 7  # six store chunks and one load chunk


def test_the_streams_wait_on_the_engines_ipc_event(world, fake) -> None:
    _pool, cache, _layout, _originals, make = world
    w = make()
    jid = w.submit(TransferJob("store", cache.cache_id, [2], [2], 30.0, wait_event=HANDLE))
    [r] = w.wait([jid], timeout=30)
    assert r.ok, r.reason
    assert fake.ipc_opened == [(0, HANDLE)]
    assert len(w._lanes[0].streams[True].waited_events) == 1
    with pytest.raises(InvalidJobError, match="wait_event must be a 64-byte"):
        w.submit(TransferJob("store", cache.cache_id, [2], [2], 30.0, wait_event=b"x"))


def test_a_sticky_cuda_error_poisons_the_worker(world, fake) -> None:
    _pool, cache, _layout, _originals, make = world
    w = make()
    fake.events.gate.clear()
    fake.events.error = RuntimeError("CUDA error: an illegal memory access was encountered")
    first = w.submit(TransferJob("store", cache.cache_id, [0], [0], 30.0))
    until("an event recorded", lambda: fake.events.recorded >= 1, 30)
    fake.events.gate.set()
    [r] = w.wait([first], timeout=30)
    assert not r.ok
    assert "illegal memory access" in (r.reason or "")
    until("the worker failed", lambda: w.fatal is not None, 30)
    assert "illegal memory access" in (w.fatal or "")
    with pytest.raises(WorkerClosedError, match="illegal memory access"):
        w.submit(TransferJob("store", cache.cache_id, [1], [1], 30.0))


def test_sticky_errors_are_told_from_ordinary_ones() -> None:
    assert is_sticky_cuda_error(RuntimeError("CUDA error: unspecified launch failure"))
    assert is_sticky_cuda_error(RuntimeError("CUDA error: misaligned address"))
    assert is_sticky_cuda_error(RuntimeError("CUDA error: the launch timed out and was terminated"))
    assert not is_sticky_cuda_error(RuntimeError("CUDA error: out of memory"))
    assert not is_sticky_cuda_error(RuntimeError("CUDA error: invalid argument"))
    # A raw call's code, and torch's AcceleratorError code, whatever the text says.
    assert is_sticky_cuda_error(CudaCallError("cudaMemcpy2DAsync", 700))
    assert not is_sticky_cuda_error(CudaCallError("cudaMemcpy2DAsync", 1))
    coded = RuntimeError("CUDA error")
    coded.error_code = 719  # type: ignore[attr-defined]
    assert is_sticky_cuda_error(coded)


@pytest.mark.parametrize("path", ["2d"])
def test_a_raw_call_s_sticky_code_poisons_the_worker_and_keeps_the_mappings(world, fake) -> None:
    """A raw copy says only a number: 700 (illegal address) must poison the worker as torch's
    text does. Every cache stays referenced, also one only a running job still holds (its
    registration gone): closing a mapping in a lost context aborts the process."""
    _pool, cache, _layout, _originals, make = world
    w = make()
    assert fake.raw is not None
    own = dataclasses.replace(
        cache, cache_id="kvc-lapsed", tensors=tuple(t.clone() for t in cache.tensors)
    )
    w.registry._caches[own.cache_id] = own
    fake.events.gate.clear()
    held = w.submit(TransferJob("store", own.cache_id, [1], [1], 30.0))
    until(
        "an event recorded", lambda: fake.events.recorded >= 1, 30
    )  # issued; its copies still queued
    w.registry.unregister(own.cache_id)
    fake.raw.fail_2d_from, fake.raw.code_2d = fake.raw.calls_2d + 1, 700
    jid = w.submit(TransferJob("store", cache.cache_id, [0], [0], 30.0))
    until("the worker failed", lambda: w.fatal is not None, 30)
    assert "cudaMemcpy2DAsync returned 700" in (w.fatal or "")
    assert "the CUDA context is lost" in (w.fatal or "")
    assert cuda_worker.poisoned()
    kept = cuda_worker._KEPT_AFTER_POISON
    assert any(c is own for c in kept)
    assert any(c is cache for c in kept)
    fake.events.gate.set()
    results = {r.job_id: r for r in w.wait([held, jid], timeout=30)}
    assert not results[jid].ok


@pytest.mark.parametrize("path", ["2d"])
def test_caches_of_jobs_a_shutdown_already_reported_are_kept_too(world, fake) -> None:
    """A shutdown that timed out reports its jobs while their copies stay queued; if those
    copies then end in a lost context, their caches (here only the jobs hold them) stay."""
    _pool, cache, _layout, _originals, make = world
    w = make(sync_timeout_s=0.1)
    own = dataclasses.replace(
        cache, cache_id="kvc-reported", tensors=tuple(t.clone() for t in cache.tensors)
    )
    w.registry._caches[own.cache_id] = own
    fake.events.gate.clear()
    jid = w.submit(TransferJob("store", own.cache_id, [1], [1], 30.0))
    until("an event recorded", lambda: fake.events.recorded >= 1, 30)
    w.registry.unregister(own.cache_id)
    w.shutdown(timeout=0.1)
    assert [(r.job_id, r.ok) for r in w.poll_finished()] == [(jid, False)]
    assert not w.quiesced
    fake.events.error = RuntimeError("CUDA error: an illegal memory access was encountered")
    fake.events.gate.set()
    until("the worker failed", lambda: w.fatal is not None, 30)
    assert any(c is own for c in cuda_worker._KEPT_AFTER_POISON)


def test_one_worker_poisoned_poisons_every_worker_of_the_process(world, fake) -> None:
    """Namespaces (tenants) each have a worker, all on the process's CUDA contexts: when one
    loses the context, the others must keep their caches and refuse too."""
    _pool, cache, _layout, _originals, make = world
    a, b = make(), make()
    registry_b = KVCacheRegistry(b.pool)
    b_cache = dataclasses.replace(cache, cache_id="kvc-of-b")
    registry_b._caches[b_cache.cache_id] = b_cache
    b.registry = registry_b
    a._poison("CUDA error: an illegal memory access was encountered")
    assert "another worker of this process" in (b.fatal or "")
    assert any(c is b_cache for c in cuda_worker._KEPT_AFTER_POISON)
    with pytest.raises(WorkerClosedError):
        b.submit(TransferJob("store", b_cache.cache_id, [0], [0], 30.0))


@pytest.mark.parametrize("path", ["2d"])
def test_a_pageable_pool_without_2d_copies_takes_the_staged_path(world, fake, monkeypatch) -> None:
    """The batch call is not for pageable memory; without cudaMemcpy2DAsync either, the
    direct copier has nothing to copy with: the staged path moves the bytes."""
    _pool, cache, layout, originals, make = world
    assert fake.raw is not None
    raw = fake.raw.raw()
    raw.memcpy2d = None
    monkeypatch.setattr(cuda_worker, "find_raw_cuda", lambda: raw)
    monkeypatch.setattr(HostPool, "pinned", property(lambda self: False))
    w = make(allow_pageable=True)
    assert w.copy_path == "staged"
    jid = w.submit(TransferJob("store", cache.cache_id, [4], [4], 30.0))
    [r] = w.wait([jid], timeout=30)
    assert r.ok, r.reason
    assert torch.equal(_pool.tensor[4], host_block(originals, layout, 4))
    assert fake.raw.batch_calls == 0


def test_the_threads_bind_their_lane_s_gpu(world, fake, monkeypatch, path) -> None:
    """The issuing thread binds the GPU before a raw copy (the driver's batch call uses the
    thread's current context), and each completion thread runs on its lane's GPU (else its
    event waits would make a context on GPU 0)."""
    import threading

    _pool, cache, _layout, _originals, make = world
    entered: list[tuple[str, int]] = []

    def device(index: int) -> Any:
        entered.append((threading.current_thread().name, index))
        return contextlib.nullcontext()

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    far = dataclasses.replace(
        cache,
        cache_id="kvc-gpu1",
        device="cuda:1",
        layouts=tuple(dataclasses.replace(lay, device="cuda:1") for lay in cache.layouts),
    )
    w = make()
    w.registry._caches[far.cache_id] = far
    ids = [w.submit(TransferJob(d, far.cache_id, [2], [2], 30.0)) for d in ("store", "load")]
    assert all(r.ok for r in w.wait(ids, timeout=30))
    done_threads = {i for name, i in entered if name.startswith("kvoffload-cuda-done-1-")}
    assert done_threads == {1}
    if path != "staged":
        assert fake.raw is not None
        assert set(fake.raw.bound) == {1}


@pytest.mark.parametrize("path", ["2d"])
def test_shutdown_counts_a_half_issued_chunk_s_copies_as_in_flight(world, fake) -> None:
    """A chunk that fails after queuing some copies records a 0-byte event for them: the
    pool must stay pinned until it fires, although no bytes are counted in flight."""
    _pool, cache, _layout, _originals, make = world
    w = make(sync_timeout_s=0.2, chunk_bytes=1 << 30)  # one chunk
    assert fake.raw is not None
    fake.raw.fail_2d_from = 2  # the first tensor's copy is queued, the second refused
    fake.events.gate.clear()
    jid = w.submit(TransferJob("store", cache.cache_id, [0], [0], 60.0))
    until("an event recorded", lambda: fake.events.recorded >= 1, 30)
    assert w._lanes[0].inflight[True] == 0
    w.shutdown(timeout=0.2)
    assert w.quiesced is False
    fake.events.gate.set()
    [r] = w.wait([jid], timeout=30)
    assert not r.ok


def test_shutdown_fails_what_the_gpu_never_finished_and_keeps_the_pool_pinned(world, fake) -> None:
    _pool, cache, _layout, _originals, make = world
    w = make(sync_timeout_s=0.2)
    fake.events.gate.clear()
    ids = [w.submit(TransferJob("store", cache.cache_id, [i], [i], 60.0)) for i in range(3)]
    until("an event recorded", lambda: fake.events.recorded >= 1, 30)
    w.shutdown(timeout=0.2)
    results = w.poll_finished()
    assert sorted(r.job_id for r in results) == ids
    assert {(r.ok, r.reason) for r in results} == {(False, "shutdown")}
    assert w.quiesced is False  # copies still queued: the pool must not be unpinned


def test_shutdown_waits_for_the_streams(world, fake) -> None:
    _pool, cache, _layout, _originals, make = world
    w = make()
    jid = w.submit(TransferJob("store", cache.cache_id, [3], [3], 60.0))
    w.wait([jid], timeout=30)
    w.shutdown(timeout=5)
    assert w.quiesced is True
    assert w._lanes == {}


def test_issue_errors_fail_the_job(world, monkeypatch, path) -> None:
    _pool, cache, _layout, _originals, make = world
    w = make()

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("CUDA error: out of memory")
        yield 0

    cls = StagedCopier if path == "staged" else DirectCopier
    monkeypatch.setattr(cls, "chunks", boom)
    jid = w.submit(TransferJob("store", cache.cache_id, [0], [0], 30.0))
    [r] = w.wait([jid], timeout=30)
    assert not r.ok
    assert r.reason == "copy failed: RuntimeError: CUDA error: out of memory"
    assert w.fatal is None  # out of memory does not poison the context


def test_refuses_caches_on_missing_gpus(world) -> None:
    _pool, cache, _layout, _originals, make = world
    w = make()
    far = dataclasses.replace(
        cache, layouts=tuple(dataclasses.replace(lay, device="cuda:3") for lay in cache.layouts)
    )
    with pytest.raises(ValueError, match=r"cuda:3, which this worker cannot reach \(1 GPUs\)"):
        w._check_cache(far)


@pytest.mark.parametrize("path", ["batch"])
def test_an_unpinned_pool_is_refused_naming_the_flag(world, fake, monkeypatch) -> None:
    _pool, _cache, _layout, _originals, make = world
    monkeypatch.setattr(HostPool, "pinned", property(lambda self: False))
    with pytest.raises(RuntimeError, match="pass --allow-pageable-pool") as info:
        make(allow_pageable=False)
    assert "\n" not in str(info.value)
    # Allowed, a pageable pool copies with 2D calls: the batch call's location hints are
    # left unset, which only pinned and device memory may have.
    w = make(allow_pageable=True)
    assert w.copy_path == "2d"
    jid = w.submit(TransferJob("store", _cache.cache_id, [1], [1], 30.0))
    [r] = w.wait([jid], timeout=30)
    assert r.ok, r.reason
    assert fake.raw is not None
    assert fake.raw.batch_calls == 0
    assert fake.raw.calls_2d > 0


def test_a_forgotten_cache_s_memory_is_let_go_once_its_jobs_ended(world, fake) -> None:
    """A lapsed registration's mappings hold the engine's GPU memory: once its jobs ended,
    nothing in the worker (an idle thread's last job, a lane's last chunk) may keep them."""
    import gc
    import weakref

    _pool, cache, _layout, _originals, make = world
    w = make(chunk_bytes=1000)
    registry = w.registry
    own = dataclasses.replace(
        cache, cache_id="kvc-leased", tensors=tuple(t.clone() for t in cache.tensors)
    )
    registry._caches[own.cache_id] = own
    refs = [weakref.ref(t) for t in own.tensors]
    ids = [
        w.submit(TransferJob("store", own.cache_id, [1, 2], [5, 6], 30.0)),
        w.submit(TransferJob("load", own.cache_id, [3, 4], [5, 6], 30.0)),
    ]
    assert all(r.ok for r in w.wait(ids, timeout=30))
    registry.unregister(own.cache_id)
    del own

    def let_go() -> bool:
        gc.collect()
        return all(r() is None for r in refs)

    until("the tensors let go", let_go, 10)
