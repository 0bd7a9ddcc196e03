"""A tenant's quotas, held across the namespaces it owns.

A tenant's namespaces are separate spaces (each its own ``Service``, manager and host pool), so
its block quota is the sum of their pools and holds by construction. ``TenantQuota`` holds the
two that cut across them: ``max_pins`` (distinct blocks pinned for loads, summed over its
namespaces: a block pinned by two of its requests is one) and ``max_requests`` (requests
tracked, live or finished with leases). Checks run before the manager call, so a refused call
changes nothing; they read counters the managers keep anyway, plus one set difference over the
call's keys for ``max_pins``, and a refusal is a ``QuotaExceededError`` naming the quota.
"""

from __future__ import annotations

from collections.abc import Sequence

from app.core.errors import QuotaExceededError
from manager import BlockKey, OffloadManager


class TenantQuota:
    """The pin and request quotas of tenant ``tenant``; ``None`` means no limit.

    ``members`` are the managers of the tenant's namespaces (the tenancy adds and removes them
    as namespaces come and go). The limits can be changed in place (a reload of the tenants
    file); they apply from the next call on.
    """

    def __init__(self, tenant: str, max_pins: int | None, max_requests: int | None) -> None:
        self.tenant = tenant
        self.max_pins = max_pins
        self.max_requests = max_requests
        self.members: list[OffloadManager] = []

    def pins(self) -> int:
        """Distinct blocks pinned now, over the tenant's namespaces."""
        return sum(m.num_pinned for m in self.members)

    def requests(self) -> int:
        """Requests tracked now, over the tenant's namespaces."""
        return sum(m.num_requests for m in self.members)

    def check_pins(self, manager: OffloadManager, keys: Sequence[BlockKey]) -> None:
        """Refuse a load of ``keys`` in ``manager`` (one of ``members``) that would take the
        distinct blocks pinned past ``max_pins``.

        Only blocks no request of that namespace pins yet count (``new_pins``): a block another
        request already pins, of this tenant or of the same request, is one block, as
        ``pins`` counts it, so loading it again never counts against the quota.
        """
        limit = self.max_pins
        if limit is not None and keys:
            adding = manager.new_pins(keys)
            if not adding:
                return
            held = self.pins()
            if held + adding > limit:
                detail = f"{held} blocks pinned, this load would pin {adding} more"
                raise QuotaExceededError(self.tenant, "pins", limit, detail)

    def check_new_request(self) -> None:
        """Refuse one more tracked request past ``max_requests``."""
        limit = self.max_requests
        if limit is not None:
            held = self.requests()
            if held >= limit:
                detail = f"{held} requests tracked; finish some first"
                raise QuotaExceededError(self.tenant, "requests", limit, detail)
