"""The large write verbs in steps (``manager.steps``, ``retain_steps``) and the suspension that
keeps them whole (``manager.suspend``), checked against the same verbs called whole (issue #42,
finding 10).

``StepsMachine`` runs two managers side by side on the same calls: *whole* calls each verb
once, *stepped* calls its ``*_steps`` twin with a step of two keys, suspending the manager at
random points between steps and then either going on (``resume``) or letting another call in
(which settles the rest first). After every call both managers answer the same, hold the same
blocks in the same slots and policy order, count the same and have emitted the same KV events.
Every policy that orders each key by its own history runs; ``prefix_lrfu`` weighs a whole
batch, so in steps it sees consecutive batches (``manager.steps`` says so).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Generator
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from manager import (
    BlockRemoved,
    BlockStored,
    InvalidArgumentError,
    ManagerError,
    OffloadManager,
    ReqContext,
    available_policies,
    create_manager,
)
from tests.manager.harness import FakeClock

STEP = 2
KEYS = [f"k{i}".encode() for i in range(10)]
SEATS = 2  # requests live at once; a finished one is replaced by a new id
# Policies that order each key by its own history: told in parts, tail part first, they end in
# the whole call's order. ``prefix_lrfu`` weighs a whole batch: in steps it sees consecutive
# batches, and its victims then differ from the whole call's (its own tests cover batches).
EXACT = {"lru", "slru", "arc", "s3fifo", "lfu"}
BATCH_WEIGHING = {"prefix_lrfu"}
key_lists = st.lists(st.sampled_from(KEYS), min_size=0, max_size=7)


def drive(manager: OffloadManager, steps: Generator[None, None, Any], how: list[int]) -> Any:
    """Run ``steps`` as the service does: at each pause, per ``how`` (cycled), go on (0),
    suspend and resume (1), or suspend and let another call in, which settles the rest (2)."""
    outcome: list[Any] = []

    def rest() -> None:
        try:
            while True:
                next(steps)
        except StopIteration as end:
            outcome.append(end.value)
        except ManagerError as exc:
            outcome.append(exc)

    i = 0
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value
        choice = how[i % len(how)] if how else 0
        i += 1
        if choice == 0:
            continue
        manager.suspend(rest)
        assert type(manager) is not OffloadManager  # suspended: every entry settles first
        if choice == 1:
            assert manager.resume()
            assert type(manager) is OffloadManager
            continue
        manager.stats()  # another call enters: the rest runs first
        assert type(manager) is OffloadManager
        assert not manager.resume()
        result = outcome[0]
        if isinstance(result, Exception):
            raise result
        return result


def same_outcome(whole: Any, stepped: Any) -> Any:
    """Both calls' outcomes, raised errors as their type and message."""
    return [(type(x).__name__, str(x)) if isinstance(x, Exception) else x for x in (whole, stepped)]


def call(f: Any, *args: Any) -> Any:
    try:
        return f(*args)
    except ManagerError as exc:
        return exc


def flat_events(manager: OffloadManager) -> list[tuple[str, list[bytes]]]:
    """The events taken, as (kind, keys)."""
    out: list[tuple[str, list[bytes]]] = []
    for e in manager.take_events():
        if isinstance(e, BlockStored):
            out.append(("stored", list(e.block_hashes)))
        elif isinstance(e, BlockRemoved):
            out.append(("removed", list(e.block_hashes)))
        else:
            out.append((type(e).__name__, []))
    return out


class StepsMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.whole: OffloadManager
        self.stepped: OffloadManager
        self.events_whole: list[tuple[str, list[bytes]]] = []
        self.events_stepped: list[tuple[str, list[bytes]]] = []
        self.reqs = [f"r{i}" for i in range(SEATS)]
        self.started = SEATS

    @initialize(
        policy=st.sampled_from(sorted(EXACT)),
        capacity=st.integers(3, 8),
        threshold=st.sampled_from([0, 2]),
    )
    def build(self, policy: str, capacity: int, threshold: int) -> None:
        self.clocks = (FakeClock(), FakeClock())
        self.whole, self.stepped = (
            create_manager(capacity, policy, threshold, clock=clock) for clock in self.clocks
        )
        for m in (self.whole, self.stepped):
            for r in self.reqs:
                m.on_new_request(ReqContext(r))

    def both(self, whole: Any, stepped: Any) -> None:
        a, b = same_outcome(whole, stepped)
        assert a == b

    @rule(
        seat=st.integers(0, SEATS - 1), keys=key_lists, how=st.lists(st.integers(0, 2), max_size=4)
    )
    def prepare_store(self, seat: int, keys: list[bytes], how: list[int]) -> None:
        ctx = ReqContext(self.reqs[seat])
        a = call(self.whole.prepare_store, keys, ctx)
        b = call(drive, self.stepped, self.stepped.prepare_store_steps(keys, ctx, STEP), how)
        self.both(a, b)

    def pending_of(self, seat: int) -> list[bytes]:
        """The stores this seat's request has in flight (the keys a writer reports)."""
        held = {r.req_id: r for r in self.whole.requests()}
        req = held.get(self.reqs[seat])
        return [] if req is None else list(req.pending_stores)

    @rule(
        seat=st.integers(0, SEATS - 1),
        extra=key_lists,
        cut=st.integers(0, 7),
        success=st.booleans(),
        how=st.lists(st.integers(0, 2), max_size=4),
    )
    def complete_store(
        self, seat: int, extra: list[bytes], cut: int, success: bool, how: list[int]
    ) -> None:
        """Mostly the request's own stores in flight (the writer's report), sometimes with
        other keys (ignored, or the slow path)."""
        keys = self.pending_of(seat)
        keys = keys[cut:] + extra[: cut % 3] if cut % 2 else keys
        ctx = ReqContext(self.reqs[seat])
        a = call(self.whole.complete_store, keys, ctx, success)
        steps = self.stepped.complete_store_steps(keys, ctx, success, STEP)
        self.both(a, call(drive, self.stepped, steps, how))

    @rule(
        seat=st.integers(0, SEATS - 1),
        extra=key_lists,
        shuffled=st.randoms(use_true_random=False),
        how=st.lists(st.integers(0, 2), max_size=4),
    )
    def touch(self, seat: int, extra: list[bytes], shuffled: Any, how: list[int]) -> None:
        """The ready keys in some order, and maybe others (ignored)."""
        keys = self.whole.resident_keys() + extra[:2]
        shuffled.shuffle(keys)
        ctx = ReqContext(self.reqs[seat])
        a = call(self.whole.touch, keys, ctx)
        self.both(a, call(drive, self.stepped, self.stepped.touch_steps(keys, ctx, STEP), how))

    @rule(keys=key_lists, how=st.lists(st.integers(0, 2), max_size=4))
    def drop(self, keys: list[bytes], how: list[int]) -> None:
        movable, kept = self.whole.sort_for_hint(keys)
        a = (self.whole.drop(movable) if movable else [], kept)
        self.both(a, call(drive, self.stepped, self.stepped.drop_steps(keys, STEP), how))

    @rule(
        keys=key_lists,
        name=st.sampled_from(["a", "b"]),
        bound=st.integers(0, 8),
        how=st.lists(st.integers(0, 2), max_size=4),
    )
    def retain(self, keys: list[bytes], name: str, bound: int, how: list[int]) -> None:
        """A retention under a caller's bound of the keys it would add (the service's quota
        check): the whole call measures with the queries, the stepped one is told by
        ``retain_steps``; over the bound, both refuse and nothing changes."""

        def check(new: int, more: int) -> None:
            if new + more > bound:
                raise InvalidArgumentError(f"{new} new, {more} more")

        def whole() -> Any:
            check(self.whole.new_retained(name, keys), self.whole.new_references(name, keys))
            return self.whole.retain(keys, 60.0, name)

        steps = self.stepped.retain_steps(keys, 60.0, name, STEP, check)
        self.both(call(whole), call(drive, self.stepped, steps, how))

    @rule(
        name=st.sampled_from(["a", "b"]),
        ttl_s=st.sampled_from([1.0, 60.0]),
        seconds=st.sampled_from([0.0, 2.0, 90.0]),
        how=st.lists(st.integers(0, 2), max_size=4),
    )
    def expire(self, name: str, ttl_s: float, seconds: float, how: list[int]) -> None:
        """A retention's TTL restarted (if it lives), time passing, then the due ones ended:
        their blocks back in the policy, in the same order."""
        for m in (self.whole, self.stepped):
            call(m.renew_retention, name, ttl_s)
        for clock in self.clocks:
            clock.advance(seconds)
        steps = self.stepped.expire_retentions_steps(STEP)
        self.both(self.whole.expire_retentions(), call(drive, self.stepped, steps, how))

    @rule(name=st.sampled_from(["a", "b"]))
    def release(self, name: str) -> None:
        self.both(*(call(m.release_retention, name) for m in (self.whole, self.stepped)))

    @rule(seat=st.integers(0, SEATS - 1), abort=st.booleans())
    def finish(self, seat: int, abort: bool) -> None:
        ctx = ReqContext(self.reqs[seat])
        new = ReqContext(f"r{self.started}")
        self.started += 1
        self.reqs[seat] = new.req_id
        for m in (self.whole, self.stepped):
            m.on_request_finished(ctx, abort)
            m.on_new_request(new)

    @invariant()
    def the_same_pool(self) -> None:
        if not hasattr(self, "whole"):
            return
        a, b = self.whole.stats(), self.stepped.stats()
        assert a == b
        assert self.whole.resident_keys() == self.stepped.resident_keys()
        for k in KEYS:
            assert self.whole.slot_of(k) == self.stepped.slot_of(k)
        assert self.whole.retentions() == self.stepped.retentions()
        for r in self.whole.retentions():
            assert self.whole.retention_keys(r.name) == self.stepped.retention_keys(r.name)
        assert self.whole.retained_where() == self.stepped.retained_where()
        self.events_whole += flat_events(self.whole)
        self.events_stepped += flat_events(self.stepped)
        assert self.events_whole == self.events_stepped


StepsMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=30, deadline=None)
TestSteps = StepsMachine.TestCase


def test_every_policy_is_classified() -> None:
    assert set(available_policies()) == EXACT | BATCH_WEIGHING


def test_a_suspended_manager_settles_at_every_public_entry() -> None:
    """Every public method and property of a suspended manager runs the rest first, but
    the event stream's two (``test_the_event_stream_does_not_settle``)."""
    m = create_manager(4)
    names = [n for n in dir(OffloadManager) if not n.startswith("_")]
    skip = {"suspend", "resume", "settle", "suspended", "num_blocks", "record_event", "take_events"}
    names = [n for n in names if n not in skip]
    ran: list[str] = []
    for name in names:

        def rest(name: str = name) -> None:
            ran.append(name)

        m.suspend(rest)
        member = getattr(type(m), name)
        if isinstance(member, property):
            getattr(m, name)
        else:
            try:
                out = getattr(m, name)()
                if inspect.isgenerator(out):  # a verb in steps settles at its first step
                    assert ran[-1:] != [name], name
                    next(out)
            except TypeError:  # wrong arguments: the rest ran before they were read
                pass
            except (ManagerError, StopIteration):
                pass
        assert ran[-1:] == [name], name
        assert type(m) is OffloadManager


def test_the_event_stream_does_not_settle() -> None:
    """A lower tier's event appended, and the events taken, while a call is suspended: the
    call stays suspended (a disk write ending mid-call does not run its rest) and the event
    is there to take."""
    m = create_manager(8)
    ran: list[int] = []
    m.suspend(lambda: ran.append(1))
    m.record_event("stored", [b"\x01" * 32], "DISK")
    events = m.take_events()
    assert ran == []
    assert type(m) is not OffloadManager
    assert [type(e).__name__ for e in events] == ["BlockStored"]
    assert m.resume()
    assert ran == []


def test_a_call_suspended_twice_settles_the_first() -> None:
    m = create_manager(4)
    ran: list[int] = []
    m.suspend(lambda: ran.append(1))
    m.suspend(lambda: ran.append(2))
    assert ran == [1]
    assert m.resume()
    assert ran == [1]
    assert not m.resume()


@pytest.mark.parametrize("policy", sorted(available_policies()))
def test_a_store_in_steps_that_finds_no_room_changes_nothing(policy: str) -> None:
    m = create_manager(4, policy, clock=FakeClock())
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    assert m.prepare_store(KEYS[:4], ctx) is not None
    m.complete_store(KEYS[:4], ctx)
    m.prepare_load(KEYS[:1], ctx)  # pinned: only 3 evictable
    m.take_events()
    before = (m.stats(), m.resident_keys())
    assert drive(m, m.prepare_store_steps(KEYS[4:9], ctx, STEP), [1]) is None
    assert (m.stats(), m.resident_keys()) == (
        dataclasses.replace(before[0], stores_refused=before[0].stores_refused + 1),
        before[1],
    )
    assert m.take_events() == []


@pytest.mark.parametrize("policy", sorted(EXACT))
def test_a_request_in_steps_is_reordered_at_its_end_as_one_whole(policy: str) -> None:
    """Store, complete and touch six keys (touched tail first), then finish: the request's
    chain and its count of ordering calls, which decide how its end reorders its blocks, are
    those of the whole calls."""
    keys = KEYS[:6]
    pools = []
    for stepped in (False, True):
        m = create_manager(8, policy, clock=FakeClock())
        ctx = ReqContext("r")
        m.on_new_request(ctx)
        if stepped:
            drive(m, m.prepare_store_steps(keys, ctx, STEP), [0])
            drive(m, m.complete_store_steps(keys, ctx, True, STEP), [1])
            drive(m, m.touch_steps(keys[::-1], ctx, STEP), [2])
        else:
            m.prepare_store(keys, ctx)
            m.complete_store(keys, ctx)
            m.touch(keys[::-1], ctx)
        m.on_request_finished(ctx)
        pools.append((m.resident_keys(), m.stats()))
    assert pools[0] == pools[1]


@pytest.mark.parametrize("policy", sorted(EXACT))
def test_an_expiry_in_steps_puts_the_blocks_back_in_the_whole_calls_order(policy: str) -> None:
    """Six kept blocks, ended in steps of two, go back into the policy as one whole expiry
    puts them: the next victims are the same, in the same order."""
    keys = KEYS[:6]
    clocks = (FakeClock(), FakeClock())
    managers = [create_manager(8, policy, clock=clock) for clock in clocks]
    for m in managers:
        ctx = ReqContext("w")
        m.on_new_request(ctx)
        m.prepare_store(keys, ctx)
        m.complete_store(keys, ctx, True)
        m.retain(keys, 1.0, "a")
        m.touch(keys[::-1], ctx)  # no effect on kept blocks: out of the policy's order
    for clock in clocks:
        clock.advance(2.0)
    whole, stepped = managers
    assert whole.expire_retentions() == drive(stepped, stepped.expire_retentions_steps(2), [2])
    assert whole.resident_keys() == stepped.resident_keys()
    assert whole.stats() == stepped.stats()
