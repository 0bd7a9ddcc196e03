"""deploy/metrics_catalogue.json is well formed, and every PromQL expression in deploy/ (rules,
dashboard, Kubernetes copies) uses only its metrics, their labels and their label values."""

from __future__ import annotations

import re

import pytest

import app.core.lower_tiers  # noqa: F401  (registers the built-in tiers)
from app.core.tier import backends
from tests.deploy.helpers import (
    CATALOGUE,
    DASHBOARD,
    DEPLOY,
    K8S,
    METRICS_DOC,
    ROOT,
    TARGET_LABELS,
    all_rules,
    catalogue,
    dashboard_expressions,
    load_json,
    load_yaml_all,
    recording_rule_names,
    rule_groups,
    series_index,
    tenant_labels,
)
from tests.deploy.promql import (
    Analysis,
    PromQLScanError,
    Selector,
    analyse,
    analyse_variable_query,
    tokenize,
)

LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
METRIC_NAME = re.compile(r"^kvoffload_[a-z0-9_]+$")
RECORD_NAME = re.compile(r"^[a-z_]+:kvoffload_[a-z0-9_]+:[a-z0-9_]+$")


# --- the catalogue itself ---------------------------------------------------------------------


def test_catalogue_entries_are_well_formed() -> None:
    raw = load_json(CATALOGUE)
    names = [entry["name"] for entry in raw["metrics"]]
    assert len(names) == len(set(names)), "duplicate metric names"
    assert raw["prefix"] == "kvoffload_"
    for entry in raw["metrics"]:
        name = entry["name"]
        assert set(entry) <= {
            "name",
            "type",
            "labels",
            "label_values",
            "results_by_op",
            "exemplar_labels",
            "opt_in",
            "help",
        }, name
        assert METRIC_NAME.match(name), name
        assert entry["type"] in ("counter", "gauge", "histogram"), name
        assert entry["help"].strip(), f"{name}: empty help"
        if entry["type"] == "counter":
            assert name.endswith("_total"), f"{name}: counters are exported with _total"
        else:
            assert not name.endswith("_total"), f"{name}: only counters end in _total"
        if entry["type"] == "histogram":
            assert name.endswith("_seconds"), f"{name}: histograms here measure seconds"
        labels = entry["labels"]
        assert len(labels) == len(set(labels)), name
        for label in labels:
            assert LABEL_NAME.match(label), (name, label)
            assert not label.startswith("__"), (name, label)
            assert label not in ("le", "quantile"), (name, label)
            assert label not in TARGET_LABELS, f"{name}: {label} is set by the scraper"
        assert set(entry.get("label_values", {})) <= set(labels), name
        for values in entry.get("label_values", {}).values():
            assert values, name
            assert len(values) == len(set(values)), name
        if entry.get("exemplar_labels"):
            assert entry["type"] in ("histogram", "counter"), f"{name}: exemplars need one"


def test_tenant_labels_are_the_tenant_and_its_namespace() -> None:
    # Added to every series of a namespace with tenants on, so no metric may declare them.
    assert tenant_labels() == {"tenant", "namespace"}
    for metric in catalogue().values():
        assert not tenant_labels() & set(metric.labels), metric.name


def test_req_id_is_an_exemplar_label_except_on_the_opt_in_live_request_gauge() -> None:
    for metric in catalogue().values():
        if "req_id" in metric.labels:
            assert metric.opt_in, metric.name
            assert metric.type == "gauge", metric.name
            assert metric.name == "kvoffload_request_blocks"
    with_exemplars = {m.name for m in catalogue().values() if "req_id" in m.exemplar_labels}
    # Every per-call instrument carries the request's exemplar; scrape-time state does not.
    assert with_exemplars == {
        "kvoffload_http_requests_total",
        "kvoffload_http_request_duration_seconds",
        "kvoffload_manager_ops_total",
        "kvoffload_manager_keys_total",
        "kvoffload_transfer_jobs_total",
        "kvoffload_transfer_bytes_total",
        "kvoffload_transfer_duration_seconds",
        "kvoffload_transfer_failures_total",
        # every lower tier's I/O calls; disk: a promotion's read, demotion writes have none
        "kvoffload_tier_io_duration_seconds",
        "kvoffload_tier_io_keys_total",
    }


