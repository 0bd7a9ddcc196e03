"""Shared paths and loaders for the deploy/ tests."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from tests.deploy.promql import Analysis, analyse, analyse_variable_query

# PyYAML ships without type stubs (types-PyYAML is not a dependency): import it untyped.
yaml: Any = importlib.import_module("yaml")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CATALOGUE = DEPLOY / "metrics_catalogue.json"
RULES = DEPLOY / "prometheus" / "rules" / "kvoffload.rules.yml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
PROMTOOL_TESTS = DEPLOY / "prometheus" / "tests"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "kvoffload.json"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "kvoffload.yml"
DASHBOARD_PROVIDER = DEPLOY / "grafana" / "provisioning" / "dashboards" / "kvoffload.yml"
COMPOSE = DEPLOY / "docker-compose.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
K8S = DEPLOY / "k8s"
# The pages of the documentation site that tell how to use these files (deploy/README.md only
# points at them; docs/operations.md lists them): deploying (the image, compose, vLLM beside
# kvoffload), Kubernetes, each tier below the pool with its deployment, the metrics and the
# dashboard, the alerts and their runbook.
DEPLOY_DOC = ROOT / "docs" / "deploy.md"
KUBERNETES_DOC = ROOT / "docs" / "kubernetes.md"
TIERS_DOC = ROOT / "docs" / "tiers.md"
METRICS_DOC = ROOT / "docs" / "metrics.md"
ALERTS_DOC = ROOT / "docs" / "alerts.md"
SYNC_TOOL = DEPLOY / "tools" / "sync_k8s.py"

# Labels the scrapers attach to every series (Prometheus: job, instance; the compose scrape
# config: service; the Prometheus Operator: namespace, pod, service, container, endpoint; the
# ServiceMonitor's relabeling: node). Anything else must come from the catalogue.
TARGET_LABELS = frozenset(
    {"job", "instance", "namespace", "pod", "node", "service", "container", "endpoint"}
)
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


KUBECTL = shutil.which("kubectl")


def context_sends(path: str) -> bool:
    """Whether the root .dockerignore lets ``path`` (relative to the repository root) into the
    build context: its last matching line decides (``!`` re-includes), as both builders read
    it. Only the patterns this repository uses are understood: ``*`` and ``dir/`` prefixes."""
    sent = True
    for raw in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        pattern = line.lstrip("!").rstrip("/")
        assert pattern == "*" or "*" not in pattern, f"pattern not understood here: {line}"
        if pattern == "*" or path == pattern or path.startswith(pattern + "/"):
            sent = include
    return sent


def kustomize(path: Path) -> list[Any]:
    """The documents ``kubectl kustomize path`` renders (it must succeed)."""
    assert KUBECTL is not None
    proc = subprocess.run(
        [KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d is not None]


def kustomize_with(components: list[str], workdir: Path) -> list[Any]:
    """The documents of an overlay of deploy/k8s with ``components`` (directories under it,
    e.g. ``remote``), made in ``workdir``."""
    overlay = workdir / "overlay"
    overlay.mkdir()
    base = os.path.relpath(K8S, overlay)
    listed = ", ".join(f"{base}/{c}" for c in components)
    (overlay / "kustomization.yaml").write_text(
        f"resources: [{base}]\ncomponents: [{listed}]\n", encoding="utf-8"
    )
    return kustomize(overlay)


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def load_yaml_all(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc is not None]


def load_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def compose_default(value: object) -> str:
    """A compose value with ``${VAR:-default}`` replaced by its default."""
    m = re.fullmatch(r"\$\{\w+:-(.+)\}", str(value))
    return m.group(1) if m else str(value)


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = path.read_text(encoding="utf-8")
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@dataclass(frozen=True)
class Metric:
    name: str
    type: str
    labels: tuple[str, ...]
    label_values: dict[str, tuple[str, ...]]
    results_by_op: dict[str, tuple[str, ...]]
    exemplar_labels: tuple[str, ...]
    help: str
    opt_in: bool

    def series_names(self) -> tuple[str, ...]:
        """Names the metric is queried by in PromQL."""
        if self.type == "histogram":
            return tuple(self.name + s for s in HISTOGRAM_SUFFIXES)
        return (self.name,)


@cache
def catalogue() -> dict[str, Metric]:
    """The catalogue by metric name."""
    raw = load_json(CATALOGUE)
    metrics = {}
    for entry in raw["metrics"]:
        metrics[entry["name"]] = Metric(
            name=entry["name"],
            type=entry["type"],
            labels=tuple(entry["labels"]),
            label_values={k: tuple(v) for k, v in entry.get("label_values", {}).items()},
            results_by_op={k: tuple(v) for k, v in entry.get("results_by_op", {}).items()},
            exemplar_labels=tuple(entry.get("exemplar_labels", [])),
            help=entry["help"],
            opt_in=bool(entry.get("opt_in", False)),
        )
    return metrics


@cache
def tenant_labels() -> frozenset[str]:
    """Labels every namespace's series carries with tenants on (``tenant``, ``namespace``)."""
    return frozenset(load_json(CATALOGUE)["tenant_labels"])


