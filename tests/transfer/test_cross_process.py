"""Real bytes across processes: a separate engine process owns the "device" cache in /dev/shm,
the service-side pool stores and loads its blocks, and the engine checks every byte (and maps
the pool by its published path)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.transfer.helpers import mixed_block_bytes
from transfer import KVCacheRegistry, KVCacheSpec, TransferJob, create_worker

REPO = Path(__file__).resolve().parents[2]
N = 40
SLOTS = 64


class EngineProcess:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.transfer.engine_proc"],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"engine process died (exit {self.proc.poll()})"
        reply: dict[str, Any] = json.loads(line)
        assert "error" not in reply, reply["error"]
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write('{"op": "exit"}\n')
            self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture
def engine():
    e = EngineProcess()
    yield e
    e.close()


@pytest.mark.parametrize("copy_threads", [1, 2])
def test_round_trip_with_an_engine_process(engine, make_pool, shm_prefix, copy_threads) -> None:
    pool = make_pool(SLOTS, mixed_block_bytes(N), pin=False)
    registry = KVCacheRegistry(pool)
    spec = engine.call("create", prefix=f"{shm_prefix}-eng", n=N, seed=11)["spec"]
    cache = registry.register(KVCacheSpec.from_dict(spec))
    assert cache.num_blocks == N
    worker = create_worker(pool, registry, "cpu", copy_threads=copy_threads)
    try:
        rng = random.Random(copy_threads)
        blocks = rng.sample(range(N), 25)
        slots = rng.sample(range(SLOTS), 25)
        job_id = worker.submit(TransferJob("store", cache.cache_id, blocks, slots, 30.0))
        [stored] = worker.wait([job_id], timeout=30)
        assert stored.ok, stored.reason
        assert stored.bytes == 25 * pool.block_bytes

        # The engine maps the pool by the published path and reads what was stored.
        layout = pool.layout()
        reply = engine.call(
            "check_pool",
            path=layout["path"],
            num_blocks=layout["num_blocks"],
            block_bytes=layout["block_bytes"],
            pairs=[[s, b] for s, b in zip(slots, blocks, strict=True)],
        )
        assert reply["ok"], reply["bad"]

        # The engine reuses those device blocks; the pool brings the data back, permuted.
        engine.call("overwrite", blocks=blocks)
        targets = rng.sample(blocks, len(blocks))
        job_id = worker.submit(TransferJob("load", cache.cache_id, targets, slots, 30.0))
        [loaded] = worker.wait([job_id], timeout=30)
        assert loaded.ok, loaded.reason
        untouched = sorted(set(range(N)) - set(blocks))
        reply = engine.call(
            "check_blocks",
            pairs=[[t, b] for t, b in zip(targets, blocks, strict=True)],
            untouched=untouched,
        )
        assert reply["ok"], reply["bad"]
    finally:
        worker.shutdown()
        registry.close()
