"""The Grafana dashboard and its provisioning: stable uids, unique panel ids, a sane layout, the
panels the operators asked for, exemplars linked to logs by req_id."""

from __future__ import annotations

import json
import re
import urllib.parse
from typing import Any

import pytest

from tests.deploy.helpers import (
    COMPOSE,
    DASHBOARD,
    DASHBOARD_PROVIDER,
    DATASOURCES,
    dashboard_panels,
    load_json,
    load_yaml,
)
from tests.deploy.promql import analyse

DASHBOARD_UID = "kvoffload-overview"
UID = re.compile(r"^[A-Za-z0-9_-]{1,40}$")
DS_VARIABLE = {"type": "prometheus", "uid": "${datasource}"}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = load_json(DASHBOARD)
    return data


def _exprs(panel: dict[str, Any]) -> list[str]:
    return [t["expr"] for t in panel.get("targets", []) if "expr" in t]


def _names(panel: dict[str, Any]) -> set[str]:
    return {name for expr in _exprs(panel) for name in analyse(expr).metric_names}


def _panels_using(dashboard: dict[str, Any], *metrics: str) -> list[dict[str, Any]]:
    return [p for p in dashboard_panels(dashboard) if set(metrics) <= _names(p)]


def test_dashboard_uid_is_stable(dashboard) -> None:
    assert dashboard["uid"] == DASHBOARD_UID, "links and alerts point at this uid: keep it"
    assert UID.match(dashboard["uid"])
    assert dashboard["title"] == "kvoffload"
    assert "id" not in dashboard or dashboard["id"] is None, "provisioned dashboards have no id"
    assert isinstance(dashboard["schemaVersion"], int)


def test_every_panel_has_a_unique_id(dashboard) -> None:
    ids = [p.get("id") for p in dashboard_panels(dashboard)]
    assert all(isinstance(i, int) and i > 0 for i in ids), ids
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {ids}"


def test_panels_fit_the_grid_without_overlapping(dashboard) -> None:
    cells: dict[tuple[int, int], int] = {}
    for panel in dashboard_panels(dashboard):
        pos = panel["gridPos"]
        assert min(pos["w"], pos["h"]) > 0, panel["id"]
        assert min(pos["x"], pos["y"]) >= 0, panel["id"]
        assert pos["x"] + pos["w"] <= 24, f"panel {panel['id']} is wider than the grid"
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                other = cells.setdefault((x, y), panel["id"])
                assert other == panel["id"], f"panels {other} and {panel['id']} overlap"


