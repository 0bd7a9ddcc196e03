"""CPU transfer backend: plain memory copies on a worker thread.

The device caches are host memory here (shared-memory files of a CPU engine), so every job is
``memmove`` calls between the cache tensors and the pool (``transfer.cpu_copy``). The worker
holds references to the pool and cache tensors while it copies, so no mapping can go away
underneath it.

Jobs run one at a time, loads before stores, each kind in submission order. With
``copy_threads > 1`` the worker thread and its helpers take chunks of a job (a few megabytes
each) from a shared cursor (memory bandwidth scales with a few threads; the default of half
the cores, at most 4, leaves a core to the service on small hosts). torch's intra-op threads
play no part: no torch op runs in the copy loop. A running job checks its deadline (and
shutdown) every few megabytes and stops with ``ok=False`` once it has passed; queued jobs fail
at their deadline without being started, even while another job runs.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from transfer.cpu_copy import CHECK_BYTES, CopyAborted, copy_on_cpu
from transfer.errors import InvalidJobError
from transfer.host_pool import HostPool
from transfer.kv_cache import KVCacheRegistry, RegisteredCache
from transfer.worker import CopyPlan, HeldJob, OnFinished, QueueingWorker

__all__ = ["CpuTransferWorker", "default_copy_threads"]


def default_copy_threads() -> int:
    """Half the cores, between 1 and 4: copies saturate memory bandwidth with a few threads."""
    return max(1, min(4, (os.cpu_count() or 1) // 2))


class CpuTransferWorker(QueueingWorker):
    """The CPU backend; see the module docstring."""

    backend = "cpu"

    def __init__(
        self,
        pool: HostPool,
        registry: KVCacheRegistry,
        *,
        on_finished: OnFinished | None = None,
        copy_threads: int | None = None,
    ) -> None:
        super().__init__(pool, registry, on_finished)
        threads = default_copy_threads() if copy_threads is None else copy_threads
        if type(threads) is not int or threads < 1:
            raise ValueError(f"copy_threads must be a positive integer, got {copy_threads!r}")
        self.copy_threads = threads
        self._pool_tensor = pool.tensor  # keeps the mapping alive while we copy into it
        self._abort = threading.Event()
        self._helpers = (
            ThreadPoolExecutor(threads - 1, thread_name_prefix="kvoffload-cpu-copy")
            if threads > 1
            else None
        )
        self._thread = threading.Thread(
            target=self._run, name="kvoffload-cpu-transfer", daemon=True
        )
        self._thread.start()

    def _check_cache(self, cache: RegisteredCache) -> None:
        devices = cache.devices
        if devices != ["cpu"]:
            raise InvalidJobError(
                f"cache {cache.cache_id} has tensors on {', '.join(devices)}; the cpu transfer "
                "backend copies only host-memory caches"
            )

    # ---------------------------------------------------------------- the worker thread

    def _expire_queued(self) -> None:
        """Fail queued jobs whose deadline passed (called between pieces of a running job)."""
        with self._cond:
            expired = self._expired_locked([*self._loads, *self._stores], time.monotonic())
        if expired:
            self._finish((j, False, "deadline") for j in expired)

    def _run(self) -> None:
        while True:
            expired: list[int] = []
            with self._cond:
                while True:
                    now = time.monotonic()
                    picked = self._pop_locked(now, expired)
                    if picked is not None or expired or self._closed:
                        break
                    nxt = self._next_deadline_locked([*self._loads, *self._stores])
                    self._cond.wait(None if nxt is None else max(0.0, nxt - now))
            if expired:
                self._finish((j, False, "deadline") for j in expired)
            if picked is None:
                if self._closed:
                    return
                continue
            job_id, entry = picked
            ok, reason = self._execute(entry)
            self._finish([(job_id, ok, reason)])
            # Hold no job while waiting: its plan holds the cache's mappings, which must go
            # once a forgotten registration's jobs ended.
            del picked, entry

    def _execute(self, entry: HeldJob) -> tuple[bool, str | None]:
        plan = entry.plan
        n = len(plan.device_blocks)
        if n == 0:
            return True, None
        # Threads take chunks of about CHECK_BYTES from a shared cursor instead of fixed
        # shares, so a thread the OS descheduled (busy host) does not hold the job back.
        step = max(1, CHECK_BYTES // plan.cache.block_bytes)
        starts = iter(range(0, n, step))
        lock = threading.Lock()
        stop = threading.Event()

        def take() -> tuple[int, int] | None:
            with lock:
                begin = next(starts, None)
            return None if begin is None else (begin, min(n, begin + step))

        helpers = min(self.copy_threads - 1, -(-n // step) - 1)
        futures: list[Future[None]] = []
        if self._helpers is not None:
            futures = [
                self._helpers.submit(self._drain, plan, take, entry.deadline, stop, False)
                for _ in range(helpers)
            ]
        errors: list[BaseException] = []
        try:
            self._drain(plan, take, entry.deadline, stop, True)
        except Exception as exc:
            errors.append(exc)
        for f in futures:
            exc2 = f.exception()  # waits: no helper may still be writing when we report
            if exc2 is not None:
                errors.append(exc2)
        if not errors:
            return True, None
        # A real error in one thread makes the others stop with CopyAborted: report the cause.
        cause = next((e for e in errors if not isinstance(e, CopyAborted)), errors[0])
        return False, self._reason(cause)

    def _drain(
        self,
        plan: CopyPlan,
        take: Callable[[], tuple[int, int] | None],
        deadline: float,
        stop: threading.Event,
        leader: bool,
    ) -> None:
        """Copy chunks until none is left; any failure stops the other threads too."""
        worker_abort = self._abort

        def should_stop() -> bool:
            if leader:
                self._expire_queued()
            return stop.is_set() or worker_abort.is_set()

        try:
            while (span := take()) is not None:
                if should_stop() or time.monotonic() > deadline:
                    raise CopyAborted
                copy_on_cpu(
                    plan,
                    self._pool_tensor,
                    begin=span[0],
                    end=span[1],
                    deadline=deadline,
                    abort=should_stop,
                )
        except BaseException:
            stop.set()
            raise

    def _reason(self, exc: BaseException) -> str:
        if isinstance(exc, CopyAborted):
            return "shutdown" if self._abort.is_set() else "deadline"
        return f"copy failed: {type(exc).__name__}: {exc}"

    def _stop(self, timeout: float) -> None:
        with self._cond:
            queued = [*self._loads, *self._stores]
            self._loads.clear()
            self._stores.clear()
        self._finish((j, False, "shutdown") for j in queued)
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._abort.set()  # the running job stops at its next check
            self._thread.join()
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)
