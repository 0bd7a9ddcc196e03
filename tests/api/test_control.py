"""Cache control through the engine and admin APIs: retain, retentions, prefetch, demote, drop.

One in-process service (32 blocks of 4 KiB, the harness's settings), with a real disk tier in a
temp dir where a test needs a tier below the pool. A *flood* stores 40 new keys, which evicts
every block of the pool that nothing keeps; a retained, pinned or prefetch-held block must
survive it. Every refusal is checked for what it answers *and* for what did not change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import app.core.cache_hints as cache_hints
import app.core.control_shared as control_shared
import app.core.retentions as retentions_module
import app.core.slices as slices
import app.http.operations as operations
from app.core.disk import DiskLink
from app.telemetry.logging import AUDIT_LOGGER, fields_of
from manager import OffloadManager
from tests.api.test_disk_tier import gated, pool_bytes, store
from tests.app.exposition import OPENMETRICS, parse
from testsupport.api_harness import BLOCK, TOKEN, Harness, hexkeys, make_settings, running
from testsupport.polling import until_async
from transfer.disk import disk_bytes_for

pytestmark = pytest.mark.anyio

FLOOD = 1000  # flood keys start here


# --------------------------------------------------------------------------- helpers


@contextlib.asynccontextmanager
async def disk_node(directory: Path, **overrides: Any) -> AsyncIterator[Harness]:
    """A service with a disk tier of 64 blocks under ``directory`` that admits every block."""
    settings: dict[str, Any] = {
        "disk_dir": directory,
        "disk_bytes": disk_bytes_for(64, BLOCK),
        "disk_admit_after": 1,
        "disk_batch_bytes": 8 * BLOCK,
        **overrides,
    }
    async with running(make_settings(**settings)) as h:
        yield h


async def flood(h: Harness, start: int = FLOOD, count: int = 40) -> None:
    """Store ``count`` new keys: more than the pool holds, so everything evictable goes."""
    await store(h, "flood", hexkeys(*range(start, start + count)))


async def lookup(h: Harness, keys: list[str]) -> list[str]:
    await h.start("look")
    r = await h.post("/v1/requests/look/lookup", {"keys": keys})
    assert r.status_code == 200, r.text
    results: list[str] = r.json()["results"]
    return results


async def pin(h: Harness, req: str, keys: list[str]) -> list[int]:
    """Pin ``keys`` with a prepare-load of request ``req``; their slots."""
    await h.start(req)
    r = await h.post(f"/v1/requests/{req}/prepare-load", {"keys": keys})
    assert r.status_code == 200, r.text
    slots: list[int] = r.json()["slots"]
    return slots


async def unpin(h: Harness, req: str, keys: list[str]) -> None:
    """End the pins ``pin`` took (complete-load)."""
    r = await h.post(f"/v1/requests/{req}/complete-load", {"keys": keys})
    assert r.status_code == 200, r.text


async def retain(
    h: Harness, req: str, keys: list[str], ttl_s: Any = 30.0, **extra: Any
) -> httpx.Response:
    return await h.post(f"/v1/requests/{req}/retain", {"keys": keys, "ttl_s": ttl_s, **extra})


async def prefetch(h: Harness, req: str, keys: list[str], deadline_s: Any = 30.0) -> httpx.Response:
    return await h.post(f"/v1/requests/{req}/prefetch", {"keys": keys, "deadline_s": deadline_s})


async def retentions(h: Harness) -> dict[str, Any]:
    r = await h.client.get("/v1/retentions")
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def get_prefetch(h: Harness, pid: int, wait_s: float = 0.0) -> dict[str, Any]:
    params = {"wait_s": wait_s} if wait_s else {}
    r = await h.client.get(f"/v1/prefetches/{pid}", params=params)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def error(r: httpx.Response) -> tuple[int, str]:
    return r.status_code, r.json()["error"]["code"]


async def disk_stats(h: Harness) -> dict[str, Any]:
    r = await h.admin.get("/admin/v1/stats")
    assert r.status_code == 200, r.text
    disk: dict[str, Any] = r.json()["tiers"]["disk"]
    return disk


async def demoted(h: Harness, count: int) -> None:
    """Wait until the disk tier wrote ``count`` demoted blocks."""

    async def done() -> bool:
        return bool((await disk_stats(h))["demotions"]["written"] >= count)

    await until_async("done", done)


async def on_disk(h: Harness, count: int = 8) -> tuple[list[str], dict[str, bytes]]:
    """Store 32 + ``count`` keys (1, 2, ...): the ``count`` oldest go to disk; those keys and
    the bytes of all."""
    keys = hexkeys(*range(1, 33 + count))
    data = await store(h, "w", keys)
    await demoted(h, count)
    cold = keys[:count]
    assert await lookup(h, cold) == ["disk"] * count
    return cold, data


async def events(h: Harness) -> list[dict[str, Any]]:
    r = await h.client.get("/v1/events", params={"limit": 1000})
    assert r.status_code == 200, r.text
    out: list[dict[str, Any]] = r.json()["events"]
    return out


def event_keys(evs: list[dict[str, Any]], kind: str, medium: str) -> set[str]:
    return {
        k for e in evs if e["type"] == kind and e["medium"] == medium for k in e["block_hashes"]
    }


# --------------------------------------------------------------------------- retain


@contextlib.contextmanager
def in_steps_of_two(
    monkeypatch: pytest.MonkeyPatch, op_name: str, step_keys: list[tuple[Any, str]]
) -> Iterator[None]:
    """Every ``op_name`` call in steps of 2 keys (each module's step size in ``step_keys``
    set to 2), the loop given way between any two steps."""
    op = operations.BY_NAME[op_name]
    above = op.steps_above
    object.__setattr__(op, "steps_above", 1)  # a frozen dataclass: restored below
    for module, name in step_keys:
        monkeypatch.setattr(module, name, 2)
    monkeypatch.setattr(slices, "YIELD_AFTER_S", 0.0)
    try:
        yield
    finally:
        object.__setattr__(op, "steps_above", above)


def retain_in_steps(monkeypatch: pytest.MonkeyPatch) -> contextlib.AbstractContextManager[None]:
    """Every retain in steps of 2 keys."""
    keys = [(retentions_module, "STEP_KEYS"), (control_shared, "STEP_KEYS")]
    return in_steps_of_two(monkeypatch, "retain", keys)


@pytest.fixture(params=["whole", "in steps"])
def retain_steps(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each retain test twice: as one call, and in steps (``Retentions.retain``'s): the
    same answers, retentions and bounds."""
    if request.param == "whole":
        yield
        return
    with retain_in_steps(monkeypatch):
        yield


async def test_a_retain_in_steps_is_one_call_to_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    """A retain of 12 keys in steps of 2, the loop given way between them: a call that enters
    the namespace's manager while the retain is suspended finds no retention yet (the keys
    were being looked at) or the whole one, every key retained, never a part."""
    with retain_in_steps(monkeypatch):
        async with running(make_settings()) as h:
            keys = hexkeys(*range(1, 13))
            await store(h, "w", keys)
            manager = h.service.pool_manager
            seen: list[tuple[int, int] | None] = []

            async def other_calls() -> None:
                for _ in range(400):
                    await asyncio.sleep(0)
                    if manager.suspended:  # between two steps
                        r = await h.client.get("/v1/retentions/s")
                        body = r.json()
                        seen.append(
                            None if r.status_code == 404 else (body["keys"], body["in_pool"])
                        )
                        if seen[-1] is not None:
                            return

            looker = asyncio.create_task(other_calls())
            r = await retain(h, "s", keys)
            await looker
            assert r.status_code == 201, r.text
            assert r.json()["results"] == ["hit"] * 12
            assert seen[-1] == (12, 12), seen
            assert set(seen[:-1]) <= {None}, seen


