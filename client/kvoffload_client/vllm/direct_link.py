"""The way of ``kvoffload_client.vllm.direct``'s scheduler side to its service: synchronous
``POST /v1/batch`` calls on the calling (scheduler) thread, the ops that wait for the next call
(completions, touches, finishes), the requests the service knows, the pool its answers name,
and the back-off after a fault."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvoffload_client.client import Batch, KVOffloadClient, OpResult
from kvoffload_client.vllm.state import M_CALLS, M_FAULTS

if TYPE_CHECKING:
    from kvoffload_client.vllm.state import Counters

log = logging.getLogger("kvoffload.vllm_direct")


class ServiceLink:
    """Calls to one service (module docstring) through ``client``, at most ``max_ops`` ops a
    call, the first back-off ``retry_interval_s``. ``forget`` is called when an answer names a
    new pool (the service restarted): what the old one held for this engine is gone with it."""

    def __init__(
        self,
        client: KVOffloadClient,
        max_ops: int,
        retry_interval_s: float,
        counters: Counters,
        forget: Callable[[], None],
    ) -> None:
        self.client = client
        self._max_ops = max_ops
        self._retry_interval_s = retry_interval_s
        self._counters = counters
        self._forget = forget
        self.pool_id: str | None = None  # the pool the last answer named
        self._started: set[str] = set()  # requests the service (of ``pool_id``) knows
        self._later: list[tuple[str | None, dict[str, Any]]] = []  # (pool, op): the next call
        self.down_until = 0.0
        self._backoff = retry_interval_s

    def down(self) -> bool:
        """Whether the service is not asked now (back-off after a fault)."""
        return time.monotonic() < self.down_until

    def pending(self) -> bool:
        return bool(self._later)

    def block_bytes(self) -> int | None:
        """The pool's block size (None, a fault counted, when the service does not answer)."""
        try:
            layout = self.client.pool()
        except Exception as exc:
            self.fault("unreachable", exc)
            return None
        self.pool_id = self.client.last_pool_id
        return int(layout.block_bytes)

    def later(self, op: dict[str, Any]) -> None:
        """Send ``op`` (of the current pool) with the next call."""
        self._later.append((self.pool_id, op))

    def start(self, req_id: str, params: Mapping[str, Any] | None) -> None:
        """Start ``req_id`` in the service with the next call, unless it knows it."""
        if req_id not in self._started:
            self.later(Batch().start_request(req_id, params).ops[0])
            self._started.add(req_id)

    def finish(self, req_id: str, abort: bool = False) -> None:
        if req_id in self._started:
            self._started.discard(req_id)
            self.later(Batch().finish_request(req_id, abort=abort).ops[0])

    def call(self, ops: Sequence[dict[str, Any]]) -> list[OpResult] | None:
        """The ops waiting for a call, then ``ops``, in one ``POST /v1/batch`` (several of
        ``max_ops`` ops at most, in order, above that). The answers to ``ops`` in order;
        None on a fault (counted, logged once, backed off) or when the service restarted."""
        waiting = [op for pool, op in self._later if pool == self.pool_id or pool is None]
        self._later.clear()
        sending = [*waiting, *ops]
        step = self._max_ops
        results: list[OpResult] = []
        for first in range(0, len(sending), step):
            batch = Batch()
            batch.ops = sending[first : first + step]
            self._counters.add(M_CALLS, "batch")
            try:
                results.extend(self.client.batch(batch))
            except Exception as exc:
                self.fault("unreachable", exc)
                return None
            self._backoff = self._retry_interval_s
            if self.down_until:
                self.down_until = 0.0
                log.warning("kvoffload direct tier: the service answers again")
            if self._restarted():
                return None
        for res, op in zip(results[: len(waiting)], waiting, strict=True):
            if not res.ok and not (res.status == 404 and op["op"] == "finish_request"):
                self._counters.add(M_FAULTS, f"{op['op']}_{res.status}")
        return results[len(waiting) :]

    def close(self) -> None:
        """Abort every request this engine opened (one last call, unless backing off)."""
        for req_id in sorted(self._started):
            self.finish(req_id, abort=True)
        if self._later and not self.down():
            self.call([])
        self.client.close()

    def fault(self, reason: str, exc: BaseException) -> None:
        """Count a fault, log it once per incident, back off (doubling, up to 16 times
        ``retry_interval_s``)."""
        self._counters.add(M_FAULTS, reason)
        if not self.down_until:
            log.warning(
                "kvoffload direct tier: %s (%s); retrying in %.1f s", reason, exc, self._backoff
            )
        self.down_until = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, 16 * self._retry_interval_s)

    def _restarted(self) -> bool:
        announced = self.client.last_pool_id
        if announced == self.pool_id:
            return False
        restarted = self.pool_id is not None
        self.pool_id = announced
        if restarted:
            self._started.clear()
            self._counters.add(M_FAULTS, "restarted")
            self._forget()
        return restarted
