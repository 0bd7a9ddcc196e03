"""GPU-only checks (skipped without CUDA): pinned pool, staged CUDA copies, CUDA IPC."""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.transfer.helpers import mixed_block_bytes
from testsupport.kvref import host_block
from transfer import HostPool, KVCacheRegistry, KVCacheSpec, TransferJob, create_worker
from transfer.cuda_worker import CudaTransferWorker

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

REPO = Path(__file__).resolve().parents[2]


def test_pool_is_pinned_by_default_and_unpinned_on_close() -> None:
    pool = HostPool.create(16, 1 << 16)
    try:
        assert pool.pinned
        assert pool.pin_chunk_blocks is not None
    finally:
        pool.close()
    assert not pool.pinned


def test_auto_backend_is_cuda(make_pool) -> None:
    pool = make_pool(4, 4096)
    w = create_worker(pool, KVCacheRegistry(pool))
    try:
        assert isinstance(w, CudaTransferWorker)
    finally:
        w.shutdown()


def test_mixed_cpu_and_cuda_tensors_in_one_cache(make_pool) -> None:
    pool = make_pool(8, 2 * 4096)
    registry = KVCacheRegistry(pool)
    a = torch.randint(0, 256, (16, 4096), dtype=torch.uint8, device="cuda")
    b = torch.randint(0, 256, (16, 4096), dtype=torch.uint8)
    cache = registry.register_tensors("mixed", [a, b], [0, 0])
    w = create_worker(pool, registry, "cuda", staging_bytes=3 * 4096)
    try:
        jid = w.submit(TransferJob("store", cache.cache_id, [3, 9, 1], [0, 1, 5], 30.0))
        [r] = w.wait([jid], timeout=30)
        assert r.ok, r.reason
        for blk, slot in ((3, 0), (9, 1), (1, 5)):
            assert torch.equal(pool.tensor[slot, :4096], a[blk].cpu())
            assert torch.equal(pool.tensor[slot, 4096:], b[blk])
    finally:
        w.shutdown()


def test_cuda_ipc_round_trip(make_pool) -> None:
    n = 24
    pool = make_pool(32, mixed_block_bytes(n))
    registry = KVCacheRegistry(pool)
    with subprocess.Popen(
        [sys.executable, "-m", "testsupport.ipc_child"],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        assert child.stdin is not None
        assert child.stdout is not None
        try:
            spec = json.loads(child.stdout.readline())["spec"]
            cache = registry.register(KVCacheSpec.from_dict(spec))
            layout = [(t["shape"], t["dtype"], t["block_dim"]) for t in spec["tensors"]]
            w = create_worker(pool, registry, "cuda")
            try:
                rng = random.Random(3)
                blocks = rng.sample(range(n), 12)
                slots = rng.sample(range(32), 12)
                jid = w.submit(TransferJob("store", cache.cache_id, blocks, slots, 30.0))
                [r] = w.wait([jid], timeout=30)
                assert r.ok, r.reason
                flats = [t.cpu() for t in cache.tensors]
                for b, s in zip(blocks, slots, strict=True):
                    assert torch.equal(pool.tensor[s], host_block(flats, layout, b))
                targets = rng.sample(range(n), 12)
                jid = w.submit(TransferJob("load", cache.cache_id, targets, slots, 30.0))
                [r] = w.wait([jid], timeout=30)
                assert r.ok, r.reason
            finally:
                w.shutdown()
            # The engine sees the loaded bytes in its own memory.
            child.stdin.write(json.dumps({"op": "digest", "blocks": targets}) + "\n")
            child.stdin.flush()
            digests = json.loads(child.stdout.readline())["digests"]
            want = [hashlib.sha256(bytes(pool.tensor[s].tolist())).hexdigest() for s in slots]
            assert digests == want
            registry.close()
            del cache
        finally:
            child.stdin.write('{"op": "exit"}\n')
            child.stdin.flush()
            child.wait(timeout=60)
