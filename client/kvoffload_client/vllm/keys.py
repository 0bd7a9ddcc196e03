"""Service keys of vLLM blocks: an 8-byte digest of what makes a chunk's bytes comparable
(``namespace_digest``) before vLLM's own key (``service_key``), within the service's 64 bytes."""

from __future__ import annotations

import hashlib
import json
from typing import Any

NAMESPACE_BYTES = 8
MAX_KEY_BYTES = 64

# --------------------------------------------------------------------------- keys


def namespace_digest(namespace: str | None, spec_config: Any, row_stride: int) -> bytes:
    """The 8-byte prefix of this engine's service keys.

    It hashes the configured ``namespace`` label (default: the model name) together with what
    makes a chunk's bytes comparable: model, KV dtype, chunk row stride, blocks per chunk,
    tokens per block of each group, parallel layout and KV cache layout. Two engines share
    blocks exactly when all of these agree; a label alone never makes different layouts mix.
    """
    model = spec_config.model
    par = spec_config.parallel
    facts = {
        "namespace": namespace if namespace is not None else model.name,
        "model": model.name,
        "dtype": model.dtype,
        "row_stride": row_stride,
        "worker_kv_bytes_per_block": spec_config.worker_kv_bytes_per_block,
        "blocks_per_chunk": spec_config.cache.blocks_per_chunk,
        "tokens_per_hash": spec_config.cache.tokens_per_hash,
        "groups": [[g.group_id, g.tokens_per_block] for g in spec_config.groups],
        "parallel": [par.world_size, par.tp_size, par.pp_size, par.pcp_size, par.dcp_size],
        "replicated_layout": spec_config.replicated_layout,
        "canonical_layout": spec_config.canonical_layout,
        "kv_cache_layout": spec_config.kv_cache_layout,
    }
    text = json.dumps(facts, sort_keys=True, default=str).encode()
    return hashlib.blake2b(text, digest_size=NAMESPACE_BYTES).digest()


def service_key(prefix: bytes, key: bytes) -> bytes:
    """The service key of ``key`` under ``prefix``: the prefix and the key, or the prefix and
    a 32-byte digest of a key too long to fit the service's 64-byte keys."""
    if len(key) + len(prefix) <= MAX_KEY_BYTES:
        return prefix + key
    return prefix + hashlib.blake2b(key, digest_size=32).digest()
