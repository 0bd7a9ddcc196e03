"""A CPU engine in a container of its own, as a real engine's would be: its KV cache is a memfd
sealed against shrinking; it reaches kvoffload over TCP for the engine API and over the pool
socket in a shared volume (``/run/kvoffload``) to register that cache by descriptor
(``SCM_RIGHTS``), which is what a service with tenants requires. Nothing else is shared: no
``/dev/shm``, PID or IPC namespace.

    cpu-engine store --seed S --blocks N     offload N blocks of S's bytes
    cpu-engine load --seed S --blocks N      look them up, onload them, compare the bytes

Block ``i`` of seed ``S`` has key ``blake2b(S:i)`` and bytes ``shake_256(S:i)``, so an engine
elsewhere (another node, another container) knows what it should get back. Each command prints
one JSON line of what it did and exits 0 only when it did what it says: ``store`` when every
block is stored, ``load`` when every block is onloaded with equal bytes (``--expect`` also checks
the lookup's first answer, e.g. ``remote`` on a node that never held the blocks).

Settings from the environment: ``CPU_ENGINE_URL`` (``http://kvoffload:8000``),
``CPU_ENGINE_POOL_SOCKET`` (``/run/kvoffload/engine.sock.pool``), ``CPU_ENGINE_TOKEN_FILE``
(``/run/secrets/kvoffload_engine_token``), ``CPU_ENGINE_NAMESPACE`` (none: the tenant's only one).
Needs ``kvoffload-client`` only (the service's image has it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

from kvoffload_client import KVOffloadClient
from kvoffload_client.pool_socket import sealed_memfd


def block_key(seed: str, i: int) -> bytes:
    """The key of block ``i`` of ``seed`` (32 bytes)."""
    return hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=32).digest()


def block_bytes(seed: str, i: int, size: int) -> bytes:
    """The bytes of block ``i`` of ``seed``, ``size`` of them."""
    return hashlib.shake_256(f"{seed}:{i}".encode()).digest(size)


class Engine:
    """One engine: a KV cache of ``2 * blocks`` blocks in a sealed memfd, registered by
    descriptor; blocks ``0..blocks-1`` are the ones stored, the rest are loaded into."""

    def __init__(self, client: KVOffloadClient, pool_socket: str, blocks: int) -> None:
        self.client = client
        self.blocks = blocks
        self.block_bytes = client.pool().block_bytes
        self.fd = sealed_memfd(2 * blocks * self.block_bytes, "cpu-engine-kv")
        spec: dict[str, Any] = {
            "name": f"cpu-engine-{os.getpid()}",
            "device": "cpu",
            "tensors": [
                {
                    "shape": [2 * blocks, self.block_bytes],
                    "dtype": "uint8",
                    "block_dim": 0,
                    "handle": {"kind": "shm", "fd": 0},
                }
            ],
        }
        try:
            self.cache = client.register_kv_cache(spec, fds=[self.fd], pool_socket=pool_socket)
        except BaseException:
            os.close(self.fd)
            raise

    def write(self, block: int, data: bytes) -> None:
        os.pwrite(self.fd, data, block * self.block_bytes)

    def read(self, block: int) -> bytes:
        return os.pread(self.fd, self.block_bytes, block * self.block_bytes)

    def close(self) -> None:
        try:
            self.client.unregister_kv_cache(self.cache.cache_id)
        finally:
            os.close(self.fd)


def store(engine: Engine, seed: str) -> dict[str, Any]:
    """Offload every block of ``seed`` (those the pool does not hold yet) and wait for it."""
    keys = [block_key(seed, i) for i in range(engine.blocks)]
    for i in range(engine.blocks):
        engine.write(i, block_bytes(seed, i, engine.block_bytes))
    req = f"store-{uuid.uuid4().hex[:12]}"
    kv = engine.client
    kv.start_request(req)
    try:
        before = kv.lookup(req, keys).results
        todo = [i for i, r in enumerate(before) if r == "miss"]
        job = kv.offload(req, engine.cache.cache_id, [keys[i] for i in todo], todo)
        state = "done" if job.job_id is None else kv.wait_jobs([job.job_id]).jobs[0].state
        after = kv.lookup(req, keys).results
    finally:
        kv.finish_request(req)
    ok = state == "done" and all(r == "hit" for r in after)
    return {"op": "store", "ok": ok, "offloaded": len(todo), "job": state, "lookup": after}


def load(engine: Engine, seed: str, expect: str | None) -> dict[str, Any]:
    """Look every block of ``seed`` up, onload it into the cache's second half, compare bytes."""
    keys = [block_key(seed, i) for i in range(engine.blocks)]
    req = f"load-{uuid.uuid4().hex[:12]}"
    kv = engine.client
    kv.start_request(req)
    started = time.monotonic()
    try:
        first = kv.lookup(req, keys).results
        targets = [engine.blocks + i for i in range(engine.blocks)]
        job = kv.onload(req, engine.cache.cache_id, keys, targets)
        state = "done" if job.job_id is None else kv.wait_jobs([job.job_id]).jobs[0].state
    finally:
        kv.finish_request(req)
    seconds = time.monotonic() - started
    equal = sum(
        engine.read(engine.blocks + i) == block_bytes(seed, i, engine.block_bytes)
        for i in range(engine.blocks)
    )
    ok = state == "done" and equal == engine.blocks
    if expect is not None:
        ok = ok and all(r == expect for r in first)
    return {
        "op": "load",
        "ok": ok,
        "lookup": sorted(set(first)),
        "job": state,
        "bytes_equal": equal,
        "blocks": engine.blocks,
        "seconds": round(seconds, 4),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cpu-engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("op", choices=["store", "load"])
    parser.add_argument("--seed", required=True, help="names the blocks (keys and bytes)")
    parser.add_argument("--blocks", type=int, default=8, help="how many blocks (default 8)")
    parser.add_argument("--expect", help="load: every key's lookup must answer this first")
    args = parser.parse_args(argv)
    if args.blocks < 1:
        parser.error(f"--blocks {args.blocks}: accepted: an integer >= 1")
    env = os.environ
    client = KVOffloadClient(
        env.get("CPU_ENGINE_URL", "http://kvoffload:8000"),
        token_file=env.get("CPU_ENGINE_TOKEN_FILE", "/run/secrets/kvoffload_engine_token"),
        namespace=env.get("CPU_ENGINE_NAMESPACE") or None,
    )
    with client:
        pool_socket = env.get("CPU_ENGINE_POOL_SOCKET", "/run/kvoffload/engine.sock.pool")
        engine = Engine(client, pool_socket, args.blocks)
        try:
            result = (
                store(engine, args.seed)
                if args.op == "store"
                else load(engine, args.seed, args.expect)
            )
        finally:
            engine.close()
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
