"""kvoffload's engine side: what an inference engine imports to use a kvoffload service.

Installed on its own (``pip install ./client``, distribution ``kvoffload-client``: httpx and
numpy, nothing of the server), so an engine's environment gains no server, no web framework and
no torch requirement, and no package with a common name (the server's are ``app``, ``manager``
and ``transfer``). Modules:

- ``client``: typed HTTP clients, sync and async, for the engine API (and the admin API).
- ``pool_socket``: the pool socket's protocol and the engine's side of it: the host pool's
  descriptor received over a Unix socket, KV caches registered by descriptor.
- ``block_copy``: copies of block rows between mapped buffers, off the GIL.
- ``vllm``: the secondary tier for vLLM's tiering manager (0.32, 0.33; needs vLLM), and
  ``vllm.cpu``, the offloading spec of a CPU engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvoffload_client.client import (
        NAMESPACE_HEADER,
        AsyncKVOffloadClient,
        Batch,
        BlockTokens,
        KVOffloadAdminClient,
        KVOffloadAuthError,
        KVOffloadClient,
        KVOffloadConnectError,
        KVOffloadError,
        KVOffloadPermissionError,
        KVOffloadQuotaError,
        read_token_file,
    )

__all__ = [
    "NAMESPACE_HEADER",
    "AsyncKVOffloadClient",
    "Batch",
    "BlockTokens",
    "KVOffloadAdminClient",
    "KVOffloadAuthError",
    "KVOffloadClient",
    "KVOffloadConnectError",
    "KVOffloadError",
    "KVOffloadPermissionError",
    "KVOffloadQuotaError",
    "read_token_file",
]
# Loaded from ``kvoffload_client.client`` on first use (PEP 562), so that
# ``kvoffload_client.pool_socket`` alone stays standard library only, without httpx.
_CLIENT_NAMES = frozenset(__all__)


def __getattr__(name: str) -> Any:
    if name in _CLIENT_NAMES:
        from kvoffload_client import client

        return getattr(client, name)
    raise AttributeError(f"module 'kvoffload_client' has no attribute {name!r}")
