"""The fault-injecting backend, and the CPU backend's deadline and shutdown paths."""

from __future__ import annotations

import time

import pytest
import torch

from tests.transfer.helpers import mixed_block_bytes
from transfer import FaultSpec, KVCacheRegistry, KVCacheSpec, TransferJob, cpu_worker, create_worker
from transfer.cpu_copy import CopyAborted, copy_on_cpu
from transfer.cpu_worker import CpuTransferWorker
from transfer.faulty_worker import INJECTED, FaultyWorker
from transfer.worker import make_plan

N = 24
SLOTS = 32


@pytest.fixture
def world(make_pool, shm_cache):
    pool = make_pool(SLOTS, mixed_block_bytes(N), pin=False)
    registry = KVCacheRegistry(pool)
    cache = shm_cache(registry, N)
    workers = []

    def worker(**kwargs):
        w = create_worker(pool, registry, "cpu", copy_threads=1, **kwargs)
        workers.append(w)
        return w

    yield pool, registry, cache.cache, worker
    for w in workers:
        w.shutdown(timeout=5)


def store(cache, blocks, slots, deadline_s=30.0) -> TransferJob:
    return TransferJob("store", cache.cache_id, list(blocks), list(slots), deadline_s)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fail_rate": 1.5}, r"fail_rate must be in \[0, 1\]"),
        ({"hang_rate": -0.1}, r"hang_rate must be in \[0, 1\]"),
        ({"fail_rate": 0.6, "hang_rate": 0.6}, "must be <= 1"),
        ({"delay_s": -1.0}, "delay_s must be a finite number"),
        ({"delay_s": float("inf")}, "delay_s must be a finite number"),
    ],
)
def test_fault_spec_validation(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        FaultSpec(**kwargs)


def test_backend_selection(world) -> None:
    pool, registry, _cache, _worker = world
    with pytest.raises(ValueError, match="unknown transfer backend 'gpu'"):
        create_worker(pool, registry, "gpu")
    w = create_worker(pool, registry, "faulty")
    assert isinstance(w, FaultyWorker)
    assert isinstance(w.inner, CpuTransferWorker)
    w.shutdown()
    w = create_worker(pool, registry, "cpu", faults=FaultSpec(fail_rate=0.5))
    assert isinstance(w, FaultyWorker)
    w.shutdown()


def test_every_job_fails_with_fail_rate_one(world) -> None:
    _pool, _registry, cache, worker = world
    w = worker(faults=FaultSpec(fail_rate=1.0, seed=1))
    ids = [w.submit(store(cache, [i], [i])) for i in range(5)]
    results = w.wait(ids, timeout=10)
    assert [(r.ok, r.reason, r.bytes) for r in results] == [(False, INJECTED, 0)] * 5


def test_hung_job_ends_at_its_deadline(world) -> None:
    _pool, _registry, cache, worker = world
    w = worker(faults=FaultSpec(hang_rate=1.0, seed=1))
    job_id = w.submit(store(cache, [0], [0], deadline_s=0.2))
    assert w.wait([job_id], timeout=0.05) == []  # still hanging
    assert [j for j, _age in w.in_flight()] == [job_id]
    [result] = w.wait([job_id], timeout=10)
    assert (result.ok, result.reason) == (False, "deadline")
    assert result.seconds >= 0.2


def test_delay_postpones_then_runs_for_real(world) -> None:
    pool, _registry, cache, worker = world
    w = worker(faults=FaultSpec(delay_s=0.1, seed=1))
    job_id = w.submit(store(cache, [3], [4]))
    [result] = w.wait([job_id], timeout=10)
    assert result.ok, result.reason
    assert result.seconds >= 0.1
    assert result.bytes == pool.block_bytes


def test_delay_past_the_deadline_fails_without_running(world) -> None:
    pool, _registry, cache, worker = world
    pool.tensor[4].fill_(0xAB)
    w = worker(faults=FaultSpec(delay_s=5.0, seed=1))
    job_id = w.submit(store(cache, [3], [4], deadline_s=0.1))
    [result] = w.wait([job_id], timeout=10)
    assert (result.ok, result.reason) == (False, "deadline")
    assert int(pool.tensor[4].min()) == 0xAB  # never copied


def test_fates_are_reproducible_with_a_seed(world) -> None:
    _pool, _registry, cache, worker = world
    outcomes = []
    for _ in range(2):
        w = worker(faults=FaultSpec(fail_rate=0.5, seed=42))
        ids = [w.submit(store(cache, [i % N], [i])) for i in range(SLOTS)]
        outcomes.append([r.ok for r in w.wait(ids, timeout=10)])
    assert outcomes[0] == outcomes[1]
    assert 0 < sum(outcomes[0]) < SLOTS


def test_faulty_worker_validates_like_the_real_one(world) -> None:
    _pool, _registry, cache, worker = world
    w = worker(faults=FaultSpec(hang_rate=1.0))
    with pytest.raises(ValueError, match="out of range"):
        w.submit(store(cache, [N], [0]))


def test_shutdown_fails_hung_and_delayed_jobs(world) -> None:
    _pool, _registry, cache, worker = world
    w = worker(faults=FaultSpec(hang_rate=1.0))
    ids = [w.submit(store(cache, [i], [i], deadline_s=60.0)) for i in range(4)]
    started = time.monotonic()
    w.shutdown(timeout=1)
    assert time.monotonic() - started < 30  # nothing waited for the 60 s deadlines
    results = w.poll_finished()
    assert sorted(r.job_id for r in results) == ids
    assert {(r.ok, r.reason) for r in results} == {(False, "shutdown")}


def test_submit_failure_inside_the_injector_is_reported(world) -> None:
    _pool, registry, cache, worker = world
    w = worker(faults=FaultSpec(delay_s=0.1))
    job_id = w.submit(store(cache, [0], [0]))
    registry.unregister(cache.cache_id)  # gone before the delayed job reaches the backend
    [result] = w.wait([job_id], timeout=10)
    assert not result.ok
    assert result.reason is not None
    assert "unknown KV cache" in result.reason


def test_cpu_queued_job_fails_at_its_deadline_without_running(world) -> None:
    pool, _registry, cache, worker = world
    w = worker()
    pool.tensor[30].fill_(0xCD)
    # A short deadline behind a longer job still ends on time, and never touches its slot.
    slow = w.submit(store(cache, list(range(N)), list(range(N))))
    quick = w.submit(store(cache, [1], [30], deadline_s=1e-6))
    results = {r.job_id: r for r in w.wait([slow, quick], timeout=10)}
    assert results[slow].ok
    assert (results[quick].ok, results[quick].reason) == (False, "deadline")
    assert int(pool.tensor[30].min()) == 0xCD


def test_running_cpu_job_stops_at_its_deadline(make_pool, shm_prefix) -> None:
    block = 256 << 10
    n = 256  # 64 MiB: far more than one millisecond of copying
    pool = make_pool(n, block, pin=False)
    registry = KVCacheRegistry(pool)
    path = f"/dev/shm/{shm_prefix}-big"
    torch.from_file(path, shared=True, size=n * block, dtype=torch.uint8).fill_(1)
    spec = {
        "name": "big",
        "device": "cpu",
        "tensors": [
            {
                "shape": [n, block],
                "dtype": "uint8",
                "block_dim": 0,
                "handle": {"kind": "shm", "path": path},
            }
        ],
    }
    cache = registry.register(KVCacheSpec.from_dict(spec))
    w = create_worker(pool, registry, "cpu", copy_threads=1)
    try:
        job_id = w.submit(store(cache, list(range(n)), list(range(n)), deadline_s=0.001))
        [result] = w.wait([job_id], timeout=30)
        assert (result.ok, result.reason, result.bytes) == (False, "deadline", 0)
    finally:
        w.shutdown()


def test_copy_stops_between_pieces_past_the_deadline_or_on_abort(world) -> None:
    pool, _registry, cache, _worker = world
    plan = make_plan("store", cache, SLOTS, list(range(N)), list(range(N)))
    with pytest.raises(CopyAborted):
        copy_on_cpu(plan, pool.tensor, deadline=time.monotonic() - 1)
    with pytest.raises(CopyAborted):
        copy_on_cpu(plan, pool.tensor, abort=lambda: True)
    copy_on_cpu(plan, pool.tensor, abort=lambda: False)  # runs to the end


def test_an_exception_during_a_copy_fails_the_job(world, monkeypatch) -> None:
    _pool, _registry, cache, worker = world
    w = worker()

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(cpu_worker, "copy_on_cpu", boom)
    job_id = w.submit(store(cache, [0], [0]))
    [result] = w.wait([job_id], timeout=10)
    assert (result.ok, result.reason) == (False, "copy failed: RuntimeError: boom")


def test_copy_threads_must_be_positive(world) -> None:
    pool, registry, _cache, _worker = world
    with pytest.raises(ValueError, match="copy_threads must be a positive integer"):
        CpuTransferWorker(pool, registry, copy_threads=0)


def test_cuda_backend_needs_cuda(world) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    pool, registry, _cache, _worker = world
    with pytest.raises(RuntimeError, match="needs CUDA"):
        create_worker(pool, registry, "cuda")
    w = create_worker(pool, registry, "auto")
    assert isinstance(w, CpuTransferWorker)
    w.shutdown()


def test_cpu_backend_refuses_device_caches(world) -> None:
    _pool, _registry, cache, worker = world
    w = worker()
    fake = type(cache)(
        cache_id=cache.cache_id,
        name=cache.name,
        block_bytes=cache.block_bytes,
        num_blocks=cache.num_blocks,
        device="cuda:0",
        layouts=tuple(
            type(lay)("cuda:0", lay.outer, lay.inner_bytes, lay.num_blocks, lay.host_offset)
            for lay in cache.layouts
        ),
        tensors=cache.tensors,
    )
    with pytest.raises(ValueError, match="copies only host-memory caches"):
        w._check_cache(fake)


def test_drop_cache_fails_jobs_still_held_by_the_injector(world) -> None:
    pool, _registry, cache, worker = world
    pool.tensor[5].fill_(0xEE)
    w = worker(faults=FaultSpec(hang_rate=1.0, seed=1))
    ids = [w.submit(store(cache, [i], [i + 4], deadline_s=60.0)) for i in range(3)]
    assert w.drop_cache(cache.cache_id, "lease expired") == []  # none of them runs
    results = w.wait(ids, timeout=10)
    assert [(r.ok, r.reason) for r in results] == [(False, "lease expired")] * 3
    assert w.in_flight() == []
    assert int(pool.tensor[5].min()) == 0xEE  # never copied


def test_drop_cache_reaches_jobs_queued_in_the_real_backend(world) -> None:
    pool, registry, cache, _worker = world

    def hanging(on_finished):  # a backend whose jobs stay queued until their deadline
        inner = CpuTransferWorker(pool, registry, copy_threads=1)
        return FaultyWorker(lambda cb: inner, FaultSpec(hang_rate=1.0), on_finished=on_finished)

    w = FaultyWorker(hanging, FaultSpec(seed=1))
    try:
        job_id = w.submit(store(cache, [0], [0], deadline_s=60.0))

        def handed_over() -> bool:
            return bool(w._inner_ids)

        end = time.monotonic() + 10
        while not handed_over():
            assert time.monotonic() < end
            time.sleep(0.01)
        assert w.drop_cache(cache.cache_id, "lease expired") == []
        [result] = w.wait([job_id], timeout=10)
        assert (result.ok, result.reason) == (False, "lease expired")
    finally:
        w.shutdown(timeout=5)


def test_fatal_and_quiesced_are_the_real_backend_s(world, monkeypatch) -> None:
    _pool, _registry, _cache, worker = world
    w = worker(faults=FaultSpec(fail_rate=0.5, seed=1))
    assert isinstance(w, FaultyWorker)
    assert w.fatal is None
    assert w.quiesced
    reason = "copy failed: CUDA error: an illegal memory access was encountered"
    monkeypatch.setattr(CpuTransferWorker, "fatal", property(lambda self: reason))
    monkeypatch.setattr(CpuTransferWorker, "quiesced", property(lambda self: False))
    assert w.fatal == reason
    assert not w.quiesced


@pytest.mark.parametrize("faulty", [False, True])
def test_a_forgotten_cache_s_mappings_go_once_its_jobs_ended(world, shm_cache, faulty) -> None:
    import gc
    import weakref

    _pool, registry, _cache, worker = world
    cache = shm_cache(registry, N).cache  # only this test holds it
    w = worker(faults=FaultSpec(seed=1)) if faulty else worker()
    ids = [
        w.submit(store(cache, [1, 2], [5, 6])),
        w.submit(TransferJob("load", cache.cache_id, [3, 4], [5, 6], 30.0)),
    ]
    assert all(r.ok for r in w.wait(ids, timeout=30))
    refs = [weakref.ref(t) for t in registry.unregister(cache.cache_id).tensors]
    del cache
    end = time.monotonic() + 10
    while any(r() is not None for r in refs):
        assert time.monotonic() < end, "the worker still holds the cache's mappings"
        gc.collect()
        time.sleep(0.01)
