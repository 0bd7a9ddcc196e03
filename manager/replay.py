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

The oracle-admission bound ``oracle-<policy>`` (e.g. ``oracle-lru``, parameter ``horizon=H``)
asks a narrower question: how far does a real policy get if it only knew which new blocks come
back soon? It runs the real manager with the named registered policy, and offers a new block to
``prepare_store`` only if its next use starts within ``H x capacity`` block references of the
start of the current request (``H = inf``: the block is ever used again). Everything else about
the policy is online. A block not offered is handled exactly as Belady's bypass: not stored, no
eviction made for it; keys already resident are still offered, as in a plain replay, so the
policy sees the same touches. It is a ceiling for admission filters that predict reuse within
that horizon, not for every policy: on a given trace cutting a block reused just past the horizon
can lose a hit the plain policy would have had.

**Two levels** (``disk_capacity``): a disk tier below the pool, decided by ``DiskIndex`` exactly
as the service decides it (inclusive: a block read back keeps its disk copy). Per request:

1. ``lookup`` all its keys in the pool, and count one ask of each (``DiskIndex.asked``; the
   service counts asks at lookup, prepare-load and prepare-store, so a new block looked up
   and then stored has two asks after its first request);
2. the prefix runs through keys that are pool hits or on disk, up to the first key in neither
   (a disk hit counts as a prefix hit: the engine is saved the recompute);
