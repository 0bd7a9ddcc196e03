"""The disk tier's metrics after real API calls: a demotion and a promotion through one
in-process service with ``--disk-dir``, then the scrape (OpenMetrics): the families, their
values, the read's ``req_id`` exemplar, and the exposition against the catalogue."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.app.exposition import (
    OPENMETRICS,
    Exposition,
    base_name,
    catalogue,
    catalogue_mismatches,
    parse,
)
from tests.deploy.helpers import DASHBOARD, all_rules, dashboard_expressions, load_json
from tests.deploy.promql import Analysis, analyse
from testsupport.api_harness import BLOCK, Harness, hexkeys, make_settings, running
from testsupport.polling import until_async
from transfer.disk import slots_for

pytestmark = pytest.mark.anyio

POOL_BLOCKS = 4
DISK_BYTES = 64 * 1024 * 4  # room for several pools' worth of blocks


def disk_settings(disk_dir: Path, **overrides: Any) -> Any:
    base: dict[str, Any] = {
        "num_blocks": POOL_BLOCKS,
        "disk_dir": disk_dir,
        "disk_bytes": DISK_BYTES,
        "disk_admit_after": 1,
        "disk_batch_bytes": 2 * 4096,  # two write batches for the four demotions
    }
    base.update(overrides)
    return make_settings(**base)


async def store(h: Harness, req: str, keys: list[str], fill: int) -> dict[str, bytes]:
    """Store ``keys`` through the pool, bytes written into the slots; their bytes."""
    await h.start(req)
    r = await h.post(f"/v1/requests/{req}/prepare-store", {"keys": keys})
    assert r.status_code == 200, r.text
    pool = h.service.transfers().pool
    data = {}
    for i, (key, slot) in enumerate(zip(r.json()["keys_to_store"], r.json()["slots"], strict=True)):
        data[key] = bytes([(fill + i) % 256]) * BLOCK
        pool.tensor[slot].numpy()[:] = memoryview(data[key])
    r = await h.post(f"/v1/requests/{req}/complete-store", {"keys": keys})
    assert r.json()["completed"] == keys
    assert (await h.client.delete(f"/v1/requests/{req}")).status_code == 200
    return data


async def demoted(h: Harness, count: int) -> None:
    async def done() -> bool:
        disk = (await h.admin.get("/admin/v1/stats")).json()["tiers"]["disk"]
        return bool(disk["demotions"]["written"] >= count and disk["queue"]["depth"] == 0)

    await until_async("done", done)


async def promote(h: Harness, req: str, keys: list[str]) -> list[int]:
    """Load ``keys`` (on disk, not in the pool) for ``req``: the first prepare-load starts the
    promotion (409), the next one pins them; their pool slots."""
    await h.start(req)
    r = await h.post(f"/v1/requests/{req}/lookup", {"keys": keys})
    assert r.json()["results"] == ["disk"] * len(keys), r.text
    r = await h.post(f"/v1/requests/{req}/prepare-load", {"keys": keys})
    assert r.status_code == 409, r.text

    async def ready() -> bool:
        r = await h.post(f"/v1/requests/{req}/lookup", {"keys": keys})
        return bool(r.json()["hit_prefix"] == len(keys))

    await until_async("ready", ready)
    r = await h.post(f"/v1/requests/{req}/prepare-load", {"keys": keys})
    assert r.status_code == 200, r.text
    slots: list[int] = r.json()["slots"]
    return slots


async def scrape(h: Harness) -> Exposition:
    r = await h.client.get("/metrics", headers={"accept": OPENMETRICS})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    return parse(r.text)


async def test_a_demotion_and_a_promotion_show_in_the_disk_metrics(tmp_path: Path) -> None:
    settings = disk_settings(tmp_path)
    slots = slots_for(DISK_BYTES, BLOCK)
    first, second = hexkeys(1, 2, 3, 4), hexkeys(5, 6, 7, 8)
    async with running(settings) as h:
        data = await store(h, "w1", first, fill=11)
        await store(h, "w2", second, fill=31)  # evicts the first four: demoted to disk
        await demoted(h, 4)
        pool_slots = await promote(h, "r-disk", first[:1])
        assert bytes(h.service.transfers().pool.tensor[pool_slots[0]].numpy()) == data[first[0]]
        await h.post("/v1/requests/r-disk/complete-load", {"keys": first[:1]})
        await demoted(h, 5)  # the pool block the promotion displaced
        ex = await scrape(h)

    # The disk's own families and every tier's, as the catalogue has them (the per-call
    # families this test leaves empty are checked in test_obs_metrics), all exported.
    assert [p for p in catalogue_mismatches(ex) if p.startswith(TIER_FAMILIES)] == []
    disk = {name for name in catalogue() if name.startswith("kvoffload_disk_")}
    assert len(disk) == 7
    tier = {name for name in catalogue() if name.startswith("kvoffload_tier_")}
    assert len(tier) == 12
    assert {base_name(name) for name in disk | tier} <= set(ex.families)
    assert ex.value("kvoffload_tier_up", tier="disk") == 1
    assert ex.value("kvoffload_tier_capacity_blocks", tier="disk") == slots
    # Inclusive: the promoted block stays on disk; the one it displaced in the pool went down.
    assert ex.value("kvoffload_tier_blocks", tier="disk") == 5
    assert ex.value("kvoffload_tier_queue_depth", tier="disk") == 0
    assert ex.value("kvoffload_disk_writes_total") == 5
    assert ex.value("kvoffload_tier_bytes_written_total", tier="disk") == 5 * BLOCK
    assert ex.value("kvoffload_disk_reads_total") == 1
    assert ex.value("kvoffload_tier_bytes_read_total", tier="disk") == BLOCK
    assert ex.value("kvoffload_tier_promoted_blocks_total", tier="disk") == 1
    assert ex.value("kvoffload_tier_incidents_total", tier="disk") == 0
    for name in (
        "kvoffload_disk_write_failures_total",
        "kvoffload_disk_read_failures_total",
        "kvoffload_disk_checksum_failures_total",
        "kvoffload_disk_admissions_refused_total",
        "kvoffload_disk_evictions_total",
    ):
        assert ex.value(name) == 0, name
    # Nothing dropped (a reason may show with 0 once its path ran).
    assert all(
        s.value == 0 for s in ex.samples("kvoffload_tier_demotions_dropped_total", tier="disk")
    )
    # One read batch for the promotion, its request as the exemplar; write batches have none.
    assert ex.value("kvoffload_tier_io_duration_seconds_count", tier="disk", op="read") == 1
    assert ex.value("kvoffload_tier_io_keys_total", tier="disk", op="read") == 1
    assert ex.exemplar_ids("kvoffload_tier_io_duration_seconds_bucket", tier="disk", op="read") == {
        "r-disk"
    }
    assert ex.exemplar_ids("kvoffload_tier_io_keys_total", tier="disk", op="read") == {"r-disk"}
    assert ex.value("kvoffload_tier_io_keys_total", tier="disk", op="write") == 5
    writes = ex.value("kvoffload_tier_io_duration_seconds_count", tier="disk", op="write")
    assert writes is not None
    assert writes >= 3  # batches of at most two blocks
    assert (
        ex.exemplar_ids("kvoffload_tier_io_duration_seconds_bucket", tier="disk", op="write")
        == set()
    )
    assert disk_selectors_not_live(ex) == []


#: The families a disk tier exports: its own and every tier's (labelled ``tier``).
TIER_FAMILIES = ("kvoffload_disk_", "kvoffload_tier_")


def disk_selectors_not_live(ex: Exposition) -> list[str]:
    """Every disk series a rule or a dashboard panel selects that the scrape lacks, or lacks
    with a label it matches on or, for ``=``, with that value (``kvoffload_disk_*``, and
    ``kvoffload_tier_*`` unless it selects another tier)."""
    live: dict[str, list[dict[str, str]]] = {}
    for _, samples in ex.families.values():
        for sample in samples:
            live.setdefault(sample.name, []).append(dict(sample.labels))
    found: list[tuple[str, Analysis]] = [
        (f"rule {r.get('alert') or r.get('record')}", analyse(r["expr"])) for r in all_rules()
    ]
    found += dashboard_expressions(load_json(DASHBOARD))
    problems = []
    for where, analysis in found:
        for selector in analysis.selectors:
            name = selector.name
            if name is None or not name.startswith(TIER_FAMILIES):
                continue
            if any(
                m.label == "tier" and m.op == "=" and m.value != "disk" for m in selector.matchers
            ):
                continue  # another tier's series
            if name not in live:
                problems.append(f"{where}: {name} not exported")
                continue
            for m in selector.matchers:
                if m.label in ("job", "instance", "tenant"):
                    continue
                if not any(m.label in labels for labels in live[name]):
                    problems.append(f"{where}: {name} has no label {m.label}")
                elif m.op == "=" and not any(ls.get(m.label) == m.value for ls in live[name]):
                    problems.append(f"{where}: no live {name}{{{m.label}={m.value!r}}}")
    return problems


async def test_blocks_asked_too_rarely_are_refused_admission(tmp_path: Path) -> None:
    async with running(disk_settings(tmp_path, disk_admit_after=2)) as h:
        await store(h, "w1", hexkeys(1, 2, 3, 4), fill=1)  # asked once each
        await store(h, "w2", hexkeys(5, 6, 7, 8), fill=2)  # evicts them
        ex = await scrape(h)
    assert ex.value("kvoffload_disk_admissions_refused_total") == 4
    assert ex.value("kvoffload_disk_writes_total") == 0
    assert ex.value("kvoffload_tier_blocks", tier="disk") == 0


def corrupt_every_block(disk_dir: Path) -> None:
    """Overwrite the tier's block file (every slot) behind its back."""
    (blocks,) = disk_dir.glob("*/blocks")
    size = blocks.stat().st_size
    fd = os.open(blocks, os.O_WRONLY)
    try:
        os.pwrite(fd, b"\xa5" * size, 0)
        os.fsync(fd)
    finally:
        os.close(fd)


