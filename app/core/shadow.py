"""Shadow evaluation in the service: ``manager.shadow.ShadowEvaluator`` fed and drained live.

The manager hands every finished request's chain to ``ShadowRunner.observe`` (a chain listener;
the evaluator only hashes the root and queues). ``run`` is a background task that replays
queued chains through one metadata-only manager per policy, never on the request path, within
a CPU budget: every ``interval_s`` it works for at most ``cpu_budget x interval_s`` seconds,
yielding to the event loop about every millisecond, so requests wait at most that long for it.

**Which policies.** ``policies`` (default: every registered policy) plus the active policy, the
control: all projections come from the same sampled requests, so the control's projection next
to the live ratio shows how far the simulation is from reality. When the operator switches to a
policy (name and parameters) that is not simulated already, the evaluation restarts with it
added (``follow``), so the control always is the active policy; ``since_generation`` says when
the current evaluation began. Every policy's projection, the control's included, is exported
(``projections``) once it has enough data (``manager.shadow``: a few hundred sampled requests),
never before: a restart empties it again.

**Overload.** A sample the budget cannot replay piles up in the evaluator's bounded queue, and
past it chains are dropped. Dropping chains at random would break the root sampling (requests
sharing a prefix are in or out together) and bias every projection down, so instead, when a
tick sees new drops, the evaluation restarts at half the sample rate (down to
``MIN_SAMPLE_RATE``), logged; ``sample_rate`` in the report is the rate in force. A restart
costs the warm-up of the simulated pools, nothing else.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from app.telemetry.logging import get_logger
from manager import BlockKey, PolicyInfo, available_policies
from manager.policies import policy_class
from manager.shadow import ShadowEvaluator, ShadowReport

log = get_logger("shadow")
MIN_SAMPLE_RATE = 1 / 1024
_SLICE_S = 0.001  # work between two yields to the event loop


@dataclass(frozen=True, slots=True)
class ShadowState:
    """The evaluation as the admin API shows it."""

    report: ShadowReport
    since_generation: int
    restarts: int


class ShadowRunner:
    """Owns the ``ShadowEvaluator`` of a service; see the module docstring."""

    def __init__(
        self,
        active: PolicyInfo,
        *,
        capacity: int,
        policies: Sequence[str] | None,
        sample_rate: float,
        store_threshold: int,
        window: int,
        max_queue: int,
        cpu_budget: float,
        interval_s: float,
    ) -> None:
        self.capacity = capacity
        self.policies = list(policies) if policies is not None else None
        self.sample_rate = sample_rate
        self.store_threshold = store_threshold
        self.window = window
        self.max_queue = max_queue
        self.cpu_budget = cpu_budget
        self.interval_s = interval_s
        self.restarts = 0
        self._params: dict[str, dict[str, Any]] = {}
        self._since = active.generation
        self._active = active
        self.evaluator = self._build(active)

    def _build(self, active: PolicyInfo) -> ShadowEvaluator:
        names = list(self.policies) if self.policies is not None else available_policies()
        if active.name not in names:
            names.append(active.name)
        self._params = {n: policy_class(n).parse_params({}) for n in names}
        self._params[active.name] = dict(active.params)
        self._since = active.generation
        self._active = active
        self._dropped_seen = 0
        return ShadowEvaluator(
            names,
            self.capacity,
            sample_rate=self.sample_rate,
            store_threshold=self.store_threshold,
            params={active.name: active.params},
            window=self.window,
            max_queue=self.max_queue,
        )

    def observe(self, chain: list[BlockKey]) -> None:
        """The manager's chain listener: queue the chain if sampled (cheap)."""
        self.evaluator.observe(chain)

    def follow(self, active: PolicyInfo) -> None:
        """The active policy changed: restart unless it is simulated with these parameters."""
        self._active = active
        if self._params.get(active.name) == active.params:
            return
        self.evaluator = self._build(active)
        self.restarts += 1
        log.info(
            "shadow evaluation restarted for the new active policy",
            extra={"fields": {"policy": active.name, "generation": active.generation}},
        )

    def drain(self, budget_s: float | None = None) -> int:
        """Replay queued chains, for about ``budget_s`` seconds (all of them when None)."""
        if budget_s is None:
            return self.evaluator.drain()
        done = 0
        deadline = time.perf_counter() + budget_s
        while time.perf_counter() < deadline:
            if not self.evaluator.drain(1):
                break
            done += 1
        return done

    def _adapt(self, dropped_before: int) -> None:
        if self.evaluator.dropped <= dropped_before or self.sample_rate <= MIN_SAMPLE_RATE:
            return
        previous = self.sample_rate
        self.sample_rate = max(MIN_SAMPLE_RATE, previous / 2)
        self.evaluator = self._build(self._active)
        self.restarts += 1
        log.warning(
            "shadow evaluation cannot keep up within its CPU budget; sample rate halved",
            extra={
                "fields": {
                    "from_rate": previous,
                    "to_rate": self.sample_rate,
                    "cpu_budget": self.cpu_budget,
                }
            },
        )

    async def tick(self) -> int:
        """One period's work: replay for at most ``cpu_budget x interval_s`` seconds, yielding
        to the loop between slices, then halve the sample rate if chains were dropped since
        the last tick; the number of chains replayed."""
        done = 0
        budget = self.cpu_budget * self.interval_s
        while budget > 0:
            started = time.perf_counter()
            replayed = self.drain(min(_SLICE_S, budget))
            budget -= time.perf_counter() - started
            done += replayed
            if not replayed:
                break
            await asyncio.sleep(0)
        self._adapt(self._dropped_seen)
        self._dropped_seen = self.evaluator.dropped
        return done

    async def run(self) -> None:
        """The background task: ``tick`` every ``interval_s``."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.tick()
            except Exception:
                log.exception("shadow evaluation failed; retrying")

    def state(self) -> ShadowState:
        """The report, since which policy generation, and how often it restarted."""
        return ShadowState(self.evaluator.report(), self._since, self.restarts)

    def projections(self) -> Mapping[str, float]:
        """Window projection per policy (the active one included) that has enough data."""
        return {r.policy: r.window for r in self.evaluator.report().ratios if r.window is not None}
