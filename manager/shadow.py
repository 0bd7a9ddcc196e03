"""Shadow evaluation: what hit ratio would each policy reach on the live request stream?

Every finished request's chain (its keys head to tail) is offered to ``ShadowEvaluator.observe``.
A deterministic sample of requests is replayed, with the accounting of ``manager.replay``,
through one metadata-only manager per policy (no bytes exist, only bookkeeping). The
projected prefix hit ratio of each policy is then a fair comparison: all of them, including a
control copy of the active policy, see exactly the same sampled requests.

Sampling keeps memory and CPU bounded. A request is sampled when the hash of its first key
(the root of its prefix tree) falls under ``sample_rate``, so all requests sharing a root are
in or out together and prefix sharing inside the sample is preserved; each shadow pool gets
``sample_rate x capacity`` blocks, as in spatially hashed sampling (SHARDS, FAST'15), since the
sample touches about that fraction of the blocks. Ratios are reported cumulatively and over a
sliding window of the last ``window`` sampled requests (what an operator acts on).

**Not enough data.** Until the window holds ``min_requests`` sampled requests (or the whole
window, when it is smaller), a projection is no number at all (``None``), not a 0.0 read as a
verdict: a few sampled requests mostly meet cold simulated pools and say little. The default,
``MIN_SAMPLED_REQUESTS`` = 400, takes the sampled request as the unit (a request's blocks hit or
miss together, as a prefix) and asks for the sample size at which a proportion is known to
within +-0.05 at 95% confidence whatever its value (1.96**2 x 0.25 / 0.05**2 = 385, rounded
up). Requests that share a root are correlated too, so this is a floor, not a guarantee.

Chains are queued by ``observe`` (cheap, on the request path) and replayed by ``drain``, which
the service calls off the request path with a budget; the queue is bounded and overflow is
counted, never silent.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from manager.core import OffloadManager, create_manager
from manager.errors import InvalidArgumentError
from manager.spec import BlockKey, ReqContext

_HASH_SPACE = 1 << 64
MIN_SAMPLED_REQUESTS = 400


@dataclass(frozen=True, slots=True)
class ShadowRatio:
    """Projected prefix hit ratio of one policy over the sampled requests.

    ``cumulative`` (since the evaluation began) and ``window`` (the recent window) are None
    until the window holds the report's ``min_requests`` sampled requests (not enough data);
    ``window_requests`` is how many it holds.
    """

    policy: str
    cumulative: float | None
    window: float | None
    requests: int
    blocks: int
    window_requests: int


@dataclass(frozen=True, slots=True)
class ShadowReport:
    """All projections plus the sampler's own accounting."""

    sample_rate: float
    shadow_capacity: int
    min_requests: int
    observed: int
    sampled: int
    queued: int
    dropped: int
    ratios: list[ShadowRatio]


class _Shadow:
    """One policy's metadata-only pool and its hit accounting."""

    def __init__(
        self,
        policy: str,
        params: Mapping[str, Any] | None,
        capacity: int,
        store_threshold: int,
        window: int,
    ) -> None:
        self.policy = policy
        self.manager: OffloadManager = create_manager(
            capacity, policy, store_threshold, policy_params=params, enable_events=False
        )
        self.hits = 0
        self.blocks = 0
        self.requests = 0
        self.recent: deque[tuple[int, int]] = deque(maxlen=window)
        self.recent_hits = 0
        self.recent_blocks = 0

    def replay(self, index: int, chain: Sequence[BlockKey]) -> None:
        m = self.manager
        ctx = ReqContext(f"shadow-{index}")
        m.on_new_request(ctx)
        hit = m.lookup(chain, ctx).hit_prefix
        if hit:
            prefix = chain[:hit]
            m.prepare_load(prefix, ctx)
            m.touch(prefix, ctx)
            m.complete_load(prefix, ctx)
        if hit < len(chain):
            out = m.prepare_store(chain[hit:], ctx)
            if out is not None and out.keys_to_store:
                m.complete_store(out.keys_to_store, ctx, True)
        m.on_request_finished(ctx)
        self.hits += hit
        self.blocks += len(chain)
        self.requests += 1
        if len(self.recent) == self.recent.maxlen:
            old_hits, old_blocks = self.recent[0]
            self.recent_hits -= old_hits
            self.recent_blocks -= old_blocks
        self.recent.append((hit, len(chain)))
        self.recent_hits += hit
        self.recent_blocks += len(chain)

    def ratio(self, min_requests: int) -> ShadowRatio:
        """The projection; no ratio before ``min_requests`` (at least 1) are in the window."""
        enough = len(self.recent) >= min_requests
        return ShadowRatio(
            policy=self.policy,
            cumulative=self.hits / self.blocks if enough and self.blocks else None,
            window=self.recent_hits / self.recent_blocks if enough and self.recent_blocks else None,
            requests=self.requests,
            blocks=self.blocks,
            window_requests=len(self.recent),
        )


