"""A tiny CPU "engine" run as a separate process by the round-trip tests.

Reads one JSON command per line on stdin and answers one JSON line on stdout:

- ``create {prefix, n, seed}``: create the MIXED_LAYOUT tensors as /dev/shm files filled with
  random bytes, keep a private copy of the originals; answer the registration body.
- ``check_pool {path, num_blocks, block_bytes, pairs: [[slot, block], ...]}``: map the pool by
  its path and check each slot holds the host block of the *original* device block.
- ``overwrite {blocks}``: replace those device blocks with fresh random bytes.
- ``check_blocks {pairs: [[device_block, original_block], ...], untouched: [...]}``: check
  each device block now holds the original bytes of another block, and the untouched blocks
  still hold their original bytes.
- ``exit``.

Run as ``python -m tests.transfer.engine_proc`` from the repository root.
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torch

from tests.transfer.helpers import write_shm_tensors
from testsupport.kvref import device_block, host_block, mixed_layout
from testsupport.shm_device import shm_spec


class Engine:
    def __init__(self) -> None:
        self.flats: list[torch.Tensor] = []
        self.originals: list[torch.Tensor] = []
        self.layout: list[tuple[list[int], str, int]] = []

    def create(self, prefix: str, n: int, seed: int) -> dict[str, Any]:
        self.layout = mixed_layout(n)
        paths, self.flats = write_shm_tensors(prefix, self.layout, seed)
        self.originals = [flat.clone() for flat in self.flats]
        return {"spec": shm_spec(prefix, paths, self.layout)}

    def check_pool(
        self, path: str, num_blocks: int, block_bytes: int, pairs: list[list[int]]
    ) -> dict[str, Any]:
        pool = torch.from_file(path, shared=True, size=num_blocks * block_bytes, dtype=torch.uint8)
        pool = pool.view(num_blocks, block_bytes)
        bad = [
            [s, b]
            for s, b in pairs
            if not torch.equal(pool[s], host_block(self.originals, self.layout, b))
        ]
        return {"ok": not bad, "bad": bad[:5]}

    def overwrite(self, blocks: list[int]) -> dict[str, Any]:
        for flat, (shape, dt, bd) in zip(self.flats, self.layout, strict=True):
            itemsize = getattr(torch, dt).itemsize
            for b in blocks:
                view = device_block(flat, shape, itemsize, bd, b)  # a copy (reshape of a slice)
                fresh = torch.randint(0, 256, view.shape, dtype=torch.uint8)
                outer = torch.Size(shape[:bd]).numel()
                flat.view(outer, shape[bd], -1)[:, b, :] = fresh.view(outer, -1)
        return {"ok": True}

    def check_blocks(self, pairs: list[list[int]], untouched: list[int]) -> dict[str, Any]:
        bad: list[Any] = []
        for flat, orig, (shape, dt, bd) in zip(
            self.flats, self.originals, self.layout, strict=True
        ):
            itemsize = getattr(torch, dt).itemsize
            for dst, src in pairs:
                got = device_block(flat, shape, itemsize, bd, dst)
                want = device_block(orig, shape, itemsize, bd, src)
                if not torch.equal(got, want):
                    bad.append([dst, src])
            for b in untouched:
                if not torch.equal(
                    device_block(flat, shape, itemsize, bd, b),
                    device_block(orig, shape, itemsize, bd, b),
                ):
                    bad.append([b, b])
        return {"ok": not bad, "bad": bad[:5]}


def main() -> None:
    engine = Engine()
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "exit":
            return
        try:
            reply = getattr(engine, op)(**cmd)
        except Exception as exc:  # report, do not die: the test shows the error
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
