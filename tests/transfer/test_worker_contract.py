"""One contract suite for every transfer backend (cpu, cpu with helper threads, the fault
injector with no faults, and cuda on GPU machines)."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from tests.transfer.helpers import BACKEND_PARAMS, ShmCache, build_worker, mixed_block_bytes
from testsupport.kvref import device_block, host_block
from transfer import (
    InvalidJobError,
    KVCacheRegistry,
    TransferJob,
    UnknownCacheError,
    WorkerClosedError,
)
from transfer.worker import JobResult, TransferWorker

N_BLOCKS = 24
POOL_BLOCKS = 40


@pytest.fixture(params=BACKEND_PARAMS)
def backend(request) -> str:
    return str(request.param)


@pytest.fixture
def setup(backend, make_pool, shm_cache):
    if backend.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    # The cuda backend needs a pinned pool (pin=None: pinned where CUDA is).
    pin = None if backend.startswith("cuda") else False
    pool = make_pool(POOL_BLOCKS, mixed_block_bytes(N_BLOCKS), pin=pin)
    registry = KVCacheRegistry(pool)
    cache = shm_cache(registry, N_BLOCKS, device="cuda" if backend == "cuda" else "cpu")
    calls = []
    worker = build_worker(backend, pool, registry, on_finished=lambda: calls.append(1))
    yield pool, registry, cache, worker, calls
    worker.shutdown(timeout=5)


def job(cache: ShmCache, direction, blocks, slots, deadline_s=30.0) -> TransferJob:
    return TransferJob(direction, cache.cache.cache_id, list(blocks), list(slots), deadline_s)


def run(worker: TransferWorker, j: TransferJob):
    job_id = worker.submit(j)
    [result] = worker.wait([job_id], timeout=30)
    assert result.job_id == job_id
    return result


def test_store_then_load_moves_exact_bytes(setup) -> None:
    pool, _registry, cache, worker, calls = setup
    rng = random.Random(1)
    blocks = rng.sample(range(N_BLOCKS), 16)
    slots = rng.sample(range(POOL_BLOCKS), 16)
    result = run(worker, job(cache, "store", blocks, slots))
    assert result.ok, result.reason
    assert result.reason is None
    assert result.bytes == 16 * pool.block_bytes
    assert result.seconds >= 0
    for b, s in zip(blocks, slots, strict=True):
        assert torch.equal(pool.tensor[s], host_block(cache.flats, cache.layout, b).cpu())
    # Load the slots back into other device blocks (a permutation), then check every byte.
    targets = rng.sample(range(N_BLOCKS), 16)
    result = run(worker, job(cache, "load", targets, slots))
    assert result.ok, result.reason
    for t, b in zip(targets, blocks, strict=True):
        for flat, orig, (shape, dt, bd) in zip(
            cache.flats, cache.originals, cache.layout, strict=True
        ):
            size = getattr(torch, dt).itemsize
            assert torch.equal(
                device_block(flat, shape, size, bd, t), device_block(orig, shape, size, bd, b)
            )
    untouched = set(range(N_BLOCKS)) - set(targets)
    for u in untouched:
        assert torch.equal(
            host_block(cache.flats, cache.layout, u), host_block(cache.originals, cache.layout, u)
        )
    assert len(calls) >= 2


def test_contiguous_runs_round_trip(setup) -> None:
    pool, _registry, cache, worker, _calls = setup
    blocks = list(range(4, 20))
    slots = list(range(10, 26))
    assert run(worker, job(cache, "store", blocks, slots)).ok
    for b, s in zip(blocks, slots, strict=True):
        assert torch.equal(pool.tensor[s], host_block(cache.flats, cache.layout, b).cpu())
    for flat in cache.flats:
        flat.zero_()
    assert run(worker, job(cache, "load", blocks, slots)).ok
    for b in blocks:
        assert torch.equal(
            host_block(cache.flats, cache.layout, b), host_block(cache.originals, cache.layout, b)
        )


def test_empty_job_finishes_ok(setup) -> None:
    _pool, _registry, cache, worker, _calls = setup
    result = run(worker, job(cache, "store", [], []))
    assert result.ok
    assert result.bytes == 0


@pytest.mark.parametrize(
    ("direction", "blocks", "slots", "message"),
    [
        ("copy", [0], [0], "direction must be 'store' or 'load', got 'copy'"),
        ("store", [0, 1], [0], r"differ in length \(2 != 1\)"),
        ("store", [N_BLOCKS], [0], rf"device block {N_BLOCKS} out of range \[0, {N_BLOCKS}\)"),
        ("load", [-1], [0], r"device block -1 out of range"),
        (
            "store",
            [0],
            [POOL_BLOCKS],
            rf"host slot {POOL_BLOCKS} out of range \[0, {POOL_BLOCKS}\)",
        ),
        ("load", [0], [-3], r"host slot -3 out of range"),
        ("store", [0, 1], [5, 5], "store writes host slot 5 more than once"),
        ("load", [2, 2], [5, 6], "load writes device block 2 more than once"),
        ("store", [0.0], [1], "device_blocks must hold integers"),
        ("store", [0], [True], "host_slots must hold integers"),
        ("store", "01", [1], "device_blocks must be a list"),
    ],
)
def test_submit_validates_first(setup, direction, blocks, slots, message) -> None:
    _pool, _registry, cache, worker, _calls = setup
    with pytest.raises(InvalidJobError, match=message):
        worker.submit(TransferJob(direction, cache.cache.cache_id, blocks, slots, 5.0))
    assert worker.in_flight() == []
    assert worker.poll_finished() == []


def test_duplicate_sources_are_fine(setup) -> None:
    pool, _registry, cache, worker, _calls = setup
    assert run(worker, job(cache, "store", [3, 3], [0, 1])).ok  # one block into two slots
    assert torch.equal(pool.tensor[0], pool.tensor[1])
    assert run(worker, job(cache, "load", [7, 8], [0, 0])).ok  # one slot into two blocks


@pytest.mark.parametrize("deadline", [0, -1.0, float("nan"), float("inf"), True, "5"])
def test_submit_rejects_bad_deadlines(setup, deadline) -> None:
    _pool, _registry, cache, worker, _calls = setup
    with pytest.raises(InvalidJobError, match="deadline_s must be a positive number"):
        worker.submit(TransferJob("store", cache.cache.cache_id, [0], [0], deadline))


def test_submit_unknown_cache(setup) -> None:
    _pool, _registry, _cache, worker, _calls = setup
    with pytest.raises(UnknownCacheError, match="kvc-missing"):
        worker.submit(TransferJob("store", "kvc-missing", [0], [0], 5.0))


def test_results_are_handed_out_once(setup) -> None:
    _pool, _registry, cache, worker, _calls = setup
    ids = [worker.submit(job(cache, "store", [i], [i])) for i in range(6)]
    assert len(set(ids)) == 6
    got = worker.wait(ids[:2], timeout=30)
    assert [r.job_id for r in got] == ids[:2]
    # wait handed those two out: poll never returns them, waiting again returns nothing.
    assert worker.wait(ids[:2], timeout=0.01) == []
    deadline = time.monotonic() + 30
    seen: list[JobResult] = []
    while len(seen) < 4 and time.monotonic() < deadline:
        seen += worker.poll_finished()
        time.sleep(0.001)
    assert sorted(r.job_id for r in seen) == ids[2:]
    assert all(r.ok for r in seen)
    assert worker.poll_finished() == []
    assert worker.in_flight() == []


def test_wait_ignores_unknown_ids_and_times_out(setup) -> None:
    _pool, _registry, cache, worker, _calls = setup
    assert worker.wait([12345], timeout=0.01) == []
    job_id = worker.submit(job(cache, "store", [0], [0]))
    results = worker.wait([job_id, 999, job_id], timeout=30)
    assert [r.job_id for r in results] == [job_id]


def test_on_finished_is_called(setup) -> None:
    _pool, _registry, cache, worker, calls = setup
    job_id = worker.submit(job(cache, "store", [1], [1]))
    worker.wait([job_id], timeout=30)
    assert calls


def test_in_flight_reports_ages(setup) -> None:
    _pool, _registry, cache, worker, _calls = setup
    job_id = worker.submit(job(cache, "store", list(range(N_BLOCKS)), list(range(N_BLOCKS))))
    flight = dict(worker.in_flight())
    if job_id in flight:  # it may already be done
        assert flight[job_id] >= 0
    worker.wait([job_id], timeout=30)
    assert job_id not in dict(worker.in_flight())


def test_shutdown_reports_every_job_and_refuses_more(setup) -> None:
    _pool, _registry, cache, worker, _calls = setup
    ids = [worker.submit(job(cache, "store", [i % N_BLOCKS], [i])) for i in range(POOL_BLOCKS)]
    worker.shutdown(timeout=5)
    results = {r.job_id: r for r in worker.poll_finished()}
    assert sorted(results) == ids
    for r in results.values():
        assert r.ok or r.reason == "shutdown"
    assert worker.in_flight() == []
    with pytest.raises(WorkerClosedError):
        worker.submit(job(cache, "store", [0], [0]))
    worker.shutdown()  # idempotent


def test_submit_from_many_threads(setup) -> None:
    _pool, _registry, cache, worker, _calls = setup
    ids: list[int] = []
    lock = threading.Lock()

    def submitter(k: int) -> None:
        for i in range(5):
            slot = k * 5 + i
            jid = worker.submit(job(cache, "store", [slot % N_BLOCKS], [slot]))
            with lock:
                ids.append(jid)

    threads = [threading.Thread(target=submitter, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 20
    results = worker.wait(ids, timeout=30)
    assert sorted(r.job_id for r in results) == sorted(ids)
    assert all(r.ok for r in results)


def test_wait_event_is_refused_for_a_cache_without_cuda_tensors(setup, backend) -> None:
    _pool, _registry, cache, worker, _calls = setup
    if backend == "cuda":
        pytest.skip("a CUDA cache takes wait_event")
    with pytest.raises(InvalidJobError, match="wait_event orders copies after a CUDA event"):
        worker.submit(
            TransferJob("store", cache.cache.cache_id, [0], [0], 30.0, wait_event=bytes(64))
        )


def test_drop_cache_fails_its_queued_jobs(setup, backend) -> None:
    """A lapsed lease fails the cache's queued jobs; those running end on their own."""
    _pool, _registry, cache, worker, _calls = setup
    ids = [worker.submit(job(cache, "store", [i], [i])) for i in range(6)]
    running = worker.drop_cache(cache.cache.cache_id, "kv cache lease expired")
    results = worker.wait(ids, timeout=30)
    assert sorted(r.job_id for r in results) == ids
    for r in results:
        assert r.ok or r.reason == "kv cache lease expired"
    assert set(running) <= set(ids)