async def test_retain_creates_then_extends_a_retention_named_after_the_request(
    h: Harness, retain_steps: None
) -> None:
    await store(h, "w", hexkeys(1, 2, 3))
    r = await h.post("/v1/requests/w/prepare-store", {"keys": hexkeys(4)})  # pending
    assert r.status_code == 200, r.text

    r = await retain(h, "agent", hexkeys(1, 2), ttl_s=30)  # the request need not exist
    assert r.status_code == 201, r.text
    first = r.json()
    assert first["name"] == "agent"
    assert (first["keys"], first["in_pool"], first["created"], first["added"]) == (2, 2, True, 2)
    assert first["results"] == ["hit", "hit"]
    assert first["promoting"] == 0
    assert first["ttl_s"] == 30
    assert 29 < first["expires_in_s"] <= 30

    # Same name: the keys it lacks are added, the TTL restarts (with the new one).
    r = await retain(h, "agent", hexkeys(2, 3, 4), ttl_s=60)
    assert r.status_code == 200, r.text
    second = r.json()
    assert second["name"] == "agent"
    assert (second["keys"], second["in_pool"], second["created"], second["added"]) == (
        4,
        3,
        False,
        2,
    )
    assert second["results"] == ["hit", "hit", "pending"]
    assert second["ttl_s"] == 60
    assert 59 < second["expires_in_s"] <= 60

    # The pending key lands: it is kept from then on.
    r = await h.post("/v1/requests/w/complete-store", {"keys": hexkeys(4)})
    assert r.status_code == 200, r.text
    r = await h.client.get("/v1/retentions/agent")
    assert r.status_code == 200, r.text
    assert (r.json()["keys"], r.json()["in_pool"]) == (4, 4)

    # An explicit name wins over the request id.
    r = await retain(h, "r2", hexkeys(1), name="session-7")
    assert r.status_code == 201, r.text
    assert r.json()["name"] == "session-7"
    listing = await retentions(h)
    assert [x["name"] for x in listing["retentions"]] == ["agent", "session-7"]  # oldest first
    assert listing["retained_blocks"] == 4  # distinct keys
    assert listing["max_retained_blocks"] == 16  # half the pool by default
    assert set(listing["retentions"][0]) == {
        "name",
        "keys",
        "in_pool",
        "ttl_s",
        "expires_in_s",
        "age_s",
    }

    await flood(h)
    assert await lookup(h, hexkeys(1, 2, 3, 4)) == ["hit"] * 4


async def test_retained_blocks_survive_a_flood_until_released(h: Harness) -> None:
    await store(h, "w", hexkeys(*range(1, 9)))
    r = await retain(h, "s", hexkeys(1, 2, 3, 4))
    assert r.status_code == 201, r.text
    await flood(h)
    assert await lookup(h, hexkeys(*range(1, 9))) == ["hit"] * 4 + ["miss"] * 4

    r = await h.client.delete("/v1/retentions/s")
    assert r.status_code == 200, r.text
    assert (r.json()["name"], r.json()["keys"], r.json()["in_pool"]) == ("s", 4, 4)
    assert (await retentions(h))["retentions"] == []
    assert error(await h.client.get("/v1/retentions/s")) == (404, "unknown_retention")
    await flood(h, FLOOD + 100)
    assert await lookup(h, hexkeys(1, 2, 3, 4)) == ["miss"] * 4


async def test_a_pool_full_of_retained_and_pinned_blocks_refuses_stores(h: Harness) -> None:
    keys = hexkeys(*range(1, 33))
    await store(h, "w", keys)
    r = await retain(h, "s", keys[:16])
    assert r.status_code == 201, r.text
    await pin(h, "p", keys[16:])
    before = await retentions(h)

    await h.start("w2")
    r = await h.post("/v1/requests/w2/prepare-store", {"keys": hexkeys(100)})
    assert error(r) == (507, "no_space"), r.text

    assert await lookup(h, keys) == ["hit"] * 32
    assert await lookup(h, hexkeys(100)) == ["miss"]
    after = await retentions(h)
    assert after["retained_blocks"] == before["retained_blocks"] == 16
    assert [(x["name"], x["keys"], x["in_pool"]) for x in after["retentions"]] == [("s", 16, 16)]
    # The pins end: the pinned half is evictable again, the retained half is not.
    await unpin(h, "p", keys[16:])
    await flood(h)
    assert await lookup(h, keys) == ["hit"] * 16 + ["miss"] * 16


async def test_a_retention_expires_through_the_lease_sweeper(
    h: Harness, retain_steps: None
) -> None:
    await store(h, "w", hexkeys(1, 2, 3))
    r = await retain(h, "s", hexkeys(1, 2), ttl_s=0.3)
    assert r.status_code == 201, r.text
    assert r.json()["ttl_s"] == 0.3

    async def gone() -> bool:
        r = await h.client.get("/v1/retentions/s")
        assert r.status_code in (200, 404), r.text
        return r.status_code == 404

    await until_async("gone", gone, 5.0)
    assert (await retentions(h))["retained_blocks"] == 0
    await flood(h)
    assert await lookup(h, hexkeys(1, 2)) == ["miss", "miss"]


async def test_renew_restarts_the_ttl(h: Harness) -> None:
    await store(h, "w", hexkeys(1, 2))
    assert (await retain(h, "s", hexkeys(1, 2), ttl_s=0.3)).status_code == 201
    r = await h.post("/v1/retentions/s/renew", {"ttl_s": 30})
    assert r.status_code == 200, r.text
    assert (r.json()["name"], r.json()["ttl_s"], r.json()["keys"]) == ("s", 30, 2)
    assert 29 < r.json()["expires_in_s"] <= 30
    await asyncio.sleep(0.5)  # well past the first TTL, sweeper rounds of 0.05 s
    r = await h.client.get("/v1/retentions/s")
    assert r.status_code == 200, r.text
    assert r.json()["in_pool"] == 2
    await flood(h)
    assert await lookup(h, hexkeys(1, 2)) == ["hit", "hit"]

    for bad in (0, -1, "5", 3601):
        r = await h.post("/v1/retentions/s/renew", {"ttl_s": bad})
        assert r.status_code == 422, (bad, r.text)
    assert (await h.client.get("/v1/retentions/s")).json()["ttl_s"] == 30


async def test_unknown_retentions_are_404(h: Harness) -> None:
    assert error(await h.client.get("/v1/retentions/nope")) == (404, "unknown_retention")
    r = await h.post("/v1/retentions/nope/renew", {"ttl_s": 5})
    assert error(r) == (404, "unknown_retention")
    assert error(await h.client.delete("/v1/retentions/nope")) == (404, "unknown_retention")
    assert error(await h.admin.delete("/admin/v1/retentions/nope")) == (404, "unknown_retention")