def test_panels_query_the_datasource_variable(dashboard) -> None:
    (ds_var,) = [v for v in dashboard["templating"]["list"] if v["name"] == "datasource"]
    assert ds_var["type"] == "datasource"
    assert ds_var["query"] == "prometheus"
    for panel in dashboard_panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["title"].strip(), panel["id"]
        assert panel["datasource"] == DS_VARIABLE, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs, panel["title"]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DS_VARIABLE, panel["title"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            assert variable["datasource"] == DS_VARIABLE, variable["name"]


def test_hit_ratio_panel_shows_prefix_and_key_hit_ratio(dashboard) -> None:
    panels = _panels_using(dashboard, "kvoffload_prefix_hit_ratio", "kvoffload_manager_keys_total")
    assert panels, "no panel with both the prefix and the key hit ratio"
    assert any('result="hit"' in e for e in _exprs(panels[0]))
    assert panels[0]["fieldConfig"]["defaults"]["unit"] == "percentunit"


def test_projected_hit_ratio_per_policy_against_live(dashboard) -> None:
    (panel,) = _panels_using(
        dashboard, "kvoffload_policy_projected_hit_ratio", "kvoffload_prefix_hit_ratio"
    )
    assert any("by (policy)" in e for e in _exprs(panel))


def test_ops_evictions_pool_and_transfer_panels(dashboard) -> None:
    ops = _panels_using(dashboard, "kvoffload_manager_ops_total")
    assert any("by (op, result)" in e for p in ops for e in _exprs(p))
    (evictions,) = _panels_using(dashboard, "kvoffload_evictions_total")
    assert "by (policy)" in _exprs(evictions)[0]
    (pool,) = _panels_using(dashboard, "kvoffload_blocks", "kvoffload_pool_capacity_blocks")
    assert "by (state)" in _exprs(pool)[0]
    (throughput,) = _panels_using(dashboard, "kvoffload_transfer_bytes_total")
    assert "by (direction)" in _exprs(throughput)[0]
    assert throughput["fieldConfig"]["defaults"]["unit"] == "Bps"  # shown as GB/s
    assert _panels_using(dashboard, "kvoffload_transfer_oldest_inflight_seconds")


def test_latency_heatmaps_show_exemplars(dashboard) -> None:
    heatmaps = {
        name: p for p in dashboard_panels(dashboard) if p["type"] == "heatmap" for name in _names(p)
    }
    for histogram in (
        "kvoffload_http_request_duration_seconds_bucket",
        "kvoffload_transfer_duration_seconds_bucket",
        "kvoffload_tier_io_duration_seconds_bucket",
    ):
        panel = heatmaps[histogram]
        (target,) = panel["targets"]
        assert target["exemplar"] is True, panel["title"]
        assert target["format"] == "heatmap"
        assert "by (le)" in target["expr"]
        assert panel["options"]["calculate"] is False
        assert "exemplars" in panel["options"]
        assert panel["options"]["yAxis"]["unit"] == "s"


def test_live_request_table(dashboard) -> None:
    (table,) = _panels_using(dashboard, "kvoffload_request_blocks")
    assert table["type"] == "table"
    (target,) = table["targets"]
    assert target["format"] == "table"
    assert target["instant"] is True
    assert "by (req_id, kind)" in target["expr"]


def test_policy_switches_are_annotations(dashboard) -> None:
    annotations = [a for a in dashboard["annotations"]["list"] if "expr" in a]
    (switches,) = [a for a in annotations if "olicy" in a["name"]]
    names = analyse(switches["expr"]).metric_names
    assert names & {"kvoffload_policy_generation", "kvoffload_policy_switches_total"}
    assert switches["datasource"] == DS_VARIABLE
    assert switches["enable"] is True


# --- provisioning -----------------------------------------------------------------------------


def _explore_panes(url: str, req_id: str) -> dict[str, Any]:
    parsed = urllib.parse.urlsplit(url)
    assert parsed.path == "/explore"
    query = urllib.parse.parse_qs(parsed.query)
    assert query["schemaVersion"] == ["1"]
    (panes,) = query["panes"]
    data: dict[str, Any] = json.loads(panes.replace("${__value.raw}", req_id))
    return data


def test_prometheus_datasource_links_exemplars_to_logs_by_req_id() -> None:
    sources = {ds["uid"]: ds for ds in load_yaml(DATASOURCES)["datasources"]}
    prometheus = next(ds for ds in sources.values() if ds["type"] == "prometheus")
    assert prometheus["isDefault"] is True
    (link,) = prometheus["jsonData"]["exemplarTraceIdDestinations"]
    assert link["name"] == "req_id"
    # Grafana expands $VAR in provisioning files; "$$" is a literal "$".
    assert "$${__value.raw}" in link["url"]
    url = link["url"].replace("$$", "$")
    (pane,) = _explore_panes(url, "req-42").values()
    (query,) = pane["queries"]
    logs = sources[pane["datasource"]]
    assert logs["type"] == "loki"
    assert query["datasource"]["uid"] == logs["uid"]
    assert "req_id" in query["expr"]
    assert "`req-42`" in query["expr"]


def test_dashboard_provider_loads_the_directory_compose_mounts() -> None:
    (provider,) = load_yaml(DASHBOARD_PROVIDER)["providers"]
    assert provider["type"] == "file"
    assert provider["folderUid"]
    grafana = load_yaml(COMPOSE)["services"]["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"])
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./grafana/provisioning/datasources"].endswith("/provisioning/datasources")
    assert mounts["./grafana/provisioning/dashboards"].endswith("/provisioning/dashboards")
    env = grafana["environment"]
    for ds in load_yaml(DATASOURCES)["datasources"]:
        var = ds["url"].lstrip("$").strip("{}")
        assert var in env, f"Grafana has no {var} for the {ds['name']} data source"


