"""The mapped host pool, for the tier's modules; it lives in ``kvoffload_client.attach``, shared
with the SGLang backend."""

from __future__ import annotations

from kvoffload_client.attach import MappedPool, file_id, map_pool

__all__ = ["MappedPool", "file_id", "map_pool"]