async def test_retaining_a_key_held_nowhere_is_404_and_changes_nothing(
    h: Harness, retain_steps: None
) -> None:
    await store(h, "w", hexkeys(1, 2))
    r = await retain(h, "s", hexkeys(1, 999, 2))
    assert error(r) == (404, "unknown_keys"), r.text
    assert hexkeys(999)[0] in r.text
    assert await retentions(h) == {
        "retentions": [],
        "retained_blocks": 0,
        "max_retained_blocks": 16,
    }
    # Not even the known keys were retained.
    await flood(h)
    assert await lookup(h, hexkeys(1, 2)) == ["miss", "miss"]


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"ttl_s": 0}, "invalid_field"),
        ({"ttl_s": -1}, "invalid_field"),
        ({"ttl_s": 3600.5}, "invalid_argument"),  # over retain_max_ttl_s
        ({"ttl_s": "5"}, "invalid_field"),
        ({"ttl_s": 5, "name": "x" * 257}, "invalid_field"),
        ({"ttl_s": 5, "name": ""}, "invalid_field"),
        ({}, "invalid_field"),
    ],
)
async def test_bad_retain_bodies_are_422_and_change_nothing(
    h: Harness, body: dict[str, Any], code: str
) -> None:
    await store(h, "w", hexkeys(1))
    r = await h.post("/v1/requests/r/retain", {"keys": hexkeys(1), **body})
    assert error(r) == (422, code), r.text
    assert (await retentions(h))["retentions"] == []


async def test_a_ttl_over_the_bound_names_the_bound_and_its_setting(h: Harness) -> None:
    await store(h, "w", hexkeys(1))
    assert (await retain(h, "r", hexkeys(1), ttl_s=60)).status_code == 201
    for path, body in (
        ("/v1/requests/r/retain", {"keys": hexkeys(1), "ttl_s": 3600.5}),
        ("/v1/retentions/r/renew", {"ttl_s": 3600.5}),
    ):
        r = await h.post(path, body)
        assert r.status_code == 422, r.text
        assert "0 < ttl_s <= 3600 (retain_max_ttl_s), got 3600.5" in r.text, r.text
    assert (await h.client.get("/v1/retentions/r")).json()["ttl_s"] == 60


async def test_a_256_character_name_and_the_longest_ttl_are_accepted(h: Harness) -> None:
    await store(h, "w", hexkeys(1))
    r = await retain(h, "r", hexkeys(1), ttl_s=3600, name="n" * 256)
    assert r.status_code == 201, r.text
    assert r.json()["name"] == "n" * 256
    assert (await h.client.get(f"/v1/retentions/{'n' * 256}")).status_code == 200


async def test_the_retained_blocks_quota_is_429_and_changes_nothing(retain_steps: None) -> None:
    async with running(make_settings(max_retained_blocks=4)) as h:
        await store(h, "w", hexkeys(*range(1, 9)))
        assert (await retain(h, "a", hexkeys(1, 2, 3))).status_code == 201
        r = await retain(h, "a", hexkeys(3, 4, 5))  # 2 more: 5 > 4
        assert error(r) == (429, "quota_exceeded"), r.text
        assert r.json()["error"]["quota"] == "retained_blocks"
        listing = await retentions(h)
        assert listing["retained_blocks"] == 3
        assert listing["max_retained_blocks"] == 4
        assert [(x["name"], x["keys"]) for x in listing["retentions"]] == [("a", 3)]
        # A key retained already counts once: another retention may name it.
        assert (await retain(h, "b", hexkeys(1, 2, 3, 4))).status_code == 201
        assert (await retentions(h))["retained_blocks"] == 4
        r = await retain(h, "c", hexkeys(5))
        assert r.json()["error"]["quota"] == "retained_blocks"
        await flood(h)
        assert await lookup(h, hexkeys(1, 2, 3, 4, 5)) == ["hit"] * 4 + ["miss"]


async def test_the_retention_keys_bound_is_429_and_changes_nothing(retain_steps: None) -> None:
    # Keys named by retentions, summed over them: many retentions of the same keys are bounded
    # although they add no distinct block.
    async with running(make_settings(max_retention_keys=5)) as h:
        await store(h, "w", hexkeys(1, 2, 3))
        assert (await retain(h, "a", hexkeys(1, 2, 3))).status_code == 201
        assert (await retain(h, "b", hexkeys(1, 2))).status_code == 201
        r = await retain(h, "c", hexkeys(1))  # 6 > 5
        assert error(r) == (429, "quota_exceeded"), r.text
        assert r.json()["error"]["quota"] == "retention_keys"
        r = await retain(h, "b", hexkeys(2, 3))  # 3 more: refused, "b" unchanged
        assert r.json()["error"]["quota"] == "retention_keys"
        listing = await retentions(h)
        assert [(x["name"], x["keys"]) for x in listing["retentions"]] == [("a", 3), ("b", 2)]
        # Keys a retention names already cost nothing more; an ended one gives its keys back.
        assert (await retain(h, "b", hexkeys(1, 2))).status_code == 200
        assert (await h.client.delete("/v1/retentions/a")).status_code == 200
        assert (await retain(h, "c", hexkeys(1, 2, 3))).status_code == 201


async def test_the_retentions_quota_is_429_and_a_taken_name_still_extends(
    retain_steps: None,
) -> None:
    async with running(make_settings(max_retentions=2)) as h:
        await store(h, "w", hexkeys(1, 2, 3))
        assert (await retain(h, "a", hexkeys(1))).status_code == 201
        assert (await retain(h, "b", hexkeys(2))).status_code == 201
        r = await retain(h, "c", hexkeys(3))
        assert error(r) == (429, "quota_exceeded"), r.text
        assert r.json()["error"]["quota"] == "retentions"
        listing = await retentions(h)
        assert [x["name"] for x in listing["retentions"]] == ["a", "b"]
        assert listing["retained_blocks"] == 2
        r = await retain(h, "a", hexkeys(3))
        assert r.status_code == 200, r.text
        assert r.json()["keys"] == 2


async def test_a_live_policy_switch_keeps_every_retention_and_its_blocks(h: Harness) -> None:
    await store(h, "w", hexkeys(*range(1, 9)))
    assert (await retain(h, "a", hexkeys(1, 2))).status_code == 201
    assert (await retain(h, "b", hexkeys(2, 3, 4))).status_code == 201
    before = [(x["name"], x["keys"], x["in_pool"]) for x in (await retentions(h))["retentions"]]
    r = await h.admin.put("/admin/v1/policy", json={"name": "arc"}, headers={"if-match": "*"})
    assert r.status_code == 200, r.text
    assert r.json()["changed"] is True
    after = [(x["name"], x["keys"], x["in_pool"]) for x in (await retentions(h))["retentions"]]
    assert after == before == [("a", 2, 2), ("b", 3, 3)]
    await flood(h)
    assert await lookup(h, hexkeys(*range(1, 9))) == ["hit"] * 4 + ["miss"] * 4
    # Released under the new policy, they are evictable by it.
    assert (await h.client.delete("/v1/retentions/a")).status_code == 200
    assert (await h.client.delete("/v1/retentions/b")).status_code == 200
    await flood(h, FLOOD + 100)
    assert await lookup(h, hexkeys(1, 2, 3, 4)) == ["miss"] * 4


