"""What the service reports about its work: manager ops, transfer jobs and HTTP calls.

``Observer`` is the one place that turns work into metrics and log lines:

- **Manager ops** (called by ``Service`` after each manager call, on the request path or from a
  job completion): ``kvoffload_manager_ops_total{op,result}`` and the per-key outcomes in
  ``kvoffload_manager_keys_total{op,result}``, each with the exemplar ``req_id`` of the request
  the op was for (its safe form, ``app.telemetry.request_ids``); the keys are also added to the HTTP
  call's ``CallInfo.keys`` for its log line. A lookup feeds the windowed live prefix hit ratio.
- **Transfer jobs** (``transfer_done``, for each record the job tracker finished): the transfer
  families with the job's ``req_id`` as exemplar, and one log line naming the job's request.
- **HTTP calls** (``on_call``, the ``CallInfo`` hook of both apps): the HTTP families and the
  one canonical log line per call (route, method, status, duration_ms, op, keys, result,
  req_id, request_id; an answer >= 400 adds ``code``, the error code it sent, and ``client``;
  a batch adds ops, ops_failed and req_ids, the engine requests its ops named, up to
  ``BATCH_REQ_IDS`` of them, with ``req_ids_more`` counting the rest). ``client`` is the
  caller's ``host:port`` (``[host]:port`` for IPv6), ``unix`` on the Unix socket: with ``code``
  it ties a refused call (401, 403, 4xx) to its caller. Probe routes (``/livez``, ``/readyz``,
  ``/metrics``) that succeed log at debug, so scrapes and health checks do not flood the log.

Op results: ``ok``; ``refused`` (``prepare_store`` found no evictable room, HTTP 507);
``error`` (the manager raised). Key results per op follow ``deploy/metrics_catalogue.json``:
lookup hit/pending/miss, prepare_store stored/reused/skipped, complete_store
completed/dropped/ignored, prepare_load pinned. ``reused`` counts the offered keys that were not
admitted as new (resident keys, and repeats of a key within one offer).

With metrics off (``metrics=None``) only the log line and ``CallInfo.keys`` remain.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from app.telemetry.calls import CallInfo, add_keys, host_port
from app.telemetry.logging import CallLevel, get_logger, log_call
from app.telemetry.metrics import LiveRequestRow, Metrics
from app.telemetry.request_ids import safe_req_id
from manager import (
    CompleteStoreOutput,
    LookupOutput,
    LookupResult,
    PrepareStoreOutput,
    RequestLeases,
)
from transfer import JobRecord

log = get_logger("transfer")
UNMATCHED_ROUTE = "unmatched"
UNIX_CLIENT = "unix"  # the client of a call on the Unix socket (ASGI gives no address there)
QUIET_ROUTES = frozenset({"/livez", "/readyz", "/metrics"})
BATCH_REQ_IDS = 64
_HIT, _PENDING = LookupResult.HIT, LookupResult.PENDING


_LEVELS: tuple[CallLevel, ...] = ("debug", "info", "warning", "error")


def _outcome(status: int, route: str) -> tuple[str, CallLevel]:
    """The ``result`` and log level a call (or a batch op) answering ``status`` deserves: an
    expected refusal is no server error (507: the documented answer of a full pool, a warning;
    503: unavailable for now, a warning), only other 5xx are errors."""
    if status < 400:
        return "ok", ("debug" if route in QUIET_ROUTES else "info")
    if status < 500:
        return "error", "info"
    if status == 507:
        return "refused", "warning"
    return "error", ("warning" if status == 503 else "error")


class HitRatioWindow:
    """Leading hits over keys looked up, over the last ``size`` lookups (empty ones skipped)."""

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError(f"window size must be positive, got {size}")
        self._recent: deque[tuple[int, int]] = deque(maxlen=size)
        self._hits = 0
        self._keys = 0

    def add(self, hits: int, keys: int) -> None:
        """One lookup: ``hits`` leading hits of ``keys`` keys."""
        if not keys:
            return
        recent = self._recent
        if len(recent) == recent.maxlen:
            old_hits, old_keys = recent[0]
            self._hits -= old_hits
            self._keys -= old_keys
        recent.append((hits, keys))
        self._hits += hits
        self._keys += keys

    def ratio(self) -> float | None:
        """The ratio, or None before the first lookup."""
        return self._hits / self._keys if self._keys else None


class RequestCounts:
    """Blocks loaded and stored per request, for the opt-in live-request table.

    Entries are made as requests load or store and pruned against the requests the manager
    still tracks (``prune``, called at scrape time and by the lease sweeper); past ``limit``
    entries a new one triggers no growth until the next prune (it is simply not counted).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._counts: dict[str, list[int]] = {}

    def add(self, req_id: str, loaded: int = 0, stored: int = 0) -> None:
        """Count ``loaded`` and ``stored`` blocks for ``req_id``."""
        entry = self._counts.get(req_id)
        if entry is None:
            if len(self._counts) >= self.limit:
                return
            entry = self._counts[req_id] = [0, 0]
        entry[0] += loaded
        entry[1] += stored

    def prune(self, live: Iterable[str]) -> None:
        """Forget every request not in ``live``."""
        keep = set(live)
        for req_id in [r for r in self._counts if r not in keep]:
            del self._counts[req_id]

    def rows(self, tracked: list[RequestLeases], limit: int) -> list[LiveRequestRow]:
        """The table: up to ``limit`` tracked requests (oldest first) with their counts."""
        self.prune(r.req_id for r in tracked)
        rows = []
        for lease in tracked[:limit]:
            loaded, stored = self._counts.get(lease.req_id, (0, 0))
            rows.append(
                LiveRequestRow(
                    req_id=safe_req_id(lease.req_id),
                    pinned=sum(lease.pins.values()),
                    pending=len(lease.pending_stores),
                    loaded=loaded,
                    stored=stored,
                )
            )
        return rows

    def __len__(self) -> int:
        return len(self._counts)


