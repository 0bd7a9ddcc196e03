"""The engine-neutral half of the SGLang backend: pages in and out of a kvoffload service
through its mapped host pool. Imports neither SGLang nor torch (``backend`` does).

A page is a list of memory regions ``(address, nbytes)`` in the engine's host pool; its bytes,
concatenated in that order, fill one service block (``block_bytes`` must equal the page's
bytes). Each call of ``exists_prefix``, ``store`` and ``load`` is one short-lived service
request:

- ``exists_prefix``: one ``/v1/batch`` (start, lookup, finish); keys held in the pool, pending,
  or in a tier below it count (a lookup asks the service to bring lower-tier keys up, so the
  load that follows finds them).
- ``store``: one batch (start, prepare-store), the copies into the slots, one batch
  (complete-store, finish). Keys the service already holds are skipped and reported stored.
- ``load``: one batch (start, prepare-load), the copies out of the slots, one batch
  (complete-load, finish). A key still coming up from a lower tier (409) is asked again for up
  to ``load_wait_s``.

A restarted service (an answer names another pool than the mapped one) is mapped again at
once, and the call goes on with the new pool. Faults never raise: a service down, slow,
refusing, or out of room makes the call answer a miss or a skipped write, is counted in
``counters`` by reason, and starts a back-off of ``retry_interval_s`` (doubling up to 16 times
while it lasts) during which calls answer at once without asking. The one exception is
``check_block_size``, meant for registration: a wrong ``--block-bytes`` is a configuration
error.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from kvoffload_client.attach import MappedPool, map_pool, parse_url
from kvoffload_client.block_copy import move_all
from kvoffload_client.client import (
    Batch,
    KVOffloadAuthError,
    KVOffloadClient,
    KVOffloadError,
    KVOffloadPermissionError,
    OpResult,
    read_token_file,
)
from kvoffload_client.pool_socket import PoolShareError, default_pool_socket

log = logging.getLogger("kvoffload.sglang")

TOKEN_FILE_ENV = "KVOFFLOAD_TOKEN_FILE"
Region = tuple[int, int]
"""``(address, nbytes)`` of one piece of a page in the engine's memory."""

# Lower-tier states a lookup answers for keys the service can bring into the pool.
_BRINGABLE = frozenset({"hit", "pending", "disk", "remote", "object"})


@dataclass(frozen=True)
class StoreConfig:
    """The backend's settings, from SGLang's ``--hicache-storage-backend-extra-config``.

    ``url``: ``http://host:port`` or ``unix:///path`` of the engine API; ``pool_socket``: the
    pool socket (default: the engine socket's path plus ``.pool``; over HTTP, the ``/proc``
    path ``GET /v1/pool`` answers); ``namespace``: the label hashed into every key (default:
    the model name); ``service_namespace`` and ``token_file`` (else ``$KVOFFLOAD_TOKEN_FILE``):
    a service with tenants.
    """

    url: str = "http://127.0.0.1:8000"
    pool_socket: str | None = None
    namespace: str | None = None
    service_namespace: str | None = None
    token_file: str | None = None
    timeout_s: float = 5.0
    connect_timeout_s: float = 1.0
    retry_interval_s: float = 1.0
    load_wait_s: float = 2.0

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> StoreConfig:
        """Read the settings from ``extra`` (other keys, SGLang's own, are left alone); a
        setting of the wrong type, a URL of another scheme or a token file that cannot be read
        is a ``ValueError`` naming the setting."""
        extra = dict(extra or {})
        kw: dict[str, Any] = {}
        for name in ("url", "pool_socket", "namespace", "service_namespace", "token_file"):
            value = extra.get(name)
            if value is not None:
                if not isinstance(value, str) or not value:
                    raise ValueError(f"kvoffload extra_config {name!r} must be a non-empty string")
                kw[name] = value
        for name in ("timeout_s", "connect_timeout_s", "retry_interval_s", "load_wait_s"):
            value = extra.get(name)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                    raise ValueError(f"kvoffload extra_config {name!r} must be a number >= 0")
                kw[name] = float(value)
        if "token_file" not in kw and os.environ.get(TOKEN_FILE_ENV):
            kw["token_file"] = os.environ[TOKEN_FILE_ENV]
        config = cls(**kw)
        try:
            parse_url(config.url)
        except ValueError as exc:
            raise ValueError(f"kvoffload extra_config 'url': {exc}") from None
        if config.token_file is not None:
            try:
                read_token_file(config.token_file)
            except (OSError, ValueError) as exc:
                raise ValueError(f"kvoffload extra_config 'token_file': {exc}") from None
        return config


