"""Store calls' metadata for routers (``token_ids``, ``block_size``, ``parent_block_hash`` on
prepare-store and offload): checked, refused whole when malformed, kept for KV events."""

from __future__ import annotations

import pytest

from app.core.kv_publisher import BlockMetadata, hash64, wire_events
from manager import BlockStored
from testsupport.api_harness import Harness, hexkeys

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"token_ids": [1, 2, 3]}, "token_ids and block_size must be given together"),
        ({"block_size": 2}, "token_ids and block_size must be given together"),
        ({"token_ids": [1, 2, 3], "block_size": 2}, "must hold block_size (2) tokens"),
        ({"token_ids": [1, 2, 3, 4], "block_size": 0}, "greater than or equal to 1"),
        ({"token_ids": [-1, 2, 3, 4], "block_size": 2}, "greater than or equal to 0"),
        ({"parent_block_hash": "xyz"}, "block_hash"),
    ],
)
async def test_malformed_metadata_is_refused_and_reserves_nothing(h: Harness, extra, message):
    await h.start()
    keys = hexkeys(1, 2)
    r = await h.post("/v1/requests/r1/prepare-store", {"keys": keys, **extra})
    assert r.status_code == 422, r.text
    assert message in r.text
    r = await h.post("/v1/requests/r1/lookup", {"keys": keys})
    assert r.json()["results"] == ["miss", "miss"]


async def test_metadata_is_kept_for_the_events_when_they_are_on(h: Harness):
    service = h.service
    service.block_meta = BlockMetadata(16)
    await h.start()
    keys = hexkeys(1, 2)
    body = {"keys": keys, "token_ids": [1, 2, 3, 4], "block_size": 2, "parent_block_hash": "aa"}
    r = await h.post("/v1/requests/r1/prepare-store", body)
    assert r.status_code == 200, r.text
    stored = [bytes.fromhex(k) for k in keys]
    (event,) = wire_events([BlockStored(1, stored)], service.block_meta)
    assert event[1:5] == ([hash64(k) for k in stored], 0xAA, [1, 2, 3, 4], 2)


async def test_without_events_metadata_is_accepted_and_not_kept(h: Harness):
    await h.start()
    body = {"keys": hexkeys(1), "token_ids": [1, 2], "block_size": 2}
    r = await h.post("/v1/requests/r1/prepare-store", body)
    assert r.status_code == 200, r.text
    assert h.service.block_meta is None