async def corrupt_read(tmp_path: Path) -> Exposition:
    """Demote four blocks, corrupt them on disk, ask for one: the scrape after its read."""
    async with running(disk_settings(tmp_path)) as h:
        keys = hexkeys(1, 2, 3, 4)
        await store(h, "w1", keys, fill=1)
        await store(h, "w2", hexkeys(5, 6, 7, 8), fill=2)
        await demoted(h, 4)
        corrupt_every_block(tmp_path)
        await h.start("r-bad")
        r = await h.post("/v1/requests/r-bad/prepare-load", {"keys": keys[:1]})
        assert r.status_code == 409, r.text

        async def dropped() -> bool:
            r = await h.post("/v1/requests/r-bad/lookup", {"keys": keys[:1]})
            return bool(r.json()["results"] == ["miss"])  # never loaded: a miss

        await until_async("dropped", dropped)
        return await scrape(h)


async def test_a_corrupt_block_is_a_checksum_failure_never_a_hit(tmp_path: Path) -> None:
    ex = await corrupt_read(tmp_path)
    assert ex.value("kvoffload_disk_checksum_failures_total") == 1
    assert ex.value("kvoffload_disk_reads_total") == 0
    assert ex.value("kvoffload_disk_read_failures_total") == 0
    assert ex.value("kvoffload_tier_promoted_blocks_total", tier="disk") == 0
    # The read batch still ran for the request (its exemplar), the tier stays up.
    assert ex.exemplar_ids("kvoffload_tier_io_duration_seconds_bucket", tier="disk", op="read") == {
        "r-bad"
    }
    assert ex.value("kvoffload_tier_up", tier="disk") == 1


async def test_a_corrupt_block_is_not_a_dropped_demotion(tmp_path: Path) -> None:
    ex = await corrupt_read(tmp_path)
    reasons = {
        s.labels["reason"]
        for s in ex.samples("kvoffload_tier_demotions_dropped_total", tier="disk")
    }
    assert "bad" not in reasons
    assert [p for p in catalogue_mismatches(ex) if p.startswith(TIER_FAMILIES)] == []