async def test_admin_clear_keeps_retained_blocks_and_admin_releases_are_audited(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=AUDIT_LOGGER)
    await store(h, "w", hexkeys(*range(1, 7)))
    assert (await retain(h, "s", hexkeys(1, 2, 3))).status_code == 201
    r = await h.admin.post("/admin/v1/cache/clear")
    assert r.status_code == 200, r.text
    assert r.json() == {"dropped": 3, "kept_pinned": 0, "kept_pending": 0, "kept_retained": 3}
    assert await lookup(h, hexkeys(*range(1, 7))) == ["hit"] * 3 + ["miss"] * 3

    r = await h.admin.get("/admin/v1/retentions")
    assert r.status_code == 200, r.text
    listing = r.json()
    assert [(x["name"], x["keys"], x["in_pool"]) for x in listing["retentions"]] == [("s", 3, 3)]
    assert (listing["retained_blocks"], listing["max_retained_blocks"]) == (3, 16)
    stats = (await h.admin.get("/admin/v1/stats")).json()["control"]
    assert (stats["retentions"], stats["retained_blocks"], stats["retained_in_pool"]) == (1, 3, 3)

    r = await h.admin.delete("/admin/v1/retentions/s")
    assert r.status_code == 200, r.text
    assert (r.json()["name"], r.json()["keys"]) == ("s", 3)
    assert (await retentions(h))["retentions"] == []
    audits = [rec for rec in caplog.records if rec.name == AUDIT_LOGGER]
    assert [rec.getMessage() for rec in audits] == ["cache.clear", "retention.release"]
    fields = fields_of(audits[1])
    assert (fields["retention"], fields["keys"]) == ("s", 3)
    assert fields["actor"]
    assert TOKEN not in caplog.text
    r = await h.admin.post("/admin/v1/cache/clear")
    assert r.json()["dropped"] == 3
    assert r.json()["kept_retained"] == 0


async def test_a_restart_has_no_retentions() -> None:
    settings = make_settings()
    async with running(settings) as h:
        await store(h, "w", hexkeys(1, 2))
        assert (await retain(h, "s", hexkeys(1, 2))).status_code == 201
        assert len((await retentions(h))["retentions"]) == 1
    async with running(settings) as h:
        assert await retentions(h) == {
            "retentions": [],
            "retained_blocks": 0,
            "max_retained_blocks": 16,
        }
        assert error(await h.client.get("/v1/retentions/s")) == (404, "unknown_retention")


async def test_retain_promotes_keys_on_disk_and_keeps_them_once_they_land(
    tmp_path: Path, retain_steps: None
) -> None:
    async with disk_node(tmp_path) as h:
        cold, data = await on_disk(h)
        warm = hexkeys(40)
        r = await retain(h, "s", [*cold[:4], *warm])
        assert r.status_code == 201, r.text
        body = r.json()
        assert body["results"] == ["disk"] * 4 + ["hit"]
        assert body["promoting"] == 4
        assert (body["keys"], body["in_pool"]) == (5, 1)

        async def landed() -> bool:
            return bool((await h.client.get("/v1/retentions/s")).json()["in_pool"] == 5)

        await until_async("landed", landed)
        assert await lookup(h, cold[:4]) == ["hit"] * 4
        await flood(h)
        assert await lookup(h, [*cold[:4], *warm]) == ["hit"] * 5
        slots = await pin(h, "r", cold[:4])
        assert [pool_bytes(h, s) for s in slots] == [data[k] for k in cold[:4]]
        await unpin(h, "r", cold[:4])

        # The promotions' holds are let go once they settle (a task on the loop: an in-process
        # client's calls need not give the loop a turn).
        async def unheld() -> bool:
            return h.service.pool_manager.num_pinned == 0

        await until_async("no hold left", unheld)
        # Released: a flood pushes them down again.
        assert (await h.client.delete("/v1/retentions/s")).status_code == 200
        await flood(h, FLOOD + 100)
        assert "hit" not in await lookup(h, cold[:4])


# --------------------------------------------------------------------------- prefetch


async def test_prefetch_brings_disk_keys_up_holds_them_and_a_load_uses_them(
    tmp_path: Path,
) -> None:
    async with disk_node(tmp_path) as h:
        cold, data = await on_disk(h)
        r = await prefetch(h, "agent", cold[:4])
        assert r.status_code == 202, r.text
        p = r.json()
        assert p["req_id"] == "agent"
        assert p["results"] == ["disk"] * 4
        assert p["state"] == "promoting"
        assert p["counts"]["promoted"] == 4
        assert 29 < p["deadline_in_s"] <= 30
        pid = p["prefetch_id"]

        held = await get_prefetch(h, pid, wait_s=2)
        assert held["state"] == "held", held
        assert "results" not in held
        assert held["counts"]["landed"] == 4
        assert await lookup(h, cold[:4]) == ["hit"] * 4
        # Held: a flood cannot evict them.
        await flood(h)
        assert await lookup(h, cold[:4]) == ["hit"] * 4

        # A load by another request uses them.
        slots = await pin(h, "other", cold[:4])
        assert [pool_bytes(h, s) for s in slots] == [data[k] for k in cold[:4]]
        done = await get_prefetch(h, pid)
        assert done["state"] == "done", done
        assert done["counts"]["used"] == 4
        assert done["counts"].get("wasted", 0) == 0
        await unpin(h, "other", cold[:4])

        async def unheld() -> bool:
            return h.service.pool_manager.num_pinned == 0

        # No hold left behind: the prefetch's nor its promotions'.
        await until_async("nothing pinned", unheld)
        control = (await h.admin.get("/admin/v1/stats")).json()["control"]
        assert (control["prefetches_live"], control["prefetch_keys"]) == (0, 0)
        # Used and no longer held: evictable again.
        await flood(h, FLOOD + 100)
        assert "hit" not in await lookup(h, cold[:4])


async def test_an_onload_by_any_request_uses_a_prefetch(h: Harness) -> None:
    data = await store(h, "w", hexkeys(1, 2))
    p = (await prefetch(h, "agent", hexkeys(1, 2))).json()
    dev, cache_id = await h.device(4)
    await h.start("engine")
    body = {"cache_id": cache_id, "keys": hexkeys(1, 2), "device_blocks": [0, 1]}
    r = await h.post("/v1/requests/engine/onload", body)
    assert r.status_code == 202, r.text
    assert (await h.wait(r.json()["job_id"]))["state"] == "done"
    assert [dev.read(0), dev.read(1)] == [data[k] for k in hexkeys(1, 2)]
    done = await get_prefetch(h, p["prefetch_id"])
    assert (done["state"], done["counts"]["used"]) == ("done", 2)


async def test_a_prefetch_past_its_deadline_is_wasted(h: Harness) -> None:
    await store(h, "w", hexkeys(1, 2, 3))
    r = await prefetch(h, "r", hexkeys(1, 2, 3), deadline_s=0.2)
    assert r.status_code == 202, r.text
    p = r.json()
    assert (p["state"], p["results"], p["counts"]["hit"]) == ("held", ["hit"] * 3, 3)

    async def over() -> bool:
        return bool((await get_prefetch(h, p["prefetch_id"]))["state"] == "done")

    await until_async("over", over)
    done = await get_prefetch(h, p["prefetch_id"])
    assert done["counts"]["wasted"] == 3
    assert done["counts"].get("used", 0) == 0
    assert done["deadline_in_s"] == 0
    # A load after the deadline uses nothing.
    await pin(h, "late", hexkeys(1))
    assert (await get_prefetch(h, p["prefetch_id"]))["counts"].get("used", 0) == 0
    await unpin(h, "late", hexkeys(1))
    control = (await h.admin.get("/admin/v1/stats")).json()["control"]
    assert (control["prefetches_live"], control["prefetch_keys"]) == (0, 0)
    await flood(h)
    assert await lookup(h, hexkeys(1, 2, 3)) == ["miss"] * 3


async def test_a_cancelled_prefetch_lets_go_of_its_blocks(h: Harness) -> None:
    await store(h, "w", hexkeys(1, 2))
    p = (await prefetch(h, "r", hexkeys(1, 2))).json()
    r = await h.client.delete(f"/v1/prefetches/{p['prefetch_id']}")
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "cancelled"
    assert r.json()["counts"]["wasted"] == 2
    again = await get_prefetch(h, p["prefetch_id"])
    assert (again["state"], again["counts"]["wasted"]) == ("cancelled", 2)
    # Cancelling again changes nothing.
    r = await h.client.delete(f"/v1/prefetches/{p['prefetch_id']}")
    assert (r.status_code, r.json()["counts"]["wasted"]) == (200, 2)
    await flood(h)
    assert await lookup(h, hexkeys(1, 2)) == ["miss", "miss"]


