"""Metrics: values, exemplars, bounded labels and the live-request table, at registry level."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.exposition import generate_latest

from app.core.control import Control
from app.core.control_shared import ControlShared
from app.core.disk import disk_families
from app.core.lower_tiers import TierChain
from app.core.object import object_families
from app.core.remote import remote_families
from app.settings import Settings
from app.telemetry.metrics import (
    ListenerConnections,
    LiveRequestRow,
    Metrics,
    ServiceSnapshot,
    TierReport,
    failure_reason,
    register_connections,
    register_kv_events,
    register_tenancy,
)
from app.telemetry.observer import Observer
from manager import OffloadManager, ReqContext, create_manager


@pytest.fixture
def manager():
    return create_manager(num_blocks=8)


REMOTE_STATE = {
    "state": "degraded",
    "counters": {"hits": 3, "bytes_written": 4096},
    "queue": {"depth": 2, "capacity": 8, "dropped": 1},
    "promotions": {"running": 0, "started": 2, "loaded": 1, "failed": 1},
    "tracked": {"blocks": 5, "capacity": 8, "removed": 4, "untracked": 1, "sweep_s": 10.0},
}

DISK_STATE = {
    "state": "ok",
    "counters": {"writes": 5, "reads": 2, "checksum_failures": 1, "bytes_read": 8192},
    "slots": 16,
    "blocks": 4,
    "queue": {"depth": 1, "staging_free": 7, "capacity": 8},
    "demotions": {"written": 5, "refused_admission": 3, "dropped": {"staging_full": 2}},
    "evictions": 1,
    "promotions": {"running": 0, "started": 3, "loaded": 2, "failed": 1},
}


REMOTE_REPORT = TierReport(
    up=False,
    queue_depth=2,
    demoted=6,
    dropped={"queue_full": 1},
    promoted=1,
    bytes_read=0,
    bytes_written=4096,
    incidents=1,
)
DISK_REPORT = TierReport(
    up=True,
    queue_depth=1,
    demoted=5,
    dropped={"staging_full": 2},
    promoted=2,
    bytes_read=8192,
    bytes_written=20480,
    incidents=0,
    blocks=4,
    capacity_blocks=16,
)


OBJECT_STATE = {"counters": {"checksum_failures": 1, "deletes": 4}}
OBJECT_REPORT = TierReport(
    up=True,
    queue_depth=0,
    demoted=9,
    dropped={},
    promoted=3,
    bytes_read=12288,
    bytes_written=36864,
    incidents=0,
    blocks=5,
    capacity_blocks=6,
)


def _control(m: OffloadManager) -> Control:
    """Cache control over ``m`` with no tier below (its families as a scrape reads them)."""
    settings = Settings(num_blocks=m.num_blocks)
    tiers = TierChain(settings, "default")
    return Control(ControlShared(settings, m, tiers, namespace="default", observer=Observer(None)))


def snapshot_of(
    m,
    live: list[LiveRequestRow] | None = None,
    remote: dict[str, Any] | None = None,
    disk: dict[str, Any] | None = None,
    obj: dict[str, Any] | None = None,
) -> ServiceSnapshot:
    reports = {"disk": DISK_REPORT} if disk is not None else {}
    if remote is not None:
        reports["remote"] = REMOTE_REPORT
    if obj is not None:
        reports["object"] = OBJECT_REPORT
    return ServiceSnapshot(
        tier_reports=reports,
        tier_metrics=[
            *_control(m).metric_families(),
            *(remote_families(remote) if remote is not None else ()),
            *(disk_families(disk) if disk is not None else ()),
            *(object_families(obj) if obj is not None else ()),
        ],
        stats=m.stats(),
        policy=m.policy,
        block_bytes=4096,
        pool_pinned=False,
        inflight={"store": 2},
        oldest_inflight_seconds=1.5,
        events_dropped=3,
        prefix_hit_ratio=0.25,
        projected_hit_ratio={"arc": 0.5, "lru": 0.4},
        live_requests=live or [],
    )


def test_per_call_metrics_count_and_carry_the_req_id_exemplar() -> None:
    reg = CollectorRegistry()
    met = Metrics(reg)
    met.http_call("/v1/requests/{req_id}/lookup", "POST", 200, 0.0004, "req-1")
    met.http_call("/v1/requests/{req_id}/lookup", "POST", 200, 0.002, "req-2")
    met.manager_op("lookup", "ok", "req-2", {"hit": 3, "pending": 0, "miss": 1})
    labels = {"route": "/v1/requests/{req_id}/lookup", "method": "POST", "status": "200"}
    assert reg.get_sample_value("kvoffload_http_requests_total", labels) == 2
    hist = {"route": "/v1/requests/{req_id}/lookup", "method": "POST"}
    assert reg.get_sample_value("kvoffload_http_request_duration_seconds_count", hist) == 2
    assert (
        reg.get_sample_value(
            "kvoffload_http_request_duration_seconds_bucket", {**hist, "le": "0.0005"}
        )
        == 1
    )
    assert (
        reg.get_sample_value("kvoffload_manager_keys_total", {"op": "lookup", "result": "hit"}) == 3
    )
    assert (
        reg.get_sample_value("kvoffload_manager_keys_total", {"op": "lookup", "result": "pending"})
        is None
    )  # zero counts create no series
    text = generate_latest(reg).decode()
    assert 'status="200"} 2.0 # {req_id="req-2"} 1.0' in text
    assert '} 1.0 # {req_id="req-1"} 0.0004' in text
    assert 'result="hit"} 3.0 # {req_id="req-2"} 3.0' in text


def test_transfer_failures_use_bounded_reasons() -> None:
    reg = CollectorRegistry()
    met = Metrics(reg)
    met.transfer_done("store", True, 4096, 0.01, None, "r")
    met.transfer_done("load", False, 0, 5.0, "deadline passed after 5.0 s", "r")
    met.transfer_done("load", False, 0, 0.1, "RuntimeError: boom /dev/shm/x", "r")
    assert reg.get_sample_value("kvoffload_transfer_bytes_total", {"direction": "store"}) == 4096
    assert (
        reg.get_sample_value(
            "kvoffload_transfer_failures_total", {"direction": "load", "reason": "deadline"}
        )
        == 1
    )
    assert (
        reg.get_sample_value(
            "kvoffload_transfer_failures_total", {"direction": "load", "reason": "error"}
        )
        == 1
    )
    assert (
        reg.get_sample_value(
            "kvoffload_transfer_jobs_total", {"direction": "load", "result": "failed"}
        )
        == 2
    )


@pytest.mark.parametrize(
    ("reason", "label"),
    [(None, "error"), ("Deadline", "deadline"), ("shutdown", "shutdown"),
     ("injected fault", "injected"), ("anything else", "error")],
)  # fmt: skip
def test_failure_reason_labels(reason, label) -> None:
    assert failure_reason(reason) == label


@pytest.mark.parametrize(
    ("req_id", "ok"),
    [("r1", True), ("a" * 120, True), ("a" * 121, False), ('x"}', False), ("", False),
     (None, False), ("sp ace", False)],
)  # fmt: skip
def test_exemplars_only_for_safe_req_ids(req_id, ok) -> None:
    reg = CollectorRegistry()
    Metrics(reg).manager_op("touch", "ok", req_id)
    (sample,) = [
        s for f in reg.collect() for s in f.samples if s.name == "kvoffload_manager_ops_total"
    ]
    assert sample.value == 1
    assert (sample.exemplar is not None) is ok


def test_state_is_read_from_the_snapshot_at_scrape_time(manager) -> None:
    reg = CollectorRegistry()
    Metrics(reg, snapshot=lambda: snapshot_of(manager))
    assert reg.get_sample_value("kvoffload_blocks", {"state": "free"}) == 8
    ctx = ReqContext("r1")
    manager.on_new_request(ctx)
    out = manager.prepare_store([b"a", b"b"], ctx)
    manager.complete_store(out.keys_to_store, ctx)
    manager.prepare_load([b"a"], ctx)
    assert reg.get_sample_value("kvoffload_blocks", {"state": "free"}) == 6
    assert reg.get_sample_value("kvoffload_blocks", {"state": "ready"}) == 2
    assert reg.get_sample_value("kvoffload_blocks", {"state": "pinned"}) == 1
    assert reg.get_sample_value("kvoffload_live_requests") == 1
    assert reg.get_sample_value("kvoffload_policy_info", {"policy": "lru"}) == 1
    assert reg.get_sample_value("kvoffload_policy_generation") == 1
    assert reg.get_sample_value("kvoffload_transfer_inflight_jobs", {"direction": "store"}) == 2
    assert reg.get_sample_value("kvoffload_transfer_inflight_jobs", {"direction": "load"}) == 0
    assert reg.get_sample_value("kvoffload_events_dropped_total") == 3
    assert reg.get_sample_value("kvoffload_policy_projected_hit_ratio", {"policy": "arc"}) == 0.5
    manager.switch_policy("arc")
    assert reg.get_sample_value("kvoffload_policy_info", {"policy": "arc"}) == 1
    assert reg.get_sample_value("kvoffload_policy_info", {"policy": "lru"}) is None


def test_evictions_are_split_by_the_policy_that_chose_them(manager) -> None:
    reg = CollectorRegistry()
    Metrics(reg, snapshot=lambda: snapshot_of(manager))
    ctx = ReqContext("r1")
    manager.on_new_request(ctx)
    for i in range(10):
        out = manager.prepare_store([bytes([i])], ctx)
        manager.complete_store(out.keys_to_store, ctx)
    manager.switch_policy("arc")
    for i in range(10, 13):
        out = manager.prepare_store([bytes([i])], ctx)
        manager.complete_store(out.keys_to_store, ctx)
    assert reg.get_sample_value("kvoffload_evictions_total", {"policy": "lru"}) == 2
    assert reg.get_sample_value("kvoffload_evictions_total", {"policy": "arc"}) == 3


def test_live_request_series_are_opt_in_capped_and_vanish_with_the_request(manager) -> None:
    rows = [LiveRequestRow(f"r{i}", 1, 0, 2, 3) for i in range(5)]
    live: list[LiveRequestRow] = list(rows)
    off = CollectorRegistry()
    Metrics(off, snapshot=lambda: snapshot_of(manager, live))
    assert (
        off.get_sample_value("kvoffload_request_blocks", {"req_id": "r0", "kind": "pinned"}) is None
    )
    on = CollectorRegistry()
    Metrics(
        on, snapshot=lambda: snapshot_of(manager, live), live_request_series=True, max_live_series=3
    )
    assert on.get_sample_value("kvoffload_request_blocks", {"req_id": "r0", "kind": "stored"}) == 3
    assert (
        on.get_sample_value("kvoffload_request_blocks", {"req_id": "r3", "kind": "stored"}) is None
    )
    live.pop(0)  # r0 finished
    assert (
        on.get_sample_value("kvoffload_request_blocks", {"req_id": "r0", "kind": "stored"}) is None
    )
    assert on.get_sample_value("kvoffload_request_blocks", {"req_id": "r1", "kind": "loaded"}) == 2


def test_no_family_but_the_live_table_has_a_req_id_label(manager) -> None:
    reg = CollectorRegistry()
    met = Metrics(reg, snapshot=lambda: snapshot_of(manager, [LiveRequestRow("r", 1, 1, 1, 1)]),
                  live_request_series=True)  # fmt: skip
    met.http_call("/livez", "GET", 200, 0.001, "r")
    met.manager_op("touch", "ok", "r", {"ok": 1})
    met.transfer_done("store", True, 1, 0.1, None, "r")
    met.policy_switched("lru", "arc")
    for family in reg.collect():
        for sample in family.samples:
            if family.name != "kvoffload_request_blocks":
                assert "req_id" not in sample.labels, family.name


CATALOGUE = Path(__file__).resolve().parents[2] / "deploy" / "metrics_catalogue.json"


def test_exported_families_match_the_deploy_catalogue_exactly(manager) -> None:
    """Names, types, label names and exemplars agree with deploy/metrics_catalogue.json."""
    entries = {e["name"]: e for e in json.loads(CATALOGUE.read_text())["metrics"]}
    reg = CollectorRegistry()
    met = Metrics(
        reg,
        snapshot=lambda: snapshot_of(
            manager,
            [LiveRequestRow("r", 1, 1, 1, 1)],
            remote=REMOTE_STATE,
            disk=DISK_STATE,
            obj=OBJECT_STATE,
        ),
        live_request_series=True,
        tiers=["disk", "remote", "object"],
    )
    ctx = ReqContext("r")
    manager.on_new_request(ctx)
    for i in range(10):  # evict, so the evictions family has a series
        out = manager.prepare_store([bytes([i])], ctx)
        manager.complete_store(out.keys_to_store, ctx)
    met.http_call("/livez", "GET", 200, 0.001, "r")
    met.manager_op("lookup", "ok", "r", {"hit": 1})
    met.transfer_done("store", True, 1, 0.1, None, "r")
    met.transfer_done("load", False, 0, 0.1, "deadline", "r")
    met.policy_switched("lru", "arc")
    met.tier_io("remote", "exists", 0.001, 4, "r")
    met.tier_io("disk", "write", 0.002, 3, None)
    met.tier_io("disk", "read", 0.001, 2, "r")
    met.tier_io("object", "delete", 0.003, 4, None)
    register_tenancy(reg, lambda: (2, 1, False))  # with --tenants, the front registry's
    # kvoffload serve's listeners (app.server), in the registry /metrics serves.
    register_connections(reg, lambda: [ListenerConnections("engine", 3, 8, {"peer_cap": 2})])
    # kvoffload serve's KV-event publisher (--kv-events-endpoint).
    register_kv_events(reg, lambda: (5, 1, 2))
    exported = {}
    for family in reg.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = {k for s in family.samples for k in s.labels if k != "le"}
        with_exemplar = any(s.exemplar is not None for s in family.samples)
        exported[name] = (family.type, labels, with_exemplar)
    assert set(exported) == set(entries)
    for name, (kind, labels, with_exemplar) in exported.items():
        entry = entries[name]
        assert kind == entry["type"], name
        assert labels == set(entry.get("labels", [])), name
        assert with_exemplar == ("req_id" in entry.get("exemplar_labels", [])), name


def test_every_tier_exports_one_family_set_labelled_by_tier() -> None:
    manager = create_manager(8)
    reg = CollectorRegistry()
    met = Metrics(
        reg,
        snapshot=lambda: snapshot_of(manager, remote=REMOTE_STATE, disk=DISK_STATE),
        tiers=["disk", "remote"],
    )

    def value(name: str, **labels: str) -> float | None:
        return reg.get_sample_value(f"kvoffload_tier_{name}", labels)

    assert value("up", tier="disk") == 1
    assert value("up", tier="remote") == 0
    assert value("blocks", tier="disk") == 4
    assert value("blocks", tier="remote") is None  # a shared store's count is not known
    assert value("capacity_blocks", tier="disk") == 16
    assert value("queue_depth", tier="remote") == 2
    assert value("demoted_blocks_total", tier="disk") == 5
    assert value("demotions_dropped_total", tier="disk", reason="staging_full") == 2
    assert value("demotions_dropped_total", tier="remote", reason="queue_full") == 1
    assert value("promoted_blocks_total", tier="disk") == 2
    assert value("bytes_read_total", tier="disk") == 8192
    assert value("bytes_written_total", tier="remote") == 4096
    assert value("incidents_total", tier="remote") == 1
    met.tier_io("disk", "read", 0.003, 2, "req-7")
    met.tier_io("disk", "write", 0.2, 32, None)
    met.tier_io("remote", "exists", 0.001, 4, "req-8")
    text = generate_latest(reg).decode()
    assert 'kvoffload_tier_io_keys_total{op="read",tier="disk"} 2.0 # {req_id="req-7"} 2.0' in text
    assert 'kvoffload_tier_io_keys_total{op="write",tier="disk"} 32.0\n' in text
    assert 'kvoffload_tier_io_keys_total{op="exists",tier="remote"} 4.0' in text
    assert (
        'kvoffload_tier_io_duration_seconds_bucket{le="0.005",op="read",tier="disk"} 1.0 '
        '# {req_id="req-7"}' in text
    )
    # No tier: no tier family at all.
    plain = CollectorRegistry()
    Metrics(plain, snapshot=lambda: snapshot_of(manager))
    assert not [f for f in plain.collect() if f.name.startswith("kvoffload_tier")]


def test_remote_tier_own_families_follow_its_state() -> None:
    manager = create_manager(8)
    reg = CollectorRegistry()
    Metrics(reg, snapshot=lambda: snapshot_of(manager, remote=REMOTE_STATE), tiers=["remote"])
    assert reg.get_sample_value("kvoffload_remote_hits_total") == 3
    assert reg.get_sample_value("kvoffload_remote_misses_total") == 0
    assert reg.get_sample_value("kvoffload_remote_tracked_blocks") == 5
    assert reg.get_sample_value("kvoffload_remote_removed_blocks_total") == 4
    plain = CollectorRegistry()
    Metrics(plain, snapshot=lambda: snapshot_of(manager))
    assert not [f for f in plain.collect() if f.name.startswith("kvoffload_remote")]


def test_disk_tier_own_families_follow_its_state() -> None:
    manager = create_manager(8)
    reg = CollectorRegistry()
    Metrics(reg, snapshot=lambda: snapshot_of(manager, disk=DISK_STATE), tiers=["disk"])
    assert reg.get_sample_value("kvoffload_disk_writes_total") == 5
    assert reg.get_sample_value("kvoffload_disk_write_failures_total") == 0
    assert reg.get_sample_value("kvoffload_disk_checksum_failures_total") == 1
    assert reg.get_sample_value("kvoffload_disk_admissions_refused_total") == 3
    assert reg.get_sample_value("kvoffload_disk_evictions_total") == 1
    plain = CollectorRegistry()
    Metrics(plain, snapshot=lambda: snapshot_of(manager))
    assert not [f for f in plain.collect() if f.name.startswith("kvoffload_disk")]


def test_connection_families_export_every_reason_of_every_listener_from_zero() -> None:
    reg = CollectorRegistry()
    rows = [
        ListenerConnections("engine", 5, 700, {"head_timeout": 4, "listener_cap": 1}),
        ListenerConnections("admin", 1, 64, {}),
    ]
    register_connections(reg, lambda: rows)
    assert reg.get_sample_value("kvoffload_connections_open", {"listener": "engine"}) == 5
    assert reg.get_sample_value("kvoffload_connections_max", {"listener": "admin"}) == 64
    closed = {
        (s.labels["listener"], s.labels["reason"]): s.value
        for family in reg.collect()
        if family.name == "kvoffload_connections_closed"
        for s in family.samples
        if s.name.endswith("_total")
    }
    assert len(closed) == 8  # 2 listeners x 4 reasons, zeros included: rates start at once
    assert closed["engine", "head_timeout"] == 4
    assert closed["engine", "listener_cap"] == 1
    assert closed["admin", "peer_cap"] == 0