3. the prefix's disk keys are promoted: pinned on disk for the read, given pool slots by one
   ``prepare_store`` that offers the whole prefix (so the prefix's own pool hits cannot be
   evicted to make room for it), completed, unpinned. A disk key the pool takes no slot for
   (no room, or the pool's store threshold) ends the prefix there;
4. load the prefix (one ask each): ``prepare_load``, ``touch``, ``complete_load``;
5. offer the rest to ``prepare_store`` (one ask each) and complete the store; finish.

Every block the pool evicts, in 3 or 5, goes to ``DiskIndex.select``; the chosen ones are
reserved on disk (evicting cold disk blocks) and written whole at once (``written``), before
the pool hands their slots out again. The bounds (Belady, ``oracle-*``) are pool-only and not
replayed with a disk.

Traces are Mooncake-format JSON lines (``hash_ids``: the request's prefix as a chain of block
ids); ``parse_trace`` turns lines into key lists. Reading files is the caller's job.
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from itertools import accumulate
from typing import Any

from manager.core import OffloadManager, create_manager
from manager.errors import InvalidArgumentError, InvalidPolicyParamsError, UnknownPolicyError
from manager.policies import available_policies, canonical_policy_name, parse_policy_params
from manager.policies.base import CanEvict, EvictionPolicy
from manager.spec import BlockKey, LookupResult, ReqContext
from manager.tiers import DiskIndex

BELADY = "belady"
ORACLE_PREFIX = "oracle-"
HORIZON = "horizon"
Progress = Callable[[int, int], None]
Admit = Callable[[Sequence[BlockKey]], list[BlockKey]]


def is_bound(name: str) -> bool:
    """Whether a policy name (or a row label starting with one) is an offline bound.

    Bounds (``belady`` and every ``oracle-<policy>``) read the future, so they are ceilings to
    compare against, never candidates for "best online policy".
    """
    return name == BELADY or name.startswith(ORACLE_PREFIX)


def oracle_base_policy(name: str) -> str | None:
    """The real policy an oracle-admission bound runs (``"oracle-lru"`` -> ``"lru"``), else None.

    The base name is not checked here; ``replay`` rejects one that is not registered.
    """
    if name.startswith(ORACLE_PREFIX):
        return name[len(ORACLE_PREFIX) :]
    return None


def replay_policy_name(name: str) -> str:
    """The name ``replay`` runs for ``name``: a registered policy's in any case or alias
    (``LRU``, ``S3-FIFO``: ``canonical_policy_name``), ``belady``, or ``oracle-`` and one of
    those (``oracle-ARC`` -> ``oracle-arc``); ``UnknownPolicyError`` otherwise."""
    folded = name.strip().lower()
    if folded == BELADY:
        return BELADY
    if folded.startswith(ORACLE_PREFIX):
        try:
            return ORACLE_PREFIX + canonical_policy_name(name.strip()[len(ORACLE_PREFIX) :])
        except UnknownPolicyError:
            raise UnknownPolicyError(
                name, [ORACLE_PREFIX + p for p in available_policies()]
            ) from None
    return canonical_policy_name(name)


def _split_horizon(name: str, params: Mapping[str, Any] | None) -> tuple[float, dict[str, Any]]:
    """``(horizon, the base policy's params)`` from an oracle bound's parameters.

    ``horizon`` is required (the bound's value depends strongly on it, so a default would make
    rows ambiguous) and must be a positive int or float, ``inf`` allowed. Raises
    ``InvalidPolicyParamsError`` otherwise.
    """
    rest = dict(params or {})
    if HORIZON not in rest:
        raise InvalidPolicyParamsError(
            f"{name} needs the parameter {HORIZON}=H (pool sizes of block references, or inf)"
        )
    horizon = rest.pop(HORIZON)
    # bool is an int subclass: reject it explicitly, "horizon=true" is a typo, not 1 pool.
    if type(horizon) not in (int, float) or not horizon > 0:  # `not >` also rejects NaN
        raise InvalidPolicyParamsError(
            f"{name}: {HORIZON} must be a positive number or inf, got {horizon!r}"
        )
    return float(horizon), rest


def check_params(policy: str, params: Mapping[str, Any] | None) -> None:
    """Check ``params`` for ``policy`` as ``replay`` would, without replaying anything.

    For a registered policy: its declared parameters and their bounds. For ``oracle-<name>``:
    ``horizon``, then the rest as ``<name>``'s parameters. Belady's bound takes none (``replay``
    ignores them). Raises ``PolicyError`` (``UnknownPolicyError``, ``InvalidPolicyParamsError``
    naming the policy, the parameter and the bound), so a caller can refuse bad input before
    a sweep that may run for minutes.
    """
    if policy == BELADY:
        return
    base = oracle_base_policy(policy)
    if base is None:
        parse_policy_params(policy, params)
        return
    if base not in available_policies():  # name the bound, not the bare base, in the error
        raise UnknownPolicyError(policy, [ORACLE_PREFIX + p for p in available_policies()])
    _, base_params = _split_horizon(policy, params)
    parse_policy_params(base, base_params)


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
class DiskReplay:
    """The disk tier's side of a two-level replay (``ReplayResult.disk``).

    ``pool_hits + disk_hits`` is the result's ``prefix_hits``; the ratios are over its
    ``blocks``. ``demotions``: blocks written to disk; ``refused``: evicted blocks not admitted
    (asked for fewer than ``admit_after`` times); ``evictions``: disk blocks evicted to make
    room; ``unwritten``: admitted blocks the disk found no room for (every slot pinned or being
    written, or more blocks at once than it has slots).
    """

    capacity: int
    policy: str
    admit_after: int
    pool_hits: int
    disk_hits: int
    pool_hit_ratio: float
    disk_hit_ratio: float
    demotions: int
    refused: int
    evictions: int
    unwritten: int


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
    #: The disk tier's side of a two-level replay; None for the pool alone.
    disk: DiskReplay | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields; a non-finite float parameter (``horizon=inf``) becomes a string,
        since JSON has no infinity (``json.dumps`` would write the non-standard ``Infinity``).
        ``disk`` is left out for the pool alone, so those rows read as they always did."""
        out = asdict(self)
        if self.disk is None:
            del out["disk"]
        out["params"] = {
            k: str(v) if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in self.params.items()
        }
        return out


class _NextUse:
    """Oracle for the bounds: each key's next reference after the current request.

    ``current[key]`` is the index of the next request using ``key`` (``inf``: none), valid for
    keys seen so far; ``distance(key)`` is the same in block references.
    """

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
        # start[i]: block references before request i. Horizons are measured on this clock,
        # not in requests, because the pool is sized in blocks and requests vary in length.
        self._start: list[int] = list(accumulate(map(len, requests), initial=0))
        self._now = 0

    def advance(self, index: int, keys: Sequence[BlockKey]) -> None:
        """Request ``index`` is being served: its keys' next uses move past it."""
        current = self.current
        for key, nxt in zip(keys, self._next[index], strict=True):
            current[key] = nxt
        self._now = self._start[index]

    def distance(self, key: BlockKey) -> float:
        """Block references from the start of the current request to the start of the next
        request using ``key``; ``inf`` if there is none (or ``key`` was never seen)."""
        nxt = self.current.get(key, math.inf)
        if nxt == math.inf:
            return math.inf
        return self._start[int(nxt)] - self._now


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
    disk_capacity: int | None = None,
    disk_admit_after: int = 2,
    disk_policy: str | None = None,
) -> ReplayResult:
    """Replay ``requests`` against a fresh manager of ``capacity`` blocks running ``policy``.

    ``policy`` may be ``"belady"`` for the offline ceiling, or ``"oracle-<name>"`` for the
    oracle-admission bound over registered policy ``<name>``; that one needs ``params`` to hold
    ``horizon`` (see the module docstring) and passes the other params to ``<name>``. Bad names
    or parameters raise ``PolicyError`` (an ``InvalidArgumentError``). ``progress(done, total)``
    is called every 256 requests and at the end.

    ``disk_capacity`` adds a disk tier of that many blocks below the pool (the module
    docstring's two levels), admitting blocks asked for ``disk_admit_after`` times and evicting
    by ``disk_policy`` (default: the pool's policy and parameters); the result's ``disk`` says
    what it did. Only online policies run with a disk: a bound raises ``InvalidArgumentError``.
    """
    if capacity <= 0:
        raise InvalidArgumentError(f"capacity must be positive, got {capacity}")
    if disk_capacity is not None:
        return _replay_two_levels(
            requests,
            policy,
            capacity,
            store_threshold=store_threshold,
            params=params,
            progress=progress,
            disk=_DiskSpec(disk_capacity, disk_admit_after, disk_policy),
        )
    oracle: _NextUse | None = None
    # admit: filters a request's missed keys before prepare_store; a key it drops is bypassed
    # (neither stored nor evicted for), which is how both bounds use the oracle.
    admit: Admit | None = None
    base = oracle_base_policy(policy)
    if policy == BELADY:
        oracle = _NextUse(requests)
        m = create_manager(capacity, "lru", store_threshold, enable_events=False)
        belady = _BeladyPolicy(capacity, oracle)
        m._policy = belady  # the oracle policy is not registered: it needs the future
        admit = partial(_belady_admit, m, belady, oracle)
    elif base is not None:
        if base not in available_policies():  # name the bound, not the bare base, in the error
            raise UnknownPolicyError(policy, [ORACLE_PREFIX + p for p in available_policies()])
        horizon, base_params = _split_horizon(policy, params)
        m = create_manager(
            capacity, base, store_threshold, policy_params=base_params, enable_events=False
        )
        oracle = _NextUse(requests)
        # horizon * capacity: inf stays inf, "ever used again"
        admit = partial(_horizon_admit, m, oracle, horizon * capacity)
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
        if admit is not None:
            rest = admit(rest)
        if rest:
            out = m.prepare_store(rest, ctx)
            if out is not None and out.keys_to_store:
                m.complete_store(out.keys_to_store, ctx, True)
        m.on_request_finished(ctx)
        if progress is not None and (index % 256 == 255 or index == total - 1):
            progress(index + 1, total)
    return _result(m, policy, params, capacity, store_threshold, total, blocks, prefix_hits)


