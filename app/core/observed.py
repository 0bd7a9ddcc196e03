"""The offload manager, observed: every request-scoped manager call, with its telemetry.

``ObservedManager`` is the one place where a manager call meets the observer
(``app.telemetry.observer``): it calls the manager, reports a raise as the op's ``error``
result and re-raises it unchanged, and otherwise hands the outcome to the observer (metrics with
the request's id as exemplar, the keys counted for the HTTP call's log line). Its methods take
the manager's own arguments, so it is also the job tracker's ``CompletionSink``: a transfer job
that ends completes through it and is observed like an engine's call.

Two things differ by caller, named by ``by_engine``: an engine's own ``complete_load`` counts
its keys as loaded (a job's keys are counted when the job is reported), and a job's completion
binds the job's ``req_id`` for logging (an engine call has it bound by the HTTP layer already).

``prepare_store`` that finds no room raises ``NoSpaceError`` (after the observer has counted the
refusal), so every caller sees one error type for it. In a tenant's namespace (``quota`` given)
that refusal is the tenant's ``blocks`` quota (``QuotaExceededError``), and a new request or a
load past its ``requests`` or ``pins`` quota is refused before the manager sees it. The tiers
below the pool (``tiers``, ``app.core.lower_tiers``, empty until the service opens them) are
told of every key looked up, loaded or stored (their admission), of every block that becomes
ready (write-behind), of loads that pinned. ``prepare_load`` only pins (or raises);
``load_or_bring_up``, which both an engine's ``prepare-load`` and an ``onload`` job call, pins
what is ready or else sends for the keys the pool lacks down the chain, in order, and says what
is coming (``Bringing``).

Adding a request-scoped manager op: one method here (call, observe), one observer method.

``observed`` and ``observed_await`` are the one way a raise becomes an op's ``error`` in the
core: ``ObservedManager`` and cache control's rooms (``retentions``, ``prefetches``,
``cache_hints``) count through them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Generator, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

from structlog.contextvars import bind_contextvars

from app.core.errors import NoSpaceError, PoolTooSmallError, QuotaExceededError
from app.core.lower_tiers import TierChain
from app.core.quota import TenantQuota
from app.telemetry.observer import Observer
from app.telemetry.request_ids import safe_req_id
from manager import (
    BlockKey,
    CompleteStoreOutput,
    KeyNotReadyError,
    LookupOutput,
    OffloadManager,
    PrepareStoreOutput,
    ReleasedLeases,
    ReqContext,
)

T = TypeVar("T")

#: Keys a step of a large call handles (``*_steps``): about a quarter of a millisecond of the
#: served process's loop (each of its C-level passes over the keys, a part at a time).
STEP_KEYS = 512


def observed(observer: Observer, op: str, req_id: str, call: Callable[..., T], *args: Any) -> T:
    """``call(*args)``; a raise is counted as ``op``'s error of ``req_id`` (``Observer.failed``)
    and re-raised unchanged. Success is the caller's to count (each op says it its own way)."""
    try:
        return call(*args)
    except Exception:
        observer.failed(op, req_id)
        raise


def observed_steps(
    observer: Observer, op: str, req_id: str, steps: Generator[None, None, T]
) -> Generator[None, None, T]:
    """``steps`` run; a raise is counted as ``observed`` counts it, and re-raised unchanged."""
    try:
        return (yield from steps)
    except Exception:
        observer.failed(op, req_id)
        raise


async def observed_await(observer: Observer, op: str, req_id: str, call: Awaitable[T]) -> T:
    """``await call``; a raise is counted as ``observed`` counts it, and re-raised unchanged."""
    try:
        return await call
    except Exception:
        observer.failed(op, req_id)
        raise


class Bringing(NamedTuple):
    """A load that pinned nothing because not every key was ready: the keys the pool lacks
    (``missing``) and those being stored or promoted (``pending``); ``promotions``: what
    brings them (this request's promotions on every tier, and anyone's covering ``pending``);
    ``unreachable``: the missing keys no tier below has taken to bring up."""

    missing: list[BlockKey]
    pending: list[BlockKey]
    promotions: list[asyncio.Task[None]]
    unreachable: list[BlockKey]

    def refusal(self) -> KeyNotReadyError:
        """The error an engine's ``prepare-load`` answers with (409)."""
        return KeyNotReadyError(self.missing, self.pending)


