"""Retentions: named sets of keys kept in the pool against eviction until a deadline.

A caller that knows what comes next (an agent pausing for a tool call, a chat front end whose
user is typing) *retains* keys for ``ttl_s`` seconds under a name (a session id). The table here
is the bookkeeping only: which retentions exist, which keys each names, until when, and how many
live retentions name each key (``counts``). ``OffloadManager`` owns one and acts on it: a key
named by any live retention is not evictable while it is ready in the pool (it leaves the
policy's order and comes back when the last retention naming it ends).

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

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from manager.errors import InvalidArgumentError, UnknownRetentionError
from manager.spec import BlockKey, RetentionInfo

#: The longest retention name (a session id, a request id).
MAX_NAME = 256


class _Retention:
    __slots__ = ("created_at", "expires_at", "keys", "name", "ttl_s")

    def __init__(self, name: str, now: float) -> None:
        self.name = name
        self.keys: dict[BlockKey, None] = {}
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
        #: Per key, how many live retentions name it (keys named by none are absent).
        self.counts: dict[BlockKey, int] = {}

    def __len__(self) -> int:
        return len(self._by_name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def new_keys(self, name: str, keys: Iterable[BlockKey]) -> int:
        """How many distinct keys of ``keys`` no retention names yet, and ``name`` would
        add (what ``add`` would add to ``len(counts)``); changes nothing."""
        counts = self.counts
        return sum(1 for k in dict.fromkeys(keys) if k not in counts)

    def add(self, name: str, keys: Sequence[BlockKey], ttl_s: float, now: float) -> Added:
        """Create or extend retention ``name`` (keys already checked by the caller) and
        restart its TTL; see the module docstring."""
        _check_name(name)
        ttl = check_ttl(ttl_s)
        rec = self._by_name.get(name)
        created = rec is None
        if rec is None:
            rec = self._by_name[name] = _Retention(name, now)
        mine = rec.keys
        added = [k for k in dict.fromkeys(keys) if k not in mine]
        mine.update(dict.fromkeys(added))
        counts = self.counts
        fresh: list[BlockKey] = []
        for key in added:
            count = counts.get(key, 0)
            if not count:
                fresh.append(key)
            counts[key] = count + 1
        rec.ttl_s = ttl
        rec.expires_at = now + ttl
        return Added(name, created, added, fresh)

    def renew(self, name: str, ttl_s: float, now: float) -> None:
        """Restart the TTL of retention ``name``."""
        ttl = check_ttl(ttl_s)
        rec = self._get(name)
        rec.ttl_s = ttl
        rec.expires_at = now + ttl

    def remove(self, name: str) -> list[BlockKey]:
        """End retention ``name``; the keys no retention names any more, head to tail."""
        rec = self._get(name)
        del self._by_name[name]
        counts = self.counts
        freed: list[BlockKey] = []
        for key in rec.keys:
            left = counts[key] - 1
            if left:
                counts[key] = left
            else:
                del counts[key]
                freed.append(key)
        return freed

    def due(self, now: float) -> list[str]:
        """The names of the retentions whose deadline is at or before ``now``."""
        return [r.name for r in self._by_name.values() if r.expires_at <= now]

    def keys_of(self, name: str) -> list[BlockKey]:
        """The keys retention ``name`` names, head to tail."""
        return list(self._get(name).keys)

    def info(
        self, name: str, now: float, in_pool: int, *, added: int = 0, created: bool = False
    ) -> RetentionInfo:
        """What retention ``name`` is now; ``in_pool``: how many of its keys are ready in
        the pool (the manager counts them)."""
        rec = self._get(name)
        return RetentionInfo(
            name=name,
            keys=len(rec.keys),
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
