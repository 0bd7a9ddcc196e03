"""Retentions: named sets of keys kept in the pool against eviction until a deadline.

A caller that knows what comes next (an agent pausing for a tool call, a chat front end whose
user is typing) *retains* keys for ``ttl_s`` seconds under a name (a session id). The table here
is the bookkeeping only: which retentions exist, which keys each names, until when, and how many
live retentions name each key. ``OffloadManager`` owns one and acts on it: a key named by any
live retention is not evictable while it is ready in the pool (it leaves the policy's order and
comes back when the last retention naming it ends).

Memory: every retained key is held once, in one table shared by the retentions (``ids``: key ->
id, with how many retentions name it); a retention holds its keys as an array of those ids (4
bytes a key), so many retentions naming the same keys cost 4 bytes a key each, not a table of
their own. ``references`` counts the ids over every retention (the caller bounds it). The table
gives its memory back as it empties (a dict never shrinks on deletion: it is rebuilt once it
holds under a quarter of its peak).

Contract:

- ``add(name, keys, ttl_s)`` creates the retention or, when the name is taken, adds the keys it
  does not name yet and restarts its TTL from now. Keys keep their first-retained order (head
  to tail), the order they go back to the policy in.
- ``renew(name, ttl_s)`` restarts the TTL; ``remove(name)`` ends it; ``due(now)`` names those
  whose deadline has passed (the caller removes them). Nothing expires by itself: time comes
  only from the ``now`` the caller passes.
- ``UnknownRetentionError`` for a name the table does not hold; ``InvalidArgumentError`` for a
  name that is not a string of 1..``MAX_NAME`` characters or a TTL that is not a finite number
  above zero. A refused call changes nothing.
"""

from __future__ import annotations

import itertools
import math
from array import array
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass

from manager.errors import InvalidArgumentError, UnknownRetentionError
from manager.parts import WHOLE, distinct_steps, parts, whole
from manager.spec import BlockKey, RetentionInfo

#: The longest retention name (a session id, a request id).
MAX_NAME = 256


#: Below this many keys at its peak, the shared table is never rebuilt (too small to matter).
REBUILD_MIN = 1024


class _Retention:
    __slots__ = ("created_at", "expires_at", "ids", "name", "ttl_s")

    def __init__(self, name: str, now: float) -> None:
        self.name = name
        # The ids (``RetentionTable.ids``) of the keys it names, head to tail, each once.
        self.ids = array("I")
        self.created_at = now
        self.expires_at = now
        self.ttl_s = 0.0


@dataclass(slots=True)
class Added:
    """What ``RetentionTable.add`` did: the retention's name, whether the call created it, the
    keys it added to it, and those of them no other retention named (newly retained)."""

    name: str
    created: bool
    added: list[BlockKey]
    newly_retained: list[BlockKey]


def check_ttl(ttl_s: object) -> float:
    """``ttl_s`` as a float; ``InvalidArgumentError`` unless it is a finite number above 0."""
    if (
        isinstance(ttl_s, bool)
        or not isinstance(ttl_s, int | float)
        or not math.isfinite(ttl_s)
        or ttl_s <= 0
    ):
        raise InvalidArgumentError(f"ttl_s must be a finite number above 0, got {ttl_s!r}")
    return float(ttl_s)


def _check_name(name: object) -> str:
    if type(name) is not str or not 0 < len(name) <= MAX_NAME:
        raise InvalidArgumentError(
            f"a retention name must be a string of 1..{MAX_NAME} characters, got {name!r:.80}"
        )
    return name