async def test_prefetched_hits_are_held_and_misses_and_pending_keys_are_not(h: Harness) -> None:
    await store(h, "w", hexkeys(1, 2, 3, 4))
    r = await h.post("/v1/requests/w/prepare-store", {"keys": hexkeys(5)})
    assert r.status_code == 200, r.text
    r = await prefetch(h, "r", hexkeys(1, 2, 999, 5, 1))
    assert r.status_code == 202, r.text
    p = r.json()
    assert p["results"] == ["hit", "hit", "miss", "pending", "hit"]
    assert p["state"] == "held"
    counts = p["counts"]
    assert (counts["hit"], counts["miss"], counts["pending"]) == (2, 1, 1)
    await h.post("/v1/requests/w/complete-store", {"keys": hexkeys(5)})
    await flood(h)
    assert await lookup(h, hexkeys(1, 2, 3, 4, 5)) == ["hit", "hit", "miss", "miss", "miss"]

    # Only misses: nothing to hold, done at once.
    r = await prefetch(h, "r", hexkeys(998))
    assert r.status_code == 202, r.text
    assert (r.json()["state"], r.json()["results"]) == ("done", ["miss"])


async def test_a_pool_full_of_held_and_pinned_blocks_refuses_stores(h: Harness) -> None:
    keys = hexkeys(*range(1, 33))
    await store(h, "w", keys)
    r = await prefetch(h, "r", keys[:8])  # the default bound: a quarter of the pool
    assert r.status_code == 202, r.text
    pid = r.json()["prefetch_id"]
    await pin(h, "p", keys[8:])
    await h.start("w2")
    r = await h.post("/v1/requests/w2/prepare-store", {"keys": hexkeys(100)})
    assert error(r) == (507, "no_space"), r.text
    assert await lookup(h, keys) == ["hit"] * 32
    assert (await get_prefetch(h, pid))["state"] == "held"
    # The holds end: those blocks are evictable again, the pinned ones are not.
    assert (await h.client.delete(f"/v1/prefetches/{pid}")).status_code == 200
    r = await h.post("/v1/requests/w2/prepare-store", {"keys": hexkeys(100)})
    assert r.status_code == 200, r.text
    assert r.json()["evicted_keys"][0] in keys[:8]


async def test_the_prefetch_keys_bound_is_429_and_changes_nothing(h: Harness) -> None:
    keys = hexkeys(*range(1, 11))
    await store(h, "w", keys)
    r = await prefetch(h, "r", keys[:9])
    assert error(r) == (429, "quota_exceeded"), r.text
    assert r.json()["error"]["quota"] == "prefetch_keys"
    r = await prefetch(h, "r", keys[:6])
    assert r.status_code == 202, r.text
    r = await prefetch(h, "r", keys[6:9])  # 6 + 3 > 8
    assert r.json()["error"]["quota"] == "prefetch_keys"
    control = (await h.admin.get("/admin/v1/stats")).json()["control"]
    assert (control["prefetches_live"], control["prefetch_keys"]) == (1, 6)
    assert control["max_prefetch_keys"] == 8
    await flood(h)
    assert await lookup(h, keys) == ["hit"] * 6 + ["miss"] * 4


@pytest.mark.parametrize(
    ("deadline", "code"),
    [
        (0, "invalid_field"),
        (-1, "invalid_field"),
        (300.5, "invalid_argument"),
        ("1", "invalid_field"),
    ],
)
async def test_bad_prefetch_deadlines_are_422(h: Harness, deadline: Any, code: str) -> None:
    await store(h, "w", hexkeys(1))
    r = await prefetch(h, "r", hexkeys(1), deadline_s=deadline)
    assert error(r) == (422, code), r.text
    control = (await h.admin.get("/admin/v1/stats")).json()["control"]
    assert (control["prefetches_live"], control["prefetch_keys"]) == (0, 0)


async def test_unknown_prefetches_are_404(h: Harness) -> None:
    assert error(await h.client.get("/v1/prefetches/999")) == (404, "unknown_prefetch")
    r = await h.client.get("/v1/prefetches/999", params={"wait_s": 1})
    assert error(r) == (404, "unknown_prefetch")
    assert error(await h.client.delete("/v1/prefetches/999")) == (404, "unknown_prefetch")


async def test_a_prefetch_never_evicts_a_retained_or_pinned_block(tmp_path: Path) -> None:
    async with disk_node(tmp_path) as h:
        cold, _ = await on_disk(h)  # the pool holds 9..40
        warm = hexkeys(*range(9, 41))
        assert (await retain(h, "s", warm[:16])).status_code == 201
        await pin(h, "p", warm[16:31])  # one block left that may go: 40
        r = await prefetch(h, "r", cold[:1])
        assert r.status_code == 202, r.text
        p = r.json()
        assert p["results"] == ["disk"], p
        assert (await get_prefetch(h, p["prefetch_id"], wait_s=2))["state"] == "held"
        assert await lookup(h, [*warm[:31], cold[0]]) == ["hit"] * 32
        assert await lookup(h, warm[31:]) != ["hit"]  # the one block that could go went
        # Nothing evictable left: the next one is refused, and nothing moves.
        r = await prefetch(h, "r", cold[1:3])
        assert r.status_code == 202, r.text
        assert r.json()["results"] == ["refused", "refused"], r.text
        assert (r.json()["state"], r.json()["counts"]["refused"]) == ("done", 2)
        assert await lookup(h, [*warm[:31], *cold[:3]]) == ["hit"] * 32 + ["disk"] * 2


async def test_a_retained_key_on_disk_with_no_room_to_come_up_stays_retained_there(
    tmp_path: Path, retain_steps: None
) -> None:
    async with disk_node(tmp_path) as h:
        cold, _ = await on_disk(h)
        warm = hexkeys(*range(9, 41))
        await pin(h, "p", warm)  # nothing evictable
        r = await retain(h, "s", cold[:1])
        assert r.status_code == 201, r.text
        body = r.json()
        assert (body["results"], body["promoting"], body["in_pool"]) == (["disk"], 0, 0)
        ex = parse((await h.client.get("/metrics", headers={"accept": OPENMETRICS})).text)
        assert ex.value("kvoffload_retained_blocks", tier="disk") == 1
        assert ex.value("kvoffload_retained_blocks", tier="pool") == 0
        assert await lookup(h, [*warm, cold[0]]) == ["hit"] * 32 + ["disk"]


# --------------------------------------------------------------------------- demote and drop


def demote_in_steps(monkeypatch: pytest.MonkeyPatch) -> contextlib.AbstractContextManager[None]:
    """Every demote in steps of 2 keys."""
    return in_steps_of_two(monkeypatch, "demote", [(cache_hints, "DEMOTE_STEP_KEYS")])


