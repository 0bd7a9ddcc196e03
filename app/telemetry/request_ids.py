"""Ids that reach logs and exemplars: one safe alphabet, and a safe form of any engine req_id.

An id written into a log line or an OpenMetrics exemplar must be short and plain: OpenMetrics
caps an exemplar's label set at 128 characters (``req_id=`` and the quotes take 9), and log
queries (``| json | req_id = "..."``) must find it verbatim. Safe ids match
``[A-Za-z0-9._:-]{1,120}``.

- ``X-Request-ID``: a caller's id is used only if it is already safe; otherwise the call gets a
  generated id (the caller's value is never echoed or logged).
- Engine ``req_id`` (path or batch op): the request is served under its id whatever it is (the
  API takes 1..256 characters), but logs and exemplars carry ``safe_req_id(req_id)``: the id
  itself when it is safe, else every character outside the alphabet replaced by ``_``, cut to
  103 characters, then ``:`` and 16 hex digits of the BLAKE2b hash of the original. The form is
  deterministic (an operator can compute it from the raw id), distinct raw ids stay distinct,
  and a hashed id is recognisable by its ``:<16 hex>`` tail.
"""

from __future__ import annotations

import hashlib
import re

MAX_SAFE_ID = 120
SAFE_ID = re.compile(r"[A-Za-z0-9._:\-]{1,120}")
_UNSAFE_CHAR = re.compile(r"[^A-Za-z0-9._:\-]")
_DIGEST_BYTES = 8
_KEEP = MAX_SAFE_ID - 1 - 2 * _DIGEST_BYTES  # room for ":" and the hex digest
# Recent answers, so a request's many calls pay one regex match; cleared when full.
_CACHE_MAX = 4096
_cache: dict[str, str] = {}


def is_safe_id(value: str) -> bool:
    """True when ``value`` can go into a log line or exemplar as it is."""
    return SAFE_ID.fullmatch(value) is not None


def exemplar_id(value: str | None) -> str | None:
    """``value`` when it can be an exemplar's ``req_id`` as it is (a safe id), else None: an
    observation is never refused for its exemplar. Answered from the same cache as
    ``safe_req_id``, so a request's many observations pay one regex match."""
    if not value:
        return None
    return value if safe_req_id(value) == value else None


def safe_req_id(req_id: str) -> str:
    """``req_id`` itself when safe, else its sanitised and hashed form (module docstring)."""
    safe = _cache.get(req_id)
    if safe is not None:
        return safe
    if SAFE_ID.fullmatch(req_id):
        safe = req_id
    else:
        digest = hashlib.blake2b(req_id.encode("utf-8", "surrogatepass"), digest_size=_DIGEST_BYTES)
        safe = f"{_UNSAFE_CHAR.sub('_', req_id[:_KEEP])}:{digest.hexdigest()}"
    if len(_cache) >= _CACHE_MAX:
        _cache.clear()
    _cache[req_id] = safe
    return safe
