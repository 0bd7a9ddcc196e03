"""The engine clients' cache control calls against a real service with a disk tier: retain,
retentions (list, one, renew, release), prefetch (state, wait, cancel), demote and drop, and the
same four verbs as ``Batch`` ops; the async client in process (``httpx.ASGITransport``, as
``tests/api/test_client.py``), the sync client over real connections to uvicorn on 127.0.0.1
(``live_service``, whose admin listener the CLI tests use too). Keys come back as ``bytes``;
a refusal raises the client's typed error with the service's status and code."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from kvoffload_client.client import (
    AsyncKVOffloadClient,
    Batch,
    Hint,
    KVOffloadClient,
    KVOffloadError,
    KVOffloadQuotaError,
    Prefetch,
    Retained,
    Retention,
    Retentions,
)

from testsupport.api_harness import BLOCK, Harness, make_settings, running
from testsupport.polling import until
from testsupport.ports import free_port
from transfer.disk import disk_bytes_for

NO_KEPT = {"pinned": 0, "retained": 0, "pending": 0, "not_in_pool": 0, "refused": 0}  # demote


def keys_of(*ids: int) -> list[bytes]:
    """8-byte keys: ``keys_of(1) == [b"\\0" * 7 + b"\\1"]``."""
    return [i.to_bytes(8, "big") for i in ids]


def disk_settings(directory: Path) -> dict[str, Any]:
    """Harness settings plus a disk tier of 64 blocks under ``directory`` admitting all."""
    return {
        "disk_dir": directory,
        "disk_bytes": disk_bytes_for(64, BLOCK),
        "disk_admit_after": 1,
        "disk_batch_bytes": 8 * BLOCK,
    }


# --------------------------------------------------------------------------- live service


@dataclass
class Live:
    """A harness service behind real uvicorn listeners (engine and admin) on 127.0.0.1."""

    engine_url: str
    admin_url: str
    harness: Harness


@contextlib.contextmanager
def live_service(**overrides: Any) -> Iterator[Live]:
    """``running(make_settings(**overrides))`` served by two uvicorn servers in one thread
    (the service's own event loop), until the block ends."""
    ready: list[Live] = []
    failed: list[BaseException] = []
    stop = threading.Event()

    async def main() -> None:
        async with running(make_settings(**overrides)) as h:
            servers = [
                uvicorn.Server(
                    uvicorn.Config(
                        app,
                        host="127.0.0.1",
                        port=free_port(),
                        log_level="warning",
                        lifespan="off",  # the harness runs the lifespans
                        ws="none",
                    )
                )
                for app in (h.app, h.admin_app)
            ]
            tasks = [asyncio.create_task(s.serve()) for s in servers]
            while not all(s.started for s in servers):
                if any(t.done() for t in tasks):
                    await asyncio.gather(*tasks)
                    raise RuntimeError("uvicorn stopped before it started")
                await asyncio.sleep(0.01)
            engine, admin = (s.config.port for s in servers)
            ready.append(Live(f"http://127.0.0.1:{engine}", f"http://127.0.0.1:{admin}", h))
            while not stop.is_set():
                await asyncio.sleep(0.02)
            for s in servers:
                s.should_exit = True
            await asyncio.gather(*tasks)

    def thread_main() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # reported to the test's thread
            failed.append(exc)

    thread = threading.Thread(target=thread_main, name="live-service", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not ready:
        if failed:
            raise failed[0]
        assert time.monotonic() < deadline, "the live service did not start"
        time.sleep(0.01)
    try:
        yield ready[0]
    finally:
        stop.set()
        thread.join(30)
        if failed:
            raise failed[0]


def stored(c: KVOffloadClient, req_id: str, keys: list[bytes]) -> None:
    """Make ``keys`` ready in the pool (a store whose bytes are whatever the slots hold)."""
    c.start_request(req_id)
    assert c.prepare_store(req_id, keys).keys_to_store == keys
    assert c.complete_store(req_id, keys).completed == keys


async def astored(c: AsyncKVOffloadClient, req_id: str, keys: list[bytes]) -> None:
    await c.start_request(req_id)
    assert (await c.prepare_store(req_id, keys)).keys_to_store == keys
    assert (await c.complete_store(req_id, keys)).completed == keys


# --------------------------------------------------------------------------- sync client


def test_sync_client_covers_every_control_call(tmp_path: Path) -> None:
    with (
        live_service(**disk_settings(tmp_path)) as live,
        KVOffloadClient(live.engine_url) as c,
    ):
        keys = keys_of(*range(1, 9))
        stored(c, "w", keys)

        # retain: created, then extended under the same name.
        got = c.retain("r1", keys[:2], 30.0, name="session")
        assert isinstance(got, Retained)
        assert (got.name, got.keys, got.in_pool, got.created, got.added) == (
            "session",
            2,
            2,
            True,
            2,
        )
        assert (got.results, got.promoting, got.ttl_s) == (["hit", "hit"], 0, 30.0)
        more = c.retain("r1", keys[:3], 30.0, name="session")
        assert (more.created, more.added, more.keys) == (False, 1, 3)
        by_req = c.retain("r-default", keys[3:4], 5.0)
        assert by_req.name == "r-default"

        listing = c.retentions()
        assert isinstance(listing, Retentions)
        assert [r.name for r in listing.retentions] == ["session", "r-default"]
        assert listing.retained_blocks == 4
        assert listing.max_retained_blocks > 0
        one = c.retention("session")
        assert isinstance(one, Retention)
        assert (one.keys, one.in_pool) == (3, 3)
        renewed = c.renew_retention("session", 60.0)
        assert renewed.ttl_s == 60.0
        assert 59 < renewed.expires_in_s <= 60
        released = c.release_retention("session")
        assert (released.name, released.keys) == ("session", 3)
        with pytest.raises(KVOffloadError) as info:
            c.retention("session")
        assert (info.value.status, info.value.code) == (404, "unknown_retention")
        with pytest.raises(KVOffloadError) as info:
            c.renew_retention("session", 1.0)
        assert (info.value.status, info.value.code) == (404, "unknown_retention")
        with pytest.raises(KVOffloadError) as info:
            c.release_retention("session")
        assert (info.value.status, info.value.code) == (404, "unknown_retention")
        with pytest.raises(KVOffloadError) as info:
            c.retain("r1", keys_of(999), 5.0)
        assert (info.value.status, info.value.code) == (404, "unknown_keys")

        # demote: out of the pool, onto the disk.
        hint = c.demote("hint", keys[4:7])
        assert isinstance(hint, Hint)
        assert hint.moved == keys[4:7]
        assert hint.kept == NO_KEPT
        until(
            "the demoted keys found on disk",
            lambda: c.lookup("w", keys[4:7]).results == ["disk"] * 3,
        )

        # prefetch: brought up, held, then waited on and cancelled.
        p = c.prefetch("agent", keys[4:7], 30.0)
        assert isinstance(p, Prefetch)
        assert (p.req_id, p.results, p.counts["promoted"]) == ("agent", ["disk"] * 3, 3)
        assert p.state in ("promoting", "held")
        held = c.prefetch_state(p.prefetch_id, wait_s=5.0)
        assert (held.state, held.results, held.counts["landed"]) == ("held", None, 3)
        assert c.prefetch_state(p.prefetch_id).state == "held"
        assert c.lookup("w", keys[4:7]).results == ["hit"] * 3
        cancelled = c.cancel_prefetch(p.prefetch_id)
        assert (cancelled.state, cancelled.counts["wasted"]) == ("cancelled", 3)
        with pytest.raises(KVOffloadError) as info:
            c.prefetch_state(10_000)
        assert (info.value.status, info.value.code) == (404, "unknown_prefetch")

        # drop: out of this namespace's pool; a retained key stays.
        dropped = c.drop("hint", keys[3:5])
        assert dropped.moved == keys[4:5]
        assert dropped.kept["retained"] == 1

        # The four verbs as batch ops, answering as the single routes.
        results = c.batch(
            Batch()
            .retain("b", keys[7:8], 10.0, name="batch-session")
            .prefetch("b", keys[7:8], 5.0)
            .demote("b", keys[5:6])
            .drop("b", keys[6:7])
            .retain("b", keys_of(999), 10.0)
        )
        assert [r.status for r in results] == [201, 202, 200, 200, 404]
        answers = [r.result for r in results[:4]]
        assert None not in answers
        name, held_now, demoted, dropped_now = (a or {} for a in answers)
        assert name["name"] == "batch-session"
        assert held_now["results"] == ["hit"]
        assert demoted["moved"] == [keys[5].hex()]
        assert dropped_now["moved"] == [keys[6].hex()]
        refused = results[4].error
        assert refused is not None
        assert refused.code == "unknown_keys"
        assert [r.name for r in c.retentions().retentions] == ["r-default", "batch-session"]


def test_a_quota_refusal_is_the_quota_error_naming_its_quota() -> None:
    with live_service(max_retentions=1) as live, KVOffloadClient(live.engine_url) as c:
        stored(c, "w", keys_of(1, 2))
        c.retain("w", keys_of(1), 10.0, name="a")
        with pytest.raises(KVOffloadQuotaError) as info:
            c.retain("w", keys_of(2), 10.0, name="b")
        assert (info.value.status, info.value.quota) == (429, "retentions")


# --------------------------------------------------------------------------- async client


@contextlib.asynccontextmanager
async def async_client(h: Harness) -> AsyncIterator[AsyncKVOffloadClient]:
    async with AsyncKVOffloadClient("http://engine", transport=httpx.ASGITransport(h.app)) as c:
        yield c


@pytest.mark.anyio
async def test_async_client_covers_every_control_call(tmp_path: Path) -> None:
    async with running(make_settings(**disk_settings(tmp_path))) as h, async_client(h) as c:
        keys = keys_of(*range(1, 9))
        await astored(c, "w", keys)

        got = await c.retain("r1", keys[:2], 30.0)
        assert (got.name, got.created, got.results) == ("r1", True, ["hit", "hit"])
        assert (await c.retain("r1", keys[:3], 20.0)).added == 1
        assert [r.name for r in (await c.retentions()).retentions] == ["r1"]
        assert (await c.retention("r1")).keys == 3
        assert (await c.renew_retention("r1", 45.0)).ttl_s == 45.0
        assert (await c.release_retention("r1")).keys == 3
        assert (await c.retentions()).retentions == []
        with pytest.raises(KVOffloadError) as info:
            await c.retention("r1")
        assert (info.value.status, info.value.code) == (404, "unknown_retention")

        hint = await c.demote("hint", keys[4:6])
        assert (hint.moved, hint.kept) == (keys[4:6], NO_KEPT)
        for _ in range(500):
            if (await c.lookup("w", keys[4:6])).results == ["disk"] * 2:
                break
            await asyncio.sleep(0.02)
        assert (await c.lookup("w", keys[4:6])).results == ["disk"] * 2

        p = await c.prefetch("agent", keys[4:6], 30.0)
        assert (p.results, p.counts["promoted"]) == (["disk"] * 2, 2)
        held = await c.prefetch_state(p.prefetch_id, wait_s=5.0)
        assert (held.state, held.counts["landed"]) == ("held", 2)
        cancelled = await c.cancel_prefetch(p.prefetch_id)
        assert cancelled.state == "cancelled"
        assert (await c.prefetch_state(p.prefetch_id)).counts["wasted"] == 2

        dropped = await c.drop("hint", keys[6:8])
        assert dropped.moved == keys[6:8]
        assert (await c.lookup("w", keys[6:8])).results != ["hit", "hit"]

        results = await c.batch(
            Batch()
            .retain("b", keys[:1], 10.0)
            .prefetch("b", keys[:1], 5.0)
            .demote("b", keys[1:2])
            .drop("b", keys[2:3])
        )
        assert [r.status for r in results] == [201, 202, 200, 200]
        assert all(r.ok and r.error is None for r in results)
