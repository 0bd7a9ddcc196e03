"""The object tier on a real Ceph RADOS Gateway: what the contract suite does not cover.

A shared bucket (node B serves what node A wrote, no restart), the layout under the prefix, the
bound (least recently used objects deleted, reported removed), objects that are not what they
claim (refused, counted, never loaded), and faults: a missing bucket, refused credentials, a
gateway that hangs, and the HTTP face of a degraded tier (``/readyz`` 200 with details, no 5xx).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from app.core.object import OBJECT_MEDIUM, ObjectLink
from app.core.service import Service
from manager.spec import BlockRemoved
from tests.object.fault_proxy import FaultProxy
from tests.object.test_tier_contract import aws_keys, object_settings
from tests.tiers.test_tier_contract import POOL_BLOCKS, Engine, N, demote, keys_of, until
from testsupport.api_harness import make_settings, running
from testsupport.rgw import USER_ID, RadosGateway

pytestmark = pytest.mark.anyio

__all__ = ["aws_keys"]


@contextlib.asynccontextmanager
async def node(
    rgw: RadosGateway, bucket: str, **overrides: Any
) -> AsyncIterator[tuple[Service, Engine, ObjectLink]]:
    """A service with the object tier alone below its pool, an engine on it, and its link."""
    settings = make_settings(
        num_blocks=POOL_BLOCKS,
        tiers=["object"],
        metrics_enabled=False,
        **{**object_settings(rgw, bucket), **overrides},
    )
    service = Service(settings)
    async with service.running():
        engine = Engine(service)
        link = service.tiers.get("object")
        assert isinstance(link, ObjectLink)
        try:
            yield service, engine, link
        finally:
            engine.close()


def listed(s3: Any, bucket: str) -> list[str]:
    """Every object key in ``bucket``."""
    keys: list[str] = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys += [item["Key"] for item in page.get("Contents", [])]
    return sorted(keys)


async def test_node_b_serves_what_node_a_wrote_without_a_restart(
    rgw: RadosGateway, bucket: str, aws_keys: None, s3: Any
) -> None:
    async with (
        node(rgw, bucket) as (a, engine_a, _),
        node(rgw, bucket) as (b, engine_b, _),
    ):
        data = await demote(a, engine_a, "object")
        keys = list(data)
        assert await b.tiers.found(keys, None) == ["object"] * N
        state, got = await engine_b.onload(keys)
        assert state == "done"
        assert got == [data[k] for k in keys]
    # One object per block stored (written behind), under <prefix>/<namespace>/<block
    # bytes>/<hex key>.
    block = a.settings.block_bytes
    every = keys + keys_of(*range(100, 100 + POOL_BLOCKS))
    assert listed(s3, bucket) == sorted(f"kvoffload/default/{block}/{k.hex()}" for k in every)


async def test_the_bound_deletes_the_least_recently_used_and_reports_them(
    rgw: RadosGateway, bucket: str, aws_keys: None, s3: Any
) -> None:
    # Room for 6 objects (block + its 32-byte MAC each).
    async with node(rgw, bucket, object_bytes=6 * (4096 + 32)) as (service, engine, link):
        # 8 stored, each written behind in the order stored: the 2 first are deleted.
        keys = keys_of(*range(8))
        await engine.offload(keys, seed=10)

        async def bounded() -> bool:
            bound = link.state()["bound"]
            return bound["deleted"] == 2 and not bound["deleting"] and len(listed(s3, bucket)) == 6

        await until("the bucket holds 6", bounded)
        found = await service.tiers.found(keys, None)
        assert found.count("object") == 6
        gone = [k for k, t in zip(keys, found, strict=True) if t is None]
        assert gone == keys[:2]
        service.drain_events()
        removed = [
            k
            for e in service.events.page(0, 10_000).events
            if isinstance(e, BlockRemoved) and e.medium == OBJECT_MEDIUM
            for k in e.block_hashes
        ]
        assert sorted(removed) == sorted(gone)
        bound = link.state()["bound"]
        assert (bound["blocks"], bound["deleted"]) == (6, 2)
        assert link.report().blocks == 6


async def test_an_object_that_is_not_what_it_claims_is_never_loaded(
    rgw: RadosGateway, bucket: str, aws_keys: None, s3: Any
) -> None:
    async with node(rgw, bucket) as (service, engine, link):
        data = await demote(service, engine, "object")
        keys = list(data)
        block = service.settings.block_bytes
        path = f"kvoffload/default/{block}/{{}}"
        body = s3.get_object(Bucket=bucket, Key=path.format(keys[0].hex()))["Body"].read()
        flipped = bytes([body[0] ^ 1]) + body[1:]
        s3.put_object(Bucket=bucket, Key=path.format(keys[0].hex()), Body=flipped)
        # Another key's object under this key's name: its MAC binds the other key.
        other = s3.get_object(Bucket=bucket, Key=path.format(keys[2].hex()))["Body"].read()
        s3.put_object(Bucket=bucket, Key=path.format(keys[1].hex()), Body=other)
        state, got = await engine.onload(keys)
        # The load fails: the refused blocks' bytes never reach the engine.
        assert state == "failed"
        assert link.health().counters["checksum_failures"] == 2
        for k in keys[:2]:
            assert service.pool_manager.slot_of(k) is None
        state, got = await engine.onload(keys[2:])
        assert state == "done"
        assert got == [data[k] for k in keys[2:]]


async def test_a_missing_bucket_degrades_the_tier_until_it_exists(
    rgw: RadosGateway, aws_keys: None, s3: Any
) -> None:
    name = "t-not-yet-there"
    async with node(rgw, name) as (service, engine, link):
        assert not link.health().ok
        assert "object_tier" in service.tiers.details()
        # The pool works; nothing is found below it.
        data = await engine.offload(keys_of(*range(8)), seed=10)
        assert await service.tiers.found(list(data), None) == [None] * 8
        s3.create_bucket(Bucket=name)
        try:

            async def ok() -> bool:
                return link.health().ok

            await until("the tier finds its bucket", ok)
        finally:
            for key in listed(s3, name):
                s3.delete_object(Bucket=name, Key=key)
            s3.delete_bucket(Bucket=name)


async def test_refused_credentials_degrade_the_tier_until_they_are_accepted(
    rgw: RadosGateway, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "KVOFFLOADLATEUSER000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "late-user-secret-key-000000000000000000")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    async with node(rgw, bucket) as (_, _, link):
        assert not link.health().ok
        assert "403" in (link.health().last_error or "") or "Permission" in str(
            link.health().last_error
        )
        assert "late-user-secret" not in str(link.state())
        # The user the keys belong to is made now, and given the bucket (then both undone).
        exe = shutil.which("radosgw-admin")
        assert exe is not None

        def admin(*args: str) -> None:
            cmd = [exe, "-c", str(rgw.conf_path), "-n", "client.admin", *args]
            subprocess.run(cmd, check=True, capture_output=True, timeout=60)

        admin(
            "user",
            "create",
            "--uid=late",
            "--display-name=late",
            "--access-key=KVOFFLOADLATEUSER000",
            "--secret-key=late-user-secret-key-000000000000000000",
        )
        try:
            admin("bucket", "link", f"--bucket={bucket}", "--uid=late")

            async def ok() -> bool:
                return link.health().ok

            await until("the keys are accepted", ok)
        finally:
            admin("bucket", "link", f"--bucket={bucket}", f"--uid={USER_ID}")
            admin("user", "rm", "--uid=late")


async def test_a_hung_gateway_makes_lookups_answer_miss_in_time_and_recovers(
    rgw: RadosGateway, bucket: str, aws_keys: None
) -> None:
    async with node(rgw, bucket, object_lookup_timeout_s=0.2) as (service, engine, link):
        data = await demote(service, engine, "object")
        keys = list(data)
        rgw.pause_gateway()
        try:
            loop = asyncio.get_running_loop()
            started = loop.time()
            assert await service.tiers.found(keys, None) == [None] * N
            assert loop.time() - started < 1.0
        finally:
            rgw.resume_gateway()

        async def back() -> bool:
            return link.health().ok and await service.tiers.found(keys, None) == ["object"] * N

        await until("lookups find the blocks again", back)


async def test_a_degraded_tier_is_ready_with_details_and_never_a_5xx(
    rgw: RadosGateway, bucket: str, aws_keys: None
) -> None:
    settings = make_settings(tiers=["object"], **object_settings(rgw, bucket))
    async with running(settings) as h:
        rgw.stop_gateway()
        try:
            link = h.service.tiers.get("object")
            assert link is not None

            async def degraded() -> bool:
                return not link.health().ok

            await until("degraded", degraded)
            r = await h.client.get("/readyz")
            assert r.status_code == 200
            assert r.json()["details"]["object_tier"].startswith("degraded: ")
            await h.start("r")
            keys = [f"{i:016x}" for i in range(8)]
            r = await h.post("/v1/requests/r/lookup", {"keys": keys})
            assert r.status_code == 200
            assert r.json()["results"] == ["miss"] * 8
            r = await h.post("/v1/requests/r/prepare-store", {"keys": keys})
            assert r.status_code == 200
        finally:
            rgw.start_gateway()


async def test_each_namespace_keeps_its_own_objects_and_bytes(
    rgw: RadosGateway, bucket: str, aws_keys: None, s3: Any, tmp_path: Path
) -> None:
    """With tenants: a namespace's objects live under its storage identity (NAMESPACE@TENANT),
    and its ``object_bytes`` in the tenants file bounds them (the other namespace has the
    service's)."""
    from tests.api.test_namespace_owner import ALICE, BOB, POOL, store_blocks
    from tests.api.test_tenancy import tenants_running

    text = (
        f'[tenants.alice]\ntokens = ["{ALICE}"]\n'
        f"namespaces = {{ a1 = {{ blocks = {POOL}, object_bytes = {3 * (4096 + 32)} }} }}\n\n"
        f'[tenants.bob]\ntokens = ["{BOB}"]\nnamespaces = {{ b1 = {POOL} }}\n'
    )
    settings = {**object_settings(rgw, bucket), "tiers": ["object"]}
    async with tenants_running(tmp_path, text, **settings) as t:
        links = {ns: t.tenancy.spaces[ns].service.tiers.get("object") for ns in ("a1", "b1")}
        assert {ns: link.capacity_blocks for ns, link in links.items()} == {  # type: ignore[union-attr]
            "a1": 3,
            "b1": t.settings.object_bytes // (4096 + 32),
        }
        keys = [f"{i:032x}" for i in range(1, 6)]
        await store_blocks(t, ALICE, "a1", keys)
        await store_blocks(t, BOB, "b1", keys)

        def under(prefix: str) -> list[str]:
            return [k for k in listed(s3, bucket) if k.startswith(prefix)]

        async def settled() -> bool:
            return len(under("kvoffload/a1@alice/")) == 3 and len(under("kvoffload/b1@bob/")) == 5

        await until("each namespace's objects under its own identity, a1 bounded", settled)


async def test_with_a_shared_secret_only_nodes_that_hold_it_load_the_objects(
    rgw: RadosGateway, bucket: str, aws_keys: None, tmp_path: Path
) -> None:
    """A node keyed with another secret (or none) refuses the objects another node wrote,
    counted; a node with the same secret loads them."""
    secret, other = tmp_path / "secret", tmp_path / "other"
    secret.write_bytes(b"fleet secret of the test, 32 byt")
    other.write_bytes(b"another secret, also 32 bytes lo")
    secret.chmod(0o600)
    other.chmod(0o600)
    async with node(rgw, bucket, object_mac_key_file=secret) as (a, engine_a, _):
        data = await demote(a, engine_a, "object")
    keys = list(data)
    for key_file in (other, None):
        async with node(rgw, bucket, object_mac_key_file=key_file) as (b, engine_b, link):
            assert await b.tiers.found(keys, None) == ["object"] * N  # a HEAD checks no MAC
            state, got = await engine_b.onload(keys)
            assert state == "failed"
            assert link.health().counters["checksum_failures"] == N
    async with node(rgw, bucket, object_mac_key_file=secret) as (_, engine_c, _):
        state, got = await engine_c.onload(keys)
        assert state == "done"
        assert got == [data[k] for k in keys]


@pytest.mark.parametrize("fault", ["slowdown", "cut"])
async def test_slowdown_or_a_cut_network_degrade_the_tier_and_nothing_is_lost(
    rgw: RadosGateway, bucket: str, aws_keys: None, fault: str
) -> None:
    """Every request answered 503 SlowDown (past the client's retries), or every connection
    reset (a cut link): the tier goes degraded, lookups answer miss at once, the pool keeps
    serving and storing, nothing is loaded wrong; restored, the tier comes back by itself and
    every block written before the fault loads with its bytes."""
    proxy = await FaultProxy(("127.0.0.1", rgw.port)).start()
    try:
        async with node(rgw, bucket, object_endpoint=proxy.endpoint, object_timeout_s=2.0) as (
            service,
            engine,
            link,
        ):
            data = await demote(service, engine, "object")
            keys = list(data)
            proxy.set(fault)  # type: ignore[arg-type]

            async def degraded() -> bool:
                return not link.health().ok

            await until("degraded", degraded)
            assert await service.tiers.found(keys, None) == [None] * N
            more = await engine.offload(keys_of(*range(200, 200 + POOL_BLOCKS)), seed=7000)
            state, got = await engine.onload(list(more)[-4:])
            assert state == "done"
            assert got == [more[k] for k in list(more)[-4:]]
            assert link.state()["queue"]["dropped_by"].get("degraded", 0) > 0
            if fault == "slowdown":
                assert proxy.requests_refused > 0
            proxy.set("pass")

            async def back() -> bool:
                return link.health().ok and await service.tiers.found(keys, None) == (
                    ["object"] * N
                )

            await until("the tier is back and finds every block", back)
            state, got = await engine.onload(keys)
            assert state == "done"
            assert got == [data[k] for k in keys]
            assert link.health().counters["checksum_failures"] == 0
    finally:
        await proxy.close()


async def test_a_miss_is_remembered_briefly_and_a_new_object_found_after(
    rgw: RadosGateway, bucket: str, aws_keys: None
) -> None:
    """Node B asked about keys the bucket lacked: for ``object_negative_cache_s`` it answers
    them miss without asking (node A's write of them meanwhile is found that much later at
    most); node A's own writes are never hidden from A."""
    async with (
        node(rgw, bucket, object_negative_cache_s=1.5) as (a, engine_a, _),
        node(rgw, bucket, object_negative_cache_s=1.5) as (b, _, link_b),
    ):
        keys = keys_of(*range(8))
        assert await b.tiers.found(keys, None) == [None] * 8  # asked: not there
        assert await a.tiers.found(keys, None) == [None] * 8
        await engine_a.offload(keys, seed=50)

        async def a_finds() -> bool:
            return await a.tiers.found(keys, None) == ["object"] * 8

        await until("node A finds its own writes at once", a_finds)
        started = time.monotonic()
        assert await b.tiers.found(keys, None) == [None] * 8  # remembered, not asked
        assert link_b.state()["lookups"]["cached_absent"] >= 8

        async def b_finds() -> bool:
            return await b.tiers.found(keys, None) == ["object"] * 8

        await until("node B finds them once its memory of the miss ends", b_finds)
        assert time.monotonic() - started <= 1.5 + 1.0