# The tiers below the pool share one family set labelled by tier; these were per tier before.
RENAMED_TIER_FAMILIES = {
    "kvoffload_disk_tier_up": "kvoffload_tier_up",
    "kvoffload_remote_tier_up": "kvoffload_tier_up",
    "kvoffload_disk_blocks": "kvoffload_tier_blocks",
    "kvoffload_disk_capacity_blocks": "kvoffload_tier_capacity_blocks",
    "kvoffload_disk_queue_depth": "kvoffload_tier_queue_depth",
    "kvoffload_remote_queue_depth": "kvoffload_tier_queue_depth",
    "kvoffload_disk_demotions_dropped_total": "kvoffload_tier_demotions_dropped_total",
    "kvoffload_remote_queue_dropped_total": "kvoffload_tier_demotions_dropped_total",
    "kvoffload_disk_promoted_blocks_total": "kvoffload_tier_promoted_blocks_total",
    "kvoffload_remote_promoted_blocks_total": "kvoffload_tier_promoted_blocks_total",
    "kvoffload_disk_bytes_read_total": "kvoffload_tier_bytes_read_total",
    "kvoffload_remote_bytes_read_total": "kvoffload_tier_bytes_read_total",
    "kvoffload_disk_bytes_written_total": "kvoffload_tier_bytes_written_total",
    "kvoffload_remote_bytes_written_total": "kvoffload_tier_bytes_written_total",
    "kvoffload_disk_incidents_total": "kvoffload_tier_incidents_total",
    "kvoffload_remote_incidents_total": "kvoffload_tier_incidents_total",
    "kvoffload_disk_io_duration_seconds": "kvoffload_tier_io_duration_seconds",
    "kvoffload_remote_call_duration_seconds": "kvoffload_tier_io_duration_seconds",
    "kvoffload_disk_io_blocks_total": "kvoffload_tier_io_keys_total",
    "kvoffload_remote_call_keys_total": "kvoffload_tier_io_keys_total",
}
# The service's own tier backends (a test's own, registered by its module, is not shipped).
TIER_NAMES = tuple(n for n, b in backends().items() if type(b).__module__.startswith("app."))


def test_lower_tiers_share_one_family_set_labelled_by_tier() -> None:
    tier_families = {n: m for n, m in catalogue().items() if n.startswith("kvoffload_tier_")}
    assert set(tier_families) == set(RENAMED_TIER_FAMILIES.values()) | {
        "kvoffload_tier_demoted_blocks_total"
    }
    for name, metric in tier_families.items():
        assert metric.labels[0] == "tier", name
        # Bounded: the registered tier names, nothing per key or per request.
        assert metric.label_values["tier"] == TIER_NAMES, name
        assert metric.opt_in, f"{name}: only with a tier below the pool"
    for old in RENAMED_TIER_FAMILIES:
        assert old not in catalogue(), f"{old} was renamed to {RENAMED_TIER_FAMILIES[old]}"
    # Every tier's ops and drop reasons in one family (the object tier adds delete).
    io = catalogue()["kvoffload_tier_io_duration_seconds"]
    assert io.labels == ("tier", "op")
    assert set(io.label_values["op"]) == {
        "read",
        "write",
        "exists",
        "get",
        "put",
        "sweep",
        "delete",
    }
    assert catalogue()["kvoffload_tier_io_keys_total"].label_values["op"] == io.label_values["op"]
    dropped = catalogue()["kvoffload_tier_demotions_dropped_total"]
    assert dropped.labels == ("tier", "reason")
    assert set(dropped.label_values["reason"]) == {
        "degraded",
        "staging_full",
        "no_room",
        "write_failed",
        "shutdown",
        "duplicate",
        "queue_full",
    }
    # What only one tier has keeps that tier's prefix and no tier label.
    for name, metric in catalogue().items():
        if name.startswith(("kvoffload_disk_", "kvoffload_remote_", "kvoffload_object_")):
            assert "tier" not in metric.labels, name
            assert metric.opt_in, name


