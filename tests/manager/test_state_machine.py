"""Stateful tests: hypothesis drives every manager operation and checks it against a model.

``ManagerMachine`` runs every registered policy (switching among them live) with the reuse
filter off and on. The model predicts every result the manager returns, except which blocks a
policy evicts; for those it checks that no pinned, pending or offered block is among them.
``LRUReferenceMachine`` fixes the policy to ``lru`` and keeps a reference recency list, so it
predicts ``evicted_keys`` (and ``resident_keys()``) exactly, including the tail-before-head
reordering the manager applies when it drops a request record.

Semantics the model mirrors (see ``manager/core.py``): calls renew their request before they can
fail; a request's *chain* is the keys it touched, loaded or offered for store, in order of first
use; ``touch`` and a successful ``complete_store`` are *ordering calls*; when a record is dropped
after two or more ordering calls (or the policy asks for every chain) the policy reorders the
chain with ``request_finished``, which for LRU is a ``touch``.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import pytest
from hypothesis import settings, target
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from manager import (
    MAX_KEY_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CompleteStoreOutput,
    InvalidArgumentError,
    KeyNotReadyError,
    LookupOutput,
    LookupResult,
    ManagerError,
    NotPinnedError,
    OffloadManager,
    PrepareStoreOutput,
    ReleasedLeases,
    ReqContext,
    RequestLeases,
    ResetCounts,
    StateConflictError,
    UnknownPolicyError,
    UnknownRequestError,
    available_policies,
    create_manager,
)
from manager.policies import policy_class
from tests.manager.harness import FakeClock

HIT, PENDING, MISS = LookupResult.HIT, LookupResult.PENDING, LookupResult.MISS
KEYS = [f"k{i}".encode() for i in range(7)]
REQ_IDS = ["r0", "r1", "r2"]
PROBE = "probe"  # a throw-away request the checks use; never one of REQ_IDS
BAD_KEYS: list[object] = [b"", b"x" * (MAX_KEY_BYTES + 1), "k0", 5, bytearray(b"k0")]

req_ids = st.sampled_from(REQ_IDS)
key_lists = st.lists(st.sampled_from(KEYS), max_size=4)
T = TypeVar("T")


@dataclass
class ModelRequest:
    renewed_at: float
    finished: bool = False
    pins: Counter[bytes] = field(default_factory=Counter)
    pending: set[bytes] = field(default_factory=set)
    reserved: dict[bytes, int] = field(default_factory=dict)
    reserved_at: float = 0.0
    chain: dict[bytes, None] = field(default_factory=dict)
    orderings: int = 0

    def holds_leases(self) -> bool:
        return bool(self.pins or self.pending or self.reserved)


@dataclass
class StorePlan:
    """What the model expects of a ``prepare_store`` that is not refused."""

    new: list[bytes]  # offered keys not resident, first occurrence first
    admitted: list[bytes]
    skipped: list[bytes]
    shortfall: int
    protected: set[bytes]
    reused: int
    victims: list[bytes] | None  # exact victims, when the model knows the policy order


class Model:
    """A plain re-statement of the manager contract over a handful of keys."""

    def __init__(
        self,
        capacity: int,
        policy: str,
        threshold: int,
        tracker_size: int | None,
        clock: FakeClock,
        exact_lru: bool,
    ) -> None:
        self.capacity = capacity
        self.policy = policy
        self.threshold = threshold
        self.tracker_size = tracker_size if tracker_size is not None else 4 * capacity
        self.clock = clock
        self.exact_lru = exact_lru
        self.generation = 1
        self.requests: dict[str, ModelRequest] = {}
        self.ready: set[bytes] = set()
        self.owner: dict[bytes, str] = {}  # pending key -> the request storing it
        self.slots: dict[bytes, int] = {}  # every resident (ready or pending) key
        self.offers: OrderedDict[bytes, int] = OrderedDict()
        self.order: list[bytes] = []  # LRU reference, least recent first (exact_lru only)
        self.expected_events: list[tuple[type, Any]] = []
        self.counters: Counter[str] = Counter()

    # ------------------------------------------------------------ derived state

    def refs(self) -> Counter[bytes]:
        total: Counter[bytes] = Counter()
        for req in self.requests.values():
            total.update(req.pins)
        return total

    def reserved_slots(self) -> list[int]:
        """Slots of stores dropped by an abort, still held for their writers."""
        return [slot for req in self.requests.values() for slot in req.reserved.values()]

    def pending_count(self) -> int:
        return len(self.owner) + len(self.reserved_slots())

    def free_count(self) -> int:
        return self.capacity - len(self.slots) - len(self.reserved_slots())

    def state(self, key: bytes) -> LookupResult:
        if key in self.ready:
            return HIT
        return PENDING if key in self.owner else MISS

    # ------------------------------------------------------------ LRU reference

    def _lru_insert(self, keys: Sequence[bytes]) -> None:
        if self.exact_lru:
            for key in reversed(keys):
                self.order.append(key)

    def _lru_touch(self, keys: Sequence[bytes]) -> None:
        if self.exact_lru:
            for key in reversed(keys):
                if key in self.order:
                    self.order.remove(key)
                    self.order.append(key)

    def _lru_remove(self, keys: Sequence[bytes] | set[bytes]) -> None:
        if self.exact_lru:
            self.order = [k for k in self.order if k not in keys]

    # ------------------------------------------------------------ requests

    def _live(self, rid: str) -> ModelRequest:
        req = self.requests.get(rid)
        if req is None or req.finished:
            raise UnknownRequestError(rid)
        req.renewed_at = self.clock.now
        return req

    def _any(self, rid: str) -> ModelRequest:
        req = self.requests.get(rid)
        if req is None:
            raise UnknownRequestError(rid)
        req.renewed_at = self.clock.now
        return req

    def _release(self, rid: str, req: ModelRequest, *, writers_alive: bool) -> ReleasedLeases:
        pins = sum(req.pins.values())
        req.pins.clear()
        dropped = len(req.pending)
        for key in req.pending:
            slot = self.slots.pop(key)
            del self.owner[key]
            if writers_alive:
                req.reserved[key] = slot
        if writers_alive and dropped:
            req.reserved_at = self.clock.now
        req.pending.clear()
        self.counters["stores_failed"] += dropped
        ended = 0
        if not writers_alive:
            ended = self._end_reservations(req)
        return ReleasedLeases(rid, pins, dropped, ended)

    def _end_reservations(self, req: ModelRequest) -> int:
        ended = len(req.reserved)
        req.reserved.clear()
        self.counters["reservations_expired"] += ended
        return ended

    def _forget(self, rid: str, req: ModelRequest) -> None:
        del self.requests[rid]
        wants_chains = getattr(policy_class(self.policy), "wants_request_chains", False)
        if req.orderings > 1 or wants_chains:
            self._lru_touch(list(req.chain))

    def new_request(self, rid: str) -> bool:
        req = self.requests.get(rid)
        if req is None:
            self.requests[rid] = ModelRequest(self.clock.now)
            return True
        if req.finished:
            raise InvalidArgumentError(f"request {rid!r} has finished and still holds leases")
        req.renewed_at = self.clock.now
        return False

    def finish(self, rid: str, abort: bool) -> ReleasedLeases:
        req = self._any(rid)
        req.finished = True
        released = ReleasedLeases(rid, 0, 0)
        if abort:
            released = self._release(rid, req, writers_alive=True)
        if not req.holds_leases():
            self._forget(rid, req)
        return released

    def expire(
        self,
        lease_ttl: float,
        idle_ttl: float | None,
        writing: set[str],
        writer_deadline: float | None,
    ) -> list[ReleasedLeases]:
        now = self.clock.now
        out = []
        for rid, req in list(self.requests.items()):
            alive = rid in writing
            overdue = writer_deadline is not None and now - req.reserved_at > writer_deadline
            if req.reserved and overdue and not alive:
                assert not req.pins, "a drop released them"
                assert not req.pending, "a drop released them"
                out.append(ReleasedLeases(rid, 0, 0, self._end_reservations(req)))
                self._forget(rid, req)
                continue
            idle = now - req.renewed_at
            if req.holds_leases():
                if idle <= lease_ttl or (alive and not req.pins and not req.pending):
                    continue
                req.finished = True
                out.append(self._release(rid, req, writers_alive=alive))
                self.counters["forced_lease_releases"] += 1
                if not req.holds_leases():
                    self._forget(rid, req)
            elif idle_ttl is not None and idle > idle_ttl:
                self._forget(rid, req)
        return out

    def release_request(self, rid: str, writers_alive: bool) -> ReleasedLeases:
        req = self.requests.get(rid)
        if req is None:
            raise UnknownRequestError(rid)
        req.finished = True
        released = self._release(rid, req, writers_alive=writers_alive)
        self.counters["forced_lease_releases"] += 1
        if not req.holds_leases():
            self._forget(rid, req)
        return released

    # ------------------------------------------------------------ loads

    def lookup(self, rid: str, keys: Sequence[bytes]) -> LookupOutput:
        self._live(rid)
        results = [self.state(k) for k in keys]
        prefix = next((i for i, r in enumerate(results) if r is not HIT), len(results))
        return LookupOutput(results, prefix)

    def prepare_load(self, rid: str, keys: Sequence[bytes]) -> list[int]:
        req = self._live(rid)
        states = [self.state(k) for k in keys]
        if any(s is not HIT for s in states):
            missing = [k for k, s in zip(keys, states, strict=True) if s is MISS]
            pending = [k for k, s in zip(keys, states, strict=True) if s is PENDING]
            raise KeyNotReadyError(missing, pending)
        req.pins.update(keys)
        req.chain.update(dict.fromkeys(keys))
        self.counters["loads"] += len(keys)
        return [self.slots[k] for k in keys]

    def complete_load(self, rid: str, keys: Sequence[bytes]) -> None:
        req = self._any(rid)
        bad = [k for k, c in Counter(keys).items() if req.pins[k] < c]
        if bad:
            raise NotPinnedError(rid, bad)
        req.pins.subtract(keys)
        req.pins = +req.pins
        if req.finished and not req.holds_leases():
            self._forget(rid, req)

    def touch(self, rid: str, keys: Sequence[bytes]) -> None:
        req = self._live(rid)
        if not keys:
            return  # an empty touch orders nothing, so it does not count as an ordering call
        self._lru_touch(keys)
        req.chain.update(dict.fromkeys(keys))
        req.orderings += 1

    # ------------------------------------------------------------ stores

    def plan_store(self, rid: str, keys: Sequence[Any]) -> StorePlan | None:
        """The expected outcome of ``prepare_store``; None: refused. Raises like the manager."""
        self._live(rid)
        for k in keys:
            if type(k) is not bytes or not 0 < len(k) <= MAX_KEY_BYTES:
                raise InvalidArgumentError(f"bad key {k!r}")  # never resident, always new
        new = list(dict.fromkeys(k for k in keys if self.state(k) is MISS))
        reused = sum(1 for k in keys if self.state(k) is not MISS)
        refs = self.refs()
        protected = {k for k in keys if k in self.ready and refs[k] == 0}
        admitted, skipped = new, []
        if self.threshold >= 2:
            admitted = [k for k in new if self.offers.get(k, 0) >= self.threshold - 1]
            skipped = [k for k in new if self.offers.get(k, 0) < self.threshold - 1]
        shortfall = len(admitted) - self.free_count()
        if shortfall > len(self.ready) - len(refs) - len(protected):
            self.counters["stores_refused"] += 1
            return None
        victims = None
        if self.exact_lru:
            candidates = [k for k in self.order if refs[k] == 0 and k not in protected]
            victims = candidates[: max(0, shortfall)]
        return StorePlan(new, admitted, skipped, shortfall, protected, reused, victims)

    def commit_store(
        self, rid: str, keys: Sequence[bytes], plan: StorePlan, out: PrepareStoreOutput
    ) -> None:
        req = self.requests[rid]
        for key in out.evicted_keys:
            self.ready.remove(key)
            del self.slots[key]
        self._lru_remove(out.evicted_keys)
        if out.evicted_keys:
            self.expected_events.append((BlockRemoved, list(out.evicted_keys)))
        self.counters["evictions"] += len(out.evicted_keys)
        if self.threshold >= 2:
            for key in plan.new:
                self.offers[key] = self.offers.pop(key, 0) + 1
            while len(self.offers) > self.tracker_size:
                self.offers.popitem(last=False)
        for key, slot in zip(out.keys_to_store, out.slots, strict=True):
            self.slots[key] = slot
            self.owner[key] = rid
            req.pending.add(key)
        req.chain.update(dict.fromkeys(keys))
        self.counters["stores_prepared"] += len(plan.admitted)
        self.counters["stores_reused"] += plan.reused
        self.counters["stores_skipped"] += len(plan.skipped)

    def complete_store(self, rid: str, keys: Sequence[bytes], success: bool) -> CompleteStoreOutput:
        req = self._any(rid)
        mine: list[bytes] = []
        dropped: list[bytes] = []
        ignored: list[bytes] = []
        for key in keys:
            if key in req.pending:
                req.pending.discard(key)
                mine.append(key)
            elif key in req.reserved:
                del req.reserved[key]
                dropped.append(key)
            else:
                ignored.append(key)
        completed: list[bytes] = []
        if success:
            completed = mine
            if mine:
                for key in mine:
                    del self.owner[key]
                    self.ready.add(key)
                self._lru_insert(mine)
                self.expected_events.append((BlockStored, list(mine)))
                self.counters["stores_completed"] += len(mine)
                req.orderings += 1
        else:
            for key in mine:
                del self.owner[key]
                del self.slots[key]
            self.counters["stores_failed"] += len(mine)
            dropped = mine + dropped
        if req.finished and not req.holds_leases():
            self._forget(rid, req)
        return CompleteStoreOutput(completed, dropped, ignored)

    # ------------------------------------------------------------ admin

    def switch(self, name: str) -> bool:
        """Whether the switch changes the policy; raises for an unknown name."""
        if name not in available_policies():
            raise UnknownPolicyError(name, available_policies())
        if name == self.policy:
            return False
        self.policy = name
        self.generation += 1
        self.counters["policy_switches"] += 1
        return True

    def reset(self) -> ResetCounts:
        refs = self.refs()
        victims = {k for k in self.ready if refs[k] == 0}
        for key in victims:
            self.ready.remove(key)
            del self.slots[key]
        self._lru_remove(victims)
        if not self.ready:
            self.expected_events.append((AllBlocksCleared, None))
        elif victims:
            self.expected_events.append((BlockRemoved, victims))
        return ResetCounts(len(victims), len(refs), self.pending_count())


class ManagerMachine(RuleBasedStateMachine):
    """Every operation, random order, a small pool; the model predicts each answer."""

    exact_lru: ClassVar[bool] = False
    m: OffloadManager
    model: Model

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.event_view: set[bytes] = set()
        self.last_seq = 0

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        policies = ["lru"] if self.exact_lru else available_policies()
        policy = data.draw(st.sampled_from(policies), label="policy")
        threshold = data.draw(st.sampled_from([0, 2, 3]), label="store_threshold")
        capacity = data.draw(st.integers(2, 5), label="num_blocks")
        tracker = data.draw(st.sampled_from([None, 2, 5]), label="reuse_tracker_size")
        self.m = create_manager(
            capacity, policy, threshold, reuse_tracker_size=tracker, clock=self.clock
        )
        self.model = Model(capacity, policy, threshold, tracker, self.clock, self.exact_lru)
        for rid in REQ_IDS[:2]:
            self.new_request(rid)

    # ------------------------------------------------------------ helpers

    def both(self, expect: Callable[[], T], act: Callable[[], object]) -> T | None:
        """Run the model and the manager; the same result, or the same error (None)."""
        error: ManagerError | None = None
        try:
            expected = expect()
        except ManagerError as exc:
            error = exc
        if error is None:
            actual = act()
            assert actual == expected
            return expected
        with pytest.raises(ManagerError) as info:
            act()
        assert type(info.value) is type(error)
        if isinstance(error, StateConflictError | UnknownRequestError | UnknownPolicyError):
            assert str(info.value) == str(error)
        return None

    def with_probe(self, action: Callable[[ReqContext], None]) -> None:
        """Run ``action`` as a short-lived request that the model tracks too."""
        probe = ReqContext(PROBE)
        assert self.both(
            lambda: self.model.new_request(PROBE), lambda: self.m.on_new_request(probe)
        )
        action(probe)
        self.both(
            lambda: self.model.finish(PROBE, False), lambda: self.m.on_request_finished(probe)
        )

    def pick_request(self, data: st.DataObject) -> str:
        """Mostly a live request, started here if need be; sometimes any id (error paths)."""
        requests = self.model.requests
        choice = data.draw(st.integers(0, 5), label="which request")
        if choice == 0:
            return data.draw(st.sampled_from(REQ_IDS), label="req_id")
        live = [rid for rid in REQ_IDS if rid in requests and not requests[rid].finished]
        if live and choice > 1:
            return data.draw(st.sampled_from(live), label="req_id")
        unused = [rid for rid in REQ_IDS if rid not in requests]
        if unused:
            rid = data.draw(st.sampled_from(unused), label="req_id")
            self.new_request(rid)
            return rid
        return data.draw(st.sampled_from(REQ_IDS), label="req_id")

    def pick_keys(self, data: st.DataObject, preferred: Sequence[bytes]) -> list[bytes]:
        """Mostly keys from ``preferred`` (when there are any), sometimes any keys."""
        if preferred and data.draw(st.integers(0, 3), label="preferred keys?") > 0:
            return data.draw(st.lists(st.sampled_from(sorted(preferred)), max_size=4))
        return data.draw(key_lists)

    # ------------------------------------------------------------ requests

    @rule(rid=req_ids)
    def new_request(self, rid: str) -> None:
        ctx = ReqContext(rid, {"n": self.clock.now})
        self.both(lambda: self.model.new_request(rid), lambda: self.m.on_new_request(ctx))

    @rule(data=st.data(), abort=st.booleans())
    def finish(self, data: st.DataObject, abort: bool) -> None:
        rid = self.pick_request(data)
        self.both(
            lambda: self.model.finish(rid, abort),
            lambda: self.m.on_request_finished(ReqContext(rid), abort=abort),
        )

    @rule(seconds=st.integers(0, 4))
    def advance_clock(self, seconds: int) -> None:
        self.clock.advance(seconds)

    @rule(
        lease_ttl=st.integers(0, 12),
        idle_ttl=st.none() | st.integers(0, 12),
        writing=st.sets(req_ids),
        writer_deadline=st.none() | st.integers(0, 12),
    )
    def expire(
        self, lease_ttl: int, idle_ttl: int | None, writing: set[str], writer_deadline: int | None
    ) -> None:
        self.both(
            lambda: self.model.expire(lease_ttl, idle_ttl, writing, writer_deadline),
            lambda: self.m.expire_requests(
                lease_ttl, idle_ttl, writing=writing, writer_deadline=writer_deadline
            ),
        )

    # ------------------------------------------------------------ loads

    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        rid = self.pick_request(data)
        keys = data.draw(key_lists)
        ctx = ReqContext(rid)
        self.both(lambda: self.model.lookup(rid, keys), lambda: self.m.lookup(keys, ctx))

    @rule(data=st.data())
    def prepare_load(self, data: st.DataObject) -> None:
        rid = self.pick_request(data)
        keys = self.pick_keys(data, sorted(self.model.ready))
        ctx = ReqContext(rid)
        self.both(
            lambda: self.model.prepare_load(rid, keys), lambda: self.m.prepare_load(keys, ctx)
        )

    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        holders = [rid for rid, req in self.model.requests.items() if req.pins]
        if holders and data.draw(st.integers(0, 4), label="a holder?") > 0:
            rid = data.draw(st.sampled_from(holders), label="req_id")
        else:
            rid = self.pick_request(data)
        req = self.model.requests.get(rid)
        pinned = sorted(req.pins.elements()) if req is not None else []
        every_pin: bool = data.draw(st.booleans(), label="all pins?")
        if pinned and every_pin:
            keys = data.draw(st.permutations(pinned))
        else:
            keys = self.pick_keys(data, pinned)
        ctx = ReqContext(rid)
        self.both(
            lambda: self.model.complete_load(rid, keys), lambda: self.m.complete_load(keys, ctx)
        )

    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        rid = self.pick_request(data)
        keys = self.pick_keys(data, sorted(self.model.ready))
        ctx = ReqContext(rid)
        self.both(lambda: self.model.touch(rid, keys), lambda: self.m.touch(keys, ctx))

    # ------------------------------------------------------------ stores

    @rule(data=st.data())
    def prepare_store(self, data: st.DataObject) -> None:
        rid = self.pick_request(data)
        absent = [k for k in KEYS if self.model.state(k) is MISS]
        offered: list[Any] = self.pick_keys(data, absent)
        if data.draw(st.integers(0, 5), label="bad key?") == 0:
            bad = data.draw(st.sampled_from(BAD_KEYS), label="bad key")
            offered.insert(data.draw(st.integers(0, len(offered)), label="at"), bad)
        self._prepare_store(rid, offered)

    @rule(data=st.data())
    def store(self, data: st.DataObject) -> None:
        """prepare_store then a successful complete_store of what it admitted, at once."""
        rid = self.pick_request(data)
        absent = [k for k in KEYS if self.model.state(k) is MISS]
        out = self._prepare_store(rid, self.pick_keys(data, absent))
        if out is not None:
            self._complete_store(rid, out.keys_to_store, True)

    def _prepare_store(self, rid: str, keys: list[Any]) -> PrepareStoreOutput | None:
        ctx = ReqContext(rid)
        model = self.model
        refs_before = model.refs()
        pending_before = set(model.owner)
        ready_before = set(model.ready)
        try:
            plan = model.plan_store(rid, keys)
        except ManagerError as exc:
            with pytest.raises(type(exc)):
                self.m.prepare_store(keys, ctx)
            return None
        out = self.m.prepare_store(keys, ctx)
        if plan is None:
            assert out is None
            return None
        assert out is not None
        assert out.keys_to_store == plan.admitted
        assert out.skipped_keys == plan.skipped
        victims = out.evicted_keys
        assert len(victims) == max(0, plan.shortfall)
        assert len(set(victims)) == len(victims)
        assert set(victims) <= ready_before
        assert not {k for k in victims if refs_before[k]}, "a pinned block was evicted"
        assert not set(victims) & pending_before, "a pending block was evicted"
        assert not set(victims) & set(keys), "a block of the offer itself was evicted"
        if plan.victims is not None:
            assert victims == plan.victims
        taken = {slot for k, slot in model.slots.items() if k not in victims}
        taken |= set(model.reserved_slots())
        assert len(set(out.slots)) == len(out.slots)
        assert not set(out.slots) & taken, "a slot in use was handed out"
        assert all(0 <= s < model.capacity for s in out.slots)
        model.commit_store(rid, keys, plan, out)
        return out

    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        writers = [r for r, req in self.model.requests.items() if req.pending or req.reserved]
        if writers and data.draw(st.integers(0, 4), label="a writer?") > 0:
            rid = data.draw(st.sampled_from(writers), label="req_id")
        else:
            rid = self.pick_request(data)
        req = self.model.requests.get(rid)
        mine = sorted(req.pending) + sorted(req.reserved) if req is not None else []
        every_store: bool = data.draw(st.booleans(), label="all stores?")
        if mine and every_store:
            keys = data.draw(st.permutations(mine))
        else:
            keys = self.pick_keys(data, mine)
        self._complete_store(rid, keys, success)

    def _complete_store(self, rid: str, keys: list[bytes], success: bool) -> None:
        ctx = ReqContext(rid)
        self.both(
            lambda: self.model.complete_store(rid, keys, success),
            lambda: self.m.complete_store(keys, ctx, success),
        )

    # ------------------------------------------------------------ admin

    @rule(data=st.data())
    def admin(self, data: st.DataObject) -> None:
        """An operator action: switch the policy, clear the cache or release a request."""
        action = data.draw(st.sampled_from(["switch_policy", "reset", "release_request"]))
        if action == "switch_policy":
            self.switch_policy(data)
        elif action == "reset":
            self.both(self.model.reset, self.m.reset)
        else:
            rid = data.draw(st.sampled_from(REQ_IDS), label="req_id")
            alive = data.draw(st.booleans(), label="writers alive?")
            self.both(
                lambda: self.model.release_request(rid, alive),
                lambda: self.m.release_request(rid, writers_alive=alive),
            )

    def switch_policy(self, data: st.DataObject) -> None:
        names = ["lru"] if self.exact_lru else available_policies()
        name = data.draw(st.sampled_from([*names, "no-such-policy"]), label="switch to")
        generation = self.m.policy.generation
        try:
            changed = self.model.switch(name)
        except UnknownPolicyError:
            with pytest.raises(UnknownPolicyError):
                self.m.switch_policy(name)
            assert self.m.policy.generation == generation
            return
        switch = self.m.switch_policy(name)
        assert switch.changed is changed
        assert switch.current.name == name
        assert switch.current.generation == self.model.generation
        assert switch.blocks_migrated == (len(self.model.ready) if changed else 0)
        ready = sorted(self.model.ready)

        def load_everything(probe: ReqContext) -> None:
            self.both(
                lambda: self.model.prepare_load(PROBE, ready),
                lambda: self.m.prepare_load(ready, probe),
            )
            self.both(
                lambda: self.model.complete_load(PROBE, ready),
                lambda: self.m.complete_load(ready, probe),
            )

        self.with_probe(load_everything)

    def teardown(self) -> None:
        # Steer generation towards runs that reach many different situations, a few times each.
        if hasattr(self, "m"):
            s = self.m.stats()
            reached = (
                s.stores_completed,
                s.stores_failed,
                s.stores_skipped,
                s.stores_refused,
                s.evictions,
                s.loads,
                s.forced_lease_releases,
                s.policy_switches,
            )
            target(float(sum(min(n, 3) for n in reached)), label="situations reached")

    @rule()
    def take_events(self) -> None:
        events = self.m.take_events()
        expected = self.model.expected_events
        self.model.expected_events = []
        assert [type(e) for e in events] == [kind for kind, _ in expected]
        for event, (_, keys) in zip(events, expected, strict=True):
            assert event.seq == self.last_seq + 1
            self.last_seq = event.seq
            assert event.medium == "CPU"
            if isinstance(event, AllBlocksCleared):
                self.event_view.clear()
            elif isinstance(event, BlockStored):
                assert event.block_hashes == keys
                assert not self.event_view & set(keys)
                self.event_view |= set(keys)
            else:
                assert isinstance(keys, set) or event.block_hashes == keys
                assert set(event.block_hashes) == set(keys)
                assert set(keys) <= self.event_view, "removed a block never reported stored"
                self.event_view -= set(keys)
        assert self.event_view == self.model.ready
        assert self.m.take_events() == []

    # ------------------------------------------------------------ invariants

    @invariant()
    def counts_add_up(self) -> None:
        s = self.m.stats()
        model = self.model
        assert s.free + s.pending + s.ready == s.num_blocks == model.capacity
        assert min(s.free, s.pending, s.ready, s.pinned) >= 0
        assert s.pinned <= s.ready
        assert s.reserved == len(model.reserved_slots()) <= s.pending
        refs = model.refs()
        assert (s.free, s.pending, s.ready, s.pinned) == (
            model.free_count(),
            model.pending_count(),
            len(model.ready),
            len(refs),
        )
        assert s.live_requests == len(model.requests)
        assert s.policy == model.policy
        for name in (
            "loads",
            "stores_prepared",
            "stores_completed",
            "stores_failed",
            "stores_reused",
            "stores_skipped",
            "stores_refused",
            "evictions",
            "forced_lease_releases",
            "reservations_expired",
            "policy_switches",
        ):
            assert getattr(s, name) == model.counters[name], name
        assert s.events_dropped == 0

    @invariant()
    def blocks_match_the_model(self) -> None:
        model = self.model
        refs = model.refs()
        assert [self.m.slot_of(k) for k in KEYS] == [model.slots.get(k) for k in KEYS]
        assert [self.m.ref_count(k) for k in KEYS] == [refs[k] for k in KEYS]
        resident = self.m.resident_keys()
        assert sorted(resident) == sorted(model.ready)
        if model.exact_lru:
            assert resident == model.order
        assert self.m.policy.generation == model.generation
        assert self.m.requests() == [
            RequestLeases(
                rid,
                dict(req.pins),
                sorted(req.pending) + sorted(req.reserved),
                self.clock.now - req.renewed_at,
                sorted(req.reserved),
                self.clock.now - req.reserved_at if req.reserved else None,
            )
            for rid, req in model.requests.items()
        ]

        def look(probe: ReqContext) -> None:
            self.both(lambda: self.model.lookup(PROBE, KEYS), lambda: self.m.lookup(KEYS, probe))

        self.with_probe(look)


class LRUReferenceMachine(ManagerMachine):
    """The same operations under ``lru`` only; the model's recency list predicts evictions."""

    exact_lru = True


ManagerMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=50, deadline=None)
LRUReferenceMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=50, deadline=None
)
TestManagerMachine = ManagerMachine.TestCase
TestLRUReferenceMachine = LRUReferenceMachine.TestCase
