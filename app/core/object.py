"""One namespace's object tier: an S3 bucket below the pool, shared by every node that names it.

``transfer.s3.S3Tier`` moves the bytes (one object per block, its MAC checked on every read).
``ObjectLink`` is the ``object`` tier of the lower-tier contract (``app.core.tier``, registered
here). It is the remote tier's link (``app.core.remote.RemoteLink``) over that store, so it does
what the remote tier does, the same way:

- **Lookups** ask the bucket (one HEAD per key the tiers above lack, bounded by
  ``object_lookup_timeout_s``; late or degraded: "not found"). Node B finds what node A wrote
  with no restart; nothing is rebuilt at a restart beyond what lookups ask.
- **Promotion**: one call brings object-only keys into the pool and on to the engine's cache.
- **Write-behind**: a block that becomes ready in the pool is queued (bounded: the overflow is
  dropped and counted, the pool never waits) and put, held in the pool until its bytes are
  copied out; one the pool evicts before its put is copied out at the eviction (staged, up to
  ``object_staging_bytes``) and put from the copy.
- **Removals**: the blocks it wrote are asked after (``object_sweep_s``); one the bucket keeps
  answering it does not hold (a lifecycle rule, another node's delete) is a ``BlockRemoved``
  event with medium ``OBJECT``.

What it adds: **the bound**. The objects this node wrote are kept in the order they were last
written or found by a lookup; when their bytes pass ``object_bytes`` (a namespace's own with
tenants), the least recently used are deleted from the bucket (in bulk, in the background),
then reported removed. Objects other nodes wrote count against their own bounds; objects left
by a node that is gone (or by this one before a restart) are the bucket's lifecycle rules' to
expire (docs/tiers.md, "Object tier (S3)").
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import operator
import time
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric

from app.core.remote import RemoteLink
from app.core.tier import TierBackend, TierContext, register
from app.settings import Settings, config_error
from app.telemetry.logging import get_logger
from app.telemetry.metrics import PREFIX, TierReport
from manager import BlockKey
from transfer import RemoteTierError
from transfer.s3 import MAC_BYTES, S3Config, S3Tier

log = get_logger("object")

#: The medium of KV events about the object tier.
OBJECT_MEDIUM = "OBJECT"
#: Keys per bulk delete (S3's limit).
DELETE_BATCH = 1000
#: How often deletes held back by a failure are tried again.
DELETE_RETRY_S = 1.0
#: Keys the negative cache remembers at most (the oldest answer goes first).
NEGATIVE_MAX = 65536


class ObjectLink(RemoteLink):
    """The object tier of one namespace's service; see the module docstring."""

    degraded_means = "serves from the pool and the other tiers; blocks in the bucket wait"
    medium = OBJECT_MEDIUM

    def __init__(
        self,
        tier: S3Tier,
        *args: Any,
        capacity_blocks: int,
        negative_s: float = 0.0,
        **kwargs: Any,
    ) -> None:
        """``capacity_blocks``: objects this node keeps in the bucket at most (the bound);
        ``negative_s``: how long a key the bucket answered it does not hold is a miss without
        asking again (0: always ask); the rest as ``RemoteLink``."""
        super().__init__(tier, *args, **kwargs)
        self.negative_s = negative_s
        # Key -> until when (monotonic) the bucket's "not there" stands, oldest answer first.
        self._absent: dict[BlockKey, float] = {}
        self.store = tier
        self.capacity_blocks = capacity_blocks
        # Written by this node, least recently used first: what the bound deletes.
        self.kept: collections.OrderedDict[BlockKey, None] = collections.OrderedDict()
        self._doomed: collections.deque[BlockKey] = collections.deque()
        self._delete_wakeup = asyncio.Event()
        self._deleter: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        super().start()
        self._deleter = asyncio.get_running_loop().create_task(
            self._delete_loop(), name="kvoffload-object-delete"
        )

    async def close(self) -> None:
        if self._deleter is not None:
            self._deleter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._deleter
            self._deleter = None
        await super().close()

    # ------------------------------------------------------------------ the bound

    def _track(self, keys: Sequence[BlockKey]) -> None:
        """Keys just written: most recently used now; past the bound, the least recently used
        are doomed (deleted in the background, then reported removed)."""
        super()._track(keys)
        kept, absent = self.kept, self._absent
        for key in keys:
            absent.pop(key, None)  # this node's own write is there now
            kept[key] = None
            kept.move_to_end(key)
        over = len(kept) - self.capacity_blocks
        if over > 0:
            for _ in range(over):
                key, _ = kept.popitem(last=False)
                self._doomed.append(key)
            self._delete_wakeup.set()

    def _used(self, keys: Sequence[BlockKey]) -> None:
        kept = self.kept
        for key in keys:
            if key in kept:
                kept.move_to_end(key)

    def _removed(self, keys: list[BlockKey]) -> None:
        for key in keys:
            self.kept.pop(key, None)
        super()._removed(keys)

    async def found(self, keys: Sequence[BlockKey], req_id: str | None = None) -> list[bool]:
        """Per key, whether the bucket holds it (``RemoteLink.found``), a key it answered "not
        there" within ``negative_s`` a miss without asking: a lookup of the same missing prefix
        step after step costs one HEAD per key per ``negative_s``, not per step. Another node's
        new object is found at most ``negative_s`` late; this node's own writes at once."""
        # Per key on the loop, in one go: C-level passes where it can (a flood of 8,192-key
        # lookups of another namespace holds the loop, and the GIL, for that long each).
        absent = self._absent
        ask: list[bool] | None = None
        if absent and self.negative_s > 0:
            now = time.monotonic()
            ask = [absent.get(k, 0.0) <= now for k in keys]
            if all(ask):
                ask = None
        if ask is None:
            answer = await super().found(keys, req_id)
        else:
            told = iter(await super().found(list(itertools.compress(keys, ask)), req_id))
            answer = [next(told) if a else False for a in ask]
            self.counts["lookups_cached_absent"] += ask.count(False)
        if self.kept and any(answer):
            self._used(list(itertools.compress(keys, answer)))
        return answer

    def _settle(
        self, keys: list[BlockKey], stamps: list[int | None], answer: Sequence[bool | None]
    ) -> None:
        super()._settle(keys, stamps, answer)
        if self.negative_s <= 0:
            return
        absent, until = self._absent, time.monotonic() + self.negative_s
        # The bucket's own "not there" (None: no answer, nothing learnt).
        for key in itertools.compress(keys, map(operator.is_, answer, itertools.repeat(False))):
            absent.pop(key, None)
            absent[key] = until
        # The oldest answers go, in one pass: ``next(iter(absent))`` per key to drop walks the
        # holes the drops before it left at the front of the dict (milliseconds a lookup, on
        # the loop, once a flood of misses filled it).
        for key in list(itertools.islice(absent, max(0, len(absent) - NEGATIVE_MAX))):
            del absent[key]

    def promote(
        self, keys: Sequence[BlockKey], req_id: str, protect: Sequence[BlockKey] = ()
    ) -> list[asyncio.Task[None]]:
        self._used(keys)
        return super().promote(keys, req_id, protect)

    async def _delete_loop(self) -> None:
        while True:
            if self._doomed:  # held back by a failure: tried again after a while
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(DELETE_RETRY_S):
                        await self._delete_wakeup.wait()
            else:
                await self._delete_wakeup.wait()
            self._delete_wakeup.clear()
            try:
                await self._delete_doomed()
            except Exception:
                log.exception("object tier delete failed; tried again")

    async def _delete_doomed(self) -> None:
        """Delete the doomed objects in bulk, then report them removed; a failed call (or a
        degraded tier) puts its keys back, first in line."""
        while self._doomed and self.store.health().ok:
            batch = [self._doomed.popleft() for _ in range(min(DELETE_BATCH, len(self._doomed)))]
            # A key written again since it was doomed is kept (most recent now).
            batch = [k for k in batch if k not in self.kept]
            if not batch:
                continue
            started = time.perf_counter()
            ok = await asyncio.to_thread(self.store.delete, batch)
            self._observe("delete", started, len(batch), None)
            if not ok:
                self._doomed.extendleft(reversed(batch))
                self.counts["delete_retries"] += 1
                return
            self.counts["deleted"] += len(batch)
            self.written.forget(batch)
            self._removed(batch)

    # ------------------------------------------------------------------ reports

    def state(self) -> dict[str, Any]:
        health = super().state()
        obj = self.store.config
        health["bucket"] = obj.bucket
        health["lookups"]["cached_absent"] = self.counts["lookups_cached_absent"]
        health["lookups"]["negative_cache_s"] = self.negative_s
        health["bound"] = {
            "blocks": len(self.kept),
            "capacity_blocks": self.capacity_blocks,
            "bytes": len(self.kept) * (self.store.block_bytes + MAC_BYTES),
            "deleting": len(self._doomed),
            "deleted": self.counts["deleted"],
            "delete_retries": self.counts["delete_retries"],
        }
        return health

    def report(self) -> TierReport:
        # The remote tier's report, with what a bounded tier knows: its count and capacity.
        return dataclasses.replace(
            super().report(), blocks=len(self.kept), capacity_blocks=self.capacity_blocks
        )

    def metric_families(self) -> Iterator[Metric]:
        return object_families(self.state())