@pytest.fixture(params=["whole", "in steps"])
def demote_steps(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each demote test twice: as one call, and in steps (``CacheHints.demote_steps``): the
    same answers and the same blocks moved."""
    if request.param == "whole":
        yield
        return
    with demote_in_steps(monkeypatch):
        yield


async def test_demote_moves_blocks_to_disk_with_their_bytes(
    tmp_path: Path, demote_steps: None
) -> None:
    async with disk_node(tmp_path) as h:
        keys = hexkeys(*range(1, 9))
        data = await store(h, "w", keys)
        r = await h.post("/v1/requests/hint/demote", {"keys": keys[:3]})
        assert r.status_code == 200, r.text
        assert r.json() == {
            "moved": keys[:3],
            "kept": {"pinned": 0, "retained": 0, "pending": 0, "not_in_pool": 0, "refused": 0},
        }
        await demoted(h, 3)
        assert await lookup(h, keys) == ["disk"] * 3 + ["hit"] * 5
        evs = await events(h)
        assert event_keys(evs, "BlockRemoved", "CPU") == set(keys[:3])
        assert event_keys(evs, "BlockStored", "DISK") == set(keys[:3])

        await h.start("r")
        r = await h.post("/v1/requests/r/prepare-load", {"keys": keys[:3]})
        assert error(r) == (409, "key_not_ready")

        async def back() -> bool:
            return await lookup(h, keys[:3]) == ["hit"] * 3

        await until_async("back", back)
        slots = await pin(h, "r", keys[:3])
        assert [pool_bytes(h, s) for s in slots] == [data[k] for k in keys[:3]]


async def test_a_demote_in_steps_is_one_call_to_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A demote of 12 keys in steps of 2, the loop given way between them: a lookup that
    enters the namespace's manager while the demote is suspended finds every key gone from
    the pool (the rest settled first), none still a hit."""
    with demote_in_steps(monkeypatch):
        async with disk_node(tmp_path) as h:
            keys = hexkeys(*range(1, 13))
            await store(h, "w", keys)
            await h.start("look")
            manager = h.service.pool_manager
            seen: list[list[str]] = []

            async def other_calls() -> None:
                for _ in range(200):
                    await asyncio.sleep(0)
                    if type(manager) is not OffloadManager:  # between two steps
                        r = await h.post("/v1/requests/look/lookup", {"keys": keys})
                        seen.append(r.json()["results"])
                        return

            looker = asyncio.create_task(other_calls())
            r = await h.post("/v1/requests/hint/demote", {"keys": keys})
            await looker
            assert r.status_code == 200, r.text
            assert r.json()["moved"] == keys
            assert len(seen) == 1
            assert "hit" not in seen[0], seen


async def test_demote_and_drop_keep_pinned_retained_and_pending_blocks(
    tmp_path: Path, demote_steps: None
) -> None:
    async with disk_node(tmp_path) as h:
        keys = hexkeys(*range(1, 9))
        await store(h, "w", keys)
        r = await h.post("/v1/requests/w/prepare-store", {"keys": hexkeys(50)})  # pending
        assert r.status_code == 200, r.text
        assert (await retain(h, "s", keys[:2])).status_code == 201
        await pin(h, "p", keys[2:4])
        named = [*keys[:6], *hexkeys(50, 999)]
        kept = {"pinned": 2, "retained": 2, "pending": 1, "not_in_pool": 1}
        named_twice = [*named[:5], *named[6:], keys[4], named[7]]  # counted once each
        r = await h.post("/v1/requests/hint/demote", {"keys": named_twice})
        assert r.status_code == 200, r.text
        assert r.json() == {"moved": [keys[4]], "kept": {**kept, "refused": 0}}
        r = await h.post("/v1/requests/hint/drop", {"keys": named})
        assert r.status_code == 200, r.text
        assert r.json() == {"moved": [keys[5]], "kept": {**kept, "not_in_pool": 2}}
        await demoted(h, 1)
        assert await lookup(h, keys[:6]) == ["hit"] * 4 + ["disk", "miss"]


async def test_demote_admits_what_the_disk_admission_would_refuse(tmp_path: Path) -> None:
    # The tiers page's disk tier (--disk-admit-after 2), after one engine flow: each block was
    # asked for once. An explicit demote is taken anyway, and a lookup then finds it on disk.
    async with disk_node(tmp_path, disk_admit_after=2) as h:
        keys = hexkeys(0x0A01, 0x0A02)
        data = await store(h, "w", keys)
        r = await h.post("/v1/requests/hint/demote", {"keys": keys})
        assert r.status_code == 200, r.text
        assert r.json() == {
            "moved": keys,
            "kept": {"pinned": 0, "retained": 0, "pending": 0, "not_in_pool": 0, "refused": 0},
        }
        await demoted(h, 2)
        assert (await disk_stats(h))["demotions"]["refused_admission"] == 0
        assert await lookup(h, keys) == ["disk", "disk"]
        await h.start("r")
        r = await h.post("/v1/requests/r/prepare-load", {"keys": keys})  # brings them up
        assert error(r) == (409, "key_not_ready")

        async def back() -> bool:
            return await lookup(h, keys) == ["hit", "hit"]

        await until_async("back", back)
        slots = await pin(h, "r", keys)
        assert [pool_bytes(h, s) for s in slots] == [data[k] for k in keys]


async def test_demote_keeps_in_the_pool_what_no_tier_below_takes(
    tmp_path: Path, demote_steps: None
) -> None:
    async with disk_node(tmp_path) as h:
        keys = hexkeys(1, 2, 3)
        await store(h, "w", keys)
        disk = h.service.tiers.get("disk")
        assert isinstance(disk, DiskLink)
        disk.store.stage([0] * disk.store.staging_free)  # every staging buffer taken
        r = await h.post("/v1/requests/hint/demote", {"keys": keys})
        assert r.status_code == 200, r.text
        assert r.json() == {
            "moved": [],
            "kept": {"pinned": 0, "retained": 0, "pending": 0, "not_in_pool": 0, "refused": 3},
        }
        assert await lookup(h, keys) == ["hit"] * 3


async def test_demote_without_a_lower_tier_is_409(h: Harness, demote_steps: None) -> None:
    await store(h, "w", hexkeys(1))
    r = await h.post("/v1/requests/hint/demote", {"keys": hexkeys(1)})
    assert error(r) == (409, "no_lower_tier"), r.text
    assert await lookup(h, hexkeys(1)) == ["hit"]


async def test_drop_removes_blocks_except_retained_and_pinned_ones(h: Harness) -> None:
    keys = hexkeys(*range(1, 7))
    await store(h, "w", keys)
    assert (await retain(h, "s", keys[:1])).status_code == 201
    await pin(h, "p", keys[1:2])
    r = await h.post("/v1/requests/hint/drop", {"keys": keys[:4]})
    assert r.status_code == 200, r.text
    assert r.json() == {
        "moved": keys[2:4],
        "kept": {"pinned": 1, "retained": 1, "pending": 0, "not_in_pool": 0},
    }
    assert await lookup(h, keys) == ["hit", "hit", "miss", "miss", "hit", "hit"]
    evs = await events(h)
    assert event_keys(evs, "BlockRemoved", "CPU") == set(keys[2:4])
    # Dropping again: nothing left to move.
    r = await h.post("/v1/requests/hint/drop", {"keys": keys[2:4]})
    assert r.json()["moved"] == []
    assert r.json()["kept"]["not_in_pool"] == 2


async def test_drop_leaves_the_copies_below(tmp_path: Path) -> None:
    async with disk_node(tmp_path) as h:
        keys = hexkeys(1, 2)
        await store(h, "w", keys)
        assert (await h.post("/v1/requests/hint/demote", {"keys": keys})).status_code == 200
        await demoted(h, 2)
        r = await retain(h, "up", keys)  # brings them back up
        assert r.status_code == 201, r.text

        async def landed() -> bool:
            return bool((await h.client.get("/v1/retentions/up")).json()["in_pool"] == 2)

        await until_async("landed", landed)
        assert (await h.client.delete("/v1/retentions/up")).status_code == 200
        r = await h.post("/v1/requests/hint/drop", {"keys": keys})
        assert r.json()["moved"] == keys
        assert await lookup(h, keys) == ["disk", "disk"]


# --------------------------------------------------------------------------- batch


async def test_control_ops_in_a_batch_answer_as_the_single_routes(h: Harness) -> None:
    await store(h, "w", hexkeys(1, 2, 3, 4))
    ops: list[Any] = [
        {"op": "retain", "req_id": "b", "keys": hexkeys(1), "ttl_s": 30},
        {"op": "retain", "req_id": "b", "keys": hexkeys(2, 999), "ttl_s": 30},  # 404
        {"op": "retain", "req_id": "b", "keys": hexkeys(2), "ttl_s": 30, "name": "other"},
        {"op": "prefetch", "req_id": "b", "keys": hexkeys(3), "deadline_s": 30},
        {"op": "demote", "req_id": "b", "keys": hexkeys(4)},  # no tier: 409
        {"op": "drop", "req_id": "b", "keys": hexkeys(1, 4)},
        {"op": "retain", "req_id": "b", "keys": hexkeys(4), "ttl_s": 30},  # 404: dropped
        {"op": "retain", "req_id": "b", "keys": hexkeys(3), "ttl_s": 30},  # 200: extends
    ]
    r = await h.post("/v1/batch", {"ops": ops})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["status"] for x in results] == [201, 404, 201, 202, 409, 200, 404, 200]
    assert results[1]["error"]["code"] == "unknown_keys"
    assert results[4]["error"]["code"] == "no_lower_tier"
    assert results[6]["error"]["code"] == "unknown_keys"
    first = results[0]["result"]
    assert (first["name"], first["created"], first["results"]) == ("b", True, ["hit"])
    assert results[2]["result"]["name"] == "other"
    pf = results[3]["result"]
    assert (pf["state"], pf["results"], pf["req_id"]) == ("held", ["hit"], "b")
    assert results[5]["result"] == {
        "moved": hexkeys(4),
        "kept": {"pinned": 0, "retained": 1, "pending": 0, "not_in_pool": 0},
    }
    assert (results[7]["result"]["keys"], results[7]["result"]["created"]) == (2, False)
    assert [x["name"] for x in (await retentions(h))["retentions"]] == ["b", "other"]

    # The same calls one by one answer the same shapes.
    single = await retain(h, "b", hexkeys(1))
    assert set(single.json()) == set(first)
    single = await prefetch(h, "b", hexkeys(2))
    assert set(single.json()) == set(pf)
    single = await h.post("/v1/requests/b/drop", {"keys": hexkeys(1, 4)})
    assert single.json() == {
        "moved": [],
        "kept": {"pinned": 0, "retained": 1, "pending": 0, "not_in_pool": 1},
    }


