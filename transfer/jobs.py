"""Wiring for the service: transfer jobs whose end is reported back to the offload manager.

``JobTracker`` submits a job to a ``TransferWorker`` and remembers which keys and request it
moves. ``poll()`` drains the worker's finished jobs and completes each against the sink (the
offload manager, which satisfies ``CompletionSink`` structurally):

- a store calls ``complete_store(keys, ctx, success=ok)``: a failed store's blocks are dropped;
- a load calls ``complete_load(keys, ctx)`` whatever ``ok`` is: the pins taken by
  ``prepare_load`` are always released.

If the worker refuses a job at ``submit`` (bad block, unknown cache, worker shut down), the
tracker completes it against the sink at once the same way (store failed, load unpinned) and
re-raises, so a refused job leaks no pin and no pending store. A sink error at completion (the
request was aborted and its pins already released, say) is logged and does not stop the poll.

Records: ``get(job_id)`` serves running records and the last ``max_finished`` finished ones
(LRU by completion). Records are updated in place by ``poll()``. Job ids are the tracker's own
(mapped to the worker's), so a load can be tracked before its copy starts, and can copy in
parts: ``defer`` makes a running record for a load whose blocks are still being brought into
the pool; ``launch`` copies one part of it (keys the caller has pinned), ``last=True`` on the
final part; ``fail`` ends it. A deferred load is ``done`` when every part copied; a part that
fails (or ``fail``) makes it ``failed``, and it stays ``running`` until the parts already
copying have settled, so nobody is told a load ended while a copy still writes into the
engine's blocks. Its ``bytes`` add up its parts; its ``seconds`` run from ``defer`` to its end.

Not thread-safe by design: the service calls it from its event loop thread only (wake the loop
from the worker's ``on_finished`` callback and call ``poll()`` there).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from manager.spec import BlockKey, ReqContext
from transfer.errors import InvalidJobError
from transfer.worker import JobResult, TransferJob, TransferWorker

__all__ = ["CompletionSink", "JobRecord", "JobTracker"]

log = logging.getLogger(__name__)

JobState = Literal["running", "done", "failed"]


class CompletionSink(Protocol):
    """What the tracker reports to: the offload manager's completion calls."""

    def complete_store(
        self, keys: Sequence[BlockKey], ctx: ReqContext, success: bool
    ) -> object: ...

    def complete_load(self, keys: Sequence[BlockKey], ctx: ReqContext) -> object: ...


@dataclass(slots=True)
class JobRecord:
    """A tracked job. ``submitted_at`` is wall-clock (epoch seconds), for reporting."""

    job_id: int
    req_id: str
    direction: Literal["store", "load"]
    cache_id: str
    keys: list[bytes]
    state: JobState
    bytes: int
    seconds: float
    reason: str | None
    submitted_at: float
    ctx: ReqContext = field(repr=False)
    started: float = field(repr=False, default=0.0)  # monotonic, for ages


@dataclass(slots=True)
class _Parts:
    """A deferred load's copies: how many run, whether the last was launched, why it failed,
    the bytes its finished parts moved."""

    in_flight: int = 0
    last: bool = False
    failed: str | None = None
    bytes: int = 0