@dataclass(frozen=True, slots=True)
class _DiskSpec:
    """The disk tier a two-level replay runs: capacity, admission, policy (None: the pool's)."""

    capacity: int
    admit_after: int
    policy: str | None


class _TwoLevels:
    """A pool over a ``DiskIndex``, served one request at a time as the module docstring says.

    The pool's eviction listener demotes at once (select, reserve, written whole), so the disk
    holds a block before the pool could reuse its slot, as in the service.
    """

    def __init__(self, pool: OffloadManager, disk: DiskIndex) -> None:
        self.pool = pool
        self.disk = disk
        self.pool_hits = 0
        self.disk_hits = 0
        self.demotions = 0
        self.disk_evictions = 0
        self.unwritten = 0
        pool.add_eviction_listener(self._demote)

    def _demote(self, victims: list[BlockKey], slots: list[int]) -> None:
        """Write the admitted victims to disk (the listener: it never calls the pool)."""
        disk = self.disk
        chosen = disk.select(victims)
        if not chosen:
            return
        op = disk.reserve(chosen)
        if op is None:
            self.unwritten += len(chosen)
            return
        self.disk_evictions += len(op.evicted)
        self.demotions += len(disk.written(op, [True] * len(op.keys)))

    def serve(self, keys: Sequence[BlockKey], ctx: ReqContext) -> int:
        """Serve one request (``ctx`` already begun, not finished); its prefix hits."""
        pool, disk = self.pool, self.disk
        results = pool.lookup(keys, ctx).results
        disk.asked(keys, ctx.req_id)
        # in_pool[i]: prefix key i is a pool hit (else it is on disk).
        in_pool: list[bool] = []
        for key, result in zip(keys, results, strict=True):
            if result is LookupResult.HIT:
                in_pool.append(True)
            elif disk.found([key])[0]:
                in_pool.append(False)
            else:
                break
        prefix = list(keys[: len(in_pool)])
        if prefix:
            disk.asked(prefix, ctx.req_id)  # the engine's prepare-load of what it was told
        if not all(in_pool):
            promoted = self._promote(prefix, in_pool, ctx)
            # The prefix ends at the first disk key the pool took no slot for.
            for i, (key, pooled) in enumerate(zip(prefix, in_pool, strict=True)):
                if not pooled and key not in promoted:
                    del prefix[i:], in_pool[i:]
                    break
        if prefix:
            pool.prepare_load(prefix, ctx)
            pool.touch(prefix, ctx)
            pool.complete_load(prefix, ctx)
        hits = len(prefix)
        from_pool = in_pool.count(True)
        self.pool_hits += from_pool
        self.disk_hits += hits - from_pool
        rest = keys[hits:]
        if rest:
            disk.asked(rest, ctx.req_id)
            out = pool.prepare_store(rest, ctx)
            if out is not None and out.keys_to_store:
                pool.complete_store(out.keys_to_store, ctx, True)
        return hits

    def _promote(
        self, prefix: list[BlockKey], in_pool: list[bool], ctx: ReqContext
    ) -> set[BlockKey]:
        """Read the prefix's disk keys into the pool; the keys now ready there."""
        pool, disk = self.pool, self.disk
        wanted = list(dict.fromkeys(k for k, p in zip(prefix, in_pool, strict=True) if not p))
        read = disk.pin(wanted)  # every wanted key was found on disk, nothing moved since
        if read is None:  # pragma: no cover - found() and pin() disagree: a DiskIndex bug
            raise AssertionError("a key found on disk could not be pinned")
        try:
            # The whole prefix is offered: its pool hits are protected from this store's
            # evictions, the disk keys get slots (evictions here demote, disk keys pinned).
            out = pool.prepare_store(prefix, ctx)
            if out is None or not out.keys_to_store:
                return set()
            return set(pool.complete_store(out.keys_to_store, ctx, True).completed)
        finally:
            disk.unpin(read)

    def result(self, blocks: int) -> DiskReplay:
        """The disk side of the replay so far, over ``blocks`` block references."""
        disk = self.disk
        return DiskReplay(
            capacity=disk.num_slots,
            policy=disk.index.policy.name,
            admit_after=disk.admit_after,
            pool_hits=self.pool_hits,
            disk_hits=self.disk_hits,
            pool_hit_ratio=self.pool_hits / blocks if blocks else 0.0,
            disk_hit_ratio=self.disk_hits / blocks if blocks else 0.0,
            demotions=self.demotions,
            refused=disk.refused,
            evictions=self.disk_evictions,
            unwritten=self.unwritten,
        )


