"""Reading a live ``/metrics`` answer in tests: parsed families, samples, exemplars, and the
check against ``deploy/metrics_catalogue.json`` (shared by the api and e2e tests)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.openmetrics.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

CATALOGUE = Path(__file__).resolve().parents[2] / "deploy" / "metrics_catalogue.json"
OPENMETRICS = "application/openmetrics-text; version=1.0.0"
_SUFFIXES = ("_total", "_created", "_bucket", "_count", "_sum", "_gcount", "_gsum")


@dataclass(frozen=True)
class Exposition:
    """The families of one OpenMetrics answer, by family name (counters without ``_total``)."""

    families: dict[str, tuple[str, list[Sample]]]

    def samples(self, name: str, **labels: str) -> list[Sample]:
        """Samples named ``name`` (``kvoffload_x_total``, ``..._bucket``) whose labels include
        ``labels``."""
        out = []
        for _, samples in self.families.values():
            for sample in samples:
                if sample.name == name and labels.items() <= sample.labels.items():
                    out.append(sample)
        return out

    def value(self, name: str, **labels: str) -> float | None:
        """The value of the one sample that matches, None when none does."""
        found = self.samples(name, **labels)
        assert len(found) <= 1, found
        return found[0].value if found else None

    def exemplar_ids(self, name: str, **labels: str) -> set[str]:
        """The ``req_id`` of every exemplar on the matching samples."""
        return {
            s.exemplar.labels["req_id"]
            for s in self.samples(name, **labels)
            if s.exemplar is not None
        }


def parse(text: str) -> Exposition:
    """Parse an OpenMetrics text answer (it must end with ``# EOF``)."""
    families = {
        family.name: (family.type, list(family.samples))
        for family in text_string_to_metric_families(text)
    }
    return Exposition(families)


def catalogue() -> dict[str, dict[str, Any]]:
    """The catalogue entries by PromQL name."""
    entries = json.loads(CATALOGUE.read_text(encoding="utf-8"))["metrics"]
    return {e["name"]: e for e in entries}


def catalogue_mismatches(exposition: Exposition) -> list[str]:
    """Every way the exposition differs from the catalogue: families missing or extra, types,
    label names, closed label values, and exemplars (empty when they agree)."""
    entries = catalogue()
    problems: list[str] = []
    seen = set()
    for family, (kind, samples) in exposition.families.items():
        name = family + "_total" if kind == "counter" else family
        seen.add(name)
        entry = entries.get(name)
        if entry is None:
            problems.append(f"{name}: exported, not in the catalogue")
            continue
        if kind != entry["type"]:
            problems.append(f"{name}: type {kind}, catalogue {entry['type']}")
        labels = {k for s in samples for k in s.labels if k != "le"}
        if labels != set(entry["labels"]):
            problems.append(f"{name}: labels {sorted(labels)}, catalogue {entry['labels']}")
        closed: dict[str, list[str]] = entry.get("label_values", {})
        for label, allowed in closed.items():
            values = {s.labels[label] for s in samples if label in s.labels}
            if not values <= set(allowed):
                problems.append(f"{name}: {label} values {sorted(values - set(allowed))}")
        by_op: dict[str, list[str]] = entry.get("results_by_op", {})
        for s in samples:
            if by_op and s.labels.get("result") not in by_op.get(s.labels.get("op", ""), []):
                problems.append(f"{name}: {s.labels} not in results_by_op")
        with_exemplar = any(s.exemplar is not None for s in samples)
        wants = "req_id" in entry.get("exemplar_labels", [])
        if with_exemplar != wants:
            problems.append(f"{name}: exemplars {with_exemplar}, catalogue {wants}")
        for s in samples:
            if s.exemplar is not None and set(s.exemplar.labels) != {"req_id"}:
                problems.append(f"{name}: exemplar labels {sorted(s.exemplar.labels)}")
    problems += [
        f"{name}: in the catalogue, not exported"
        for name in set(entries) - seen
        if not entries[name].get("opt_in")  # exported only when a setting turns it on
    ]
    return problems


def base_name(sample_name: str) -> str:
    """The family a sample belongs to (``x_bucket`` -> ``x``)."""
    for suffix in _SUFFIXES:
        if sample_name.endswith(suffix):
            return sample_name[: -len(suffix)]
    return sample_name
