"""Prefix-LRFU: decayed frequency per prefix block, learned admission, parents outrank children.

Why a prefix cache needs its own policy
---------------------------------------
A KV block is only worth something if every block before it in its prefix is resident too:
the engine reuses the *leading* hits of a request and stops at the first miss. The blocks of
the pool form a forest (a trie of request chains) and three facts follow:

1. A block must never be hotter than its parent. Every request that uses a block also uses its
   parent, so the parent's value is at least the child's, and evicting a parent before its child
   wastes the child. The policy keeps ``child < parent`` in its order at all times (the tail of
   a chain goes before its head). Victims are therefore leaves of the resident forest; if a
   parent must go while a child cannot (the child is pinned), the child and its resident
   descendants become the next victims, because they cannot be hit until the parent returns.
2. Frequency matters, but so does recency, and both must age. Each block has an LRFU score
   (Lee et al. 2001): a use adds 1 and the score halves every ``half_life x capacity`` block
   references. Kept in log form, ``K = t_last + H * log2(score)`` orders blocks exactly as their
   decayed scores do at any later time, so the order is a static heap key (O(log n)).
3. Most new blocks are never used again (tails of one-off prompts, the last, partial block of
   every prompt, the new suffix after a shared prefix), and whether they will be depends on the
   shape of the request. ``insert`` cannot refuse a block, so the policy *places* it instead: a
   new block starts with a score equal to the estimated probability that a block of its kind is
   reused, learned online, so an unlikely one is filed as (nearly) the next victim. Kinds come
   from the request chain (``request_finished``): the chain's last block; otherwise whether the
   block extends a prefix some earlier request stored (a divergent suffix) or starts a new one,
   and the chain length in half-octaves (long shared documents and system prompts come back more
   often than short one-off prompts). An observation is the head of the new run of blocks (and
   the chain's last block) watched for a later reference within ``watch_factor x capacity``
   block references; estimates are shrunk towards the global rate and forget old data.

A block evicted and stored again resumes its decayed score from a bounded ghost memory, so a
prefix that keeps coming back is recognised as popular.

Memory bound: held keys (one heap entry each, plus stale heap entries compacted at 2x), trie
links between held keys only, at most ``ghost_factor x capacity`` ghost entries and at most
``2 x capacity`` watched keys (oldest dropped first), and a fixed number of learned classes.

Tie order: equal keys go by a sequence number; a batch is numbered tail first and a clamped
child takes its parent's key with a smaller number, so ``coldest_first`` (a sort of the heap
keys) is exactly the order in which repeated ``evict(1)`` calls take the keys.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence

from manager.policies.base import CanEvict, EvictionPolicy
from manager.policies.lazy_heap import LazyHeap
from manager.policies.params import ParamSpec
from manager.policies.registry import register_policy

# Learned classes of new blocks: for each of "starts a new prefix" and "extends a stored
# prefix", one class per half-octave of the request's chain length, plus the chain's last block.
_LENGTH_CLASSES = 24  # half-octaves: lengths up to 2**12 blocks, longer share the last class
_LEAF = _LENGTH_CLASSES  # class index of the chain's last block (within a group)
_GROUP = _LENGTH_CLASSES + 1
_NUM_CLASSES = 2 * _GROUP
_SHRINK = 4.0  # pseudo-observations pulling a class estimate towards the global rate
_PRIOR = 0.5  # the global rate before any outcome (as many pseudo-observations as _SHRINK)
_MEMORY = 1024.0  # resolved observations kept per class; beyond, old ones count half
_MIN_WEIGHT = 1.0 / 4096  # floor of a learned weight, so every key stays finite
_FRESH = -1  # class of a held key that was admitted without history and not yet classified
_USED = -2  # class of a held key with real history (used, or stored again from the ghost)


def _length_class(length: int) -> int:
    """Half-octave bucket of a chain length: 1, 2, 3, 4-5, 6-7, 8-11, 12-15, 16-22, ..."""
    if length <= 1:
        return 0
    return min(int(2.0 * math.log2(length)), _LENGTH_CLASSES - 1)


class _Stat:
    """Per held key: time and log2 score of its last use, and its class (or a marker)."""

    __slots__ = ("cls", "logscore", "time")

    def __init__(self, time: float, logscore: float, cls: int) -> None:
        self.time = time
        self.logscore = logscore
        self.cls = cls


class _ReuseRates:
    """Online estimate, per class, of the chance that a watched block is referenced again
    within ``horizon`` block references.

    Outcomes arrive late (a miss is only known when the horizon has passed), so counting only
    resolved outcomes would overrate every class while its first misses are pending, which is
    most of the time during warm-up. A pending block therefore counts as the fraction of its
    horizon that has elapsed (an exposure, as in a life table): exact when a reuse is equally
    likely anywhere in the horizon, and a small correction in steady state, where resolved
    outcomes dominate. Estimates are shrunk towards the global rate (few observations say
    little), and old outcomes fade (halved past ``_MEMORY``), so the rates follow a drifting
    workload.
    """

    def __init__(self, horizon: float) -> None:
        self.horizon = horizon
        self.reused = [0.0] * _NUM_CLASSES
        self.resolved = [0.0] * _NUM_CLASSES
        self.pending = [0] * _NUM_CLASSES
        self.pending_since = [0.0] * _NUM_CLASSES  # sum of the pending registration times
        self.all_reused = 0.0
        self.all_resolved = 0.0
        self.all_pending = 0
        self.all_pending_since = 0.0

    def start(self, cls: int, now: float) -> None:
        self.pending[cls] += 1
        self.pending_since[cls] += now
        self.all_pending += 1
        self.all_pending_since += now

    def resolve(self, cls: int, since: float, reused: bool) -> None:
        self.pending[cls] -= 1
        self.pending_since[cls] -= since
        self.all_pending -= 1
        self.all_pending_since -= since
        self.resolved[cls] += 1.0
        self.all_resolved += 1.0
        if reused:
            self.reused[cls] += 1.0
            self.all_reused += 1.0
        if self.resolved[cls] > _MEMORY:  # forget: old outcomes count half
            self.resolved[cls] *= 0.5
            self.reused[cls] *= 0.5
        if self.all_resolved > _MEMORY * _NUM_CLASSES:
            self.all_resolved *= 0.5
            self.all_reused *= 0.5

    def rate(self, cls: int, now: float) -> float:
        h = self.horizon
        exposure = (self.all_pending * now - self.all_pending_since) / h
        prior = (self.all_reused + _SHRINK * _PRIOR) / (self.all_resolved + exposure + _SHRINK)
        exposure = (self.pending[cls] * now - self.pending_since[cls]) / h
        rate = (self.reused[cls] + _SHRINK * prior) / (self.resolved[cls] + exposure + _SHRINK)
        return min(1.0, max(_MIN_WEIGHT, rate))


@register_policy
class PrefixLRFUPolicy(EvictionPolicy):
    """LRFU over a prefix forest: decayed frequency, learned placement, children first."""

    name = "prefix_lrfu"
    wants_request_chains = True
    # All three are multiples of the capacity, so one range suits every pool size. Any positive
    # value works (a tiny one only makes the quantity shorter than one block reference), so
    # the lower ends stay open at 0 as before.
    params_spec = (
        # The half-life of a score, in pool turnovers. 1000 turnovers is already "never
        # decays" (LFU without aging); far beyond, ``half_life x capacity`` overflows to inf
        # and a heap key ``now + inf x 0`` becomes NaN, which breaks the order.
        ParamSpec(
            name="half_life",
            kind="float",
            default=1.0,
            low=0.0,
            high=1000.0,
            low_open=True,
            doc="block references, as a multiple of the capacity, for a score to halve",
        ),
        # Ghost entries (an ordered-dict entry with a tuple each) cost memory in proportion:
        # capped at 16 as LFU's history_factor. The oldest ghost is at least ghost_factor pool
        # turnovers old, so at the default half-life its score has decayed by 2**-16 there.
        ParamSpec(
            name="ghost_factor",
            kind="float",
            default=2.0,
            low=0.0,
            high=16.0,
            low_open=True,
            doc="evicted keys whose scores are remembered, as a multiple of the capacity",
        ),
        # The horizon within which a watched block counts as reused. Memory does not depend
        # on it (at most 2 x capacity keys are watched, oldest dropped as not reused); 1000
        # turnovers as before: by then the watch bound has ended the watch of any block of a
        # chain shorter than ~2000 blocks, so a longer horizon would change nothing.
        ParamSpec(
            name="watch_factor",
            kind="float",
            default=2.0,
            low=0.0,
            high=1000.0,
            low_open=True,
            doc="block references, as a multiple of the capacity, a new block is watched for",
        ),
    )

    def __init__(self, capacity: int, params: dict[str, object] | None = None) -> None:
        super().__init__(capacity, params)
        p = self.params
        # The score halves every ``half`` block references, i.e. relative to the time the pool
        # takes to turn over, so the same default suits every capacity.
        self._half: float = p["half_life"] * capacity
        self._ghost_max = max(1, int(p["ghost_factor"] * capacity))
        self._watch_max = 2 * capacity
        self._rates = _ReuseRates(p["watch_factor"] * capacity)
        self._t = 0.0  # virtual clock: block references (keys inserted or touched) so far
        self._seq = 0
        self._finished = 0  # request_finished calls so far (tells one request from another)
        self._order = LazyHeap(slack=2)  # held keys by (heap key, sequence)
        self._stat: dict[bytes, _Stat] = {}
        self._ghost: OrderedDict[bytes, tuple[float, float]] = OrderedDict()
        self._parent: dict[bytes, bytes] = {}  # links between held keys only
        self._children: dict[bytes, set[bytes]] = {}
        # Watched key -> (class, registration time, request_finished index).
        self._watch: OrderedDict[bytes, tuple[int, float, int]] = OrderedDict()

    # ------------------------------------------------------------------ learned placement

    def _logweight(self, cls: int) -> float:
        return math.log2(self._rates.rate(cls, self._t))

    def _watch_key(self, key: bytes, cls: int) -> None:
        watch = self._watch
        if key in watch:
            return
        watch[key] = (cls, self._t, self._finished)
        self._rates.start(cls, self._t)
        if len(watch) > self._watch_max:  # bounded memory: the oldest counts as not reused
            _, (old, since, _) = watch.popitem(last=False)
            self._rates.resolve(old, since, False)

    def _expire_watch(self) -> None:
        """Watched keys not referenced within the horizon count as not reused."""
        watch, rates = self._watch, self._rates
        limit = self._t - rates.horizon
        while watch:
            key = next(iter(watch))
            cls, since, _ = watch[key]
            if since >= limit:
                break
            del watch[key]
            rates.resolve(cls, since, False)

    def _credit(self, key: bytes) -> None:
        seen = self._watch.pop(key, None)
        if seen is not None:
            self._rates.resolve(seen[0], seen[1], True)

    # ------------------------------------------------------------------ ordering

    def _file(self, items: list[tuple[bytes, float]]) -> None:
        """File a batch ordered head to tail: each key below the one before it and below its
        known parent; on equal keys the tail is numbered first (so it goes first)."""
        n = len(items)
        base = self._seq + n
        self._seq += n + 1
        entry, parent = self._order.entries, self._parent
        prev: tuple[float, int] | None = None
        for i, (key, prio) in enumerate(items):
            cur = (prio, base - i)
            up = parent.get(key)
            if up is not None:
                top = entry[up]
                if cur >= top:
                    cur = (top[0], top[1] - 1)
            if prev is not None and cur >= prev:
                cur = (prev[0], prev[1] - 1)
            old = entry.get(key)
            self._order.set(key, cur[0], cur[1])
            if old is not None and cur < old:  # moved down: its children must stay below it
                self._clamp_below(key)
            prev = cur

    def _clamp_below(self, key: bytes) -> None:
        """Push the resident descendants of ``key`` below it where they are not already."""
        entry, children = self._order.entries, self._children
        stack = [key]
        while stack:
            up = stack.pop()
            top = entry[up]
            for child in children.get(up, ()):
                if entry[child] >= top:
                    self._order.set(child, top[0], top[1] - 1)
                    stack.append(child)

    def _link(self, up: bytes, key: bytes) -> None:
        parent = self._parent
        old = parent.get(key)
        if old == up or up == key:
            return
        if key in self._children:
            # Hash chains never loop, but arbitrary keys might: a link that would make ``key``
            # its own ancestor is ignored (the clamp would otherwise never end). Only a key with
            # children can close a loop, so new leaves, the common case, skip the walk.
            node: bytes | None = up
            while node is not None:
                if node == key:
                    return
                node = parent.get(node)
        if old is not None:
            self._unlink(key, old)
        self._parent[key] = up
        self._children.setdefault(up, set()).add(key)

    def _unlink(self, key: bytes, up: bytes) -> None:
        siblings = self._children[up]
        siblings.discard(key)
        if not siblings:
            del self._children[up]

    def _forget_links(self, key: bytes) -> set[bytes]:
        """Drop every link of ``key``; returns its children (now without a parent)."""
        up = self._parent.pop(key, None)
        if up is not None:
            self._unlink(key, up)
        kids = self._children.pop(key, set())
        for child in kids:
            del self._parent[child]
        return kids

    def _used(self, stat: _Stat, now: float) -> None:
        """Count a use at ``now``: the score becomes 1 + the old score decayed to ``now``."""
        decayed = stat.logscore - (now - stat.time) / self._half
        stat.logscore = math.log2(1.0 + 2.0**decayed) if decayed > -60.0 else 0.0
        stat.time = now
        stat.cls = _USED

    # ------------------------------------------------------------------ the interface

    def insert(self, keys: Sequence[bytes]) -> None:
        self._t += len(keys)
        now, half = self._t, self._half
        # Until the request's chain arrives, a new block is weighed by its batch alone.
        guess = self._logweight(_length_class(len(keys)))
        items: list[tuple[bytes, float]] = []
        stats, ghost = self._stat, self._ghost
        for key in keys:
            self._credit(key)
            stat = stats.get(key)
            if stat is None:
                old = ghost.pop(key, None)
                if old is None:
                    stat = _Stat(now, guess, _FRESH)
                else:  # stored again: a use, resuming the decayed score it had
                    stat = _Stat(old[0], old[1], _USED)
                    self._used(stat, now)
                stats[key] = stat
            else:  # already held (the manager never does this): count a use
                self._used(stat, now)
            items.append((key, now + half * stat.logscore))
        self._file(items)
        self._expire_watch()
        self._order.compact()

    def touch(self, keys: Sequence[bytes]) -> None:
        stats = self._stat
        held = [k for k in keys if k in stats]
        if not held:
            return
        self._t += len(held)
        now, half = self._t, self._half
        items: list[tuple[bytes, float]] = []
        for key in held:
            self._credit(key)
            stat = stats[key]
            self._used(stat, now)
            items.append((key, now + half * stat.logscore))
        self._file(items)
        self._expire_watch()
        self._order.compact()

    def request_finished(self, keys: Sequence[bytes]) -> None:
        """Learn the chain's links, place its new blocks by their class, file it tail first.

        Counts no use: a new block's score is set to the learned weight of its class (its
        placement), and every held block of the chain is moved below the held block before it
        (and its other descendants below it) where needed.
        """
        self._finished += 1
        stats, entry, watch = self._stat, self._order.entries, self._watch
        n = len(keys)
        length_cls = _length_class(n)
        group = -1  # 0: the chain's new blocks start a prefix, 1: they extend a stored one
        logweight: float | None = None
        for i, key in enumerate(keys):
            seen = watch.get(key)
            if seen is not None and seen[2] < self._finished:
                self._credit(key)  # used again by a later request than the one it came from
            stat = stats.get(key)
            if stat is None or stat.cls != _FRESH:
                continue
            if group < 0:  # the head of the chain's new run: watch it for the whole run
                group = 1 if i > 0 else 0
                if i < n - 1:
                    self._watch_key(key, group * _GROUP + length_cls)
            if i == n - 1:
                cls = group * _GROUP + _LEAF
                self._watch_key(key, cls)
                stat.logscore = self._logweight(cls)
            else:
                cls = group * _GROUP + length_cls
                if logweight is None:
                    logweight = self._logweight(cls)
                stat.logscore = logweight
            stat.cls = cls
            old = entry[key]
            self._order.set(key, stat.time + self._half * stat.logscore, old[1])
            if entry[key] < old:
                self._clamp_below(key)
        prev: bytes | None = None  # the chain's previous key, if held: the parent to link
        above: bytes | None = None  # the last held key before this one: it must stay hotter
        for key in keys:
            if key not in entry:
                prev = None
                continue
            if prev is not None:
                self._link(prev, key)
            top = entry[above] if above is not None and above != key else None
            up = self._parent.get(key)
            if up is not None and (top is None or entry[up] < top):
                top = entry[up]
            if top is not None and entry[key] >= top:
                self._order.set(key, top[0], top[1] - 1)
                self._clamp_below(key)
            prev = above = key
        self._order.compact()

    def remove(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            if self._order.discard(key):
                del self._stat[key]
                self._forget_links(key)
        self._order.compact()

    def evict(self, n: int, can_evict: CanEvict | None = None) -> list[bytes] | None:
        chosen = self._order.pop_lowest(n, can_evict)
        if chosen is None:
            return None
        victims = [key for _, _, key in chosen]
        entry = self._order.entries
        ghost, stats = self._ghost, self._stat
        orphans: list[bytes] = []
        for key in victims:
            stat = stats.pop(key)
            ghost[key] = (stat.time, stat.logscore)
            orphans.extend(self._forget_links(key))
        for child in orphans:
            if child in entry:
                self._demote(child)
        while len(ghost) > self._ghost_max:
            ghost.popitem(last=False)
        return victims

    def _demote(self, root: bytes) -> None:
        """Make ``root`` and its resident descendants the next victims, deepest first: none
        of them can be hit while the parent of ``root`` is missing."""
        order: list[bytes] = []
        stack = [root]
        while stack:
            key = stack.pop()
            order.append(key)
            stack.extend(self._children.get(key, ()))
        for key in reversed(order):  # every child was listed after its parent
            self._seq += 1
            self._order.set(key, -math.inf, self._seq)

    def coldest_first(self) -> Iterator[bytes]:
        return iter(self._order.ordered())

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
