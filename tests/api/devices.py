"""A CPU "device" KV cache for tests: a shared-memory file the test (the engine) owns.

``ShmDevice`` creates ``/dev/shm/kvoffload-test-*`` of ``num_blocks x block_bytes`` bytes, maps
it, lets the test write and read device blocks, and builds the ``POST /v1/kv-caches`` body
(one float16 tensor whose block dimension is 0). ``close()`` unmaps and unlinks the file.
"""

from __future__ import annotations

import mmap
import os
import uuid
from typing import Any

SHM_DIR = "/dev/shm"


class ShmDevice:
    """A registered-by-path CPU KV cache; block ``b`` is bytes ``[b*block_bytes, (b+1)*...)``."""

    def __init__(self, num_blocks: int, block_bytes: int, name: str | None = None) -> None:
        if block_bytes % 2:
            raise ValueError("block_bytes must be even (float16 elements)")
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.name = name or f"engine-{uuid.uuid4().hex[:8]}"
        self.path = os.path.join(SHM_DIR, f"kvoffload-test-{uuid.uuid4().hex}")
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, num_blocks * block_bytes)
            self._map = mmap.mmap(fd, num_blocks * block_bytes)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)

    def spec(self) -> dict[str, Any]:
        """The registration body for ``POST /v1/kv-caches``."""
        return {
            "name": self.name,
            "device": "cpu",
            "tensors": [
                {
                    "shape": [self.num_blocks, self.block_bytes // 2],
                    "dtype": "float16",
                    "block_dim": 0,
                    "handle": {"kind": "shm", "path": self.path},
                }
            ],
        }

    def write(self, block: int, data: bytes) -> None:
        """Fill device block ``block`` with ``data`` (exactly ``block_bytes``)."""
        assert len(data) == self.block_bytes
        start = block * self.block_bytes
        self._map[start : start + self.block_bytes] = data

    def read(self, block: int) -> bytes:
        """The bytes of device block ``block``."""
        start = block * self.block_bytes
        return bytes(self._map[start : start + self.block_bytes])

    def fill(self, block: int, seed: int) -> bytes:
        """Write a recognisable pattern derived from ``seed``; returns it."""
        pattern = (seed.to_bytes(4, "little") * (self.block_bytes // 4 + 1))[: self.block_bytes]
        self.write(block, pattern)
        return pattern

    def close(self) -> None:
        """Unmap and delete the file. Idempotent."""
        if not self._map.closed:
            self._map.close()
        if os.path.exists(self.path):
            os.unlink(self.path)

    def __enter__(self) -> ShmDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