def test_object_tier_families_are_the_ones_it_exports() -> None:
    """kvoffload_object_* are the object tier's own families (app.core.object), counters
    without labels, exported only with --object-bucket."""
    from app.core.object import object_families

    exported = {family.name + "_total" for family in object_families({})}
    listed = {name for name in catalogue() if name.startswith("kvoffload_object_")}
    assert listed == exported
    for name in listed:
        metric = catalogue()[name]
        assert (metric.type, metric.labels, metric.opt_in) == ("counter", (), True), name


def test_renamed_tier_families_are_gone_from_deploy() -> None:
    """No rule, panel, Kubernetes copy or container test names a family by its old name; the
    metrics page names them only in its rename table, each beside its new name."""
    texts = [
        *DEPLOY.glob("prometheus/**/*.yml"),
        DASHBOARD,
        *K8S.rglob("*.yaml"),
        *(ROOT / "tests" / "containers").glob("*.py"),
    ]
    old = re.compile(r"\b(" + "|".join(map(re.escape, RENAMED_TIER_FAMILIES)) + r")(?![a-z_])")
    found = [
        f"{path.relative_to(ROOT)}: {m.group(1)}"
        for path in texts
        for m in old.finditer(path.read_text(encoding="utf-8"))
    ]
    assert not found, "\n".join(found)
    rename_rows = {}
    for line in METRICS_DOC.read_text(encoding="utf-8").splitlines():
        for m in old.finditer(line):
            assert line.startswith("|"), f"docs/metrics.md names {m.group(1)} outside a table"
            rename_rows[m.group(1)] = line
    for name, new in RENAMED_TIER_FAMILIES.items():
        assert name in rename_rows, f"docs/metrics.md's rename table lacks {name}"
        assert f"`{new}" in rename_rows[name], f"{name}: its row does not name {new}"


def test_keys_results_by_op_match_the_label_values() -> None:
    keys = catalogue()["kvoffload_manager_keys_total"]
    assert set(keys.results_by_op) == set(keys.label_values["op"])
    flat = [r for results in keys.results_by_op.values() for r in results]
    assert sorted(flat) == sorted(keys.label_values["result"])


def test_the_metrics_page_documents_every_metric() -> None:
    text = METRICS_DOC.read_text(encoding="utf-8")
    missing = [name for name in catalogue() if f"`{name}" not in text]
    assert not missing, f"docs/metrics.md does not list {missing}"


# --- the scanner ------------------------------------------------------------------------------


def test_scanner_finds_names_matchers_and_grouping_labels() -> None:
    a = analyse(
        "histogram_quantile(0.99, sum by (le, route) (rate("
        'kvoffload_http_request_duration_seconds_bucket{job=~"$job", route!="/livez"}'
        "[$__rate_interval])))"
        " / on (instance) group_left (policy) (kvoffload_policy_info == 1)"
        " > bool 1e-3 unless absent(kvoffload_blocks offset 5m) or vector(0)"
    )
    assert a.metric_names == {
        "kvoffload_http_request_duration_seconds_bucket",
        "kvoffload_policy_info",
        "kvoffload_blocks",
    }
    assert a.grouping_labels == {"le", "route", "instance", "policy"}
    assert {"histogram_quantile", "sum", "rate", "absent", "vector"} <= a.functions
    bucket = next(s for s in a.selectors if s.name and s.name.endswith("_bucket"))
    assert [(m.label, m.op, m.value) for m in bucket.matchers] == [
        ("job", "=~", "$job"),
        ("route", "!=", "/livez"),
    ]