# --- the tiers below the pool ----------------------------------------------------------------
# One row of panels for every tier, by the ``tier`` label, then a row of the disk tier's own
# panels, one of the remote tier's and one of the object tier's, below every other panel.


def _rows(dashboard: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The tier rows by the word their title starts with: Tiers, Disk, Remote, Object."""
    rows = {}
    for p in dashboard["panels"]:
        if p["type"] == "row":
            word = p["title"].split()[0]
            if word in ("Tiers", "Disk", "Remote", "Object"):
                assert word not in rows, f"two {word} rows"
                rows[word] = p
    assert set(rows) == {"Tiers", "Disk", "Remote", "Object"}, sorted(rows)
    return rows


def _y(panel: dict[str, Any]) -> int:
    y: int = panel["gridPos"]["y"]
    return y


def _tier_generic(panel: dict[str, Any]) -> bool:
    """Whether the panel shows a kvoffload_tier_* family for every tier (not one tier's)."""
    return any(
        m.name and m.name.startswith("kvoffload_tier_") and not _fixed_tier(m)
        for expr in _exprs(panel)
        for m in analyse(expr).selectors
    )


def _fixed_tier(selector: Any) -> str | None:
    return next((m.value for m in selector.matchers if m.label == "tier" and m.op == "="), None)


def _tiers_fixed(panel: dict[str, Any]) -> set[str]:
    """The tiers the panel's kvoffload_tier_* selectors fix with tier="..."."""
    return {
        tier
        for expr in _exprs(panel)
        for m in analyse(expr).selectors
        if m.name and m.name.startswith("kvoffload_tier_") and (tier := _fixed_tier(m))
    }


def _own(panel: dict[str, Any], tier: str) -> bool:
    """Whether the panel shows one tier's own series: its prefix, or tier="<tier>"."""
    return tier in _tiers_fixed(panel) or any(
        name.startswith(f"kvoffload_{tier}_") for name in _names(panel)
    )


def test_tier_variable_lists_the_tiers(dashboard) -> None:
    variables = [v["name"] for v in dashboard["templating"]["list"]]
    (tier,) = [v for v in dashboard["templating"]["list"] if v["name"] == "tier"]
    assert variables.index("tier") > variables.index("instance")
    assert tier["type"] == "query"
    query = tier["query"]["query"]
    assert query.startswith("label_values(kvoffload_tier_up{")
    assert query.endswith(", tier)")
    assert tier["definition"] == query
    assert tier["includeAll"] is True
    assert tier["multi"] is True
    assert tier["allValue"] == ".*"


def test_every_tier_panels_show_each_tier(dashboard) -> None:
    """The Tiers row: up, demoted and promoted blocks, drops by reason, bytes, queues,
    incidents, I/O latency and keys by op, each by tier and for the tiers picked above."""
    generic = [p for p in dashboard_panels(dashboard) if _tier_generic(p)]
    for panel in generic:
        for expr in _exprs(panel):
            for m in analyse(expr).selectors:
                if m.name and m.name.startswith("kvoffload_tier_"):
                    assert ("tier", "=~", "$tier") in [
                        (x.label, x.op, x.value) for x in m.matchers
                    ], panel["title"]
        if panel["type"] != "heatmap":
            assert all("tier" in analyse(e).grouping_labels for e in _exprs(panel)), panel["title"]
            legends = [t["legendFormat"] for t in panel["targets"]]
            assert all("{{tier}}" in legend for legend in legends), panel["title"]

    def one(*metrics: str) -> dict[str, Any]:
        (panel,) = [p for p in generic if set(metrics) <= _names(p)]
        return panel

    up = one("kvoffload_tier_up")
    assert up["type"] == "stat"
    texts = {
        v["text"] for m in up["fieldConfig"]["defaults"]["mappings"] for v in m["options"].values()
    }
    assert texts == {"up", "degraded"}
    assert _exprs(up) == [
        'min by (tier) (kvoffload_tier_up{job=~"$job", instance=~"$instance", '
        'tenant=~"$tenant", tier=~"$tier"})'
    ], "one value per tier: its worst instance"
    one("kvoffload_tier_demoted_blocks_total", "kvoffload_tier_promoted_blocks_total")
    dropped = one("kvoffload_tier_demotions_dropped_total")
    assert "by (tier, reason)" in _exprs(dropped)[0]
    throughput = one("kvoffload_tier_bytes_read_total", "kvoffload_tier_bytes_written_total")
    assert throughput["fieldConfig"]["defaults"]["unit"] == "Bps"
    queue = one("kvoffload_tier_queue_depth")
    assert "by (tier, instance)" in _exprs(queue)[0], "a queue is one node's"
    one("kvoffload_tier_incidents_total")
    keys = one("kvoffload_tier_io_keys_total")
    assert "by (tier, op)" in _exprs(keys)[0]
    (latency,) = [
        p
        for p in generic
        if p["type"] == "timeseries" and "kvoffload_tier_io_duration_seconds_bucket" in _names(p)
    ]
    exprs = _exprs(latency)
    assert {e.split(",")[0] for e in exprs} == {
        "histogram_quantile(0.5",
        "histogram_quantile(0.99",
    }
    assert all("by (le, tier, op)" in e for e in exprs)
    assert latency["fieldConfig"]["defaults"]["unit"] == "s"
    (heatmap,) = [p for p in generic if p["type"] == "heatmap"]
    (target,) = heatmap["targets"]
    assert target["exemplar"] is True, "a slow promotion's req_id leads to its logs"
    assert 'op=~"read|get"' in target["expr"], "the reads a load waits for, of every tier"
    # Every family the tiers share is on a panel of the row.
    shared = {n.removesuffix("_bucket") for p in generic for n in _names(p) if "_tier_" in n} - {
        "kvoffload_tier_blocks",
        "kvoffload_tier_capacity_blocks",
    }  # disk only: its row
    assert shared == {
        "kvoffload_tier_up",
        "kvoffload_tier_queue_depth",
        "kvoffload_tier_demoted_blocks_total",
        "kvoffload_tier_demotions_dropped_total",
        "kvoffload_tier_promoted_blocks_total",
        "kvoffload_tier_bytes_read_total",
        "kvoffload_tier_bytes_written_total",
        "kvoffload_tier_incidents_total",
        "kvoffload_tier_io_duration_seconds",
        "kvoffload_tier_io_keys_total",
    }
    # One row holds them, below every other panel and above the disk, remote and object rows.
    rows = _rows(dashboard)
    assert _y(rows["Tiers"]) < _y(rows["Disk"]) < _y(rows["Remote"]) < _y(rows["Object"])
    assert len(generic) >= 9
    assert all(_y(rows["Tiers"]) < _y(p) < _y(rows["Disk"]) for p in generic)
    others = [
        p
        for p in dashboard_panels(dashboard)
        if p["type"] != "row" and not _tier_generic(p) and not _own(p, "disk")
        if not _own(p, "remote") and not _own(p, "object")
    ]
    assert others
    assert all(_y(p) < _y(rows["Tiers"]) for p in others)


def test_disk_tier_panels(dashboard) -> None:
    disk = [p for p in dashboard_panels(dashboard) if _own(p, "disk")]
    (capacity,) = [
        p for p in disk if {"kvoffload_tier_blocks", "kvoffload_tier_capacity_blocks"} <= _names(p)
    ]
    assert _tiers_fixed(capacity) == {"disk"}
    (demotions,) = [
        p
        for p in disk
        if {"kvoffload_disk_writes_total", "kvoffload_disk_admissions_refused_total"} <= _names(p)
    ]
    assert "kvoffload_disk_reads_total" in _names(demotions)
    assert [p for p in disk if "kvoffload_disk_evictions_total" in _names(p)]
    (errors,) = [p for p in disk if "kvoffload_disk_checksum_failures_total" in _names(p)]
    assert {
        "kvoffload_disk_read_failures_total",
        "kvoffload_disk_write_failures_total",
        "kvoffload_tier_incidents_total",
    } <= _names(errors)
    assert _tiers_fixed(errors) == {"disk"}
    # Every family of the disk tier's own is on a panel.
    own = {n for p in disk for n in _names(p) if n.startswith("kvoffload_disk_")}
    assert own == {
        "kvoffload_disk_writes_total",
        "kvoffload_disk_write_failures_total",
        "kvoffload_disk_reads_total",
        "kvoffload_disk_read_failures_total",
        "kvoffload_disk_checksum_failures_total",
        "kvoffload_disk_admissions_refused_total",
        "kvoffload_disk_evictions_total",
    }
    # One row holds them, between the Tiers row above and the remote tier's row below.
    rows = _rows(dashboard)
    assert len(disk) >= 4
    assert all(_y(rows["Disk"]) < _y(p) < _y(rows["Remote"]) for p in disk)
    assert not [p for p in disk if _own(p, "remote") or _tier_generic(p)]


def test_remote_tier_panels(dashboard) -> None:
    remote = [p for p in dashboard_panels(dashboard) if _own(p, "remote")]

    def one(*metrics: str) -> dict[str, Any]:
        (panel,) = [p for p in remote if set(metrics) <= _names(p)]
        return panel

    hits = one("kvoffload_remote_hits_total", "kvoffload_remote_misses_total")
    assert any("/" in e for e in _exprs(hits)), "the remote hit ratio"
    one(
        "kvoffload_remote_gets_total",
        "kvoffload_remote_puts_total",
        "kvoffload_remote_get_failures_total",
        "kvoffload_remote_put_failures_total",
    )
    one(
        "kvoffload_remote_errors_total",
        "kvoffload_remote_timeouts_total",
        "kvoffload_remote_skipped_total",
    )
    tracked = one("kvoffload_remote_tracked_blocks", "kvoffload_remote_removed_blocks_total")
    assert all("by (instance)" in e for e in _exprs(tracked)), "what one node wrote"
    # Every family of the remote tier's own is on a panel.
    own = {n for p in remote for n in _names(p) if n.startswith("kvoffload_remote_")}
    assert len(own) == 11
    # One row holds them, between the disk tier's row and the object tier's row below.
    rows = _rows(dashboard)
    assert len(remote) >= 4
    assert all(_y(rows["Remote"]) < _y(p) < _y(rows["Object"]) for p in remote)
    others = [
        p
        for p in dashboard_panels(dashboard)
        if p["type"] != "row" and p not in remote and not _own(p, "object")
    ]
    assert all(_y(p) < _y(rows["Remote"]) for p in others)
    assert not [p for p in remote if _own(p, "disk") or _own(p, "object") or _tier_generic(p)]


def test_object_tier_panels(dashboard) -> None:
    obj = [p for p in dashboard_panels(dashboard) if _own(p, "object")]

    def one(*metrics: str) -> dict[str, Any]:
        (panel,) = [p for p in obj if set(metrics) <= _names(p)]
        return panel

    # The bound: the objects this node keeps against the objects it may keep.
    bound = one("kvoffload_tier_blocks", "kvoffload_tier_capacity_blocks")
    assert _tiers_fixed(bound) == {"object"}
    one("kvoffload_object_deletes_total", "kvoffload_object_delete_failures_total")
    errors = one("kvoffload_object_errors_total", "kvoffload_object_timeouts_total")
    assert _tiers_fixed(errors) <= {"object"}
    (checksum,) = [p for p in obj if "kvoffload_object_checksum_failures_total" in _names(p)]
    assert "KvoffloadObjectChecksumFailures" in checksum["description"]
    # What one node wrote and deleted: per instance.
    assert all("by (instance)" in e for p in obj for e in _exprs(p))
    # Every family of the object tier's own is on a panel.
    own = {n for p in obj for n in _names(p) if n.startswith("kvoffload_object_")}
    assert own == {
        "kvoffload_object_checksum_failures_total",
        "kvoffload_object_deletes_total",
        "kvoffload_object_delete_failures_total",
        "kvoffload_object_errors_total",
        "kvoffload_object_timeouts_total",
    }
    # One row holds them, below every other panel.
    rows = _rows(dashboard)
    assert len(obj) >= 4
    assert all(_y(p) > _y(rows["Object"]) for p in obj)
    others = [p for p in dashboard_panels(dashboard) if p["type"] != "row" and p not in obj]
    assert all(_y(p) < _y(rows["Object"]) for p in others)
    assert not [p for p in obj if _own(p, "disk") or _own(p, "remote") or _tier_generic(p)]