_OBJECT_COUNTERS = {
    "checksum_failures": "Objects read from the object tier whose length or MAC did not match "
    "(refused, never loaded).",
    "deletes": "Objects the object tier deleted to keep under its bound.",
    "delete_failures": "Objects a delete call of the object tier failed for (tried again).",
    "errors": "Object tier calls that failed or answered errors.",
    "timeouts": "Object tier batches not finished within their timeout.",
}


def object_families(state: dict[str, Any]) -> Iterator[Metric]:
    """The object tier's own families (the ones every tier has are ``kvoffload_tier_*``)."""
    counters = state.get("counters", {})
    for name, doc in _OBJECT_COUNTERS.items():
        yield CounterMetricFamily(f"{PREFIX}_object_{name}", doc, value=counters.get(name, 0))


class ObjectBackend(TierBackend):
    """The ``object`` tier backend: on with ``--object-bucket``."""

    position = 30

    def enabled(self, settings: Settings) -> bool:
        return settings.object_bucket is not None

    def open(self, ctx: TierContext) -> ObjectLink:
        s = ctx.settings
        if s.object_bucket is None:
            raise config_error("tiers", "object", "the object tier needs --object-bucket")
        # Every setting checked before the client exists: a refusal leaves no probe running.
        capacity = s.object_bytes // (s.block_bytes + MAC_BYTES)
        if capacity < 1:
            raise config_error(
                "object_bytes",
                s.object_bytes,
                f"holds no object of {s.block_bytes + MAC_BYTES} bytes (a block and its MAC)",
            )
        config = s3_config(s)
        try:
            tier = S3Tier(ctx.pool, object_namespace(s, ctx.storage), config)
        except RemoteTierError as exc:
            raise config_error("object_bucket", s.object_bucket, str(exc)) from None
        return ObjectLink(
            tier,
            ctx.manager,
            lookup_timeout_s=s.object_lookup_timeout_s,
            queue_blocks=s.object_queue_blocks,
            batch_blocks=s.object_batch_blocks,
            hold_s=s.lease_ttl_s,
            sweep_s=s.object_sweep_s,
            # Deletes, not the removal tracking, keep the bound: it tracks up to twice as many
            # (the doomed until their delete lands) and never pushes out a key still kept.
            tracked_blocks=2 * capacity + s.object_batch_blocks,
            removal_confirm_s=s.object_removal_confirm_s,
            on_call=lambda op, sec, n, req: ctx.observer.tier_io(ctx.name, op, sec, n, req),
            name=ctx.name,
            capacity_blocks=capacity,
            negative_s=s.object_negative_cache_s,
            pool=ctx.pool,
            staging_bytes=s.object_staging_bytes,
        )