def test_scanner_handles_aggregation_clauses_subqueries_and_recording_rules() -> None:
    a = analyse(
        "max without (policy) (kvoffload_policy_projected_hit_ratio)"
        " - sum(instance:kvoffload_lookup_keys:rate5m) by (job)"
        " + max_over_time(kvoffload_transfer_oldest_inflight_seconds[1h:5m])"
        ' + count_values("x", {__name__="kvoffload_live_requests"})'
    )
    assert a.metric_names == {
        "kvoffload_policy_projected_hit_ratio",
        "instance:kvoffload_lookup_keys:rate5m",
        "kvoffload_transfer_oldest_inflight_seconds",
        "kvoffload_live_requests",
    }
    assert a.grouping_labels == {"policy", "job"}
    assert "max" in a.functions
    assert "count_values" in a.functions


def test_scanner_reads_strings_and_durations_without_inventing_names() -> None:
    assert analyse('label_replace(vector(1), "dst", "$1", "src", "(.*)")').metric_names == set()
    assert analyse("time() - 1h30m").metric_names == set()
    assert [t.kind for t in tokenize("rate(x[5m]) * 2.5e9")] == [
        "ident",
        "op",
        "ident",
        "op",
        "number",
        "op",
        "op",
        "op",
        "number",
    ]
    with pytest.raises(PromQLScanError):
        analyse("rate(x{job=}[5m])")
    with pytest.raises(PromQLScanError):
        analyse("x ? y")


def test_scanner_reads_grafana_label_values_queries() -> None:
    analysis, label = analyse_variable_query('label_values(kvoffload_blocks{job=~"$job"}, state)')
    assert label == "state"
    assert analysis.metric_names == {"kvoffload_blocks"}
    analysis, label = analyse_variable_query("label_values(job)")
    assert label == "job"
    assert analysis.metric_names == set()


# --- expressions in deploy/ use only the catalogue --------------------------------------------


def _problems(where: str, analysis: Analysis, records: set[str]) -> list[str]:
    all_labels = {label for m in catalogue().values() for label in m.labels}
    known_labels = all_labels | TARGET_LABELS | tenant_labels() | {"le"}
    problems = []
    for label in sorted(analysis.grouping_labels - known_labels):
        problems.append(f"{where}: groups by unknown label {label!r}")
    for selector in analysis.selectors:
        problems.extend(_selector_problems(where, selector, records, known_labels))
    bare = {m.name for m in catalogue().values() if m.type == "histogram"}
    for name in sorted(analysis.metric_names & bare):
        problems.append(f"{where}: histogram {name} is queried as _bucket/_sum/_count")
    return problems


def _selector_problems(
    where: str, selector: Selector, records: set[str], known_labels: set[str]
) -> list[str]:
    name = selector.name
    if name is None:
        return [f"{where}: selector without a metric name"]
    if name in records:
        # Recording rules keep catalogue labels (and target labels) only.
        return [
            f"{where}: {name} has no label {m.label!r}"
            for m in selector.matchers
            if m.label not in known_labels
        ]
    metric = series_index().get(name)
    if metric is None:
        return [f"{where}: {name} is not in deploy/metrics_catalogue.json"]
    problems = []
    allowed = set(metric.labels) | TARGET_LABELS | tenant_labels() | {"__name__"}
    if name.endswith("_bucket"):
        allowed.add("le")
    fixed: dict[str, str] = {}
    for m in selector.matchers:
        if m.label not in allowed:
            problems.append(f"{where}: {name} has no label {m.label!r}")
            continue
        values = metric.label_values.get(m.label)
        if values is None or "$" in m.value:
            continue
        if m.op in ("=", "!="):
            wanted = [m.value]
            if m.op == "=":
                fixed[m.label] = m.value
        elif re.fullmatch(r"[A-Za-z0-9_]+(\|[A-Za-z0-9_]+)*", m.value):
            wanted = m.value.split("|")
        else:
            continue
        for value in wanted:
            if value not in values:
                problems.append(f"{where}: {name}{{{m.label}}} never takes the value {value!r}")
    if (
        metric.results_by_op
        and "op" in fixed
        and "result" in fixed
        and fixed["result"] not in metric.results_by_op.get(fixed["op"], ())
    ):
        problems.append(f"{where}: {name} has no result {fixed['result']!r} for op {fixed['op']!r}")
    return problems


