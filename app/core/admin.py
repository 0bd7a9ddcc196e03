"""The operator's operations on a service: policy, shadow, stats, leases, cache, log level.

``Admin`` is a room of ``Service`` (``service.admin``): it reads the service's parts and changes
them on an operator's word. Every change that changes something writes one audit line naming
the actor (``app.telemetry.logging.audit``). Nothing here speaks HTTP.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from app.core.shadow import ShadowRunner, ShadowState
from app.core.transfers import Transfers
from app.telemetry import logging as app_logging
from app.telemetry.logging import audit
from app.telemetry.observer import Observer
from app.telemetry.request_ids import safe_req_id
from manager import (
    ManagerStats,
    OffloadManager,
    PolicyInfo,
    PolicySwitch,
    ReleasedLeases,
    RequestLeases,
    ResetCounts,
    available_policies,
)


class Admin:
    """Operator operations on one service; see the module docstring."""

    def __init__(
        self,
        manager: OffloadManager,
        observer: Observer,
        shadow: ShadowRunner | None,
        *,
        transfers: Callable[[], Transfers | None],
        namespace: str,
    ) -> None:
        """``transfers``: the running data path, None when the service is not running;
        ``namespace``: the service's, named in its audit lines."""
        self.namespace = namespace
        self._manager = manager
        self._observer = observer
        self._shadow = shadow
        self._transfers = transfers

    def policy(self) -> tuple[PolicyInfo, list[str]]:
        """The active policy and the names of every policy."""
        return self._manager.policy, available_policies()

    def switch_policy(self, name: str, params: Mapping[str, Any], actor: str) -> PolicySwitch:
        """Switch the eviction policy live; audited when it changed something."""
        switch = self._manager.switch_policy(name, params)
        if switch.changed:
            self._observer.policy_switched(switch.previous.name, switch.current.name)
            if self._shadow is not None:
                self._shadow.follow(switch.current)
            audit(
                "policy.switch",
                actor,
                namespace=self.namespace,
                from_policy=switch.previous.name,
                from_params=switch.previous.params,
                to_policy=switch.current.name,
                to_params=switch.current.params,
                generation=switch.current.generation,
                blocks_migrated=switch.blocks_migrated,
            )
        return switch

    def shadow_state(self) -> ShadowState | None:
        """The shadow evaluation's state (None when it is off)."""
        return None if self._shadow is None else self._shadow.state()

    def live_hit_ratio(self) -> float | None:
        """Leading hits over keys of the recent live lookups (None before the first)."""
        return self._observer.hit_window.ratio()

    def stats(self) -> ManagerStats:
        """The manager's gauges and counters."""
        return self._manager.stats()

    def jobs_running(self) -> tuple[int, float | None]:
        """Number of running transfer jobs and the age of the oldest (None: none running)."""
        transfers = self._transfers()
        return (0, None) if transfers is None else transfers.running()

    def kv_caches(self) -> int:
        """Number of registered device KV caches (0 when not running)."""
        transfers = self._transfers()
        return 0 if transfers is None else len(transfers.caches())

    def requests(self) -> list[RequestLeases]:
        """Every tracked request and its leases."""
        return self._manager.requests()

    def release_request(self, req_id: str, actor: str) -> ReleasedLeases:
        """Force-release a request's leases (its engine is presumed gone); audited.

        If one of its store jobs is still running here, the slots that job writes stay
        reserved until it ends, so no other block can be given a slot under a running copy.
        """
        transfers = self._transfers()
        writing = transfers is not None and req_id in transfers.writing()
        released = self._manager.release_request(req_id, writers_alive=writing)
        audit(
            "request.release",
            actor,
            namespace=self.namespace,
            req_id=safe_req_id(req_id),
            pins_released=released.pins_released,
            stores_dropped=released.stores_dropped,
        )
        return released

    def clear_cache(self, actor: str) -> ResetCounts:
        """Drop every unpinned ready block; audited."""
        counts = self._manager.reset()
        audit(
            "cache.clear",
            actor,
            namespace=self.namespace,
            dropped=counts.dropped,
            kept_pinned=counts.kept_pinned,
            kept_pending=counts.kept_pending,
            kept_retained=counts.kept_retained,
        )
        return counts

    def log_level(self) -> str:
        """The current log level."""
        return app_logging.get_level()

    def set_log_level(self, level: str, actor: str) -> tuple[str, str]:
        """Set the log level of the whole process live; (previous, current). Audited when it
        changed (audit lines are written whatever the level)."""
        previous = app_logging.set_level(level)
        if previous != level:
            audit("log_level.set", actor, from_level=previous, to_level=level)
        return previous, level