class Observer:
    """Metrics and log lines of one service; see the module docstring."""

    def __init__(
        self,
        metrics: Metrics | None,
        *,
        hit_window: int = 1000,
        request_counts: RequestCounts | None = None,
    ) -> None:
        self.metrics = metrics
        self.hit_window = HitRatioWindow(hit_window)
        self.request_counts = request_counts

    # ------------------------------------------------------------------ manager ops

    def op(self, op: str, req_id: str, result: str = "ok") -> None:
        """An op without per-key outcomes (touch, request_start, request_finish, ...)."""
        if self.metrics is not None:
            self.metrics.manager_op(op, result, safe_req_id(req_id))

    def failed(self, op: str, req_id: str) -> None:
        """The manager raised for ``op``."""
        self.op(op, req_id, "error")

    def lookup(self, req_id: str, out: LookupOutput) -> None:
        """A lookup: keys by state, the live prefix window."""
        results = out.results
        n = len(results)
        add_keys(n)
        self.hit_window.add(out.hit_prefix, n)
        if self.metrics is not None:
            if out.hit_prefix == n:
                hits, pending = n, 0
            else:
                hits, pending = results.count(_HIT), results.count(_PENDING)
            self.metrics.manager_op(
                "lookup",
                "ok",
                safe_req_id(req_id),
                {"hit": hits, "pending": pending, "miss": n - hits - pending},
            )

    def prepare_store(self, req_id: str, offered: int, out: PrepareStoreOutput | None) -> None:
        """A store offer of ``offered`` keys: admitted (stored), filtered (skipped), reused;
        ``out`` None: refused for lack of room."""
        add_keys(offered)
        if self.metrics is None:
            return
        if out is None:
            self.metrics.manager_op("prepare_store", "refused", safe_req_id(req_id))
            return
        stored, skipped = len(out.keys_to_store), len(out.skipped_keys)
        self.metrics.manager_op(
            "prepare_store",
            "ok",
            safe_req_id(req_id),
            {"stored": stored, "skipped": skipped, "reused": max(0, offered - stored - skipped)},
        )

    def complete_store(self, req_id: str, out: CompleteStoreOutput) -> None:
        """Stores finished (by the engine, or by a store job's end)."""
        completed = len(out.completed)
        add_keys(completed + len(out.dropped) + len(out.ignored))
        if self.request_counts is not None and completed:
            self.request_counts.add(req_id, stored=completed)
        if self.metrics is not None:
            self.metrics.manager_op(
                "complete_store",
                "ok",
                safe_req_id(req_id),
                {"completed": completed, "dropped": len(out.dropped), "ignored": len(out.ignored)},
            )

    def prepare_load(self, req_id: str, pinned: int) -> None:
        """Keys pinned for a load."""
        add_keys(pinned)
        if self.metrics is not None:
            self.metrics.manager_op("prepare_load", "ok", safe_req_id(req_id), {"pinned": pinned})

    def complete_load(self, req_id: str, keys: int, *, by_engine: bool) -> None:
        """Keys unpinned; an engine's own ``complete_load`` also counts them as loaded (a load
        job's keys are counted by ``transfer_done`` when the job succeeded)."""
        add_keys(keys)
        if by_engine and self.request_counts is not None and keys:
            self.request_counts.add(req_id, loaded=keys)
        if self.metrics is not None:
            self.metrics.manager_op("complete_load", "ok", safe_req_id(req_id))

    # ------------------------------------------------------------------ jobs and policy

    def transfer_done(self, record: JobRecord) -> None:
        """A finished transfer job: metrics with its req_id, and its log line."""
        ok = record.state == "done"
        safe = safe_req_id(record.req_id)
        if self.metrics is not None:
            self.metrics.transfer_done(
                record.direction, ok, record.bytes, record.seconds, record.reason, safe
            )
        if ok and record.direction == "load" and self.request_counts is not None:
            self.request_counts.add(record.req_id, loaded=len(record.keys))
        fields = {
            "req_id": safe,
            "job_id": record.job_id,
            "direction": record.direction,
            "cache_id": record.cache_id,
            "keys": len(record.keys),
            "bytes": record.bytes,
            "duration_ms": round(record.seconds * 1000, 3),
            "state": record.state,
        }
        if ok:
            log.debug("transfer job finished", extra={"fields": fields})
        else:
            log.warning(
                "transfer job failed", extra={"fields": {**fields, "reason": record.reason}}
            )

    def policy_switched(self, from_policy: str, to_policy: str) -> None:
        """One effective live policy switch."""
        if self.metrics is not None:
            self.metrics.policy_switched(from_policy, to_policy)

    def tier_io(self, tier: str, op: str, seconds: float, keys: int, req_id: str | None) -> None:
        """One I/O call of a lower tier (``app.core.tier``)."""
        if self.metrics is not None:
            rid = safe_req_id(req_id) if req_id else None
            self.metrics.tier_io(tier, op, seconds, keys, rid)

    # ------------------------------------------------------------------ HTTP calls

    def on_call(self, info: CallInfo) -> None:
        """The ``CallInfo`` hook: HTTP metrics and the canonical log line."""
        route = info.route or UNMATCHED_ROUTE
        status = info.status
        if self.metrics is not None:
            self.metrics.http_call(route, info.method, status, info.duration_s, info.log_id)
        result, level = _outcome(status, route)
        fields: dict[str, Any] = {
            "route": route,
            "method": info.method,
            "status": status,
            "duration_ms": round(info.duration_s * 1000, 3),
            "op": info.op,
            "keys": info.keys,
            "result": result,
        }
        if status >= 400:
            # A refused call (401, 403, any 4xx or 5xx) is traced to its caller: the code it
            # was sent and the address it came from. Successful lines leave the address out:
            # they name their engine request, and the hot path pays for every field.
            fields["code"] = info.error_code
            client = info.client
            fields["client"] = UNIX_CLIENT if client is None else host_port(*client)
        if info.namespace is not None:
            fields["tenant"] = info.tenant
            fields["namespace"] = info.namespace
        if info.ops is not None:
            fields["ops"] = len(info.ops)
            fields["ops_failed"] = sum(1 for _, s in info.ops if s >= 400)
        if info.op_errors:
            # A batch's refused ops: a count per status and code, and the line at the level
            # of the gravest of them (a 507 op warns as a 507 call would).
            fields["op_errors"] = {f"{st} {code}": n for (st, code), n in info.op_errors.items()}
            worst = max(_LEVELS.index(_outcome(st, route)[1]) for st, _ in info.op_errors)
            level = _LEVELS[max(worst, _LEVELS.index(level))]
        if info.batch_req_ids:
            # The engine requests a batch served (an engine's scheduler step), so each one can
            # be followed in the log; safe forms, at most BATCH_REQ_IDS of them.
            ids = info.batch_req_ids
            fields["req_ids"] = [safe_req_id(r) for r in ids[:BATCH_REQ_IDS]]
            if len(ids) > BATCH_REQ_IDS:
                fields["req_ids_more"] = len(ids) - BATCH_REQ_IDS
        fields["req_id"] = info.log_id
        fields["request_id"] = info.request_id
        log_call(level, fields)
