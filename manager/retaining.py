"""The offload manager's retention verbs, over ``manager.retention``'s table, and ``demote``.

A retained key that is ready is *kept*: out of the policy's order, so no eviction looks at it,
until the last retention naming it ends. ``demote`` evicts chosen blocks now, through the
eviction listeners. See ``manager.core`` for the contract.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

from manager.events import EventsRoom
from manager.parts import WHOLE, parts, whole
from manager.slots import check_keys
from manager.spec import BlockKey, RetentionInfo


class RetainingRoom(EventsRoom):
    """Named retentions (``retain`` ... ``expire_retentions``), their queries, and ``demote``."""

    def retain(self, keys: Sequence[BlockKey], ttl_s: float, name: str) -> RetentionInfo:
        """Keep ``keys`` in the pool against eviction for ``ttl_s`` seconds, as retention
        ``name`` (``manager.retention``: a taken name gets the keys it lacks and its TTL
        restarted). A retained key that is ready is never evicted, by a store or a
        promotion, until the last retention naming it ends; one that is not resident yet is
        kept from the moment it becomes ready. Retaining makes no room: when the pool is full
        of pinned and retained blocks, ``prepare_store`` refuses as it does for pins.
        ``InvalidArgumentError`` for a bad key, name or TTL; nothing changes then."""
        return whole(self.retain_steps(keys, ttl_s, name, WHOLE))

    def retain_steps(
        self,
        keys: Sequence[BlockKey],
        ttl_s: float,
        name: str,
        step: int,
        check: Callable[[int, int], None] | None = None,
    ) -> Generator[None, None, RetentionInfo]:
        """``retain`` in steps of about ``step`` keys (``manager.steps``). Before the first
        change, ``check(new_retained, new_references)`` is called with what the call would
        add to ``num_retained`` and to ``retention_references`` (a caller's bounds): whatever
        it raises, nothing changed."""
        for part in parts(keys, step):
            yield
            check_keys(part)
        table = self._retentions
        added = yield from table.add_steps(name, keys, ttl_s, self._clock(), step, check)
        if added.created:
            self._retentions_started += 1
        slot_of, in_flight, kept = self._slot, self._pending, self._kept
        for part in parts(added.newly_retained, step):
            yield
            ready_set = slot_of.keys() & part
            ready_set -= in_flight
            # Their order, without a test per key when all are ready (the common case).
            ready = part if len(ready_set) == len(part) else [k for k in part if k in ready_set]
            if ready:
                self._policy.remove(ready)
                kept.update(ready)
        return (
            yield from self._retention_info_steps(
                name, step, added=len(added.added), created=added.created
            )
        )

    def renew_retention(self, name: str, ttl_s: float) -> RetentionInfo:
        """Restart retention ``name``'s TTL (``UnknownRetentionError`` if there is none)."""
        self._retentions.renew(name, ttl_s, self._clock())
        return self._retention_info(name)

    def release_retention(self, name: str) -> RetentionInfo:
        """End retention ``name`` now; what it was. Its keys no other retention names go back
        to the policy (head hotter than tail), evictable again."""
        return whole(self.release_retention_steps(name, WHOLE))

    def release_retention_steps(self, name: str, step: int) -> Generator[None, None, RetentionInfo]:
        """``release_retention`` in steps of about ``step`` keys (``manager.steps``)."""
        info = yield from self._retention_info_steps(name, step)
        yield from self._end_retention_steps(name, step)
        self._retentions_released += 1
        return info

    def expire_retentions(self) -> list[RetentionInfo]:
        """End every retention whose TTL has passed (by the injected clock); what they were."""
        return whole(self.expire_retentions_steps(WHOLE))

    def expire_retentions_steps(self, step: int) -> Generator[None, None, list[RetentionInfo]]:
        """``expire_retentions`` in steps of about ``step`` keys (``manager.steps``)."""
        out = []
        for name in self._retentions.due(self._clock()):
            out.append((yield from self._retention_info_steps(name, step)))
            yield from self._end_retention_steps(name, step)
        self._retentions_expired += len(out)
        return out

    def retentions(self) -> list[RetentionInfo]:
        """Every live retention, oldest first."""
        return [self._retention_info(n) for n in self._retentions.names()]

    def retention(self, name: str) -> RetentionInfo:
        """Retention ``name`` now (``UnknownRetentionError`` if there is none)."""
        return self._retention_info(name)

    def retention_keys(self, name: str) -> list[BlockKey]:
        """The keys retention ``name`` names, head to tail."""
        return self._retentions.keys_of(name)

    def new_retained(self, name: str, keys: Sequence[BlockKey]) -> int:
        """How many distinct keys of ``keys`` no retention names yet: how much retaining
        them would add to ``stats().retained`` (a quota's measure); changes nothing."""
        return self._retentions.new_keys(name, keys)

    def new_references(self, name: str, keys: Sequence[BlockKey]) -> int:
        """How many distinct keys of ``keys`` retention ``name`` does not name yet: how much
        retaining them would add to ``retention_references`` (a bound's measure); changes
        nothing."""
        return self._retentions.new_references(name, keys)

    @property
    def retention_references(self) -> int:
        """Keys named by live retentions, summed over them: a key two retentions name counts
        twice (what the retentions' memory grows with)."""
        return self._retentions.references

    def retained_where(self) -> tuple[int, int, list[BlockKey]]:
        """Where the retained keys are: how many are ready in the pool, how many pending
        there, and the keys not in the pool (one pass over the retained keys)."""
        slot_of, in_flight = self._slot, self._pending
        absent: list[BlockKey] = []
        pending = 0
        for key in self._retained:
            if key not in slot_of:
                absent.append(key)
            elif key in in_flight:
                pending += 1
        return len(self._kept), pending, absent

    def is_retained(self, key: BlockKey) -> bool:
        """Whether a live retention names ``key``."""
        return key in self._retained

    @property
    def num_retained(self) -> int:
        """How many distinct keys live retentions name (``stats().retained``)."""
        return len(self._retained)

    @property
    def num_retentions(self) -> int:
        """How many retentions are live (``stats().retentions``)."""
        return len(self._retentions)

    def has_retention(self, name: str) -> bool:
        """Whether retention ``name`` is live."""
        return name in self._retentions

    def _retention_info(self, name: str) -> RetentionInfo:
        return whole(self._retention_info_steps(name, WHOLE))

    def _retention_info_steps(
        self, name: str, step: int, *, added: int = 0, created: bool = False
    ) -> Generator[None, None, RetentionInfo]:
        kept = self._kept
        in_pool = 0
        if kept:
            for part in self._retentions.key_parts(name, step):
                in_pool += sum(map(kept.__contains__, part))
                yield
        return self._retentions.info(name, self._clock(), in_pool, added=added, created=created)

    def _end_retention(self, name: str) -> None:
        whole(self._end_retention_steps(name, WHOLE))

    def _end_retention_steps(self, name: str, step: int) -> Generator[None, None, None]:
        freed = yield from self._retentions.remove_steps(name, step)
        kept = self._kept
        back: list[BlockKey] = []
        for part in parts(freed, step):
            yield
            back += [k for k in part if k in kept]
        if not back:
            return
        for part in parts(back, step):
            yield
            kept.difference_update(part)
        for part in reversed(parts(back, step)):  # tail part first: the head ends hottest
            yield
            self._policy.insert(list(part))
        if not kept:
            kept.clear()  # a set keeps its size after removals: give it back

    def demote(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """Evict the ready blocks among ``keys`` that nothing pins and no retention names, now,
        as the policy would (the eviction listeners copy them down: a lower tier takes them);
        the keys evicted, reported as one ``BlockRemoved`` event. Others are left as they are.
        """
        check_keys(keys)
        refs, in_flight, slot_of, kept = self._refs, self._pending, self._slot, self._kept
        victims = [
            k
            for k in dict.fromkeys(keys)
            if k in slot_of and k not in refs and k not in in_flight and k not in kept
        ]
        if victims:
            self._policy.remove(victims)
            freed = list(map(slot_of.pop, victims))
            for listener in self._eviction_listeners:
                listener(victims, freed)
            self._push_free(freed)
            self._demoted += len(victims)
            self._emit_removed(victims)
        return victims
