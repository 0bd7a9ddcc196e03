"""Fault injection: a worker that wraps a real backend and makes some of its jobs misbehave.

Shipped code, selected by settings (``create_worker(..., faults=FaultSpec(...))`` or
``backend="faulty"``, see ``transfer.backends``), so staging and chaos tests can exercise the
service's failure paths against real copies. ``FaultSpec`` says which faults. Per job, drawn in
submission order from ``random.Random(seed)``:

- with probability ``fail_rate``: the job does not run and finishes ``ok=False`` with reason
  ``"injected failure"`` (after ``delay_s``);
- with probability ``hang_rate``: the job never runs and never completes; it finishes
  ``ok=False`` with reason ``"deadline"`` when its deadline passes, like any stuck copy;
- otherwise it runs on the real backend, ``delay_s`` late, with what is left of its deadline
  (a delay longer than the deadline fails it with ``"deadline"`` without running it).

Validation is the real backend's, so bad jobs still raise at ``submit``. Job ids, results,
``wait`` and ``in_flight`` follow the common contract (``transfer.worker``); results of the real
backend are translated to this worker's ids. ``fatal`` and ``quiesced`` are the real backend's
(a wrapped CUDA worker's sticky error still stops the service), and ``drop_cache`` fails the
cache's jobs still held here (delayed or hanging) as well as those queued in the real backend.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import threading
import time
from collections.abc import Callable

from transfer.worker import CopyPlan, HeldJob, OnFinished, TransferJob, WorkerBase

__all__ = ["INJECTED", "FaultSpec", "FaultyWorker"]

log = logging.getLogger(__name__)

INJECTED = "injected failure"


@dataclasses.dataclass(frozen=True, slots=True)
class FaultSpec:
    """Faults to inject: per job, fail with probability ``fail_rate``, never finish (until its
    deadline) with probability ``hang_rate``; every job starts ``delay_s`` late. ``seed`` makes
    the draw reproducible."""

    fail_rate: float = 0.0
    delay_s: float = 0.0
    hang_rate: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("fail_rate", "hang_rate"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v}")
        if self.fail_rate + self.hang_rate > 1.0:
            raise ValueError(
                f"fail_rate + hang_rate must be <= 1, got {self.fail_rate + self.hang_rate}"
            )
        if not (math.isfinite(self.delay_s) and self.delay_s >= 0.0):
            raise ValueError(f"delay_s must be a finite number >= 0, got {self.delay_s}")


class FaultyWorker(WorkerBase):
    """Fault-injecting wrapper; see the module docstring.

    ``inner_factory`` builds the real backend given the callback it must call on completion.
    """

    backend = "faulty"

    def __init__(
        self,
        inner_factory: Callable[[OnFinished], WorkerBase],
        faults: FaultSpec,
        *,
        on_finished: OnFinished | None = None,
    ) -> None:
        self._inner_ready = False
        inner = inner_factory(self._inner_finished)
        super().__init__(inner.pool, inner.registry, on_finished)
        self.inner = inner
        self.faults = faults
        self._rng = random.Random(faults.seed)
        # job id -> (fate, when to act): fate is "fail", "hang" or "run".
        self._pending: dict[int, tuple[str, float]] = {}
        self._inner_ids: dict[int, int] = {}  # inner job id -> our job id
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvoffload-faults", daemon=True)
        self._thread.start()

    def validate(self, job: TransferJob) -> CopyPlan:
        return self.inner.validate(job)

    @property
    def fatal(self) -> str | None:
        return self.inner.fatal

    @property
    def quiesced(self) -> bool:
        return self.inner.quiesced

    def _unqueue_locked(self, job_ids: set[int]) -> list[int]:
        """Jobs not handed to the real backend yet (delayed or hanging) leave the queue."""
        out = [j for j in self._pending if j in job_ids]
        for j in out:
            del self._pending[j]
        return out

    def drop_cache(self, cache_id: str, reason: str) -> list[int]:
        running = super().drop_cache(cache_id, reason)
        if not running:
            return running
        # Those already handed over: the real backend fails its queued ones (their results
        # come back through ``_drain_inner``) and reports which of them still run.
        still = set(self.inner.drop_cache(cache_id, reason))
        with self._cond:
            ours = {inner: mine for inner, mine in self._inner_ids.items() if mine in running}
            self._cond.notify_all()
        self._drain_inner()
        with self._cond:
            return [ours[i] for i in still if i in ours and ours[i] in self._held]

    def _accept(self, job_id: int, entry: HeldJob) -> None:
        draw = self._rng.random()
        f = self.faults
        if draw < f.fail_rate:
            fate = "fail"
        elif draw < f.fail_rate + f.hang_rate:
            fate = "hang"
        else:
            fate = "run"
        self._pending[job_id] = (fate, entry.submitted + f.delay_s)

    def _inner_finished(self) -> None:
        with self._cond:
            self._inner_ready = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stopping:
                    return
                now = time.monotonic()
                expired: list[int] = []
                failed: list[int] = []
                release: list[tuple[int, HeldJob]] = []
                wake_at = float("inf")
                for job_id, (fate, act_at) in list(self._pending.items()):
                    entry = self._held.get(job_id)
                    if entry is None:
                        del self._pending[job_id]
                        continue
                    if entry.deadline <= now:
                        expired.append(job_id)
                    elif fate != "hang" and act_at <= now:
                        if fate == "fail":
                            failed.append(job_id)
                        else:
                            release.append((job_id, entry))
                    else:
                        nxt = entry.deadline if fate == "hang" else min(entry.deadline, act_at)
                        wake_at = min(wake_at, nxt)
                        continue
                    del self._pending[job_id]
                inner_ready, self._inner_ready = self._inner_ready, False
                if not (expired or failed or release or inner_ready):
                    timeout = None if wake_at == float("inf") else max(0.0, wake_at - now)
                    entry = None  # hold no job while waiting (its plan holds the mappings)
                    self._cond.wait(timeout)
                    continue
            self._finish([(j, False, "deadline") for j in expired])
            self._finish([(j, False, INJECTED) for j in failed])
            for job_id, entry in release:
                self._start(job_id, entry)
            entry = None
            release = []
            self._drain_inner()

    def _start(self, job_id: int, entry: HeldJob) -> None:
        remaining = entry.deadline - time.monotonic()
        if remaining <= 0:
            self._finish([(job_id, False, "deadline")])
            return
        try:
            inner_id = self.inner.submit(dataclasses.replace(entry.job, deadline_s=remaining))
        except Exception as exc:  # e.g. the cache was unregistered while the job was delayed
            self._finish([(job_id, False, f"submit failed: {exc}")])
            return
        with self._cond:
            self._inner_ids[inner_id] = job_id

    def _drain_inner(self) -> None:
        results = self.inner.poll_finished()
        if not results:
            return
        outcomes = []
        with self._cond:
            for r in results:
                job_id = self._inner_ids.pop(r.job_id, None)
                if job_id is None:
                    log.warning("fault injector: result for unknown inner job %d", r.job_id)
                    continue
                outcomes.append((job_id, r.ok, r.reason))
        self._finish(outcomes)

    def _stop(self, timeout: float) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()
        with self._cond:
            never_started = list(self._pending)
            self._pending.clear()
        self._finish((j, False, "shutdown") for j in never_started)
        self.inner.shutdown(timeout)
        self._drain_inner()
