"""Trace replay: drive the real manager with a request trace and measure the prefix hit ratio.

Accounting per request (the same for every policy, and for the Belady bound):

1. ``lookup`` all its keys; ``hit_prefix`` leading hits are what the engine saves;
2. load that prefix: ``prepare_load``, ``touch``, ``complete_load``;
3. offer the remaining keys to ``prepare_store`` and complete the store;
4. finish the request.

The prefix hit ratio is the sum of ``hit_prefix`` over the sum of request lengths.

Belady's MIN is the ceiling: with the future known, evict the block whose next use is farthest
and never store a block that will not be used again, or one whose next use is later than that
of every block it would displace. MIN maximises block hits, not prefix hits, so it is a
reference ceiling, not a proof of optimality for this metric.

Traces are Mooncake-format JSON lines (``hash_ids``: the request's prefix as a chain of block
ids); ``parse_trace`` turns lines into key lists. Reading files is the caller's job.
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from manager.core import OffloadManager, create_manager
from manager.errors import InvalidArgumentError
from manager.policies.base import CanEvict, EvictionPolicy
from manager.spec import BlockKey, ReqContext

BELADY = "belady"
Progress = Callable[[int, int], None]


def block_key(block_id: int) -> BlockKey:
    """The manager key of a trace block id (8 bytes, big endian)."""
    return block_id.to_bytes(8, "big")


def parse_trace(lines: Iterable[str]) -> list[list[BlockKey]]:
    """Requests as key lists from Mooncake-format JSON lines; blank lines are skipped.

    Raises ``InvalidArgumentError`` naming the line for malformed input.
    """
    requests: list[list[BlockKey]] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            ids = record["hash_ids"]
            if not isinstance(ids, list) or not all(type(i) is int and 0 <= i < 2**64 for i in ids):
                raise ValueError("hash_ids must be a list of non-negative 64-bit integers")
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgumentError(f"trace line {lineno}: {exc}") from None
        requests.append([block_key(i) for i in ids])
    return requests


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """Outcome of one replay."""

    policy: str
    params: dict[str, Any]
    capacity: int
    store_threshold: int
    requests: int
    blocks: int
    prefix_hits: int
    hit_ratio: float
    stores: int
    refused: int
    evictions: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _NextUse:
    """Oracle for Belady: position of each key's next reference after the current request."""

    def __init__(self, requests: Sequence[Sequence[BlockKey]]) -> None:
        # next_pos[i][j]: index of the next request that uses requests[i][j], or inf.
        self._next: list[list[float]] = [[] for _ in requests]
        last_seen: dict[BlockKey, float] = {}
        for i in range(len(requests) - 1, -1, -1):
            row = []
            for key in requests[i]:
                row.append(last_seen.get(key, math.inf))
            for key in requests[i]:
                last_seen[key] = i
            self._next[i] = row
        self.current: dict[BlockKey, float] = {}

    def advance(self, index: int, keys: Sequence[BlockKey]) -> None:
        """Request ``index`` is being served: its keys' next uses move past it."""
        current = self.current
        for key, nxt in zip(keys, self._next[index], strict=True):
            current[key] = nxt


class _BeladyPolicy(EvictionPolicy):
    """Evict the key whose next use is farthest (lazy max-heap over the oracle's values)."""

    name = BELADY

    def __init__(self, capacity: int, oracle: _NextUse) -> None:
        super().__init__(capacity)
        self._oracle = oracle
        self._held: set[BlockKey] = set()
        self._heap: list[tuple[float, BlockKey]] = []

    def _push(self, keys: Iterable[BlockKey]) -> None:
        current = self._oracle.current
        for key in keys:
            heapq.heappush(self._heap, (-current.get(key, math.inf), key))

    def farthest(self, can_evict: CanEvict | None) -> float:
        """Next use of the next victim (``-inf`` if nothing is evictable); changes nothing."""
        victims = self.evict(1, can_evict, dry_run=True)
        if not victims:
            return -math.inf
        return self._oracle.current.get(victims[0], math.inf)

    def insert(self, keys: Sequence[BlockKey]) -> None:
        self._held.update(keys)
        self._push(keys)

    def touch(self, keys: Sequence[BlockKey]) -> None:
        self._push(k for k in keys if k in self._held)

    def request_finished(self, keys: Sequence[BlockKey]) -> None:
        """Order depends only on the future; nothing to do."""

    def remove(self, keys: Sequence[BlockKey]) -> None:
        self._held.difference_update(keys)

    def evict(
        self, n: int, can_evict: CanEvict | None = None, *, dry_run: bool = False
    ) -> list[BlockKey] | None:
        current = self._oracle.current
        heap = self._heap
        victims: list[BlockKey] = []
        chosen: set[BlockKey] = set()
        skipped: list[tuple[float, BlockKey]] = []
        while heap and len(victims) < n:
            neg, key = heapq.heappop(heap)
            if key not in self._held or key in chosen:
                continue
            now = -current.get(key, math.inf)
            if now != neg:  # stale entry: the key was used since; re-file it
                heapq.heappush(heap, (now, key))
                continue
            skipped.append((neg, key))
            if can_evict is None or can_evict(key):
                victims.append(key)
                chosen.add(key)
        for entry in skipped:
            heapq.heappush(heap, entry)
        if len(victims) < n:
            return None
        if not dry_run:
            self._held.difference_update(victims)
        return victims

    def coldest_first(self) -> Iterator[BlockKey]:
        current = self._oracle.current
        return iter(sorted(self._held, key=lambda k: -current.get(k, math.inf)))

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: object) -> bool:
        return key in self._held


