"""Several registries served as one, each one's samples given labels of its own.

With tenants, every namespace's service keeps its metrics in a registry of its own (the same
families, one set per namespace). ``LabelledRegistries`` collects them at scrape time into one
family per name, adding each source's labels (``tenant``, ``namespace``) to its samples, so a
dashboard sums or splits them like any other label. Exemplars and timestamps pass through.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

Sources = Callable[[], Sequence[tuple[Mapping[str, str], CollectorRegistry]]]


class LabelledRegistries(Collector):
    """Collect ``sources()`` (labels, registry) pairs as one set of families."""

    def __init__(self, sources: Sources) -> None:
        self._sources = sources

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for labels, registry in self._sources():
            for metric in registry.collect():
                merged = families.get(metric.name)
                if merged is None:
                    merged = Metric(metric.name, metric.documentation, metric.type, metric.unit)
                    families[metric.name] = merged
                if labels:
                    merged.samples.extend(
                        s._replace(labels={**s.labels, **labels}) for s in metric.samples
                    )
                else:
                    merged.samples.extend(metric.samples)
        yield from families.values()