register("object", ObjectBackend())


def object_namespace(settings: Settings, storage: str) -> str:
    """Where a namespace's objects live in the bucket: ``<prefix>/<storage>/<block bytes>``
    (``app.core.storage``: a namespace given to another tenant starts empty; block sizes never
    mix)."""
    prefix = settings.object_prefix.strip("/")
    tail = f"{storage}/{settings.block_bytes}"
    return f"{prefix}/{tail}" if prefix else tail


def s3_config(settings: Settings) -> S3Config:
    """The store's configuration from the settings (the shared secret read from its file)."""
    s = settings
    assert s.object_bucket is not None
    secret = None
    if s.object_mac_key_file is not None:
        try:
            secret = s.object_mac_key_file.read_bytes().strip()
        except OSError as exc:
            path = s.object_mac_key_file
            raise config_error("object_mac_key_file", path, exc.strerror or str(exc)) from None
        if len(secret) < 16:
            raise config_error(
                "object_mac_key_file", s.object_mac_key_file, "holds fewer than 16 bytes"
            )
    return S3Config(
        bucket=s.object_bucket,
        endpoint=s.object_endpoint,
        region=s.object_region,
        addressing=s.object_addressing,
        verify_tls=s.object_verify_tls,
        timeout_s=s.object_timeout_s,
        concurrency=s.object_concurrency,
        secret=secret,
    )