def test_rule_expressions_use_only_catalogue_metrics() -> None:
    records = recording_rule_names()
    problems = []
    for rule in all_rules():
        where = f"rule {rule.get('record') or rule.get('alert')}"
        problems += _problems(where, analyse(rule["expr"]), records)
    assert not problems, "\n".join(problems)


def test_recording_rules_follow_the_naming_convention_and_are_defined_once() -> None:
    records = [r["record"] for r in all_rules() if "record" in r]
    assert len(records) == len(set(records))
    for name in records:
        assert RECORD_NAME.match(name), f"{name}: use level:kvoffload_metric:operations"


def test_dashboard_expressions_use_only_catalogue_metrics() -> None:
    records = recording_rule_names()
    dashboard = load_json(DASHBOARD)
    expressions = dashboard_expressions(dashboard)
    assert len(expressions) > 20
    problems = []
    for where, analysis in expressions:
        problems += _problems(where, analysis, records)
    assert not problems, "\n".join(problems)


def test_kubernetes_rule_copy_uses_only_catalogue_metrics() -> None:
    (rule,) = load_yaml_all(K8S / "prometheusrule.yaml")
    records = {r["record"] for g in rule_groups(rule["spec"]) for r in g["rules"] if "record" in r}
    problems = []
    for group in rule_groups(rule["spec"]):
        for r in group["rules"]:
            where = f"k8s rule {r.get('record') or r.get('alert')}"
            problems += _problems(where, analyse(r["expr"]), records)
    assert not problems, "\n".join(problems)


def test_checker_rejects_what_it_should() -> None:
    records = {"instance:kvoffload_x:rate5m"}
    bad = {
        "rate(kvoffload_http_requests[5m])": "not in deploy/metrics_catalogue.json",
        "kvoffload_transfer_duration_seconds": "queried as _bucket",
        'kvoffload_blocks{state="used"}': "never takes the value 'used'",
        'kvoffload_blocks{status="free"}': "has no label 'status'",
        'kvoffload_manager_keys_total{op="lookup", result="stored"}': "no result 'stored'",
        'kvoffload_http_requests_total{req_id="r1"}': "has no label 'req_id'",
        'kvoffload_transfer_jobs_total{result=~"ok|broken"}': "never takes the value 'broken'",
        "sum by (reqid) (kvoffload_live_requests)": "unknown label 'reqid'",
        'kvoffload_pool_capacity_blocks{le="1"}': "has no label 'le'",
    }
    for expr, message in bad.items():
        problems = _problems("t", analyse(expr), records)
        assert any(message in p for p in problems), (expr, problems)
    good = [
        "sum by (le) (rate(kvoffload_transfer_duration_seconds_bucket"
        '{direction="load", le="+Inf"}[5m]))',
        'kvoffload_request_blocks{req_id="r1", kind="pinned"}',
        'instance:kvoffload_x:rate5m{job="kvoffload", op="lookup"}',
        'kvoffload_manager_keys_total{op="prepare_load", result="pinned", node=~"$node"}',
        'sum by (tenant) (rate(kvoffload_http_requests_total{status="429", namespace="a"}[5m]))',
    ]
    for expr in good:
        assert _problems("t", analyse(expr), records) == [], expr