class JobTracker:
    """Submits jobs and completes them against a ``CompletionSink``; see the module docstring."""

    def __init__(
        self, worker: TransferWorker, sink: CompletionSink, *, max_finished: int = 10000
    ) -> None:
        if max_finished <= 0:
            raise ValueError(f"max_finished must be positive, got {max_finished}")
        self.worker = worker
        self.sink = sink
        self.max_finished = max_finished
        self._running: dict[int, JobRecord] = {}
        self._finished: OrderedDict[int, JobRecord] = OrderedDict()
        self._ids = itertools.count(1)
        # The worker's job id -> ours and the keys that job moves (a part's, or all of them).
        self._by_worker: dict[int, tuple[int, list[bytes]]] = {}
        self._parts: dict[int, _Parts] = {}  # deferred loads, by our job id
        self._ended: list[JobRecord] = []  # records ended since the last poll
        self.sink_errors = 0

    def submit(
        self,
        direction: Literal["store", "load"],
        ctx: ReqContext,
        cache_id: str,
        keys: Sequence[bytes],
        device_blocks: Sequence[int],
        host_slots: Sequence[int],
        deadline_s: float,
        wait_event: bytes | None = None,
    ) -> JobRecord:
        """Submit one job moving ``keys`` (``keys[i]`` lives in ``host_slots[i]``), its copies
        ordered after ``wait_event`` (a CUDA IPC event handle) when given."""
        keys = list(keys)
        try:
            if direction not in ("store", "load"):
                raise InvalidJobError(f"direction must be 'store' or 'load', got {direction!r}")
            if len(keys) != len(host_slots):
                raise InvalidJobError(
                    f"keys and host_slots differ in length ({len(keys)} != {len(host_slots)})"
                )
            job = TransferJob(
                direction=direction,
                cache_id=cache_id,
                device_blocks=list(device_blocks),
                host_slots=list(host_slots),
                deadline_s=deadline_s,
                req_id=ctx.req_id,
                wait_event=wait_event,
            )
            worker_id = self.worker.submit(job)
        except Exception:
            if direction in ("store", "load"):
                self._complete(direction, keys, ctx, ok=False, job_id=None)
            raise
        job_id = next(self._ids)
        self._by_worker[worker_id] = (job_id, keys)
        record = JobRecord(
            job_id=job_id,
            req_id=ctx.req_id,
            direction=direction,
            cache_id=cache_id,
            keys=keys,
            state="running",
            bytes=0,
            seconds=0.0,
            reason=None,
            submitted_at=time.time(),
            ctx=ctx,
            started=time.monotonic(),
        )
        self._running[job_id] = record
        return record

    def defer(self, ctx: ReqContext, cache_id: str, keys: Sequence[bytes]) -> JobRecord:
        """A running load whose copies start later, in parts (``launch``), or never
        (``fail``): nothing is pinned for it yet."""
        record = JobRecord(
            job_id=next(self._ids),
            req_id=ctx.req_id,
            direction="load",
            cache_id=cache_id,
            keys=list(keys),
            state="running",
            bytes=0,
            seconds=0.0,
            reason=None,
            submitted_at=time.time(),
            ctx=ctx,
            started=time.monotonic(),
        )
        self._running[record.job_id] = record
        self._parts[record.job_id] = _Parts()
        return record

    def launch(
        self,
        record: JobRecord,
        keys: Sequence[bytes],
        device_blocks: Sequence[int],
        host_slots: Sequence[int],
        deadline_s: float,
        wait_event: bytes | None = None,
        *,
        last: bool,
    ) -> bool:
        """Copy one part of a deferred load: ``keys``, which the caller has pinned (in
        ``host_slots``), into ``device_blocks``, after ``wait_event`` when given; ``last``:
        no part follows. False, with the part's keys unpinned, when the load has failed
        already or the copy is refused (which fails the load, its reason saying why)."""
        parts = self._parts.get(record.job_id)
        keys = list(keys)
        if parts is None or parts.failed is not None:
            self._complete("load", keys, record.ctx, ok=False, job_id=record.job_id)
            return False
        parts.last = last
        if not keys:
            self._maybe_end(record, parts)
            return True
        job = TransferJob(
            direction="load",
            cache_id=record.cache_id,
            device_blocks=list(device_blocks),
            host_slots=list(host_slots),
            deadline_s=deadline_s,
            req_id=record.req_id,
            wait_event=wait_event,
        )
        try:
            worker_id = self.worker.submit(job)
        except Exception as exc:
            self._complete("load", keys, record.ctx, ok=False, job_id=record.job_id)
            self.fail(record, f"copy refused: {exc}")
            return False
        self._by_worker[worker_id] = (record.job_id, keys)
        parts.in_flight += 1
        return True

    def fail(self, record: JobRecord, reason: str) -> None:
        """Fail a deferred load: no part is copied after this; it ends once the parts
        already copying have settled (at once when none is)."""
        parts = self._parts.get(record.job_id)
        if parts is None or parts.failed is not None:
            return
        parts.failed = reason
        self._maybe_end(record, parts)

    def failed(self, record: JobRecord) -> bool:
        """Whether a deferred load has failed (or ended): launch no more parts of it."""
        parts = self._parts.get(record.job_id)
        return parts is None or parts.failed is not None

    def _maybe_end(self, record: JobRecord, parts: _Parts) -> None:
        if parts.in_flight or (parts.failed is None and not parts.last):
            return
        del self._parts[record.job_id]
        self._running.pop(record.job_id, None)
        record.state = "done" if parts.failed is None else "failed"
        record.reason = parts.failed
        record.bytes = parts.bytes
        record.seconds = time.monotonic() - record.started
        self._finish(record)
        self._ended.append(record)

    def poll(self) -> list[JobRecord]:
        """Complete every job the worker reports finished; returns the records that ended
        (deferred loads among them, also those failed or ended since the last poll)."""
        for result in self.worker.poll_finished():
            self._settle(result)
        ended, self._ended = self._ended, []
        return ended

    def _settle(self, result: JobResult) -> None:
        job_id, keys = self._by_worker.pop(result.job_id, (None, []))
        record = None if job_id is None else self._running.get(job_id)
        if record is None:
            log.warning("finished transfer job %d is not tracked", result.job_id)
            return
        self._complete(record.direction, keys, record.ctx, result.ok, record.job_id)
        parts = self._parts.get(record.job_id)
        if parts is not None:  # one part of a deferred load
            parts.in_flight -= 1
            parts.bytes += result.bytes
            if not result.ok and parts.failed is None:
                parts.failed = result.reason or "copy failed"
            self._maybe_end(record, parts)
            return
        del self._running[record.job_id]
        record.state = "done" if result.ok else "failed"
        record.bytes = result.bytes
        record.seconds = result.seconds
        record.reason = result.reason
        self._finish(record)
        self._ended.append(record)

    def _finish(self, record: JobRecord) -> None:
        finished = self._finished
        finished[record.job_id] = record
        while len(finished) > self.max_finished:
            finished.popitem(last=False)

    def _complete(
        self,
        direction: str,
        keys: list[bytes],
        ctx: ReqContext,
        ok: bool,
        job_id: int | None,
    ) -> None:
        if not keys:
            return
        try:
            if direction == "store":
                self.sink.complete_store(keys, ctx, success=ok)
            else:
                self.sink.complete_load(keys, ctx)
        except Exception as exc:
            self.sink_errors += 1
            # Neither the req_id nor the error's text (which names it) goes into the log: an
            # engine's id reaches logs only sanitised, and the app logs that form beside the
            # job id, which is enough to correlate.
            log.warning("completing %s job %s failed: %s", direction, job_id, type(exc).__name__)

    def get(self, job_id: int) -> JobRecord | None:
        """The record of a running or recently finished job, else None."""
        record = self._running.get(job_id)
        if record is not None:
            return record
        record = self._finished.get(job_id)
        if record is not None:
            self._finished.move_to_end(job_id)
        return record

    def running(self) -> list[JobRecord]:
        """Running records, oldest first."""
        return list(self._running.values())

    def oldest_running_age(self) -> float:
        """Seconds since the oldest running job was submitted (0.0 when none runs)."""
        if not self._running:
            return 0.0
        oldest = next(iter(self._running.values()))
        return time.monotonic() - oldest.started