def _replay_two_levels(
    requests: Sequence[Sequence[BlockKey]],
    policy: str,
    capacity: int,
    *,
    store_threshold: int,
    params: Mapping[str, Any] | None,
    progress: Progress | None,
    disk: _DiskSpec,
) -> ReplayResult:
    """``replay`` with a disk tier (see ``replay``)."""
    if is_bound(policy):
        raise InvalidArgumentError(
            f"{policy} is a pool-only bound; a replay with a disk tier runs online policies"
        )
    if type(disk.capacity) is not int or disk.capacity <= 0:
        raise InvalidArgumentError(
            f"disk capacity must be a positive integer, got {disk.capacity!r}"
        )
    pool = create_manager(
        capacity, policy, store_threshold, policy_params=params, enable_events=False
    )
    # The disk runs the pool's policy and parameters unless told another policy.
    index = DiskIndex(
        disk.capacity,
        disk.policy or policy,
        admit_after=disk.admit_after,
        policy_params=params if disk.policy is None else None,
    )
    tiers = _TwoLevels(pool, index)
    prefix_hits = blocks = 0
    total = len(requests)
    for index_, keys in enumerate(requests):
        ctx = ReqContext(f"trace-{index_}")
        pool.on_new_request(ctx)
        prefix_hits += tiers.serve(keys, ctx)
        blocks += len(keys)
        pool.on_request_finished(ctx)
        if progress is not None and (index_ % 256 == 255 or index_ == total - 1):
            progress(index_ + 1, total)
    return _result(
        pool, policy, params, capacity, store_threshold, total, blocks, prefix_hits,
        disk=tiers.result(blocks),
    )  # fmt: skip


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


