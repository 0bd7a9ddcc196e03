"""S3-FIFO (Yang et al., SOSP 2023): three FIFO queues, quick demotion of one-hit wonders.

New blocks enter a small FIFO ``S`` (``small_ratio`` of the capacity). A block leaving ``S``
that was used while there moves to the main FIFO ``M``; one that was not is dropped and its key
remembered in the ghost FIFO ``G``. A block stored again while its key is in ``G`` goes
straight to ``M``. ``M`` is a CLOCK: a block at its head with a use count above zero loses one
and goes back to the tail. Use counts saturate at 3. Most blocks in a KV trace are used once
(the tail of a conversation that ends), and this evicts them after one short stay in ``S``.

A pinned or protected block met while scanning is passed over in place; all moves made by a
scan that cannot find enough victims are undone, so a failed ``evict`` changes nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from manager.policies.base import CanEvict, EvictionPolicy
from manager.policies.params import ParamSpec
from manager.policies.registry import register_policy

MAX_FREQ = 3


@register_policy
class S3FIFOPolicy(EvictionPolicy):
    """Small FIFO + main CLOCK + ghost FIFO."""

    name = "s3fifo"
    reorders_on_touch = False
    params_spec = (
        # The share of the capacity given to the small FIFO S, the rest being M. Both queues
        # must exist for the algorithm to mean anything: 0 would leave no probation for new
        # blocks and 1 no main queue, so both ends are excluded; inside, any share works
        # (the target is at least one block), and the paper's 0.1 is the default.
        ParamSpec(
            name="small_ratio",
            kind="float",
            default=0.1,
            low=0.0,
            high=1.0,
            low_open=True,
            high_open=True,
            doc="share of the capacity for the small FIFO of new blocks",
        ),
    )

    def __init__(self, capacity: int, params: dict[str, object] | None = None) -> None:
        super().__init__(capacity, params)
        self._small_target = max(1, int(capacity * self.params["small_ratio"]))
        # key -> use count; dict order is FIFO order (oldest first).
        self._small: OrderedDict[bytes, int] = OrderedDict()
        self._main: OrderedDict[bytes, int] = OrderedDict()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, keys: Sequence[bytes]) -> None:
        ghost = self._ghost
        for key in reversed(keys):
            if key in ghost:
                del ghost[key]
                self._main[key] = 0
            else:
                self._small[key] = 0

    def touch(self, keys: Sequence[bytes]) -> None:
        small, main = self._small, self._main
        for key in keys:
            if key in small:
                small[key] = min(small[key] + 1, MAX_FREQ)
            elif key in main:
                main[key] = min(main[key] + 1, MAX_FREQ)

    def request_finished(self, keys: Sequence[bytes]) -> None:
        """File the chain's held keys again at the young end of their queue, tail first.

        A request that stored its chain over several calls would otherwise leave its tail
        younger than its head; use counts are kept, so no use is counted.
        """
        small, main = self._small, self._main
        for key in reversed(keys):
            if key in small:
                small.move_to_end(key)
            elif key in main:
                main.move_to_end(key)

    def remove(self, keys: Sequence[bytes]) -> None:
        small, main = self._small, self._main
        for key in keys:
            if small.pop(key, None) is None:
                main.pop(key, None)

    def evict(self, n: int, can_evict: CanEvict | None = None) -> list[bytes] | None:
        if n <= 0:
            return []
        small, main = self._small, self._main
        undo: list[tuple[str, bytes, int]] = []
        victims: list[bytes] = []
        ghosted: list[bytes] = []
        # A lap of a queue that meets only unevictable blocks moves on to the other queue; a
        # lap of both ends the scan (then every move is undone). Promotions and count
        # decrements are progress, and the step budget bounds pathological scans.
        small_skips = main_skips = 0
        budget = (MAX_FREQ + 2) * (len(small) + len(main)) + n
        while len(victims) < n and budget > 0:
            budget -= 1
            small_ok = bool(small) and small_skips < len(small)
            main_ok = bool(main) and main_skips < len(main)
            if small_ok and (len(small) >= self._small_target or not main_ok):
                key, freq = small.popitem(last=False)
                undo.append(("s", key, freq))
                if can_evict is not None and not can_evict(key):
                    small[key] = freq
                    small_skips += 1
                elif freq > 0:
                    main[key] = freq - 1
                    small_skips = main_skips = 0
                else:
                    victims.append(key)
                    ghosted.append(key)
                    small_skips = 0
            elif main_ok:
                key, freq = main.popitem(last=False)
                undo.append(("m", key, freq))
                if can_evict is not None and not can_evict(key):
                    main[key] = freq
                    main_skips += 1
                elif freq > 0:
                    main[key] = freq - 1
                    main_skips = 0
                else:
                    victims.append(key)
                    main_skips = 0
            else:
                break
        if len(victims) < n:
            self._undo(undo)
            return None
        ghost = self._ghost
        for key in ghosted:
            ghost[key] = None
        while len(ghost) > self.capacity:
            ghost.popitem(last=False)
        return victims

    def _undo(self, undo: list[tuple[str, bytes, int]]) -> None:
        """Put every popped key back where it was, in reverse order of the moves."""
        small, main = self._small, self._main
        for where, key, freq in reversed(undo):
            small.pop(key, None)
            main.pop(key, None)
            queue = small if where == "s" else main
            queue[key] = freq
            queue.move_to_end(key, last=False)

    def coldest_first(self) -> Iterator[bytes]:
        """The exact order of repeated ``evict(1)``: the scan run on copies, nothing changed."""
        small, main = OrderedDict(self._small), OrderedDict(self._main)
        order: list[bytes] = []
        while small or main:
            if small and (len(small) >= self._small_target or not main):
                key, freq = small.popitem(last=False)
                if freq > 0:
                    main[key] = freq - 1
                else:
                    order.append(key)
            else:
                key, freq = main.popitem(last=False)
                if freq > 0:
                    main[key] = freq - 1
                else:
                    order.append(key)
        return iter(order)

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __contains__(self, key: object) -> bool:
        return key in self._small or key in self._main
