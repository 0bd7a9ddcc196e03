"""The remote tier's contract: a store shared by many nodes, behind the host pool.

Primitives (every backend, one contract). Keys are the manager's opaque block keys (``bytes``);
a backend stores a key under its *remote name* ``<namespace>/<hex key>`` (``remote_name``), so
engines with different namespaces (model, layout, block size) never see each other's blocks.
Host pool slots are where bytes come from or go to (and, for a put, a block's bytes staged
outside the pool): the tier never hands out bytes.

- ``exists(keys) -> list[bool | None]``: one batch; per key, True when the store holds it now,
  False when the store answered that it does not, None when there was no answer for it (the
  call failed, timed out or was skipped). Only False says a block is gone: a node reports
  its removal on that answer alone (``app.core.remote``). ``timeout_s``: the caller's budget
  (a lookup's), when shorter than the tier's own: work not started by then never starts, and a
  key not answered by then is None, which does not degrade the tier.
- ``get_into(keys, slots) -> list[bool]``: copy each key's bytes into host slot ``slots[i]``;
  True only for a key whose full block was read into its slot. A False slot holds undefined
  bytes and must not be loaded (the caller drops the block it was reserved for).
- ``put_from(keys, slots) -> list[bool]``: store each slot's block under its key; True once the
  store holds it. A key the store already holds counts as stored.
- ``put_bytes(keys, blocks) -> list[bool]``: ``put_from`` for blocks whose bytes are no longer in
  the pool (copied out when the pool evicted them before their put: ``app.core.remote``), each
  exactly one block long; the same objects, the same answers.
- ``health() -> RemoteHealth``: state (``ok`` or ``degraded``), since when, the last error, and
  counters; never blocks on the backend. A backend that can lose its store while no call flows
  (a master that dies) checks on it by itself, so ``health()`` says so within seconds without
  traffic (``MooncakeTier``: a health check every ``probe_interval_s``).
- ``held_slots() -> frozenset[int]``: slots named by a call whose backend work has not ended
  (a call that timed out may still read or write them). The caller must not reuse such a slot
  for another block until it leaves this set.
- ``close()``: stop the backend client; idempotent. Later calls answer as failures (False;
  None for ``exists``: a closed tier has no answer).

Failures never raise out of the data calls: a failed, timed-out or skipped call answers False
(None for ``exists``) for its keys, and the backend's ``health()`` says why. Malformed calls
(lengths differ, a slot out of range, one slot named twice) raise ``InvalidJobError`` before
anything moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from transfer.errors import InvalidJobError
from transfer.health import TierHealth, TierState

__all__ = [
    "COUNTERS",
    "RemoteHealth",
    "RemoteState",
    "RemoteTier",
    "check_blocks",
    "check_slots",
    "remote_name",
]

RemoteState = TierState

# Every backend reports these counters (and may add its own).
COUNTERS = (
    "exists_calls",  # exists() batches that reached the backend
    "hits",  # keys exists() found
    "misses",  # keys exists() did not find
    "gets",  # keys get_into() read in full
    "get_failures",  # keys get_into() did not read (absent, failed, timed out, skipped)
    "puts",  # keys put_from() stored
    "put_failures",  # keys put_from() did not store
    "bytes_read",
    "bytes_written",
    "errors",  # backend calls that failed or returned errors for some keys
    "timeouts",  # backend calls not finished within the tier's timeout
    "incidents",  # times the tier went from ok to degraded
    "skipped",  # calls answered without the backend while degraded or closed
)


#: A remote tier's state and counters (at least ``COUNTERS``): ``transfer.health.TierHealth``.
RemoteHealth = TierHealth


class RemoteTier(Protocol):
    """A shared store behind the host pool (see the module docstring for the contract)."""

    @property
    def namespace(self) -> str: ...

    def exists(
        self, keys: Sequence[bytes], timeout_s: float | None = None
    ) -> list[bool | None]: ...

    def get_into(self, keys: Sequence[bytes], slots: Sequence[int]) -> list[bool]: ...

    def put_from(self, keys: Sequence[bytes], slots: Sequence[int]) -> list[bool]: ...

    def put_bytes(self, keys: Sequence[bytes], blocks: Sequence[bytes]) -> list[bool]: ...

    def health(self) -> RemoteHealth: ...

    def held_slots(self) -> frozenset[int]: ...

    def close(self) -> None: ...


def remote_name(namespace: str, key: bytes) -> str:
    """The name ``key`` is stored under remotely: ``<namespace>/<hex key>``."""
    return f"{namespace}/{key.hex()}"


def check_slots(keys: Sequence[bytes], slots: Sequence[int], num_blocks: int) -> None:
    """Raise ``InvalidJobError`` unless ``slots`` pairs one distinct, in-range slot per key."""
    if len(keys) != len(slots):
        raise InvalidJobError(f"{len(keys)} keys but {len(slots)} slots")
    for slot in slots:
        if type(slot) is not int or not 0 <= slot < num_blocks:
            raise InvalidJobError(f"slot {slot!r} is outside the pool (0..{num_blocks - 1})")
    if len(set(slots)) != len(slots):
        raise InvalidJobError("a slot is named twice in one call")


def check_blocks(keys: Sequence[bytes], blocks: Sequence[bytes], block_bytes: int) -> None:
    """Raise ``InvalidJobError`` unless ``put_bytes`` got one block of ``block_bytes`` a key."""
    if len(keys) != len(blocks):
        raise InvalidJobError(f"{len(keys)} keys but {len(blocks)} blocks")
    for i, block in enumerate(blocks):
        if len(block) != block_bytes:
            raise InvalidJobError(f"block {i} is {len(block)} bytes, not {block_bytes}")