@pytest.mark.parametrize(
    "bad_op",
    [
        {"op": "retain", "req_id": "b", "keys": hexkeys(1)},  # ttl_s missing
        {"op": "prefetch", "req_id": "b", "keys": hexkeys(1), "deadline_s": 0},
        {"op": "demote", "req_id": "b", "keys": hexkeys(1), "ttl_s": 5},  # unknown field
    ],
)
async def test_a_malformed_control_op_refuses_the_whole_batch(
    h: Harness, bad_op: dict[str, Any]
) -> None:
    await store(h, "w", hexkeys(1))
    ops = [{"op": "retain", "req_id": "b", "keys": hexkeys(1), "ttl_s": 30}, bad_op]
    r = await h.post("/v1/batch", {"ops": ops})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["message"].startswith("ops.1"), r.text
    assert (await retentions(h))["retentions"] == []  # the valid op did not run


# --------------------------------------------------------------------------- metrics


async def test_control_metrics() -> None:
    async with running(make_settings(max_retained_blocks=4)) as h:
        await store(h, "w", hexkeys(*range(1, 9)))
        assert (await retain(h, "a", hexkeys(1, 2, 3))).status_code == 201
        assert (await retain(h, "a", hexkeys(3))).status_code == 200  # renewed
        assert (await h.post("/v1/retentions/a/renew", {"ttl_s": 60})).status_code == 200
        assert (await retain(h, "x", hexkeys(999))).status_code == 404  # an error
        assert (await retain(h, "b", hexkeys(4), ttl_s=0.2)).status_code == 201
        assert (await retain(h, "c", hexkeys(5))).status_code == 429
        assert (await retain(h, "d", hexkeys(5), ttl_s=0.2)).status_code == 429
        p = (await prefetch(h, "pf", hexkeys(6, 7, 998))).json()
        await pin(h, "user", hexkeys(6, 7))
        assert (await get_prefetch(h, p["prefetch_id"]))["state"] == "done"
        p = (await prefetch(h, "pf", hexkeys(8))).json()
        assert (await h.client.delete(f"/v1/prefetches/{p['prefetch_id']}")).status_code == 200
        r = await h.post("/v1/requests/hint/drop", {"keys": hexkeys(1, 8)})
        assert r.json()["moved"] == hexkeys(8)

        async def expired() -> bool:
            return len((await retentions(h))["retentions"]) == 1

        await until_async("expired", expired)
        assert (await retain(h, "e", hexkeys(4))).status_code == 201
        assert (await h.client.delete("/v1/retentions/e")).status_code == 200

        r = await h.client.get("/metrics", headers={"accept": OPENMETRICS})
        assert r.status_code == 200, r.text
        ex = parse(r.text)
        assert ex.value("kvoffload_retentions_live") == 1
        assert ex.value("kvoffload_retained_blocks", tier="pool") == 3
        assert ex.value("kvoffload_retentions_total", event="created") == 3
        assert ex.value("kvoffload_retentions_total", event="renewed") == 2
        assert ex.value("kvoffload_retentions_total", event="released") == 1
        assert ex.value("kvoffload_retentions_total", event="expired") == 1
        assert ex.value("kvoffload_prefetch_keys_total", outcome="hit") == 3
        assert ex.value("kvoffload_prefetch_keys_total", outcome="miss") == 1
        assert ex.value("kvoffload_prefetch_keys_total", outcome="used") == 2
        assert ex.value("kvoffload_prefetch_keys_total", outcome="wasted") == 1
        assert ex.value("kvoffload_prefetch_won_seconds_count") == 1
        assert ex.value("kvoffload_cache_hint_blocks_total", hint="drop") == 1
        assert ex.value("kvoffload_cache_hint_blocks_total", hint="demote") == 0
        ops = "kvoffload_manager_ops_total"
        assert ex.value(ops, op="retain", result="ok") == 4
        assert ex.value(ops, op="retain", result="error") == 3
        assert ex.value(ops, op="prefetch", result="ok") == 2
        assert ex.value(ops, op="drop", result="ok") == 1
        assert ex.exemplar_ids(ops, op="retain", result="error") <= {"x", "c", "d"}
        assert ex.exemplar_ids(ops, op="prefetch", result="ok") == {"pf"}


# --------------------------------------------------------------------------- found in review


async def test_a_retained_key_with_its_store_in_flight_is_counted_pending(
    h: Harness, retain_steps: None
) -> None:
    await store(h, "w", hexkeys(1))
    assert (await h.post("/v1/requests/w/prepare-store", {"keys": hexkeys(2)})).status_code == 200
    r = await retain(h, "s", hexkeys(1, 2))
    assert r.json()["results"] == ["hit", "pending"]
    ex = parse((await h.client.get("/metrics", headers={"accept": OPENMETRICS})).text)
    assert ex.value("kvoffload_retained_blocks", tier="pool") == 1
    assert ex.value("kvoffload_retained_blocks", tier="pending") == 1, "counted elsewhere"


