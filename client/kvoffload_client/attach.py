"""How an engine's integration reaches a service: its URL (``parse_url``) and its host pool,
mapped into the engine's process (``map_pool``: over the pool socket, else through the
``/proc`` path the service answers). Shared by the vLLM tier and the SGLang backend; imports no
engine."""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from urllib.parse import urlsplit

import numpy as np

from kvoffload_client.client import KVOffloadClient
from kvoffload_client.pool_socket import receive_pool


@dataclass
class MappedPool:
    """The service's host pool mapped into this process: ``blocks[slot]`` is one block.

    ``pool_id`` names the pool the service announced (its ``X-KVOffload-Pool``) or, for a
    pool mapped through its ``/proc`` path, the file's identity; ``path`` is that path (None
    when the descriptor came over the pool socket).
    """

    pool_id: str
    num_blocks: int
    block_bytes: int
    blocks: np.ndarray
    path: str | None = None

    @classmethod
    def from_fd(
        cls,
        fd: int,
        pool_id: str,
        num_blocks: int,
        block_bytes: int,
        path: str | None = None,
        offset: int = 0,
    ) -> MappedPool:
        """Map the blocks of ``fd`` (from byte ``offset``) shared and writable; the caller
        keeps ``fd`` (the mapping outlives it)."""
        total = num_blocks * block_bytes
        region = mmap.mmap(fd, offset + total, mmap.MAP_SHARED)
        flat = np.frombuffer(region, dtype=np.uint8, count=total, offset=offset)
        return cls(pool_id, num_blocks, block_bytes, flat.reshape(num_blocks, block_bytes), path)

    def still_current(self, announced: str | None) -> bool:
        """Whether an answer with pool header ``announced`` came from the service of this
        pool. Without a header, a pool mapped through a ``/proc`` path is current while that
        path still names the same file (it vanishes with the service process)."""
        if announced is not None:
            return announced == self.pool_id
        if self.path is None:
            return True
        try:
            return file_id(os.stat(self.path)) == self.pool_id
        except OSError:
            return False


def file_id(st: os.stat_result) -> str:
    return f"file:{st.st_dev}:{st.st_ino}"


def map_pool(
    client: KVOffloadClient,
    pool_socket: str | None,
    timeout_s: float,
    *,
    token: str | None = None,
    namespace: str | None = None,
) -> MappedPool:
    """Map the service's host pool; the one place that knows how a pool is obtained.

    Through the pool socket (``app.pool_share.receive_pool``, asking with ``token`` and
    ``namespace`` when either is given: the descriptor passed over a Unix socket, works across
    containers) when that module and socket exist, else through the ``/proc/<pid>/fd/<n>`` path
    ``GET /v1/pool`` answers (same user and PID namespace; ``client`` carries the credentials).
    Raises (``OSError``, ``httpx.HTTPError``, ``KVOffloadError``, the pool socket's
    ``PoolShareError``, ...) when neither works.
    """
    if pool_socket is not None and os.path.exists(pool_socket):
        shared = receive_pool(pool_socket, timeout_s=timeout_s, token=token, namespace=namespace)
        try:
            return MappedPool.from_fd(
                shared.fd,
                str(shared.pool_id),
                shared.num_blocks,
                shared.block_bytes,
                offset=shared.offset,
            )
        finally:
            os.close(shared.fd)
    layout = client.pool()
    fd = os.open(layout.path, os.O_RDWR)
    try:
        pool_id = client.last_pool_id or file_id(os.fstat(fd))
        path = None if client.last_pool_id else layout.path
        return MappedPool.from_fd(fd, pool_id, layout.num_blocks, layout.block_bytes, path)
    finally:
        os.close(fd)


def parse_url(url: str) -> tuple[str | None, str | None]:
    """(base_url, uds) of a service ``url``: ``unix:///path`` or ``http(s)://host:port``."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError(f"kvoffload tier url {url!r} names no socket path")
        return None, parts.path
    if parts.scheme in ("http", "https"):
        return url.rstrip("/"), None
    raise ValueError(f"kvoffload tier url {url!r}: use unix:///path or http://host:port")