def _horizon_admit(
    m: OffloadManager, oracle: _NextUse, reach: float, keys: Sequence[BlockKey]
) -> list[BlockKey]:
    """Oracle admission: offer a new key only if its next use is at most ``reach`` block
    references away (``reach = inf``: only if it has one).

    Resident keys are kept so ``prepare_store`` treats them exactly as in a plain replay (it
    counts them as reuse and shields them from this store's evictions).
    """
    resident = m._slot
    admitted: list[BlockKey] = []
    for key in keys:
        if key in resident:
            admitted.append(key)
            continue
        distance = oracle.distance(key)
        # The explicit inf test matters: with reach = inf, `inf <= inf` would admit one-offs.
        if distance != math.inf and distance <= reach:
            admitted.append(key)
    return admitted


def _result(
    m: OffloadManager,
    policy: str,
    params: Mapping[str, Any] | None,
    capacity: int,
    store_threshold: int,
    requests: int,
    blocks: int,
    prefix_hits: int,
    disk: DiskReplay | None = None,
) -> ReplayResult:
    """A replay's row from its counts and the pool's statistics."""
    stats = m.stats()
    return ReplayResult(
        policy=policy,
        params=dict(params or {}),
        capacity=capacity,
        store_threshold=store_threshold,
        requests=requests,
        blocks=blocks,
        prefix_hits=prefix_hits,
        hit_ratio=prefix_hits / blocks if blocks else 0.0,
        stores=stats.stores_completed,
        refused=stats.stores_refused,
        evictions=stats.evictions,
        disk=disk,
    )