def replay(
    requests: Sequence[Sequence[BlockKey]],
    policy: str,
    capacity: int,
    *,
    store_threshold: int = 0,
    params: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
) -> ReplayResult:
    """Replay ``requests`` against a fresh manager of ``capacity`` blocks running ``policy``.

    ``policy`` may be ``"belady"`` for the offline ceiling. ``progress(done, total)`` is called
    every 256 requests and at the end.
    """
    if capacity <= 0:
        raise InvalidArgumentError(f"capacity must be positive, got {capacity}")
    oracle: _NextUse | None = None
    belady: _BeladyPolicy | None = None
    if policy == BELADY:
        oracle = _NextUse(requests)
        m = create_manager(capacity, "lru", store_threshold, enable_events=False)
        belady = _BeladyPolicy(capacity, oracle)
        m._policy = belady  # the oracle policy is not registered: it needs the future
    else:
        m = create_manager(
            capacity, policy, store_threshold, policy_params=params, enable_events=False
        )
    prefix_hits = 0
    blocks = 0
    total = len(requests)
    for index, keys in enumerate(requests):
        ctx = ReqContext(f"trace-{index}")
        m.on_new_request(ctx)
        if oracle is not None:
            oracle.advance(index, keys)
        hit = m.lookup(keys, ctx).hit_prefix
        prefix_hits += hit
        blocks += len(keys)
        if hit:
            prefix = keys[:hit]
            m.prepare_load(prefix, ctx)
            m.touch(prefix, ctx)
            m.complete_load(prefix, ctx)
        rest = keys[hit:]
        if belady is not None and oracle is not None:
            rest = _belady_admit(m, belady, oracle, rest)
        if rest:
            out = m.prepare_store(rest, ctx)
            if out is not None and out.keys_to_store:
                m.complete_store(out.keys_to_store, ctx, True)
        m.on_request_finished(ctx)
        if progress is not None and (index % 256 == 255 or index == total - 1):
            progress(index + 1, total)
    stats = m.stats()
    return ReplayResult(
        policy=policy,
        params=dict(params or {}),
        capacity=capacity,
        store_threshold=store_threshold,
        requests=total,
        blocks=blocks,
        prefix_hits=prefix_hits,
        hit_ratio=prefix_hits / blocks if blocks else 0.0,
        stores=stats.stores_completed,
        refused=stats.stores_refused,
        evictions=stats.evictions,
    )


def _belady_admit(
    m: OffloadManager, policy: _BeladyPolicy, oracle: _NextUse, keys: Sequence[BlockKey]
) -> list[BlockKey]:
    """MIN's bypass: offer only new keys that beat the block they would displace."""
    current = oracle.current
    resident = m._slot
    free = len(m._free)
    admitted: list[BlockKey] = []
    farthest: float | None = None
    for key in keys:
        if key in resident:
            admitted.append(key)  # resident: skipped by prepare_store, harmless
            continue
        nxt = current.get(key, math.inf)
        if nxt == math.inf:
            continue
        if free > 0:
            free -= 1
            admitted.append(key)
            continue
        if farthest is None:
            farthest = policy.farthest(lambda k: k not in m._refs)
        if nxt < farthest:
            admitted.append(key)
    return admitted
