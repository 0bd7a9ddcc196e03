"""The offload manager: which blocks live in the host pool, in which slot, in which state.

Primitives (all batch-native, all carrying a ``ReqContext``):

- ``lookup(keys)``: per key HIT / PENDING / MISS plus ``hit_prefix``; changes only statistics.
- ``prepare_load(keys)`` / ``complete_load(keys)``: pin ready blocks for a host->device copy and
  unpin them afterwards. Pins are counted per request, so a request can only release what it
  holds and a retried ``complete_load`` cannot unpin twice.
- ``touch(keys)``: record a use (policy order); keys that are not ready are ignored.
- ``prepare_store(keys)`` / ``complete_store(keys, success)``: reserve slots for the keys not yet
  resident, evicting unpinned ready blocks if needed, then make them ready (or drop them).
  ``prepare_store`` is all-or-nothing: ``None`` and no change when the room cannot be made.
- ``on_new_request`` / ``on_request_finished``: the request lifecycle. Pins and pending stores are
  *leases* owned by the request. A normal finish keeps them until their ``complete_*`` call
  arrives (a store may finish after its request). An abort releases every pin at once and drops
  every pending store from the index; the slot of a dropped store stays reserved (an *orphaned
  reservation*) until the writer reports (``complete_store``) or a writer deadline passes,
  because a copy may still be writing into it and the slot must not be handed to another block
  under that copy.
- ``expire_requests(lease_ttl, writer_deadline=...)``: force-release the leases of requests
  silent for longer than the TTL (a crashed engine cannot leak the pool), and end orphaned
  reservations whose writer has not reported within the deadline (an engine that aborts and
  never reports cannot hold the pool either). Time comes only from the injected clock.
- ``retain(keys, ttl_s, name)`` / ``renew_retention`` / ``release_retention`` /
  ``expire_retentions``: named retentions (``manager.retention``) keep their keys' ready blocks
  out of eviction until their TTL passes; such a *kept* block leaves the policy's order and
  returns to it when the last retention naming it ends. ``demote(keys)``: evict chosen blocks
  now, through the eviction listeners (a lower tier takes them).
- ``take_events()``: KV events since the last call, drained once, in order; ``set_event_sink``
  names a callback told of each event as it joins (its reader drains them there).
- ``touch_steps``, ``complete_store_steps``, ``prepare_store_steps``, ``drop_steps``: the
  same verbs in steps of a bounded number of keys, for a caller that gives way between them
  (``manager.steps``); ``suspend(rest)`` / ``resume()``: between two steps, any other entry first
  runs the rest (``manager.suspend``), so that to everyone else such a call is one.
- ``switch_policy(name, params)``: rebuild a new policy from the resident blocks, coldest first;
  block state is untouched and no block is lost. ``reset()``: drop every ready block that is
  neither pinned nor retained.

Keys: a key is ``bytes`` (exactly) of 1..``MAX_KEY_BYTES`` bytes. Every call that takes keys
(``lookup``, ``touch``, ``prepare_load``, ``complete_load``, ``prepare_store``,
``complete_store``) raises ``InvalidArgumentError`` and changes nothing (the request's lease is
still renewed) when one of them is not a key and not equal to a key the manager holds. Held keys
(resident, pending or pinned) were checked when ``prepare_store`` admitted them, so each call
checks its batch only on the paths where some key was not found in the table it was looked up
in; a batch of held keys in the expected state, the hot case, pays nothing for the check. The
tables compare by equality, as dicts do: an object equal to a held key (a ``bytes`` subclass, a
``memoryview`` of it) is taken as that key.

Block states: a key is *pending* from ``prepare_store`` until ``complete_store``, then *ready*;
a ready block with a ref count above zero is *pinned*. The policy only holds ready blocks, and
the manager only lets it evict ready blocks with a zero ref count that are not part of the
store offer being served; retained ready blocks are not in the policy at all. Invariant:
``free + pending + ready == num_blocks``, where *pending* also counts the reserved slots of
dropped in-flight stores.

Not thread-safe: the service calls it from one event loop, each call runs to completion (a
call in steps, to completion before anyone else's).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from manager.loads import HIT as HIT
from manager.loads import MISS as MISS
from manager.loads import PENDING as PENDING
from manager.loads import LoadsRoom
from manager.retaining import RetainingRoom
from manager.slots import DEFAULT_MAX_EVENTS as DEFAULT_MAX_EVENTS
from manager.slots import ChainListener as ChainListener
from manager.slots import Clock as Clock
from manager.slots import EvictionListener as EvictionListener
from manager.steps import StepsRoom
from manager.stores import StoresRoom
from manager.suspend import SuspendRoom
from manager.switch import SwitchRoom


class OffloadManager(RetainingRoom, StepsRoom, StoresRoom, LoadsRoom, SwitchRoom, SuspendRoom):
    """Bookkeeping of the host pool; see the module docstring for the contract.

    Assembled from rooms, each a class over the state in ``manager.slots`` (``PoolState``: the
    tables and counters, set in its ``__init__``, and the slot and pin methods):
    ``manager.events`` (KV events, listeners), ``manager.requests`` (requests and leases),
    ``manager.switch`` (policy switch, ``reset``, ``drop``, ``stats``), ``manager.loads``
    (``lookup``, ``prepare_load``, ``complete_load``, ``touch``), ``manager.stores``
    (``prepare_store``, ``complete_store``), ``manager.retaining`` (retentions, ``demote``),
    ``manager.steps`` (the large write verbs in steps) and ``manager.suspend`` (a caller's
    steps kept whole to everyone else).
    A room's bases are the rooms whose methods it calls. No room overrides another's method,
    so the order of the bases decides nothing.
    """

    _unsettled = frozenset({"record_event", "take_events"})


def create_manager(
    num_blocks: int,
    policy: str = "lru",
    store_threshold: int = 0,
    *,
    policy_params: Mapping[str, Any] | None = None,
    reuse_tracker_size: int | None = None,
    clock: Clock = time.monotonic,
    enable_events: bool = True,
    max_events: int = DEFAULT_MAX_EVENTS,
) -> OffloadManager:
    """Build an ``OffloadManager`` for a pool of ``num_blocks`` slots.

    ``store_threshold >= 2`` turns on the reuse filter (a new key is admitted on its N-th
    offer); ``clock`` is the only time source the manager reads.
    """
    return OffloadManager(
        num_blocks,
        policy,
        policy_params,
        store_threshold,
        reuse_tracker_size=reuse_tracker_size,
        clock=clock,
        enable_events=enable_events,
        max_events=max_events,
    )