class PageStore:
    """Pages of ``page_bytes`` under service keys, through a kvoffload service (see the module
    docstring). Thread-safe: SGLang's prefetch and backup threads call it at once."""

    def __init__(self, config: StoreConfig, page_bytes: int, rank_tag: str = "0") -> None:
        self.config = config
        self.page_bytes = page_bytes
        base_url, uds = parse_url(config.url)
        self.pool_socket = config.pool_socket or (default_pool_socket(uds) if uds else None)
        self.client = KVOffloadClient(
            base_url,
            uds=uds,
            timeout=httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s),
            token_file=config.token_file,
            namespace=config.service_namespace,
        )
        self.counters: collections.Counter[str] = collections.Counter()
        self.disabled: str | None = None
        self._pool: MappedPool | None = None
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._backoff = config.retry_interval_s
        self._tag = f"sglang-{rank_tag}-{uuid.uuid4().hex[:8]}"
        self._seq = 0

    # ------------------------------------------------------------------ connection

    def check_block_size(self) -> bool:
        """At registration: map the pool and check its block size. A pool of another block
        size, or credentials the service refuses, raise ``ValueError`` naming the setting to
        change; a service that cannot be reached returns False (the backend starts, answers
        misses, and checks again when the service is back)."""
        try:
            pool = self._map()
        except (KVOffloadAuthError, KVOffloadPermissionError) as exc:
            raise ValueError(
                f"kvoffload refused the credentials (extra_config 'token_file' / "
                f"'service_namespace'): {exc}"
            ) from None
        except PoolShareError as exc:
            if exc.reason is not None:
                raise ValueError(
                    f"kvoffload's pool socket refused the credentials (extra_config "
                    f"'token_file' / 'service_namespace'): {exc.reason}"
                ) from None
            self._fault("unreachable", f"cannot map the pool ({exc})")
            return False
        except Exception as exc:  # whatever the way to the service failed with
            self._fault("unreachable", f"cannot reach kvoffload ({type(exc).__name__}: {exc})")
            return False
        if pool.block_bytes != self.page_bytes:
            raise ValueError(self._mismatch(pool))
        with self._lock:
            self._pool = pool
        return True

    def _mismatch(self, pool: MappedPool) -> str:
        return (
            f"kvoffload's pool block size is {pool.block_bytes} bytes but an SGLang page is "
            f"{self.page_bytes} bytes; start kvoffload with --block-bytes {self.page_bytes} "
            "(or change SGLang's --page-size)"
        )

    def _map(self) -> MappedPool:
        return map_pool(
            self.client,
            self.pool_socket,
            timeout_s=self.config.timeout_s,
            token=self.client.current_token(),
            namespace=self.config.service_namespace,
        )

    def _ready(self) -> MappedPool | None:
        """The mapped pool, mapping it if needed; None (counted) while backing off, disabled
        or unreachable."""
        if self.disabled is not None:
            self.counters["skipped_disabled"] += 1
            return None
        if time.monotonic() < self._down_until:
            self.counters["skipped_backoff"] += 1
            return None
        with self._lock:
            pool = self._pool
        if pool is not None:
            return pool
        try:
            pool = self._map()
        except Exception as exc:  # whatever the way to the pool failed with: a fault
            self._fault("unreachable", f"cannot map the pool ({type(exc).__name__}: {exc})")
            return None
        if pool.block_bytes != self.page_bytes:
            self.disabled = self._mismatch(pool)
            log.error("kvoffload backend disabled: %s", self.disabled)
            self.counters["faults_block_size"] += 1
            return None
        with self._lock:
            self._pool = pool
        return pool

    def _fault(self, reason: str, message: str) -> None:
        """Count a fault, log it, and back off (doubling up to 16 times the interval)."""
        with self._lock:
            self.counters[f"faults_{reason}"] += 1
            first = time.monotonic() >= self._down_until
            self._down_until = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, 16 * self.config.retry_interval_s)
        if first:
            log.warning("kvoffload backend: %s; pages miss until it answers", message)

    def _healthy(self) -> None:
        with self._lock:
            self._backoff = self.config.retry_interval_s

    def _current(self, pool: MappedPool) -> MappedPool | None:
        """The pool the last answer's slots index: ``pool``, or, when that answer came from a
        service with another pool (restarted), the new one mapped now; None (counted) when it
        cannot be mapped."""
        if pool.still_current(self.client.last_pool_id):
            return pool
        self.counters["service_restarted"] += 1
        with self._lock:
            if self._pool is pool:
                self._pool = None
        fresh = self._ready()
        if fresh is None or not fresh.still_current(self.client.last_pool_id):
            return None
        return fresh

    def _req_id(self) -> str:
        with self._lock:
            self._seq += 1
            return f"{self._tag}-{self._seq}"

    def _batch(self, batch: Batch) -> list[OpResult] | None:
        """One batch call; None (a fault, counted) when it fails as a whole."""
        try:
            results = self.client.batch(batch)
        except httpx.TimeoutException as exc:
            self._fault("timeout", f"timed out ({type(exc).__name__})")
            return None
        except (httpx.HTTPError, OSError) as exc:
            self._fault("unreachable", f"unreachable ({type(exc).__name__}: {exc})")
            return None
        except (KVOffloadAuthError, KVOffloadPermissionError) as exc:
            self._fault("refused", f"refused the credentials ({exc.code})")
            return None
        except KVOffloadError as exc:
            self._fault("error", f"answered {exc.status} {exc.code}")
            return None
        except (KeyError, TypeError, ValueError) as exc:
            self._fault("bad_answer", f"answered something unreadable ({exc})")
            return None
        self._healthy()
        return results

    # ------------------------------------------------------------------ the three calls

    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, the service holds or can bring into its pool
        (0 on any fault)."""
        if not keys:
            return 0
        if self._ready() is None:
            return 0
        req = self._req_id()
        batch = Batch().start_request(req).lookup(req, keys, 10.0).finish_request(req)
        results = self._batch(batch)
        if results is None or len(results) != 3:
            return 0
        answer = results[1]
        if not answer.ok or answer.result is None:
            self.counters["faults_lookup"] += 1
            return 0
        pool = self._pool
        if pool is not None:
            self._current(pool)  # a restarted service: map its pool before the load
        found = 0
        for state in answer.result["results"]:
            if state not in _BRINGABLE:
                break
            found += 1
        self.counters["lookup_keys"] += len(keys)
        self.counters["lookup_found"] += found
        return found

    def _begin(
        self, keys: Sequence[bytes], pages: Sequence[Sequence[Region]], unserved: str
    ) -> MappedPool | None:
        """The opening of a store or a load: the mapped pool, or None when there is nothing to
        move (no keys) or no pool to move it through (``unserved`` counted once a key).
        ``ValueError`` when ``keys`` and ``pages`` differ in length."""
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
        if not keys:
            return None
        pool = self._ready()
        if pool is None:
            self.counters[unserved] += len(keys)
        return pool

    def store(self, keys: Sequence[bytes], pages: Sequence[Sequence[Region]]) -> list[bool]:
        """Store page ``pages[i]`` under ``keys[i]``; per key whether the service now holds it
        (already held counts). All False on a fault or when the service has no room."""
        pool = self._begin(keys, pages, "store_skipped")
        if pool is None:
            return [False] * len(keys)
        req = self._req_id()
        results = self._batch(Batch().start_request(req).prepare_store(req, keys))
        if results is None or len(results) != 2:
            self.counters["store_skipped"] += len(keys)
            return [False] * len(keys)
        answer = results[1]
        if not answer.ok or answer.result is None:
            status = answer.status
            self.counters["store_no_room" if status == 507 else "store_refused"] += len(keys)
            self._finish(req, [], None, abort=True)
            return [False] * len(keys)
        to_store = [bytes.fromhex(k) for k in answer.result["keys_to_store"]]
        slots = [int(s) for s in answer.result["slots"]]
        current = self._current(pool)
        if current is None:
            self._finish(req, to_store, False, abort=True)
            self.counters["store_skipped"] += len(keys)
            return [False] * len(keys)
        index = {k: i for i, k in enumerate(keys)}
        ok = True
        try:
            moves = []
            for key, slot in zip(to_store, slots, strict=True):
                moves.extend(_page_moves(current, slot, pages[index[key]], self.page_bytes, True))
            move_all(moves)
        except (KeyError, IndexError, ValueError) as exc:
            self._fault("bad_answer", f"a store it answered cannot be copied ({exc})")
            ok = False
        done = self._finish(req, to_store, ok)
        if not (ok and done):
            self.counters["store_skipped"] += len(keys)
            return [False] * len(keys)
        self.counters["store_pages"] += len(to_store)
        self.counters["store_held"] += len(keys) - len(to_store)
        return [True] * len(keys)

    def load(self, keys: Sequence[bytes], pages: Sequence[Sequence[Region]]) -> list[bool]:
        """Copy the page of ``keys[i]`` into ``pages[i]``; per key whether it was loaded (all
        False on a fault, a key the service does not hold, or one still coming up after
        ``load_wait_s``)."""
        pool = self._begin(keys, pages, "load_missed")
        if pool is None:
            return [False] * len(keys)
        req = self._req_id()
        slots = self._pin(req, keys)
        if slots is None:
            self.counters["load_missed"] += len(keys)
            return [False] * len(keys)
        current = self._current(pool)
        if current is None:
            self._finish(req, list(keys), None, abort=True)
            self.counters["load_missed"] += len(keys)
            return [False] * len(keys)
        ok = True
        try:
            moves = []
            for slot, page in zip(slots, pages, strict=True):
                moves.extend(_page_moves(current, slot, page, self.page_bytes, False))
            move_all(moves)
        except (IndexError, ValueError) as exc:
            self._fault("bad_answer", f"a load it answered cannot be copied ({exc})")
            ok = False
        # The copy is done before the pins are released, so the bytes read are the key's.
        done = self._finish(req, list(keys), None)
        if not (ok and done):
            self.counters["load_missed"] += len(keys)
            return [False] * len(keys)
        self.counters["load_pages"] += len(keys)
        return [True] * len(keys)

    def _pin(self, req: str, keys: Sequence[bytes]) -> list[int] | None:
        """Start ``req`` and pin ``keys`` (prepare-load); their slots, or None. A 409 (a key
        coming up from a lower tier) is asked again until ``load_wait_s`` has passed."""
        deadline = time.monotonic() + self.config.load_wait_s
        batch = Batch().start_request(req).prepare_load(req, keys)
        while True:
            results = self._batch(batch)
            if results is None or len(results) != len(batch.ops):
                return None
            answer = results[-1]
            if answer.ok and answer.result is not None:
                return [int(s) for s in answer.result["slots"]]
            if answer.status != 409 or time.monotonic() >= deadline:
                self._finish(req, [], None, abort=True)
                self.counters["load_not_ready" if answer.status == 409 else "load_refused"] += 1
                return None
            time.sleep(0.02)
            batch = Batch().prepare_load(req, keys)

    def _finish(
        self, req: str, keys: Sequence[bytes], stored: bool | None, abort: bool = False
    ) -> bool:
        """Complete ``keys`` (a store's with ``stored``, a load's when None) and finish
        ``req``; whether the service took the completion."""
        batch = Batch()
        if keys:
            if stored is None:
                batch.complete_load(req, keys)
            else:
                batch.complete_store(req, keys, success=stored)
        batch.finish_request(req, abort=abort)
        results = self._batch(batch)
        return results is not None and all(r.ok for r in results)

    def stats(self) -> dict[str, int]:
        """A copy of the counters (faults by reason, pages stored, loaded, skipped, missed)."""
        return dict(self.counters)

    def close(self) -> None:
        """Close the HTTP client (the mapping goes with the object)."""
        self.client.close()


def _page_moves(
    pool: MappedPool, slot: int, page: Sequence[Region], page_bytes: int, to_pool: bool
) -> list[tuple[int, int, int]]:
    """``(dst, src, nbytes)`` moves between slot ``slot`` and the regions of ``page``."""
    if not 0 <= slot < pool.num_blocks:
        raise IndexError(f"slot {slot} out of [0, {pool.num_blocks})")
    if sum(n for _, n in page) != page_bytes:
        raise ValueError(f"a page of {sum(n for _, n in page)} bytes, not {page_bytes}")
    base = pool.blocks[slot].ctypes.data
    moves = []
    offset = 0
    for addr, n in page:
        moves.append((base + offset, addr, n) if to_pool else (addr, base + offset, n))
        offset += n
    return moves