class ObservedManager:
    """Request-scoped manager calls with their telemetry; see the module docstring."""

    def __init__(
        self,
        manager: OffloadManager,
        observer: Observer,
        tiers: TierChain,
        quota: TenantQuota | None = None,
    ) -> None:
        self.manager = manager
        self.observer = observer
        self.tiers = tiers
        self.quota = quota
        #: Called with the keys of every load that pinned them (cache control's prefetches).
        self.load_listeners: list[Callable[[Sequence[BlockKey]], None]] = []

    def _call(self, op: str, req_id: str, call: Callable[..., T], *args: Any) -> T:
        """``call(*args)``; a raise is counted as ``op``'s error and re-raised (``observed``)."""
        return observed(self.observer, op, req_id, call, *args)

    def start_request(self, req_id: str, kv_transfer_params: Mapping[str, Any] | None) -> bool:
        """Start or renew a request; True if it is new."""
        ctx = ReqContext(req_id, kv_transfer_params)
        quota = self.quota
        if quota is not None and req_id not in self.manager.request_ids:
            self._call("request_start", req_id, quota.check_new_request)
        created = self._call("request_start", req_id, self.manager.on_new_request, ctx)
        self.observer.op("request_start", req_id)
        return created

    def finish_request(self, req_id: str, abort: bool) -> ReleasedLeases:
        """Finish a request (abort: release its leases now)."""
        finish = self.manager.on_request_finished
        released = self._call("request_finish", req_id, finish, ReqContext(req_id), abort)
        self.observer.op("request_finish", req_id)
        return released

    def lookup(self, keys: Sequence[BlockKey], ctx: ReqContext) -> LookupOutput:
        """Per-key state and ``hit_prefix``."""
        out = self._call("lookup", ctx.req_id, self.manager.lookup, keys, ctx)
        self.tiers.asked(keys, ctx.req_id)
        self.observer.lookup(ctx.req_id, out)
        return out

    def prepare_load(self, keys: Sequence[BlockKey], ctx: ReqContext) -> list[int]:
        """Pin ready keys; their host slots."""
        if len(keys) > self.manager.num_blocks:
            self._call("prepare_load", ctx.req_id, self._check_fits, keys)
        if self.quota is not None:
            self._call("prepare_load", ctx.req_id, self.quota.check_pins, self.manager, keys)
        self.tiers.asked(keys, ctx.req_id)
        slots = self._call("prepare_load", ctx.req_id, self.manager.prepare_load, keys, ctx)
        self.tiers.loaded(ctx.req_id, keys)
        for listener in self.load_listeners:
            listener(keys)
        self.observer.prepare_load(ctx.req_id, len(slots))
        return slots

    def load_or_bring_up(self, keys: Sequence[BlockKey], ctx: ReqContext) -> list[int] | Bringing:
        """``prepare_load`` when every key is ready: their slots. Otherwise nothing is pinned:
        the keys the pool lacks are sent for down the chain (``promote``, never evicting the
        load's other keys; a lookup then answers pending, then hit), and what is coming is
        returned. Other refusals raise as ``prepare_load``'s do."""
        try:
            return self.prepare_load(keys, ctx)
        except KeyNotReadyError as exc:  # the manager's answer for "not every key is ready"
            missing, pending = exc.missing, exc.pending
        if missing:
            self.promote(missing, ctx.req_id, keys)
        slot_of = self.manager.slot_of
        return Bringing(
            missing,
            pending,
            self.promotions_for(ctx.req_id, pending),
            [k for k in missing if slot_of(k) is None],
        )

    def ready_among(self, keys: Iterable[BlockKey]) -> list[BlockKey]:
        """The ``keys`` ready in the pool now, in order (a read: nothing observed, pinned or
        counted)."""
        is_ready = self.manager.is_ready
        return [k for k in keys if is_ready(k)]

    def _check_fits(self, keys: Sequence[BlockKey]) -> None:
        """``PoolTooSmallError`` for a load of more distinct keys than the pool has slots."""
        distinct = len(set(keys))
        if distinct > self.manager.num_blocks:
            raise PoolTooSmallError(distinct, self.manager.num_blocks)

    def promote(
        self, keys: Sequence[BlockKey], req_id: str, protect: Sequence[BlockKey] = ()
    ) -> list[asyncio.Task[None]]:
        """Start bringing ``keys`` the pool lacks into it for ``req_id`` from the lower tiers,
        in the chain's order; the promotions started (each task ends when its blocks are ready
        or dropped). ``protect``: the load's other keys, never evicted to make room for
        these."""
        return self.tiers.promote(keys, req_id, protect, self.manager)

    def promotions_for(
        self, req_id: str, pending: Sequence[BlockKey] = ()
    ) -> list[asyncio.Task[None]]:
        """The promotions in flight for ``req_id`` on every lower tier, and those (of any
        request, a prefetch) bringing up any of ``pending``."""
        tasks = self.tiers.promotions_for(req_id)
        if pending:
            tasks = list({*tasks, *self.tiers.promotions_covering(pending)})
        return tasks

    def touch(self, keys: Sequence[BlockKey], ctx: ReqContext) -> None:
        """Mark keys recently used."""
        self._call("touch", ctx.req_id, self.manager.touch, keys, ctx)
        self.observer.op("touch", ctx.req_id)

    def touch_steps(self, keys: Sequence[BlockKey], ctx: ReqContext) -> Generator[None, None, None]:
        """``touch`` in steps of ``STEP_KEYS`` (``manager.steps``)."""
        steps = self.manager.touch_steps(keys, ctx, STEP_KEYS)
        yield from observed_steps(self.observer, "touch", ctx.req_id, steps)
        self.observer.op("touch", ctx.req_id)

    def complete_load(
        self, keys: Sequence[BlockKey], ctx: ReqContext, *, by_engine: bool = False
    ) -> None:
        """Unpin keys pinned by ``prepare_load``."""
        if not by_engine:
            bind_contextvars(req_id=safe_req_id(ctx.req_id))
        self._call("complete_load", ctx.req_id, self.manager.complete_load, keys, ctx)
        self.observer.complete_load(ctx.req_id, len(keys), by_engine=by_engine)

    def prepare_store(self, keys: Sequence[BlockKey], ctx: ReqContext) -> PrepareStoreOutput:
        """Reserve slots for the new keys; ``NoSpaceError`` when no room can be made."""
        out = self._call("prepare_store", ctx.req_id, self.manager.prepare_store, keys, ctx)
        return self._prepared(keys, ctx, out)

    def prepare_store_steps(
        self, keys: Sequence[BlockKey], ctx: ReqContext
    ) -> Generator[None, None, PrepareStoreOutput]:
        """``prepare_store`` in steps of ``STEP_KEYS`` (``manager.steps``)."""
        steps = self.manager.prepare_store_steps(keys, ctx, STEP_KEYS)
        out = yield from observed_steps(self.observer, "prepare_store", ctx.req_id, steps)
        return self._prepared(keys, ctx, out)

    def _prepared(
        self, keys: Sequence[BlockKey], ctx: ReqContext, out: PrepareStoreOutput | None
    ) -> PrepareStoreOutput:
        self.tiers.asked(keys, ctx.req_id)
        self.observer.prepare_store(ctx.req_id, len(keys), out)
        if out is None:
            why = self._held_room()
            if self.quota is not None:
                limit = self.manager.num_blocks
                detail = f"no evictable room for {len(keys)} block(s) in this namespace ({why})"
                raise QuotaExceededError(self.quota.tenant, "blocks", limit, detail)
            raise NoSpaceError(len(keys), why)
        return out

    def _held_room(self) -> str:
        """What holds the pool when a store finds no room: its blocks that are not evictable."""
        st = self.manager.stats()
        return (
            f"of {st.num_blocks} blocks, {st.pinned} pinned, {st.retained_ready} retained, "
            f"{st.pending} pending, {st.ready - st.pinned - st.retained_ready} evictable"
        )

    def complete_store(
        self,
        keys: Sequence[BlockKey],
        ctx: ReqContext,
        success: bool = True,
        *,
        by_engine: bool = False,
    ) -> CompleteStoreOutput:
        """Finish this request's stores of ``keys``."""
        if not by_engine:
            bind_contextvars(req_id=safe_req_id(ctx.req_id))
        complete = self.manager.complete_store
        out = self._call("complete_store", ctx.req_id, complete, keys, ctx, success)
        return self._completed(ctx, out)

    def complete_store_steps(
        self, keys: Sequence[BlockKey], ctx: ReqContext, success: bool
    ) -> Generator[None, None, CompleteStoreOutput]:
        """An engine's ``complete_store`` in steps of ``STEP_KEYS`` (``manager.steps``)."""
        steps = self.manager.complete_store_steps(keys, ctx, success, STEP_KEYS)
        out = yield from observed_steps(self.observer, "complete_store", ctx.req_id, steps)
        return self._completed(ctx, out)

    def _completed(self, ctx: ReqContext, out: CompleteStoreOutput) -> CompleteStoreOutput:
        self.observer.complete_store(ctx.req_id, out)
        if out.completed:
            self.tiers.stored(out.completed)
        return out