class RetentionTable:
    """The retentions of one manager; see the module docstring."""

    def __init__(self) -> None:
        self._by_name: dict[str, _Retention] = {}
        #: The keys some live retention names, each with its id (keys named by none are
        #: absent): the one copy of each key, shared by every retention naming it.
        self.ids: dict[BlockKey, int] = {}
        self._key_of: list[BlockKey | None] = []  # id -> key (None: a free id)
        self._refs = array("I")  # id -> how many live retentions name it
        self._free_ids: list[int] = []
        self._peak = 0  # most keys ``ids`` held since it was last rebuilt
        self._peak_names = 0  # most retentions held since ``_by_name`` was last rebuilt
        #: Keys named, summed over the live retentions (a key two retentions name counts 2).
        self.references = 0

    def __len__(self) -> int:
        return len(self._by_name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def new_keys(self, name: str, keys: Iterable[BlockKey]) -> int:
        """How many distinct keys of ``keys`` no retention names yet, and ``name`` would
        add (what ``add`` would add to ``len(ids)``); changes nothing."""
        return len(dict.fromkeys(keys).keys() - self.ids.keys())

    def new_references(self, name: str, keys: Iterable[BlockKey]) -> int:
        """How many distinct keys of ``keys`` retention ``name`` does not name yet (what
        ``add`` would add to ``references``); changes nothing."""
        rec = self._by_name.get(name)
        distinct = dict.fromkeys(keys)
        if rec is None:
            return len(distinct)
        mine = set(rec.ids)
        ids = self.ids
        return sum(1 for k in distinct if ids.get(k) not in mine)

    def add(self, name: str, keys: Sequence[BlockKey], ttl_s: float, now: float) -> Added:
        """Create or extend retention ``name`` (keys already checked by the caller) and
        restart its TTL; see the module docstring."""
        return whole(self.add_steps(name, keys, ttl_s, now, WHOLE))

    def add_steps(
        self,
        name: str,
        keys: Sequence[BlockKey],
        ttl_s: float,
        now: float,
        step: int,
        check: Callable[[int, int], None] | None = None,
    ) -> Generator[None, None, Added]:
        """``add``, about ``step`` keys' work a step (the caller keeps the table unseen
        between two steps). Before the first change, the name and the TTL are checked and
        ``check(new, references)`` is called with what the call would add to ``len(ids)``
        and to ``references``: whatever it raises, nothing changed."""
        _check_name(name)
        ttl = check_ttl(ttl_s)
        rec = self._by_name.get(name)
        ids, refs = self.ids, self._refs
        mine: set[int] = set()  # the ids the retention names already
        if rec is not None:
            for named_part in parts(rec.ids, step):
                yield
                mine.update(named_part)
        distinct = yield from distinct_steps(keys, step)
        added: list[BlockKey] = []  # the keys the retention does not name yet
        new = 0
        for part in parts(list(distinct), step):
            yield
            if mine:
                part = [k for k in part if ids.get(k) not in mine]
            added += part
            new += len(part) - len(ids.keys() & part)
        if check is not None:
            check(new, len(added))
        created = rec is None
        if rec is None:
            rec = self._by_name[name] = _Retention(name, now)
            self._peak_names = max(self._peak_names, len(self._by_name))
        named = rec.ids
        fresh: list[BlockKey] = []
        for part in parts(added, step):
            yield
            if ids.keys().isdisjoint(part):
                # Every key new to the table (the common case): ids handed out in bulk.
                fresh += part
                named.extend(self._new_ids(part))
                continue
            for key in part:
                i = ids.get(key)
                if i is None:
                    i = self._new_id(key)
                    fresh.append(key)
                else:
                    refs[i] += 1
                named.append(i)
        self.references += len(added)
        if len(ids) > self._peak:
            self._peak = len(ids)
        rec.ttl_s = ttl
        rec.expires_at = now + ttl
        return Added(name, created, added, fresh)

    def _new_ids(self, keys: Sequence[BlockKey]) -> list[int]:
        """``_new_id`` of each key, in order (the same ids), without a call per key."""
        free = self._free_ids
        reused = free[: -len(keys) - 1 : -1]  # taken off the end, as ``pop`` takes them
        if reused:
            del free[-len(reused) :]
        key_of, refs = self._key_of, self._refs
        for i, key in zip(reused, keys, strict=False):
            key_of[i] = key
            refs[i] = 1
        start = len(key_of)
        rest = keys[len(reused) :]
        key_of.extend(rest)
        refs.extend(itertools.repeat(1, len(rest)))
        out = reused + list(range(start, start + len(rest)))
        self.ids.update(zip(keys, out, strict=True))
        return out

    def _new_id(self, key: BlockKey) -> int:
        if self._free_ids:
            i = self._free_ids.pop()
            self._key_of[i] = key
            self._refs[i] = 1
        else:
            i = len(self._key_of)
            self._key_of.append(key)
            self._refs.append(1)
        self.ids[key] = i
        return i

    def renew(self, name: str, ttl_s: float, now: float) -> None:
        """Restart the TTL of retention ``name``."""
        ttl = check_ttl(ttl_s)
        rec = self._get(name)
        rec.ttl_s = ttl
        rec.expires_at = now + ttl

    def remove(self, name: str) -> list[BlockKey]:
        """End retention ``name``; the keys no retention names any more, head to tail."""
        return whole(self.remove_steps(name, WHOLE))

    def remove_steps(self, name: str, step: int) -> Generator[None, None, list[BlockKey]]:
        """``remove``, about ``step`` keys' work a step (the caller keeps the table unseen
        between two steps)."""
        rec = self._get(name)
        del self._by_name[name]
        ids, refs, key_of, free_ids = self.ids, self._refs, self._key_of, self._free_ids
        freed: list[BlockKey] = []
        for part in parts(rec.ids, step):
            yield
            for i in part:
                left = refs[i] - 1
                refs[i] = left
                if not left:
                    key = key_of[i]
                    assert key is not None
                    del ids[key]
                    key_of[i] = None
                    free_ids.append(i)
                    freed.append(key)
        self.references -= len(rec.ids)
        if self._peak >= REBUILD_MIN and len(ids) * 4 < self._peak:
            yield from self._rebuild_steps(step)
        if self._peak_names >= REBUILD_MIN and len(self._by_name) * 4 < self._peak_names:
            self._by_name = dict(self._by_name)
            self._peak_names = len(self._by_name)
        return freed

    def _rebuild_steps(self, step: int) -> Generator[None, None, None]:
        """Give back what the shared table grew to: a dict keeps its size after deletions.
        The ids are renumbered densely, and every retention's array with them; about
        ``step`` ids' work a step."""
        old_key_of, old_refs = self._key_of, self._refs
        live: list[int] = []
        for at in range(0, len(old_key_of), step):
            yield
            chunk = range(at, min(at + step, len(old_key_of)))
            live += [i for i in chunk if old_key_of[i] is not None]
        new_of: dict[int, int] = {}
        key_of: list[BlockKey | None] = []
        refs = array("I")
        for part in parts(live, step):
            yield
            new_of.update(zip(part, range(len(key_of), len(key_of) + len(part)), strict=True))
            key_of += map(old_key_of.__getitem__, part)
            refs.extend(map(old_refs.__getitem__, part))
        # The same dict object, rebuilt in place: the manager holds it (``is_retained``).
        ids = self.ids
        ids.clear()
        for at in range(0, len(key_of), step):
            yield
            chunk_keys = key_of[at : at + step]  # every one live: not None
            ids.update(zip(chunk_keys, range(at, at + len(chunk_keys)), strict=True))  # type: ignore[arg-type]
        for rec in self._by_name.values():
            renumbered = array("I")
            for ids_part in parts(rec.ids, step):
                yield
                renumbered.extend(map(new_of.__getitem__, ids_part))
            rec.ids = renumbered
        self._key_of, self._refs, self._free_ids = key_of, refs, []
        self._peak = len(key_of)

    def due(self, now: float) -> list[str]:
        """The names of the retentions whose deadline is at or before ``now``."""
        return [r.name for r in self._by_name.values() if r.expires_at <= now]

    def keys_of(self, name: str) -> list[BlockKey]:
        """The keys retention ``name`` names, head to tail."""
        # A live retention's ids are never free: each names its key (mapped in C).
        return list(map(self._key_of.__getitem__, self._get(name).ids))  # type: ignore[arg-type]

    def key_parts(self, name: str, step: int) -> Iterator[list[BlockKey]]:
        """``keys_of(name)`` a part of ``step`` keys at a time, each part made as it is
        asked for."""
        key_of = self._key_of
        for part in parts(self._get(name).ids, step):
            yield list(map(key_of.__getitem__, part))  # type: ignore[arg-type]

    def info(
        self, name: str, now: float, in_pool: int, *, added: int = 0, created: bool = False
    ) -> RetentionInfo:
        """What retention ``name`` is now; ``in_pool``: how many of its keys are ready in
        the pool (the manager counts them)."""
        rec = self._get(name)
        return RetentionInfo(
            name=name,
            keys=len(rec.ids),
            in_pool=in_pool,
            ttl_s=rec.ttl_s,
            expires_in_s=max(0.0, rec.expires_at - now),
            age_s=max(0.0, now - rec.created_at),
            added=added,
            created=created,
        )

    def names(self) -> list[str]:
        """Every retention's name, oldest first."""
        return list(self._by_name)

    def _get(self, name: str) -> _Retention:
        rec = self._by_name.get(name)
        if rec is None:
            raise UnknownRetentionError(name)
        return rec
