"""The offload manager's requests and their leases.

A request's pins and pending stores are leases it owns; this room starts and ends requests,
expires silent ones, ends overdue reservations and forgets a record (reordering its chain). See
``manager.core`` for the contract.
"""

from __future__ import annotations

from collections.abc import Collection, Container

from manager.errors import InvalidArgumentError, UnknownRequestError
from manager.slots import PoolState, RequestRecord
from manager.spec import ReleasedLeases, ReqContext, RequestLeases


class RequestsRoom(PoolState):
    """The request lifecycle and its leases: start, finish, expire, release, forget."""

    def on_new_request(self, ctx: ReqContext) -> bool:
        """Start (or renew) request ``ctx.req_id``; returns True if it was new.

        Idempotent: announcing a live request again renews its leases and updates its
        ``kv_transfer_params``. A finished request that still holds leases cannot be restarted.
        """
        req_id = ctx.req_id
        if type(req_id) is not str or not req_id:
            raise InvalidArgumentError(f"req_id must be a non-empty string, got {req_id!r}")
        req = self._requests.get(req_id)
        now = self._clock()
        if req is None:
            self._requests[req_id] = RequestRecord(ctx, now)
            return True
        if req.finished:
            raise InvalidArgumentError(
                f"request {req_id!r} has finished and still holds leases; use a new req_id"
            )
        req.kv_transfer_params = ctx.kv_transfer_params
        req.renewed_at = now
        return False

    def on_request_finished(self, ctx: ReqContext, abort: bool = False) -> ReleasedLeases:
        """End request ``ctx.req_id``.

        Normal finish: pins and pending stores stay valid until their ``complete_*`` calls (the
        record is dropped once it holds nothing). Abort: every pin is released and every pending
        store dropped from the index at once; see the module docstring for their slots. Finishing
        a finished request again is a no-op, except that ``abort=True`` still aborts it.
        """
        req = self._requests.get(ctx.req_id)
        if req is None:
            raise UnknownRequestError(ctx.req_id)
        req.renewed_at = self._clock()
        req.finished = True
        released = ReleasedLeases(ctx.req_id, 0, 0)
        if abort:
            released = self._release(req, writers_alive=True)
        if not req.holds_leases():
            self._forget(req)
        return released

    def expire_requests(
        self,
        lease_ttl: float,
        idle_ttl: float | None = None,
        *,
        writing: Container[str] = (),
        writer_deadline: float | None = None,
    ) -> list[ReleasedLeases]:
        """Force-release requests that have been silent too long, and end overdue reservations.

        A request holding leases (pins, pending stores, reserved slots) and silent for more than
        ``lease_ttl`` seconds loses them: its engine is presumed gone, so its slots are freed at
        once and it is forgotten, unless its id is in ``writing`` (a copy the caller runs may
        still be writing its stores): then, as after an abort, those slots stay reserved until
        the copy reports through ``complete_store``.

        With ``writer_deadline``, the reserved slots of a request's dropped stores (after an
        abort, a release or an expiry with writers alive) are freed once ``writer_deadline``
        seconds have passed since the drop, unless its id is in ``writing``: a writer that
        has not reported by then is presumed gone (counted in ``reservations_expired``). The
        request is forgotten with them, so a late ``complete_store`` from it raises
        ``UnknownRequestError`` and changes nothing, whatever became of those slots.

        With ``idle_ttl``, requests holding nothing and silent for longer are forgotten too.
        Every call a request makes renews it. Returns what was released, one entry per request
        that held leases or reserved slots.
        """
        now = self._clock()
        out: list[ReleasedLeases] = []
        for req in list(self._requests.values()):
            alive = req.req_id in writing
            if (
                req.reserved
                and writer_deadline is not None
                and now - req.reserved_at > writer_deadline
                and not alive
            ):
                # A drop released the request's pins and pending stores; only these remain.
                out.append(ReleasedLeases(req.req_id, 0, 0, self._end_reservations(req)))
                if not req.holds_leases():
                    self._forget(req)
                continue
            idle = now - req.renewed_at
            if req.holds_leases():
                if idle <= lease_ttl:
                    continue
                if alive and not req.pins and not req.pending:
                    continue  # only reserved slots under a running copy: wait for its report
                req.finished = True
                out.append(self._release(req, writers_alive=alive))
                self._forced_lease_releases += 1
                if not req.holds_leases():
                    self._forget(req)
            elif idle_ttl is not None and idle > idle_ttl:
                self._forget(req)
        return out

    def release_request(self, req_id: str, *, writers_alive: bool = False) -> ReleasedLeases:
        """Operator action: release every lease of ``req_id`` now and end the request.

        Pins are released and pending stores dropped from the index at once. With
        ``writers_alive=False`` (the engine is gone) their slots are freed and the request is
        forgotten, like a lease expiry. With ``writers_alive=True`` (a copy may still be writing,
        e.g. a transfer job the service itself runs) the slots stay reserved, as after an abort,
        until ``complete_store`` from that request reports them; the request is forgotten then.
        """
        req = self._requests.get(req_id)
        if req is None:
            raise UnknownRequestError(req_id)
        req.finished = True
        released = self._release(req, writers_alive=writers_alive)
        self._forced_lease_releases += 1
        if not req.holds_leases():
            self._forget(req)
        return released

    def _live(self, ctx: ReqContext) -> RequestRecord:
        req = self._requests.get(ctx.req_id)
        if req is None or req.finished:
            raise UnknownRequestError(ctx.req_id)
        req.renewed_at = self._clock()
        return req

    def _any(self, ctx: ReqContext) -> RequestRecord:
        """The request, live or finished-with-leases (``complete_*`` may follow a finish)."""
        req = self._requests.get(ctx.req_id)
        if req is None:
            raise UnknownRequestError(ctx.req_id)
        req.renewed_at = self._clock()
        return req

    def _release(self, req: RequestRecord, *, writers_alive: bool) -> ReleasedLeases:
        refs = self._refs
        pins = 0
        for key, count in req.pins.items():
            left = refs[key] - count
            pins += count
            if left:
                refs[key] = left
            else:
                del refs[key]
        req.pins.clear()
        dropped = list(req.pending)
        self._pending.difference_update(dropped)
        slots = list(map(self._slot.pop, dropped))
        req.pending.clear()
        self._stores_failed += len(dropped)
        ended = 0
        if writers_alive:
            if dropped:
                req.reserved.update(zip(dropped, slots, strict=True))
                self._num_reserved += len(dropped)
                # The writer deadline runs from the latest drop: later slots get their full time.
                req.reserved_at = self._clock()
        else:
            self._push_free(slots)
            if req.reserved:
                ended = self._end_reservations(req)
        return ReleasedLeases(req.req_id, pins, len(dropped), ended)

    def _end_reservations(self, req: RequestRecord) -> int:
        """Free the reserved slots of ``req``'s dropped stores without their writer's report
        (counted in ``reservations_expired``); how many there were."""
        ended = len(req.reserved)
        self._push_free(list(req.reserved.values()))
        self._num_reserved -= ended
        self._reservations_expired += ended
        req.reserved.clear()
        return ended

    def _forget(self, req: RequestRecord) -> None:
        """Drop a request record; reorder its blocks tail-before-head if it used several calls."""
        self._requests.pop(req.req_id, None)
        reorder = req.orderings > 1 or self._policy.wants_request_chains
        if reorder or self._chain_listeners:
            chain = list(req.keys)
            if reorder:
                self._policy.request_finished(chain)
            for listener in self._chain_listeners:
                listener(chain)

    def requests(self) -> list[RequestLeases]:
        """Every request the manager tracks (live, or finished with leases), with its leases."""
        now = self._clock()
        return [
            RequestLeases(
                req_id=r.req_id,
                pins=dict(r.pins),
                pending_stores=sorted(r.pending) + sorted(r.reserved),
                idle_seconds=max(0.0, now - r.renewed_at),
                reserved_stores=sorted(r.reserved),
                reserved_seconds=max(0.0, now - r.reserved_at) if r.reserved else None,
            )
            for r in self._requests.values()
        ]

    @property
    def request_ids(self) -> Collection[str]:
        """The ids of the tracked requests (a live view: do not keep it across calls)."""
        return self._requests.keys()

    @property
    def num_requests(self) -> int:
        """How many requests are tracked: live, or finished and still holding leases."""
        return len(self._requests)
