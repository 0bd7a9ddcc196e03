"""Shared test scaffolding for the manager: readable keys, a fake clock, a pool driver.

``Pool`` drives an ``OffloadManager`` through its public API only, so the same test body works
with the reuse filter on or off: ``offer`` repeats a store offer as often as the filter needs.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence
from typing import Any

from manager import (
    LookupResult,
    ManagerStats,
    OffloadManager,
    PolicyInfo,
    PrepareStoreOutput,
    ReqContext,
    RequestLeases,
    create_manager,
)
from manager.policies import ARCPolicy

HIT = LookupResult.HIT
PENDING = LookupResult.PENDING
MISS = LookupResult.MISS


def key(i: int) -> bytes:
    """A readable block key (failure messages show ``b'k007'``)."""
    return f"k{i:03d}".encode()


def keys(start: int, stop: int) -> list[bytes]:
    """``key(i)`` for ``start <= i < stop``, in order."""
    return [key(i) for i in range(start, stop)]


class FakeClock:
    """A clock the test moves by hand; the manager reads time only through it."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def quiet_stats(stats: ManagerStats) -> ManagerStats:
    """``stats`` without the lookup counters (the probe lookups of ``Pool.state`` move them)."""
    return dataclasses.replace(stats, lookup_hit=0, lookup_pending=0, lookup_miss=0)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What ``Pool.snapshot`` saw; equal snapshots mean the call in between changed nothing."""

    stats: ManagerStats
    resident: list[bytes]
    slots: list[int | None]
    refs: list[int]
    requests: list[RequestLeases]
    policy: PolicyInfo
    states: list[LookupResult]

    def bumped(self, **deltas: int) -> Snapshot:
        """This snapshot with the named ``stats`` counters increased by the given amounts."""
        stats = dataclasses.replace(
            self.stats, **{name: getattr(self.stats, name) + d for name, d in deltas.items()}
        )
        return dataclasses.replace(self, stats=stats)


class Pool:
    """An ``OffloadManager`` on a fake clock, plus helpers that speak its public API."""

    def __init__(
        self,
        num_blocks: int,
        policy: str = "lru",
        store_threshold: int = 0,
        **kwargs: Any,
    ) -> None:
        self.clock = FakeClock()
        self.m: OffloadManager = create_manager(
            num_blocks, policy, store_threshold, clock=self.clock, **kwargs
        )
        self.threshold = store_threshold
        self._ids = itertools.count()

    # -------------------------------------------------------------- requests

    def request(self, req_id: str | None = None) -> ReqContext:
        """Start a request (a fresh id unless one is given)."""
        ctx = ReqContext(req_id if req_id is not None else f"req-{next(self._ids)}")
        assert self.m.on_new_request(ctx) is True
        return ctx

    # -------------------------------------------------------------- stores

    def prime(self, block_keys: Sequence[bytes], ctx: ReqContext) -> None:
        """Offer fresh keys ``threshold - 1`` times, so that the next offer admits them."""
        for _ in range(self.threshold - 1):
            out = self.m.prepare_store(block_keys, ctx)
            assert out is not None
            assert out.keys_to_store == []
            assert set(out.skipped_keys) == {k for k in block_keys if self.state(k) is MISS}

    def offer(self, block_keys: Sequence[bytes], ctx: ReqContext) -> PrepareStoreOutput | None:
        """Offer ``block_keys`` until the reuse filter admits them all; the merged outputs.

        None when an offer is refused (earlier offers of a filtered pool may have counted).
        """
        merged = PrepareStoreOutput([], [], [])
        for _ in range(max(1, self.threshold)):
            out = self.m.prepare_store(block_keys, ctx)
            if out is None:
                return None
            merged = PrepareStoreOutput(
                merged.keys_to_store + out.keys_to_store,
                merged.slots + out.slots,
                merged.evicted_keys + out.evicted_keys,
                out.skipped_keys,
            )
            if not out.skipped_keys:
                break
        return merged

    def store(self, block_keys: Sequence[bytes], ctx: ReqContext | None = None) -> list[bytes]:
        """Store ``block_keys`` (one call each for offer and completion); returns evicted keys.

        Without ``ctx`` a request of its own does it and finishes, so it adds no reordering.
        """
        own = ctx is None
        use = self.request() if ctx is None else ctx
        out = self.offer(block_keys, use)
        assert out is not None, f"store of {list(block_keys)} refused"
        assert out.skipped_keys == []
        done = self.m.complete_store(out.keys_to_store, use, success=True)
        assert done.completed == out.keys_to_store
        if own:
            self.m.on_request_finished(use)
        assert self.states(block_keys) == [HIT] * len(block_keys)
        return out.evicted_keys

    def store_each(self, block_keys: Iterable[bytes]) -> list[bytes]:
        """Store keys one call at a time (the last one ends up most recent); evicted keys."""
        evicted: list[bytes] = []
        for k in block_keys:
            evicted += self.store([k])
        return evicted

    def pin(self, block_keys: Sequence[bytes], ctx: ReqContext | None = None) -> ReqContext:
        """Pin ``block_keys`` for a request (a new one unless given); returns that request."""
        use = self.request() if ctx is None else ctx
        self.m.prepare_load(block_keys, use)
        return use

    # -------------------------------------------------------------- observation

    def states(self, block_keys: Sequence[bytes]) -> list[LookupResult]:
        """Lookup results through a throw-away request (it leaves no trace but counters)."""
        probe = ReqContext("probe")
        self.m.on_new_request(probe)
        try:
            return self.m.lookup(block_keys, probe).results
        finally:
            self.m.on_request_finished(probe)

    def state(self, block_key: bytes) -> LookupResult:
        return self.states([block_key])[0]

    def snapshot(self, block_keys: Sequence[bytes]) -> Snapshot:
        """Everything observable about the pool and ``block_keys`` (lookup counters aside)."""
        m = self.m
        return Snapshot(
            stats=quiet_stats(m.stats()),
            resident=m.resident_keys(),
            slots=[m.slot_of(k) for k in block_keys],
            refs=[m.ref_count(k) for k in block_keys],
            requests=m.requests(),
            policy=m.policy,
            states=self.states(block_keys),
        )

    def check_accounting(self) -> None:
        """Block counts add up and every resident block has its own slot."""
        s = self.m.stats()
        assert s.free + s.pending + s.ready == s.num_blocks
        assert min(s.free, s.pending, s.ready, s.pinned) >= 0
        assert s.pinned <= s.ready
        resident = self.m.resident_keys()
        assert len(resident) == s.ready
        slots = [self.m.slot_of(k) for k in resident]
        assert None not in slots
        assert len(set(slots)) == len(slots)
        assert all(0 <= slot < s.num_blocks for slot in slots if slot is not None)


def arc_of(m: OffloadManager) -> ARCPolicy:
    """The manager's live ARC policy, to read its lists (no public accessor exists)."""
    policy = m._policy
    assert isinstance(policy, ARCPolicy)
    return policy