class ShadowEvaluator:
    """Ghost simulations of several policies over a sample of the live request stream."""

    def __init__(
        self,
        policies: Iterable[str],
        capacity: int,
        *,
        sample_rate: float = 0.125,
        store_threshold: int = 0,
        params: Mapping[str, Mapping[str, Any]] | None = None,
        window: int = 2000,
        max_queue: int = 10_000,
        min_capacity: int = 64,
        min_requests: int = MIN_SAMPLED_REQUESTS,
    ) -> None:
        """``min_requests``: sampled requests the window must hold before a projection is a
        number (capped at ``window``, which can hold no more); see the module docstring."""
        if not 0 < sample_rate <= 1:
            raise InvalidArgumentError(f"sample_rate must be in (0, 1], got {sample_rate}")
        if window <= 0 or max_queue <= 0 or min_requests <= 0:
            raise InvalidArgumentError("window, max_queue and min_requests must be positive")
        names = list(dict.fromkeys(policies))
        if not names:
            raise InvalidArgumentError("shadow evaluation needs at least one policy")
        self.sample_rate = sample_rate
        self.capacity = max(min_capacity, round(capacity * sample_rate))
        self.min_requests = min(min_requests, window)
        self._cutoff = int(sample_rate * _HASH_SPACE)
        params = params or {}
        self._shadows = [
            _Shadow(name, params.get(name), self.capacity, store_threshold, window)
            for name in names
        ]
        self._queue: deque[list[BlockKey]] = deque()
        self._max_queue = max_queue
        self.observed = 0
        self.sampled = 0
        self.dropped = 0

    @property
    def policies(self) -> list[str]:
        return [s.policy for s in self._shadows]

    def sampled_root(self, root: BlockKey) -> bool:
        """Whether requests whose chain starts with ``root`` are in the sample."""
        if self._cutoff >= _HASH_SPACE:
            return True
        digest = hashlib.blake2b(root, digest_size=8).digest()
        return int.from_bytes(digest, "big") < self._cutoff

    def observe(self, chain: Sequence[BlockKey]) -> bool:
        """Queue a finished request's chain if it is sampled; returns whether it was queued.

        When the queue is full the chain is dropped and counted in ``dropped``.
        """
        self.observed += 1
        if not chain or not self.sampled_root(chain[0]):
            return False
        if len(self._queue) >= self._max_queue:
            self.dropped += 1
            return False
        self._queue.append(list(chain))
        return True

    def drain(self, max_requests: int | None = None) -> int:
        """Replay up to ``max_requests`` queued chains (all when None) through every shadow."""
        done = 0
        queue = self._queue
        while queue and (max_requests is None or done < max_requests):
            chain = queue.popleft()
            for shadow in self._shadows:
                shadow.replay(self.sampled, chain)
            self.sampled += 1
            done += 1
        return done

    def report(self) -> ShadowReport:
        """Current projections, one per policy, in the order they were given."""
        return ShadowReport(
            sample_rate=self.sample_rate,
            shadow_capacity=self.capacity,
            min_requests=self.min_requests,
            observed=self.observed,
            sampled=self.sampled,
            queued=len(self._queue),
            dropped=self.dropped,
            ratios=[s.ratio(self.min_requests) for s in self._shadows],
        )
