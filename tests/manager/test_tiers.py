"""The disk tier's bookkeeping under a pool: hypothesis drives a pool and a ``DiskIndex`` wired as
the service wires them and checks both against a model.

The pool's eviction listener selects the victims to demote and reserves disk slots for them at
once (the service then writes their bytes before the pool reuses the slots); the writes end
later, whole or torn, in any order. Disk hits are read back into the pool under a pin that can
outlive other operations and end corrupt (the block is dropped). A restart rebuilds the index
from the blocks written whole (``restore``), as the service does from what it finds on disk.
"""

from __future__ import annotations

import itertools
from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from manager import DiskIndex, DiskOp, OffloadManager, ReqContext, available_policies
from manager.spec import BlockKey

KEYS = [f"k{i}".encode() for i in range(8)]
POOL = 3
DISK = 3
TRACKED = 1000  # no ask is forgotten: the model counts them all

key_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=POOL + 1, unique=True)


class PoolOverDisk(RuleBasedStateMachine):
    """A pool of ``POOL`` blocks over a disk of ``DISK`` slots, and the model of the disk:
    ``loadable`` (written whole), ``writing`` (reserved, not yet written), ``pinned`` (reads in
    flight), the ask count of every key and the refusals."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = OffloadManager(POOL, "lru", enable_events=False)
        self.pool.add_eviction_listener(self._demote)
        self.ids = itertools.count()
        self.loadable: set[BlockKey] = set()
        self.writing: set[BlockKey] = set()
        self.pinned: Counter[BlockKey] = Counter()
        self.asks: Counter[BlockKey] = Counter()
        self.refused = 0
        self.writes: list[DiskOp] = []
        self.reads: list[DiskOp] = []

    @initialize(policy=st.sampled_from(available_policies()), admit_after=st.integers(1, 3))
    def start(self, policy: str, admit_after: int) -> None:
        self.policy = policy
        self.disk = DiskIndex(DISK, policy, admit_after=admit_after, max_tracked=TRACKED)

    # ------------------------------------------------------------------ the pool's side

    def _ask(self, keys: list[BlockKey]) -> None:
        self.disk.asked(keys)
        self.asks.update(keys)

    def _demote(self, victims: list[BlockKey], slots: list[int]) -> None:
        """The pool's eviction listener: select, check against the model, reserve."""
        disk = self.disk
        chosen = disk.select(victims)
        # K = 1 admits every victim, asked or not (no tracker: a restart forgets nothing).
        k_asks = disk.admit_after
        admitted = [k for k in victims if k_asks == 1 or self.asks[k] >= k_asks]
        fresh = [k for k in admitted if k not in self.loadable and k not in self.writing]
        assert chosen == fresh
        # Refused: victims absent from the disk (neither written whole nor being written)
        # that were not chosen.
        absent = [k for k in victims if k not in self.loadable and k not in self.writing]
        self.refused += len(absent) - len(chosen)
        if not chosen:
            return
        op = disk.reserve(chosen)
        free = DISK - len(self.loadable) - len(self.writing)
        evictable = len(self.loadable - set(self.pinned))
        if op is None:
            assert len(chosen) > free + evictable
            return
        assert op.keys == chosen
        assert set(op.evicted) <= self.loadable
        assert not set(op.evicted) & set(self.pinned), "a pinned disk block was evicted"
        self.loadable -= set(op.evicted)
        self.writing |= set(chosen)
        self.writes.append(op)

    def _request(self) -> ReqContext:
        ctx = ReqContext(f"r{next(self.ids)}")
        self.pool.on_new_request(ctx)
        return ctx

    @rule(keys=key_lists)
    def store(self, keys: list[BlockKey]) -> None:
        """An engine stores ``keys`` (evicting under pressure: demotions)."""
        ctx = self._request()
        self._ask(keys)
        out = self.pool.prepare_store(keys, ctx)
        if out is not None and out.keys_to_store:
            self.pool.complete_store(out.keys_to_store, ctx, True)
        self.pool.on_request_finished(ctx)

    @rule(keys=key_lists)
    def lookup(self, keys: list[BlockKey]) -> None:
        ctx = self._request()
        self.pool.lookup(keys, ctx)
        self._ask(keys)
        assert self.disk.found(keys) == [k in self.loadable for k in keys]
        self.pool.on_request_finished(ctx)

    @rule(data=st.data())
    def promote(self, data: st.DataObject) -> None:
        """Read a disk block the pool lacks back into it; the read stays pinned until
        ``end_read``."""
        candidates = sorted(k for k in self.loadable if self.pool.slot_of(k) is None)
        if not candidates:
            assert self.disk.pin([k for k in KEYS if k not in self.loadable][:1]) is None
            return
        key = data.draw(st.sampled_from(candidates))
        ctx = self._request()
        self._ask([key])
        op = self.disk.pin([key])
        assert op is not None
        self.pinned[key] += 1
        self.reads.append(op)
        out = self.pool.prepare_store([key], ctx)  # may demote others while key is pinned
        if out is not None and out.keys_to_store:
            self.pool.complete_store(out.keys_to_store, ctx, True)
        self.pool.on_request_finished(ctx)

    # ------------------------------------------------------------------ the disk's side

    @precondition(lambda self: bool(self.reads))
    @rule(data=st.data(), corrupt=st.booleans())
    def end_read(self, data: st.DataObject, corrupt: bool) -> None:
        """A read ends; a corrupt one drops its block from the index."""
        op = self.reads.pop(data.draw(st.integers(0, len(self.reads) - 1)))
        for key in op.keys:
            self.pinned[key] -= 1
        self.pinned += Counter()  # drop the zeros
        dropped = self.disk.unpin(op, op.keys if corrupt else ())
        expected = [k for k in op.keys if k not in self.pinned] if corrupt else []
        assert dropped == expected  # a block another read still pins is kept
        self.loadable -= set(dropped)

    @precondition(lambda self: bool(self.writes))
    @rule(data=st.data())
    def end_write(self, data: st.DataObject) -> None:
        """A write ends; the blocks not written whole (torn) are dropped."""
        op = self.writes.pop(data.draw(st.integers(0, len(self.writes) - 1)))
        ok = data.draw(st.lists(st.booleans(), min_size=len(op.keys), max_size=len(op.keys)))
        done = self.disk.written(op, ok)
        assert done == [k for k, good in zip(op.keys, ok, strict=True) if good]
        self.writing -= set(op.keys)
        self.loadable |= set(done)

    @precondition(lambda self: not self.writes and not self.reads)
    @rule()
    def restart(self) -> None:
        """The service restarts: a new index adopts the blocks written whole, at their slots;
        the ask counts start over."""
        old = self.disk
        blocks = []
        for key in old.index.resident_keys():  # coldest first
            slot = old.index.slot_of(key)
            assert slot is not None
            blocks.append((key, slot))
        self.disk = DiskIndex(DISK, self.policy, admit_after=old.admit_after, max_tracked=TRACKED)
        assert self.disk.restore(blocks) == len(self.loadable)
        self.asks.clear()
        self.refused = 0

    # ------------------------------------------------------------------ invariants

    @invariant()
    def disk_within_its_slots(self) -> None:
        stats = self.disk.index.stats()
        assert stats.ready + stats.pending <= self.disk.num_slots

    @invariant()
    def never_both_being_written_and_loadable(self) -> None:
        assert not self.writing & self.loadable
        assert not any(self.disk.found(sorted(self.writing)))
        assert [k for k in KEYS if self.disk.found([k])[0]] == sorted(self.loadable)

    @invariant()
    def pinned_blocks_stay_loadable(self) -> None:
        assert set(self.pinned) <= self.loadable

    @invariant()
    def counts_agree(self) -> None:
        disk = self.disk.index.stats()
        assert (disk.ready, disk.pending) == (len(self.loadable), len(self.writing))
        assert disk.pinned == len(self.pinned)
        assert self.disk.refused == self.refused
        pool = self.pool.stats()
        assert pool.ready == len(self.pool.resident_keys()) <= POOL
        assert pool.pending == pool.pinned == 0  # every pool request ended


PoolOverDisk.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestPoolOverDisk = PoolOverDisk.TestCase
