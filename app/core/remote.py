"""One namespace's remote tier, as the service uses it: lookups, promotion, write-behind.

The tier itself (``transfer.remote``: ``MooncakeTier`` and any other backend with the same
contract) moves bytes between host pool slots and a store shared by nodes, each call bounded and
run on its own threads. ``RemoteLink``, the ``remote`` tier of the lower-tier contract
(``app.core.tier``, registered here), decides *when*, and keeps the manager right while it does:

- **Lookups** (``found``): only the keys the pool lacks are asked about, in one batch per call,
  off the event loop and for at most ``remote_lookup_timeout_s``; a late or failed answer is
  "not found". Keys the pool holds never wait on the remote tier. Each namespace asks on a
  lane of its own (``LookupLane``: ``LOOKUP_LANE_WIDTH`` calls at once, on its own threads,
  never the loop's shared executor), and the store is given the lookup's remaining time: what
  it has not started by then is never started. So one namespace's flood of misses queues
  behind itself only, and leaves no work behind in the store when its lookups give up.
- **Promotion** (``promote``, from ``prepare-load`` / ``onload`` of keys the pool lacks): slots
  are reserved for the keys as stores pending for the engine's request (``PENDING`` to every
  lookup, held against eviction), one ``get_into`` reads them into the slots, and each key read
  in full becomes ready (then ``HIT``) and is held for that request (``OffloadManager.hold``)
  until the request pins it with its own load (``loaded``) or ``hold_s`` passes, so it is still
  there when the engine comes back for it; a key not read is dropped (``MISS``). Bytes not
  read in full are never made loadable. While a read may still write into its slots (it
  outlived its timeout), their stores stay pending; the request's id is in ``writing()`` so no
  lease expiry frees them under it.
- **Write-behind** (``stored``; ``app.core.remote_writes``): a block that becomes ready in the
  pool (an engine's or a job's completed store) is queued; a background task puts batches of
  up to ``remote_batch_blocks`` with ``put_from``, each block *held* in the pool
  (``OffloadManager.hold``: not evicted, its slot not reused) until the put has let go of its
  slot. The queue is bounded: what does not fit is dropped and counted, never waited for. A
  stored batch is one ``BlockStored`` event with medium ``REMOTE``. A queued block the pool
  evicts before its turn (a burst of stores larger than the pool, exactly when a lower tier
  matters) is *staged*: its bytes are copied out at the eviction, while its slot still holds
  them, and its put sends the copy (``put_bytes``). Staging is bounded in bytes
  (``staging_bytes``) and never makes the pool wait: a block the bound cannot take is dropped
  and counted (``staging_full``).
- **Removals** (``sweep``): the store evicts on its own and tells nobody (nor does a lone
  master that restarts empty), so the node keeps the keys it reported stored (at most
  ``tracked_blocks``, in line: the one asked after longest ago first) and asks the store
  about each of them at least every ``sweep_s``, in slices spread over one-second ticks; a
  lookup's answer about a tracked key counts the same. A key the store has kept answering it
  does not hold (``exists`` False, never an unanswered None) for ``removal_confirm_s`` is a
  ``BlockRemoved`` event with medium ``REMOTE`` and is no longer tracked; one answered held
  meanwhile is not. Why wait: Mooncake answers "not held" for blocks in the segments of nodes
  that have not re-registered with a new HA leader yet (seen for up to a minute after a
  takeover), and a block reported removed that is still there is never reported stored
  again. A key stored again while it was being asked about is not reported (each store
  stamps it). A key pushed out of the bound (the head of the line) is reported removed too
  (counted ``untracked``): the node no longer vouches for it, and a router that believes a
  block gone costs a recompute, one that believes it there costs a wrong route. Nothing is
  swept while the tier is degraded.
- **Faults**: the tier degrades by itself (``health()``) and recovers with its probe; while it
  is degraded, lookups answer "not found" without asking it, promotion starts nothing and
  write-behind drops what it would have put (counted).

All of this runs on the event loop except the tier's calls, which run on threads; manager calls
happen on the loop only.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import math
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from app.core.promotion import Promotions
from app.core.remote_writes import RemoteWrites
from app.core.tier import LowerTier, TierBackend, TierContext, dropped_by_reason, register
from app.settings import Settings, config_error
from app.telemetry.logging import get_logger
from app.telemetry.metrics import PREFIX, TierReport
from manager import REMOTE_MEDIUM, BlockKey, OffloadManager
from transfer import HostPool, RemoteTierError
from transfer.health import TierHealth
from transfer.remote import RemoteTier

log = get_logger("remote")

#: How often a put or get that outlived its timeout is checked for having let go of its slots.
HELD_POLL_S = 0.05
#: The sweep's tick: each tick asks about a slice of the tracked keys.
SWEEP_TICK_S = 1.0
#: The shortest tick, whatever ``sweep_s`` says (no busy loop).
SWEEP_MIN_TICK_S = 0.05
#: Keys per ``exists`` call of the sweep (the master answers 16k keys in about 5 ms).
SWEEP_BATCH = 16384
#: A namespace's lookups asking its store at once (``LookupLane``); more wait, on the loop.
LOOKUP_LANE_WIDTH = 2
#: The share of a lookup's remaining time the store is given: the rest brings its partial
#: answer (the keys answered in time) back before the lookup's own bound ends.
STORE_SHARE = 0.8

T = TypeVar("T")


class LookupLane:
    """One namespace's own way to its store for lookups: at most ``width`` calls running at
    once, on threads of its own, never the loop's default executor (which every namespace,
    and every tier's reads and writes, share). A call that gets no thread before its deadline
    never starts; one that started keeps its thread until it returns, so a namespace whose
    calls outlive their callers only queues its own next ones."""

    def __init__(self, width: int, name: str) -> None:
        self.width = width
        self.running = 0
        self._free = asyncio.Semaphore(width)
        self._threads = concurrent.futures.ThreadPoolExecutor(width, thread_name_prefix=name)

    async def run(self, fn: Callable[[float], T], deadline: float) -> T | None:
        """``fn(seconds left)`` on the lane once a thread is free, if that is before
        ``deadline`` (the loop's clock); None when it did not start by then or the lane is
        closed."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(deadline):
                await self._free.acquire()
        except TimeoutError:
            return None
        left = deadline - loop.time()
        try:
            if left <= 0:
                raise RuntimeError("no time left")
            future = self._threads.submit(fn, left)
        except RuntimeError:  # no time left, or closed
            self._free.release()
            return None
        self.running += 1

        def ended() -> None:
            self.running -= 1
            self._free.release()

        def done(_: concurrent.futures.Future[T]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nothing waits
                loop.call_soon_threadsafe(ended)

        future.add_done_callback(done)
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        """Start nothing more; calls running end within their budgets."""
        self._threads.shutdown(wait=False, cancel_futures=True)


class WrittenKeys:
    """The keys a node reported stored remotely (see "Removals" in the module docstring): in
    line to be asked after (the one asked after longest ago first), each with the stamp of
    its last store, and those the store answered "not held" for, since when. State only: the
    caller asks the store and reports what ``add`` pushes out and ``settle`` finds gone."""

    def __init__(self, capacity: int, confirm_s: float) -> None:
        self.capacity = capacity
        self.confirm_s = confirm_s
        self._line: dict[BlockKey, int] = {}
        self._absent_since: dict[BlockKey, float] = {}  # monotonic
        self._stamps = itertools.count()

    def __len__(self) -> int:
        return len(self._line)

    def __iter__(self) -> Iterator[BlockKey]:
        return iter(self._line)

    @property
    def suspected(self) -> int:
        """Keys answered "not held", not yet for ``confirm_s``."""
        return len(self._absent_since)

    def add(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """Keys just stored: stamped anew, last in line; the keys pushed out of
        ``capacity`` (the head of the line)."""
        line, absent = self._line, self._absent_since
        for key in keys:
            line.pop(key, None)
            absent.pop(key, None)
            line[key] = next(self._stamps)
        dropped = list(itertools.islice(line, max(0, len(line) - self.capacity)))
        for key in dropped:
            del line[key]
            absent.pop(key, None)
        return dropped

    def forget(self, keys: Sequence[BlockKey]) -> None:
        """No longer track ``keys`` (the caller deleted them and reports it)."""
        for key in keys:
            self._line.pop(key, None)
            self._absent_since.pop(key, None)

    def stamps_of(self, keys: Sequence[BlockKey]) -> list[int | None]:
        """Each key's stamp now (None: not tracked), to hand to ``settle`` with the answer."""
        line = self._line
        if not line:
            return [None] * len(keys)
        return list(map(line.get, keys))

    def head(self, share: float) -> list[BlockKey]:
        """The first ``share`` of the line (at least one key when any is tracked)."""
        return list(itertools.islice(self._line, math.ceil(len(self._line) * share)))

    def settle(
        self, keys: Sequence[BlockKey], stamps: Sequence[int | None], answer: Sequence[bool | None]
    ) -> list[BlockKey]:
        """Take the store's answer about keys asked when they had ``stamps``; the keys it
        has answered "not held" for at least ``confirm_s``, no longer tracked. Any other
        goes to the back of the line (asked again a round later, so keys that get no answer
        never hold the others back); a "held" clears the suspicion. A key stored again (or
        no longer tracked) since it was asked about is left alone."""
        line, absent = self._line, self._absent_since
        if not line or stamps.count(None) == len(stamps):  # none of them tracked (when asked)
            return []
        now = time.monotonic()
        gone = []
        for key, stamp, there in zip(keys, stamps, answer, strict=True):
            if stamp is None or line.get(key) != stamp:
                continue
            del line[key]
            if there is False:
                first = absent.setdefault(key, now)
                if now - first >= self.confirm_s:
                    del absent[key]
                    gone.append(key)
                    continue
            elif there:
                absent.pop(key, None)
            line[key] = stamp
        return gone


class RemoteLink(LowerTier):
    """The remote tier of one namespace's service; see the module docstring."""

    degraded_means = "serves from the pool and the other tiers"
    #: The medium of its KV events.
    medium = REMOTE_MEDIUM

    def __init__(
        self,
        tier: RemoteTier,
        manager: OffloadManager,
        *,
        lookup_timeout_s: float,
        queue_blocks: int,
        batch_blocks: int,
        hold_s: float = 60.0,
        sweep_s: float = 10.0,
        tracked_blocks: int = 262144,
        removal_confirm_s: float = 120.0,
        on_call: Callable[[str, float, int, str | None], None] | None = None,
        name: str = "remote",
        pool: HostPool | None = None,
        staging_bytes: int = 0,
    ) -> None:
        """``hold_s``: how long a promoted block waits, held, for its request's load.
        ``sweep_s``: every tracked key is asked about at least this often (0: no sweep; lookups
        still report the removals they see). ``tracked_blocks``: how many stored keys are
        tracked for removal. ``removal_confirm_s``: how long a key must keep being answered
        "not held" before it is reported removed. ``on_call(op, seconds, keys, req_id)``: each
        remote call's latency. ``name``: the name the chain knows it by. ``pool``: the pool the
        manager's slots index, which queued blocks evicted before their put are copied out of,
        up to ``staging_bytes`` at a time (no pool or 0: such blocks are lost, counted
        ``gone_before_put``)."""
        self.name = name
        self.promotions = Promotions(manager, hold_s=hold_s, tier=name)
        self.tier = tier
        self.manager = manager
        self.lookup_timeout_s = lookup_timeout_s
        self._on_call = on_call
        self.counts: collections.Counter[str] = collections.Counter()
        self.writes = RemoteWrites(
            tier,
            manager,
            self.counts,
            name=name,
            queue_blocks=queue_blocks,
            batch_blocks=batch_blocks,
            pool=pool,
            staging_bytes=staging_bytes,
            observe=self._observe,
            written=self._written,
            released=self._until_released,
        )
        self.sweep_s = sweep_s
        self.lookups = LookupLane(LOOKUP_LANE_WIDTH, f"kvoffload-{name}-lookup")
        self.written = WrittenKeys(tracked_blocks, removal_confirm_s)
        self._sweep: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the write-behind task (and the sweep, unless ``sweep_s`` is 0) on the
        running loop."""
        loop = asyncio.get_running_loop()
        self.writes.start()
        if self.sweep_s > 0:
            self._sweep = loop.create_task(self._sweep_loop(), name="kvoffload-remote-sweep")

    async def close(self) -> None:
        """Stop writing behind, wait for promotions in flight, close the tier (it waits for
        its calls still touching the pool)."""
        await self.writes.close()
        if self._sweep is not None:
            self._sweep.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweep
        self._sweep = None
        await self.promotions.close()
        self.lookups.close()
        await asyncio.to_thread(self.tier.close)

    def health(self) -> TierHealth:
        """The store's state and counters (never blocks)."""
        return self.tier.health()

    def state(self) -> dict[str, Any]:
        """What ``/admin/v1/stats`` and ``/readyz`` say about the tier."""
        tier = self.tier.health()
        health = tier.as_dict()
        # The tier counts every exists() answer, the sweep's too: hits and misses here are
        # the lookups' own (what the hit-ratio panels mean).
        health["counters"] = {
            **tier.counters,
            "hits": self.counts["lookup_hits"],
            "misses": self.counts["lookup_misses"],
        }
        health["namespace"] = self.tier.namespace
        dropped = dropped_by_reason(self.counts)
        health["queue"] = {
            **self.writes.state(),
            "dropped": sum(dropped.values()),
            "dropped_by": dropped,
        }
        promoted = self.promotions.counts
        health["promotions"] = {
            "running": self.promotions.in_flight,
            "started": promoted["promoted_keys"],
            "loaded": promoted["promoted_ready"],
            "failed": promoted["promoted_failed"],
        }
        health["lookups"] = {
            "timeouts": self.counts["lookup_timeouts"],
            "skipped_degraded": self.counts["lookups_skipped"],
        }
        health["written"] = self.counts["written"]
        health["tracked"] = {
            "blocks": len(self.written),
            "capacity": self.written.capacity,
            "suspected": self.written.suspected,
            "removed": self.counts["removed"],
            "untracked": self.counts["untracked"],
            "asked": self.counts["sweep_asked"],
            "sweep_s": self.sweep_s,
            "removal_confirm_s": self.written.confirm_s,
        }
        health["write_behind_failed"] = {
            "put": self.counts["put_failed"],
            "gone_before_put": self.counts["gone_before_put"],
        }
        return health

    @property
    def queue_depth(self) -> int:
        return len(self.writes)

    def report(self) -> TierReport:
        counters = self.tier.health().counters
        return TierReport(
            up=self.tier.health().ok,
            queue_depth=len(self.writes),
            demoted=self.counts["written"],
            dropped=dropped_by_reason(self.counts),
            promoted=self.promotions.counts["promoted_ready"],
            bytes_read=counters.get("bytes_read", 0),
            bytes_written=counters.get("bytes_written", 0),
            incidents=counters.get("incidents", 0),
        )

    def metric_families(self) -> Iterator[Metric]:
        return remote_families(self.state())

    # ------------------------------------------------------------------ lookups

    async def found(self, keys: Sequence[BlockKey], req_id: str | None = None) -> list[bool]:
        """Per key, whether the remote tier holds it; False for all when it is degraded, slow
        (past ``lookup_timeout_s``) or failing, and for the keys it did not answer in time.
        Asked on the namespace's lane (``LookupLane``): no thread free before the bound, no
        call."""
        if not keys:
            return []
        if not self.tier.health().ok:
            self.counts["lookups_skipped"] += 1
            return [False] * len(keys)
        started = time.perf_counter()
        asked = list(keys)
        stamps = self.written.stamps_of(asked)
        tier = self.tier

        def ask(left: float) -> list[bool | None]:
            return tier.exists(asked, timeout_s=left * STORE_SHARE)

        deadline = asyncio.get_running_loop().time() + self.lookup_timeout_s
        got: list[bool | None] | None = None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(deadline):
                got = await self.lookups.run(ask, deadline)
        if got is None or (got and all(a is None for a in got)):
            self.counts["lookup_timeouts"] += 1
            return [False] * len(keys)
        answer = got
        self._observe("exists", started, len(keys), req_id)
        self.counts["lookup_hits"] += answer.count(True)
        self.counts["lookup_misses"] += answer.count(False)
        self._settle(list(keys), stamps, answer)
        return list(map(bool, answer))

    # ------------------------------------------------------------------ promotion

    def promote(
        self, keys: Sequence[BlockKey], req_id: str, protect: Sequence[BlockKey] = ()
    ) -> list[asyncio.Task[None]]:
        """Start bringing the keys the pool lacks into it for request ``req_id``
        (``app.core.promotion``) in one read; the task that settles it, none when nothing
        started (the tier is degraded or the pool has no room: the keys stay not ready).
        ``protect``: the load's other keys, not evicted to make room."""
        if not self.tier.health().ok:
            return []
        task = self.promotions.start(keys, req_id, self._read, protect)
        return [] if task is None else [task]

    async def _read(self, keys: list[BlockKey], slots: list[int], req_id: str) -> list[bool]:
        started = time.perf_counter()
        ok = await asyncio.to_thread(self.tier.get_into, keys, slots)
        self._observe("get", started, len(keys), req_id)
        # A get past its timeout may still write into the slots of the keys it failed.
        await self._until_released([s for s, good in zip(slots, ok, strict=True) if not good])
        return ok

    def takes(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key an explicit ``demote`` is about to evict: whether this node has written it
        to the store (tracked in ``written``). A key still queued or being put is not taken:
        the write-behind reads it from its pool slot, so evicting it first would lose it."""
        line = self.written.stamps_of(keys)
        return [stamp is not None for stamp in line]

    # ------------------------------------------------------------------ write-behind

    def evicted(
        self, victims: list[BlockKey], slots: list[int], *, promoting: bool = False
    ) -> None:
        """The pool evicts ``victims``: the queued ones are staged (``RemoteWrites``)."""
        self.writes.evicted(victims, slots, promoting=promoting)

    def stored(self, keys: Sequence[BlockKey]) -> None:
        """Queue blocks that became ready for the tier (``RemoteWrites``)."""
        self.writes.stored(keys)

    def _written(self, keys: list[BlockKey]) -> None:
        """A put stored ``keys``: one event, and they are tracked for removal."""
        self.manager.record_event("stored", keys, self.medium)
        self._track(keys)

    # ------------------------------------------------------------------ removals

    def _track(self, keys: Sequence[BlockKey]) -> None:
        """Track keys just reported stored; those pushed out of the bound are reported
        removed (``untracked``)."""
        dropped = self.written.add(keys)
        if dropped:
            self.counts["untracked"] += len(dropped)
            self._removed(dropped)

    def _settle(
        self, keys: list[BlockKey], stamps: list[int | None], answer: Sequence[bool | None]
    ) -> None:
        """Report what the store's answer about tracked keys shows gone (``WrittenKeys.settle``)."""
        gone = self.written.settle(keys, stamps, answer)
        if gone:
            self._removed(gone)

    def _removed(self, keys: list[BlockKey]) -> None:
        self.counts["removed"] += len(keys)
        self.manager.record_event("removed", keys, self.medium)

    async def sweep(self) -> int:
        """One tick of the sweep: ask the store about the slice of tracked keys due now
        (all of them once per ``sweep_s``), oldest first; the keys asked about."""
        if not self.written or not self.tier.health().ok:
            return 0
        due = self.written.head(min(1.0, self._tick() / self.sweep_s) if self.sweep_s else 1.0)
        for start in range(0, len(due), SWEEP_BATCH):
            keys = due[start : start + SWEEP_BATCH]
            stamps = self.written.stamps_of(keys)
            began = time.perf_counter()
            answer = await asyncio.to_thread(self.tier.exists, keys)
            self._observe("sweep", began, len(keys), None)
            self.counts["sweep_asked"] += len(keys)
            self._settle(keys, stamps, answer)
        return len(due)

    def _tick(self) -> float:
        return max(SWEEP_MIN_TICK_S, min(SWEEP_TICK_S, self.sweep_s))

    async def _sweep_loop(self) -> None:
        tick = self._tick()
        while True:
            await asyncio.sleep(tick)
            try:
                await self.sweep()
            except Exception:
                log.exception("remote sweep failed; it runs again at the next tick")

    # ------------------------------------------------------------------ helpers

    async def _until_released(self, slots: Sequence[int]) -> None:
        """Wait until the tier no longer touches any of ``slots`` (a call past its timeout may
        still read or write them)."""
        if not slots:
            return
        wanted = set(slots)
        while wanted & self.tier.held_slots():
            await asyncio.sleep(HELD_POLL_S)

    def _observe(self, op: str, started: float, keys: int, req_id: str | None) -> None:
        if self._on_call is not None:
            self._on_call(op, time.perf_counter() - started, keys, req_id)


# The remote tier's counters (``transfer.remote.COUNTERS``) exported as counters, by name.
_REMOTE_COUNTERS = {
    "hits": "Keys the remote tier found when asked by a lookup.",
    "misses": "Keys the remote tier did not hold when asked by a lookup.",
    "gets": "Blocks read in full from the remote tier into the pool.",
    "get_failures": "Blocks not read from the remote tier (absent, failed, timed out, skipped).",
    "puts": "Blocks written to the remote tier.",
    "put_failures": "Blocks not written to the remote tier.",
    "errors": "Remote tier calls that failed or answered errors.",
    "timeouts": "Remote tier calls not finished within their timeout.",
    "skipped": "Remote tier calls answered without the store while degraded.",
}

#: Builds a namespace's remote tier: ``(settings, pool, storage identity)`` (``build_tier``).
RemoteFactory = Callable[[Settings, HostPool, str], RemoteTier]


def remote_families(state: dict[str, Any]) -> Iterator[Metric]:
    """The remote tier's own families (the ones every tier has are ``kvoffload_tier_*``)."""
    counters = state.get("counters", {})
    for name, doc in _REMOTE_COUNTERS.items():
        yield CounterMetricFamily(f"{PREFIX}_remote_{name}", doc, value=counters.get(name, 0))
    tracked = state["tracked"]
    yield GaugeMetricFamily(
        f"{PREFIX}_remote_tracked_blocks",
        "Blocks this node wrote to the remote tier and asks after for having been removed.",
        value=tracked["blocks"],
    )
    yield CounterMetricFamily(
        f"{PREFIX}_remote_removed_blocks",
        "Blocks this node wrote to the remote tier and reported removed (REMOTE "
        "BlockRemoved): found gone (evicted, or lost with a master) or no longer tracked.",
        value=tracked["removed"],
    )


class RemoteBackend(TierBackend):
    """The ``remote`` tier backend: on with ``--remote-tier``; ``factory`` builds the store
    client (``build_tier``: Mooncake; tests give another ``transfer.remote.RemoteTier``)."""

    position = 20

    def __init__(self, factory: RemoteFactory | None = None) -> None:
        self.factory = factory

    def enabled(self, settings: Settings) -> bool:
        return settings.remote_tier != "none"

    def open(self, ctx: TierContext) -> RemoteLink:
        s = ctx.settings
        if s.remote_tier == "none":
            raise config_error("tiers", "remote", "the remote tier needs --remote-tier")
        factory = self.factory or build_tier
        try:
            tier = factory(s, ctx.pool, ctx.storage)
        except RemoteTierError as exc:  # its library is missing: the node cannot start so
            raise config_error("remote_tier", s.remote_tier, str(exc)) from None
        return RemoteLink(
            tier,
            ctx.manager,
            lookup_timeout_s=s.remote_lookup_timeout_s,
            queue_blocks=s.remote_queue_blocks,
            batch_blocks=s.remote_batch_blocks,
            hold_s=s.lease_ttl_s,
            sweep_s=s.remote_sweep_s,
            tracked_blocks=s.remote_tracked_blocks,
            removal_confirm_s=s.remote_removal_confirm_s,
            on_call=lambda op, sec, n, req: ctx.observer.tier_io(ctx.name, op, sec, n, req),
            name=ctx.name,
            pool=ctx.pool,
            staging_bytes=s.remote_staging_bytes,
        )


register("remote", RemoteBackend())


def remote_namespace(storage: str, block_bytes: int) -> str:
    """Where a namespace's blocks live in the shared store, ``kvoffload/<storage>/<block_bytes>``:
    its storage identity (``app.core.storage``: ``NAMESPACE@TENANT`` with tenants, the bare
    namespace without) and the block size. Nodes share blocks only under the same identity (the
    same namespace *and* owner: a namespace given to another tenant finds none of the old
    owner's objects, which stay in the store for the nodes that still serve that owner) and the
    same block size; the engine's own key carries its model and layout (e.g. the vLLM tier's
    namespace digest)."""
    return f"kvoffload/{storage}/{block_bytes}"


def build_tier(settings: Settings, pool: HostPool, storage: str) -> RemoteTier:
    """The remote tier ``settings`` name, on ``pool``, for the namespace of storage identity
    ``storage`` (``remote_namespace``; blocking: call it off the loop).

    ``RemoteTierError`` when its library is missing; a store that cannot be reached yet is no
    error (the tier starts degraded and connects when it can).
    """
    from transfer.mooncake import MooncakeConfig, MooncakeTier

    s = settings
    assert s.remote_tier == "mooncake"
    assert s.mooncake_master
    assert s.mooncake_metadata
    config = MooncakeConfig(
        master=s.mooncake_master,
        metadata_url=s.mooncake_metadata,
        local_hostname=s.mooncake_local_hostname or socket.gethostname(),
        protocol=s.mooncake_protocol,
        segment_bytes=s.mooncake_segment_bytes,
        replicas=s.mooncake_replicas,
        rdma_devices=s.mooncake_rdma_devices,
        timeout_s=s.remote_timeout_s,
    )
    return MooncakeTier(pool, remote_namespace(storage, s.block_bytes), config)
