"""Admission by proven reuse: a new block is stored only on its ``threshold``-th offer.

Most blocks offered for store are never looked up again (the tail of a one-off prompt). The
filter counts offers per key and admits a key once it has been offered ``threshold`` times, so
a block must show reuse before it takes a slot. ``split`` answers without changing anything and
``record`` counts an offer, so a caller that may still refuse the store (``prepare_store``'s
all-or-nothing contract) counts only the offers it goes through with.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from manager.errors import InvalidArgumentError
from manager.spec import BlockKey


class ReuseFilter:
    """Admit a new key only on its ``threshold``-th store offer.

    Offer counts live in a bounded LRU tracker (``max_tracked`` keys, the least recently offered
    forgotten first). A key keeps its count after admission, so a block that proved reuse once
    is admitted again at once if it is evicted and offered anew.
    """

    def __init__(self, threshold: int, max_tracked: int) -> None:
        if threshold < 2:
            raise InvalidArgumentError(f"reuse filter threshold must be >= 2, got {threshold}")
        if max_tracked <= 0:
            raise InvalidArgumentError(f"reuse tracker size must be positive, got {max_tracked}")
        self.threshold = threshold
        self.max_tracked = max_tracked
        self._offers: OrderedDict[BlockKey, int] = OrderedDict()

    def split(self, keys: Sequence[BlockKey]) -> tuple[list[BlockKey], list[BlockKey]]:
        """(admitted, skipped) for an offer of ``keys``, counting this offer; changes nothing."""
        get = self._offers.get
        need = self.threshold - 1
        admitted = [k for k in keys if get(k, 0) >= need]
        if len(admitted) == len(keys):
            return admitted, []
        return admitted, [k for k in keys if get(k, 0) < need]

    def record(self, keys: Sequence[BlockKey]) -> None:
        """Count one offer of each key."""
        offers = self._offers
        for key in keys:
            offers[key] = offers.pop(key, 0) + 1
        while len(offers) > self.max_tracked:
            offers.popitem(last=False)

    def __len__(self) -> int:
        return len(self._offers)

    def offers(self, key: BlockKey) -> int:
        """Offers counted for ``key`` (0 when untracked)."""
        return self._offers.get(key, 0)
