"""Service keys of SGLang pages: an 8-byte digest of what makes a page's bytes comparable
(``page_prefix``) before SGLang's own page key, within the service's 64-byte keys.

SGLang names a page by a 64-hex SHA-256 chained over the page's token ids (seeded by the
request's ``extra_key`` / ``cache_salt``); the same text on every rank of one engine. The TP
rank goes into the prefix, not into a kvoffload namespace: an engine's ranks are one tenant (one
token, one quota, one pool socket, one event stream for a router), so they share one namespace,
and the prefix keeps their shards apart inside it. An MLA model's KV is the same on every rank,
so there the rank is left out and the ranks share pages (one writer, as SGLang's own backends
do).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass

PREFIX_BYTES = 8
MAX_KEY_BYTES = 64
PAGE_KEY_BYTES = 32
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class PageFormat:
    """What two engines must agree on to share a page's bytes.

    ``tp_rank`` is None for an MLA model (its KV is replicated over the TP ranks). ``layout``
    is the host pool's (``layer_first``, ``page_first``, ...) and ``interface`` the order the
    bytes are kept in: ``v1`` (the regions of ``get_page_buffer_meta``, in its order) or
    ``flat`` (the legacy path's flattened page); the two differ for a ``layer_first`` pool.
    """

    label: str
    model: str
    dtype: str
    page_size: int
    page_bytes: int
    layout: str
    interface: str
    is_mla: bool
    tp_size: int
    tp_rank: int | None
    pp_size: int
    pp_rank: int
    cp_size: int
    cp_rank: int


def page_prefix(fmt: PageFormat) -> bytes:
    """The 8-byte prefix of every service key of pages in format ``fmt``.

    ``engine: sglang`` is hashed too, so no SGLang prefix equals a vLLM tier's prefix (a
    digest of a different document) except by a 64-bit accident.
    """
    facts = {"engine": "sglang", **asdict(fmt)}
    text = json.dumps(facts, sort_keys=True).encode()
    return hashlib.blake2b(text, digest_size=PREFIX_BYTES).digest()


def service_key(prefix: bytes, key: str) -> bytes:
    """The service key of SGLang page key ``key``: the prefix and the 32 bytes its 64 hex digits
    spell, or a 32-byte digest of any other key text (a pool's suffixed key, a custom scheme)."""
    if len(key) == 64 and _HEX64.fullmatch(key):
        return prefix + bytes.fromhex(key)
    return prefix + hashlib.blake2b(key.encode(), digest_size=PAGE_KEY_BYTES).digest()