@cache
def series_index() -> dict[str, Metric]:
    """Every queryable series name (histograms as _bucket/_sum/_count) -> its metric."""
    return {name: m for m in catalogue().values() for name in m.series_names()}


def rule_groups(doc: Any) -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = doc["groups"]
    return groups


def all_rules() -> list[dict[str, Any]]:
    return [rule for group in rule_groups(load_yaml(RULES)) for rule in group["rules"]]


def recording_rule_names() -> set[str]:
    return {r["record"] for r in all_rules() if "record" in r}


def alert_rules() -> list[dict[str, Any]]:
    return [r for r in all_rules() if "alert" in r]


def walk(node: Any) -> Iterator[Any]:
    """Every dict and list in a JSON-like tree, depth first."""
    yield node
    if isinstance(node, dict):
        for value in node.values():
            yield from walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from walk(value)


def dashboard_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, including panels nested in (collapsed) rows."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def dashboard_expressions(dashboard: dict[str, Any]) -> list[tuple[str, Analysis]]:
    """(where, analysis) for every PromQL expression of the dashboard."""
    found: list[tuple[str, Analysis]] = []
    for panel in dashboard_panels(dashboard):
        for target in panel.get("targets", []):
            if "expr" in target:
                where = f"panel {panel['id']} ({panel['title']}) {target['refId']}"
                found.append((where, analyse(target["expr"])))
    for annotation in dashboard["annotations"]["list"]:
        if "expr" in annotation:
            found.append((f"annotation {annotation['name']}", analyse(annotation["expr"])))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]
        text = query["query"] if isinstance(query, dict) else query
        analysis, _label = analyse_variable_query(text)
        found.append((f"variable {variable['name']}", analysis))
    return found


_QUANTITY = re.compile(r"^([0-9.]+)\s*([A-Za-z]*)$")
_UNITS = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    # docker / compose sizes (b, k, m, g are binary there)
    "b": 1,
    "kb": 2**10,
    "m": 2**20,
    "mb": 2**20,
    "g": 2**30,
    "gb": 2**30,
}


def parse_bytes(value: str | int) -> int:
    """Bytes in a Kubernetes quantity (``9Gi``) or a compose size (``1280m``)."""
    if isinstance(value, int):
        return value
    m = _QUANTITY.match(value.strip())
    if m is None or m.group(2) not in _UNITS:
        raise ValueError(f"not a byte quantity: {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def write_secret_volume(root: Path, files: dict[str, str], mode: int) -> None:
    """Lay ``files`` out as the kubelet lays out a secret volume: the files in a timestamped
    directory, ``..data`` linking to it, and one link per file through ``..data``."""
    data = root / "..2026_01_01_00_00_00.000000001"
    data.mkdir(parents=True)
    for name, text in files.items():
        (data / name).write_text(text, encoding="utf-8")
        (data / name).chmod(mode)
    (root / "..data").symlink_to(data.name)
    for name in files:
        (root / name).symlink_to(f"..data/{name}")
