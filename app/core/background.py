"""The service's background work while it runs, on its event loop.

- ``CompletionPump``: completes transfer jobs in the manager as they end. The worker thread
  wakes it (``wake``: thread-safe, ``call_soon_threadsafe``) when a job ends; a poll every
  ``PUMP_POLL_S`` is the safety net (a wake-up lost in a race costs at most that long). Each
  round reports the ended jobs to the observer.
- ``LeaseSweeper``: every ``lease_check_interval_s``, releases the leases of requests gone
  silent (``expire``, so a crashed engine cannot leak the pool), ends expired retentions
  (``Control.expire``, in steps as a large engine call runs), forgets KV caches whose lease
  lapsed, lets the service check for a failed transfer backend, and prunes the request-count
  table.

A failed round is logged and the next one runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from app.core.control import Control
from app.core.slices import stepper
from app.core.transfers import Transfers
from app.settings import Settings
from app.telemetry.logging import get_logger
from app.telemetry.observer import Observer, RequestCounts
from app.telemetry.request_ids import safe_req_id
from manager import OffloadManager, ReleasedLeases

log = get_logger("service")

#: The completion pump's poll when nothing wakes it.
PUMP_POLL_S = 0.25


class CompletionPump:
    """See the module docstring. ``transfers()``: the data path, None when not running."""

    def __init__(
        self,
        transfers: Callable[[], Transfers | None],
        observer: Observer,
    ) -> None:
        self._transfers = transfers
        self._observer = observer
        self._wakeup = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def wake(self) -> None:
        """Called by the worker thread when a job ends."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed under us: nothing to wake
            loop.call_soon_threadsafe(self._wakeup.set)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop the pump runs on (set before the worker can wake it)."""
        self._loop = loop

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(PUMP_POLL_S):
                    await self._wakeup.wait()
            self._wakeup.clear()
            try:
                self.report_finished()
            except Exception:
                log.exception("completion pump failed; retrying")

    def report_finished(self) -> None:
        """Complete the jobs that ended and report each to the observer."""
        transfers = self._transfers()
        if transfers is not None:
            for record in transfers.collect():
                self._observer.transfer_done(record)


#: How often housekeeping looks again whether a large call is still between its steps.
UNSUSPENDED_POLL_S = 0.001


async def unsuspended(manager: OffloadManager, patience_s: float) -> None:
    """Wait until no call is suspended between its steps in ``manager``, for at most
    ``patience_s``. Housekeeping that enters the manager meanwhile would settle that call, its
    rest run whole (``manager.suspend``), holding the loop as if it had never been cut into
    steps; a sweep that comes a moment later loses nothing."""
    deadline = time.monotonic() + patience_s
    while manager.suspended and time.monotonic() < deadline:
        await asyncio.sleep(UNSUSPENDED_POLL_S)


class LeaseSweeper:
    """See the module docstring. ``check_fatal()``: the service's look at its backend."""

    def __init__(
        self,
        settings: Settings,
        manager: OffloadManager,
        transfers: Callable[[], Transfers | None],
        check_fatal: Callable[[], None],
        request_counts: RequestCounts | None,
        control: Control | None = None,
    ) -> None:
        self.settings = settings
        self._control = control
        self.manager = manager
        self._transfers = transfers
        self._check_fatal = check_fatal
        self._request_counts = request_counts

    async def run(self) -> None:
        interval = self.settings.lease_check_interval_s
        while True:
            await asyncio.sleep(interval)
            await unsuspended(self.manager, interval)
            try:
                self.expire()
                if self._control is not None:
                    # In steps, as an engine's large call: many large retentions ending at
                    # once are no one long step.
                    await self._control.expire(stepper(self.manager))
                transfers = self._transfers()
                if transfers is not None:
                    transfers.expire_caches()
                self._check_fatal()
                counts = self._request_counts
                if counts is not None and len(counts) > counts.limit // 2:
                    counts.prune(r.req_id for r in self.manager.requests())
            except Exception:
                log.exception("lease sweep failed; retrying")

    def expire(self) -> list[ReleasedLeases]:
        """Release the leases of requests silent for longer than ``lease_ttl_s`` (the slots of
        a store job still running here stay reserved until it ends), end the orphaned
        reservations of aborted stores whose engine has not reported them within
        ``abort_writer_deadline_s`` (a store job running here reports at its end, which its
        ``job_deadline_s`` bounds), and forget requests that hold nothing and have been silent
        for the request idle TTL."""
        s = self.settings
        transfers = self._transfers()
        released = self.manager.expire_requests(
            s.lease_ttl_s,
            s.effective_request_idle_ttl_s,
            writing=set() if transfers is None else transfers.writing(),
            writer_deadline=s.abort_writer_deadline_s,
        )
        for r in released:
            fields: dict[str, object] = {
                "req_id": safe_req_id(r.req_id),
                "pins_released": r.pins_released,
                "stores_dropped": r.stores_dropped,
                "reservations_ended": r.reservations_ended,
            }
            if r.pins_released or r.stores_dropped:
                message = "request leases expired"
                fields["lease_ttl_s"] = s.lease_ttl_s
            else:
                # The engine aborted and never reported these stores: if it still writes into
                # those slots, it overwrites the blocks they are given to next.
                message = "aborted stores not reported within the writer deadline; slots freed"
                fields["abort_writer_deadline_s"] = s.abort_writer_deadline_s
            log.warning(message, extra={"fields": fields})
        return released
