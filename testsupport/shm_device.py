"""CPU "device" KV caches for tests: tensors in /dev/shm files that the test (the engine) owns.

One helper for every suite that needs a registered-by-path cache:

- ``create_shm_file(path, nbytes)``: a new zero-filled file (created exclusively, mode 0600);
- ``shm_spec(name, paths, layout)``: the registration body (``POST /v1/kv-caches``, or
  ``KVCacheSpec.from_dict``) for tensors in those files;
- ``ShmDevice``: one float16 tensor whose block dimension is 0, read and written by block
  through ``mmap`` (API, end-to-end and load tests). The transfer tests map files of any
  layout with torch instead (``tests.transfer.helpers.write_shm_tensors``);
- ``MemfdDevice``: the same over a sealed memfd, registered by passing its descriptor (what
  a service with tenants takes).

Imports no torch, so load-test workers stay light.
"""

from __future__ import annotations

import mmap
import os
import uuid
from collections.abc import Sequence
from typing import Any

from kvoffload_client.pool_socket import sealed_memfd

SHM_DIR = "/dev/shm"

Layout = Sequence[tuple[Sequence[int], str, int]]
"""Per tensor: ``(shape, dtype name, block_dim)``."""


def create_shm_file(path: str, nbytes: int) -> None:
    """Create ``path`` (which must not exist) as ``nbytes`` zero bytes, readable by us only."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def shm_spec(name: str, paths: Sequence[str], layout: Layout) -> dict[str, Any]:
    """The registration body of a CPU cache whose tensor ``i`` lives in ``paths[i]``."""
    return {
        "name": name,
        "device": "cpu",
        "tensors": [
            {
                "shape": list(shape),
                "dtype": dt,
                "block_dim": bd,
                "handle": {"kind": "shm", "path": p},
            }
            for p, (shape, dt, bd) in zip(paths, layout, strict=True)
        ],
    }


class ShmDevice:
    """A registered-by-path CPU KV cache; block ``b`` is bytes ``[b*block_bytes, (b+1)*...)``.

    Its file is ``/dev/shm/kvoffload-test-*``; ``close()`` unmaps and unlinks it.
    """

    def __init__(self, num_blocks: int, block_bytes: int, name: str | None = None) -> None:
        self._shape(num_blocks, block_bytes, name)
        self.path = os.path.join(SHM_DIR, f"kvoffload-test-{uuid.uuid4().hex}")
        create_shm_file(self.path, num_blocks * block_bytes)
        try:
            with open(self.path, "r+b") as f:
                self._map = mmap.mmap(f.fileno(), num_blocks * block_bytes)
        except BaseException:
            os.unlink(self.path)
            raise

    def _shape(self, num_blocks: int, block_bytes: int, name: str | None) -> None:
        """Keep the cache's size and name (a random ``engine-*`` one by default);
        ``ValueError`` for an odd ``block_bytes`` (the elements are float16)."""
        if block_bytes % 2:
            raise ValueError("block_bytes must be even (float16 elements)")
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.name = name or f"engine-{uuid.uuid4().hex[:8]}"

    def spec(self) -> dict[str, Any]:
        """The registration body for ``POST /v1/kv-caches``."""
        layout = [([self.num_blocks, self.block_bytes // 2], "float16", 0)]
        return shm_spec(self.name, [self.path], layout)

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


class MemfdDevice(ShmDevice):
    """A CPU KV cache in a sealed memfd (``sealed_memfd``), registered by descriptor: ``fd``
    goes in the registration's ``fds``, and ``spec()`` names it as descriptor 0."""

    def __init__(self, num_blocks: int, block_bytes: int, name: str | None = None) -> None:
        self._shape(num_blocks, block_bytes, name)
        self.path = ""
        self.fd = sealed_memfd(num_blocks * block_bytes, self.name)
        self._map = mmap.mmap(self.fd, num_blocks * block_bytes)

    def spec(self) -> dict[str, Any]:
        """The registration body for the pool socket (``fds=[self.fd]``)."""
        spec = super().spec()
        spec["tensors"][0]["handle"] = {"kind": "shm", "fd": 0}
        return spec

    def close(self) -> None:
        """Unmap and close the memfd. Idempotent."""
        if not self._map.closed:
            self._map.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> MemfdDevice:
        return self
