"""GET /v1/events: cursor reads of KV events, and the fell-behind flag."""

from __future__ import annotations

import pytest

from testsupport.api_harness import Harness, hexkeys, make_settings, running

pytestmark = pytest.mark.anyio


async def store(h: Harness, *ids: int) -> None:
    keys = hexkeys(*ids)
    await h.post("/v1/requests/r1/prepare-store", {"keys": keys})
    r = await h.post("/v1/requests/r1/complete-store", {"keys": keys})
    assert r.json()["completed"] == keys


async def test_cursor_paging(h: Harness) -> None:
    await h.start()
    await store(h, 1, 2)
    await store(h, 3)
    r = await h.client.get("/v1/events", params={"after": 0})
    page = r.json()
    assert [e["seq"] for e in page["events"]] == [1, 2]
    assert page["events"][0] == {
        "seq": 1,
        "type": "BlockStored",
        "block_hashes": hexkeys(1, 2),
        "medium": "CPU",
    }
    assert (page["next_after"], page["latest_seq"], page["fell_behind"]) == (2, 2, False)

    r = await h.client.get("/v1/events", params={"after": 1, "limit": 1})
    assert [e["seq"] for e in r.json()["events"]] == [2]
    r = await h.client.get("/v1/events", params={"after": 2})
    page = r.json()
    assert (page["events"], page["next_after"], page["fell_behind"]) == ([], 2, False)


async def test_removed_and_cleared_events(h: Harness) -> None:
    await h.start()
    n = h.settings.num_blocks
    await store(h, *range(n))
    await h.post("/v1/requests/r1/prepare-load", {"keys": hexkeys(n - 1)})  # pinned: kept
    await h.post("/v1/requests/r1/prepare-store", {"keys": hexkeys(1000)})  # evicts one
    r = await h.admin.post("/admin/v1/cache/clear")
    assert r.json() == {"dropped": n - 2, "kept_pinned": 1, "kept_pending": 1, "kept_retained": 0}
    events = (await h.client.get("/v1/events")).json()["events"]
    assert [e["type"] for e in events] == ["BlockStored", "BlockRemoved", "BlockRemoved"]
    assert len(events[1]["block_hashes"]) == 1
    assert len(events[2]["block_hashes"]) == n - 2

    await h.post("/v1/requests/r1/complete-load", {"keys": hexkeys(n - 1)})
    await h.admin.post("/admin/v1/cache/clear")
    events = (await h.client.get("/v1/events", params={"after": 3})).json()["events"]
    assert [e["type"] for e in events] == ["AllBlocksCleared"]
    assert events[-1]["block_hashes"] == []


async def test_a_reader_that_fell_behind_is_told() -> None:
    async with running(make_settings(event_buffer_size=4)) as h:
        await h.start()
        for i in range(10):
            await store(h, i)
        page = (await h.client.get("/v1/events", params={"after": 0})).json()
        assert page["fell_behind"] is True
        assert [e["seq"] for e in page["events"]] == [7, 8, 9, 10]
        page = (await h.client.get("/v1/events", params={"after": 6})).json()
        assert page["fell_behind"] is False
        assert len(page["events"]) == 4
        page = (await h.client.get("/v1/events", params={"after": 5})).json()
        assert page["fell_behind"] is True


async def test_a_cursor_from_the_future_means_a_restart(h: Harness) -> None:
    await h.start()
    await store(h, 1)
    page = (await h.client.get("/v1/events", params={"after": 50})).json()
    assert page["fell_behind"] is True
    assert page["next_after"] == page["latest_seq"] == 1
    assert page["instance"] == h.service.instance


async def test_bad_cursor_is_422(h: Harness) -> None:
    assert (await h.client.get("/v1/events", params={"after": -1})).status_code == 422
    assert (await h.client.get("/v1/events", params={"after": "x"})).status_code == 422
    assert (await h.client.get("/v1/events", params={"limit": 0})).status_code == 422