async def test_a_prefetch_of_hits_wins_no_seconds(h: Harness) -> None:
    await store(h, "w", hexkeys(1))
    assert (await prefetch(h, "r", hexkeys(1))).status_code == 202
    await asyncio.sleep(0.3)
    await pin(h, "u", hexkeys(1))
    ex = parse((await h.client.get("/metrics", headers={"accept": OPENMETRICS})).text)
    assert ex.value("kvoffload_prefetch_won_seconds_count") == 1
    won = ex.value("kvoffload_prefetch_won_seconds_sum")
    assert won is not None
    assert won < 0.3, f"{won:.3f} s won by blocks that were in the pool at the prefetch"


@pytest.mark.parametrize("name", ["tenant/session", ".."])
async def test_a_retention_name_no_route_could_address_is_refused(h: Harness, name: str) -> None:
    await store(h, "w", hexkeys(1))
    # A name is a path segment: one no route could address is refused up front.
    r = await retain(h, "r", hexkeys(1), name=name)
    assert (r.status_code, r.json()["error"]["code"]) == (422, "invalid_field"), r.text
    assert "accepted: letters, digits" in r.json()["error"]["message"]
    assert (await h.client.get("/v1/retentions")).json()["retentions"] == []
    # A request id that cannot name a retention needs an explicit name.
    r = await h.post(
        "/v1/batch", {"ops": [{"op": "retain", "req_id": "a/b", "keys": hexkeys(1), "ttl_s": 5}]}
    )
    assert r.json()["results"][0]["status"] == 422
    assert "needs an explicit name" in r.json()["results"][0]["error"]["message"]
    name_ok = "sess-1.a_b:c@d"
    assert (await retain(h, "r", hexkeys(1), name=name_ok)).status_code == 201
    assert (await h.client.delete(f"/v1/retentions/{name_ok}")).status_code == 200


# ------------------------------------------------------------------------ a load meets a prefetch


async def test_an_onload_during_a_prefetch_s_read_joins_it_and_leaves_nothing_held(
    tmp_path: Path,
) -> None:
    """The read of a prefetch is gated; an onload of the same keys by another request waits on
    that read (one job, no 409), copies the bytes, and the prefetch counts them used: nothing
    stays held until its deadline (the load pinned them before the prefetch could hold them)."""
    async with disk_node(tmp_path) as h:
        cold, data = await on_disk(h)
        disk = h.service.tiers.get("disk")
        assert isinstance(disk, DiskLink)
        gate = gated(disk.store, "preadv")
        p = (await prefetch(h, "router", cold[:2])).json()
        assert p["state"] == "promoting"
        dev, cache_id = await h.device(4)
        await h.start("engine")
        body = {"cache_id": cache_id, "keys": cold[:2], "device_blocks": [0, 1]}
        r = await h.post("/v1/requests/engine/onload", body)
        assert r.status_code == 202, r.text
        gate.set()
        assert (await h.wait(r.json()["job_id"]))["state"] == "done"
        assert [dev.read(0), dev.read(1)] == [data[k] for k in cold[:2]]
        done = await get_prefetch(h, p["prefetch_id"], wait_s=2)
        assert (done["state"], done["counts"]["used"], done["counts"]["wasted"]) == ("done", 2, 0)
        assert h.service.control.state()["prefetch_keys"] == 0
        st = (await h.admin.get("/admin/v1/stats")).json()
        assert st["blocks"]["pinned"] == 0


async def test_a_lookup_with_prefetch_deadline_s_starts_the_prefetch_in_the_same_call(
    tmp_path: Path,
) -> None:
    async with disk_node(tmp_path) as h:
        cold, data = await on_disk(h)
        await h.start("r")
        body = {"keys": cold[:3] + hexkeys(9999), "prefetch_deadline_s": 5}
        r = await h.post("/v1/requests/r/lookup", body)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["results"] == ["disk"] * 3 + ["miss"]
        pid = answer["prefetch_id"]
        held = await get_prefetch(h, pid, wait_s=2)
        assert (held["state"], held["counts"]["landed"]) == ("held", 3)
        assert await lookup(h, cold[:3]) == ["hit"] * 3
        slots = await pin(h, "r", cold[:3])
        assert [pool_bytes(h, s) for s in slots] == [data[k] for k in cold[:3]]
        assert (await get_prefetch(h, pid))["counts"]["used"] == 3
        # Nothing below the pool: no prefetch, and the answer has no prefetch_id.
        r = await h.post("/v1/requests/r/lookup", {"keys": cold[:3], "prefetch_deadline_s": 5})
        assert r.json() == {"results": ["hit"] * 3, "hit_prefix": 3}
        # A deadline over the bound is refused before anything is looked up.
        r = await h.post("/v1/requests/r/lookup", {"keys": cold[:1], "prefetch_deadline_s": 1e6})
        assert error(r) == (422, "invalid_argument")
        r = await h.post("/v1/requests/r/lookup", {"keys": cold[:1], "prefetch_deadline_s": 0})
        assert error(r) == (422, "invalid_field")


async def test_a_lookup_s_prefetch_past_the_bound_answers_the_lookup_and_counts_it(
    tmp_path: Path,
) -> None:
    async with disk_node(tmp_path, prefetch_max_keys=2) as h:
        cold, _ = await on_disk(h)
        await h.start("r")
        r = await h.post("/v1/requests/r/lookup", {"keys": cold[:3], "prefetch_deadline_s": 5})
        assert r.json() == {"results": ["disk"] * 3, "hit_prefix": 0}
        assert h.service.control.counts["prefetch_refused"] == 3
        assert await lookup(h, cold[:3]) == ["disk"] * 3  # nothing started


async def test_a_lookup_without_tiers_checks_prefetch_deadline_s_only(h: Harness) -> None:
    await h.start("r")
    r = await h.post("/v1/requests/r/lookup", {"keys": hexkeys(1), "prefetch_deadline_s": 5})
    assert r.json() == {"results": ["miss"], "hit_prefix": 0}
    r = await h.post("/v1/requests/r/lookup", {"keys": hexkeys(1), "prefetch_deadline_s": 1e6})
    assert error(r) == (422, "invalid_argument")


async def test_a_load_of_more_blocks_than_the_pool_holds_says_so(tmp_path: Path) -> None:
    """The trap: 9 keys on disk, a pool of 8; the load could never be pinned at once. The
    answer says the pool is too small and how big it is, instead of "not stored"."""
    async with disk_node(tmp_path, num_blocks=8) as h:
        keys = hexkeys(*range(1, 10))
        await store(h, "w", keys)  # 9 into 8: one goes to disk, all are somewhere
        await h.start("big")
        r = await h.post("/v1/requests/big/prepare-load", {"keys": keys})
        assert error(r) == (409, "pool_too_small"), r.text
        assert "the pool holds 8" in r.json()["error"]["message"]
        _, cache_id = await h.device(16)
        body = {"cache_id": cache_id, "keys": keys, "device_blocks": list(range(9))}
        r = await h.post("/v1/requests/big/onload", body)
        assert error(r) == (409, "pool_too_small"), r.text
        # Repeats of one key are one block: a load of 8 distinct keys listed 9 times fits.
        r = await h.post("/v1/requests/big/prepare-load", {"keys": [*keys[1:], keys[1]]})
        assert r.status_code == 200 or error(r) == (409, "key_not_ready"), r.text
