"""The copy thread: bytes between vLLM's primary tier and the mapped host pool, off the scheduler
thread. Each queued ``Copy`` is copied once (runs of rows in one memmove each, on a few threads,
without the GIL) unless its job ended first (deadline, drain): copied or cancelled, never both.
Every copy, done or not, owes the service its completion (``Done``, for the link thread)."""

from __future__ import annotations

import logging
import queue
import threading
import time

from kvoffload_client.block_copy import BlockCopier
from kvoffload_client.vllm.state import M_FAULTS, Copy, Done, Shared

log = logging.getLogger("kvoffload.vllm_tier")


class Copier:
    """The tier's copy thread and its queue (``put``); ``start``, then ``stop`` once."""

    def __init__(self, shared: Shared) -> None:
        self.shared = shared
        self._queue: queue.SimpleQueue[Copy | None] = queue.SimpleQueue()
        self._block_copier = BlockCopier()
        self._thread = threading.Thread(target=self._run, name="kvoffload-tier-copy", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, task: Copy) -> None:
        """Queue a copy (link thread)."""
        self._queue.put(task)

    def stop(self) -> None:
        """Copy what is queued, end the thread, free the copier's threads."""
        self._queue.put(None)
        self._thread.join(timeout=10.0)
        self.close()

    def close(self) -> None:
        self._block_copier.close()

    def _run(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                return
            self._copy(task)

    def _copy(self, task: Copy) -> None:
        shared = self.shared
        transfer = task.transfer
        job = transfer.job
        with shared.job_lock:
            run = not job.ended
            job.copying = run
        success = False
        started = time.perf_counter()
        if run:
            try:
                pool, primary = task.pool.blocks, shared.primary
                if job.load:
                    self._block_copier.copy(primary, task.chunks, pool, task.slots)
                else:
                    self._block_copier.copy(pool, task.slots, primary, task.chunks)
                success = True
            except Exception:
                log.exception("kvoffload tier: copy of job %d failed", job.job_id)
                shared.counters.add(M_FAULTS, "copy")
        seconds = time.perf_counter() - started
        shared.done.append(Done(transfer.req_id, job.load, task.skeys, task.pool.pool_id, success))
        if not run:
            return
        nbytes = len(task.slots) * shared.block_size_bytes
        shared.finish_job(job, success, seconds if success else None, nbytes if success else None)
