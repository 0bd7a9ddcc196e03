"""kvoffload as an L3 storage backend of SGLang's hierarchical cache (HiCache), SGLang 0.5.23.

SGLang loads it with its ``dynamic`` backend::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "kvoffload", "module_path": "kvoffload_client.sglang",
      "class_name": "KVOffloadStorage", "interface_v1": 1, "url": "unix:///run/kvoffload/kv.sock"}'

Rooms: ``keys`` (the page prefix and service keys), ``store`` (pages through the mapped pool,
faults, counters; no SGLang, no torch), ``backend`` (``KVOffloadStorage``, the
``HiCacheStorage`` SGLang calls; imports SGLang). Importing this package imports no SGLang:
``KVOffloadStorage`` is loaded on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVOffloadStorage"]


def __getattr__(name: str) -> Any:
    if name == "KVOffloadStorage":
        from kvoffload_client.sglang.backend import KVOffloadStorage

        return KVOffloadStorage
    raise AttributeError(f"module 'kvoffload_client.sglang' has no attribute {name!r}")
