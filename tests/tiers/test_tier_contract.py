"""The lower-tier contract (``app.core.tier``), run against every backend through the service
core alone: no HTTP, no apps. A ``Service`` is started with one tier below its pool and driven
through its own API (``service.manager``, ``service.transfers()``, ``service.tiers``), as the
HTTP layer drives it.

The backends: ``disk`` (a real directory, O_DIRECT where the filesystem allows), ``remote`` (the
remote link over ``tests.api.test_remote_tier``'s in-process store: the Mooncake suite,
``make test-remote``, runs the real store), and ``memory`` (``tests.tiers.memory_tier``), a
backend that exists only in the tests and reaches the service by its module alone.

Each backend is checked for: demotion (a block the pool lets go reaches the tier, and the chain
names the tier for it), a one-call onload of blocks only the tier holds (bytes equal), faults (a
broken tier drops what it is given without making the pool wait, reports itself degraded, and
recovers), and a restart where the tier persists (the blocks are found again, bytes equal).
Then the chain itself (order, refusals, names), and the tenancy's deletion of a dropped
namespace's blocks through the contract, on a tier the service never names.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import tests.tiers.memory_tier as memory_tier
from app.core.disk import DiskLink
from app.core.errors import NoSpaceError
from app.core.remote import RemoteBackend
from app.core.service import Service
from app.core.tier import LowerTier, TierBackend
from app.settings import ConfigError, Settings
from manager import KeyNotReadyError
from tests.api.test_remote_tier import MemoryStore
from tests.api.test_remote_tier import MemoryTier as RemoteMemoryTier
from testsupport.api_harness import make_settings
from testsupport.polling import until_async
from testsupport.shm_device import ShmDevice
from transfer import HostPool

pytestmark = pytest.mark.anyio

POOL_BLOCKS = 16
N = 8  # blocks demoted and brought back


@dataclass
class Backend:
    """How to run one backend in the suite."""

    name: str
    settings: dict[str, Any]
    overrides: dict[str, TierBackend]
    # Break the tier / mend it (a fault the tier itself sees).
    breaks: Callable[[LowerTier], None]
    mends: Callable[[LowerTier], None]


def disk_backend(tmp: Path) -> Backend:
    def breaks(tier: LowerTier) -> None:
        assert isinstance(tier, DiskLink)
        tier.store.mark_degraded("broken by the test")

    return Backend(
        "disk",
        {"disk_dir": tmp / "disk", "disk_bytes": 64 * 4096 + 65536, "disk_admit_after": 1},
        {},
        breaks,
        lambda tier: None,  # its probe writes again and finds the disk good
    )


def remote_backend(tmp: Path) -> Backend:
    store = MemoryStore()

    def factory(settings: Settings, pool: HostPool, storage: str) -> RemoteMemoryTier:
        return RemoteMemoryTier(store, pool, f"kvoffload/{storage}/{settings.block_bytes}")

    def breaks(tier: LowerTier) -> None:
        store.down = True

    def mends(tier: LowerTier) -> None:
        store.down = False

    return Backend(
        "remote",
        {
            "remote_tier": "mooncake",
            "mooncake_master": "store:1",
            "mooncake_metadata": "http://store/metadata",
            "remote_lookup_timeout_s": 1.0,
            "remote_removal_confirm_s": 0.0,
        },
        {"remote": RemoteBackend(factory)},
        breaks,
        mends,
    )


def memory_backend(tmp: Path) -> Backend:
    memory_tier.STORES.clear()

    def switch(down: bool) -> Callable[[LowerTier], None]:
        def flip(tier: LowerTier) -> None:
            assert isinstance(tier, memory_tier.MemoryTier)
            tier.down = down

        return flip

    return Backend("memory", {}, {}, switch(True), switch(False))


BACKENDS = {"disk": disk_backend, "remote": remote_backend, "memory": memory_backend}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    made: Backend = BACKENDS[request.param](tmp_path)
    return made


@contextlib.asynccontextmanager
async def serving(backend: Backend) -> AsyncIterator[tuple[Service, Engine]]:
    """A running service with ``backend`` alone below its pool, and an engine on it."""
    settings = make_settings(
        num_blocks=POOL_BLOCKS, tiers=[backend.name], metrics_enabled=False, **backend.settings
    )
    service = Service(settings, tier_backends=backend.overrides)
    async with service.running():
        engine = Engine(service)
        try:
            yield service, engine
        finally:
            engine.close()


#: How long a condition may take to hold (a backend on a real store may need longer).
UNTIL_S = 10.0


async def until(what: str, check: Callable[[], Any]) -> None:
    """``until_async`` bounded by ``UNTIL_S`` (the object suite lengthens it)."""
    await until_async(what, check, UNTIL_S)


def keys_of(*ns: int) -> list[bytes]:
    return [n.to_bytes(4, "big") * 4 for n in ns]


class Engine:
    """An engine's calls on the service core: a device cache, offloads and onloads."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.dev = ShmDevice(64, service.settings.block_bytes)
        self.cache_id = service.transfers().register_cache(self.dev.spec()).cache_id
        self.calls = 0

    def close(self) -> None:
        self.dev.close()

    async def offload(self, keys: list[bytes], seed: int) -> dict[bytes, bytes]:
        """Store ``keys`` from device blocks 0.. filled from ``seed``; their bytes."""
        transfers = self.service.transfers()
        req = self._req()
        self.service.manager.start_request(req, None)
        data = {k: self.dev.fill(i, seed + i) for i, k in enumerate(keys)}
        deadline = time.monotonic() + 10
        while True:
            try:
                started = transfers.offload(req, self.cache_id, keys, list(range(len(keys))))
                break
            except NoSpaceError:
                # Blocks a tier holds while it writes them behind (remote) are not evictable
                # yet: an engine told 507 stores again a moment later.
                assert time.monotonic() < deadline, "the pool never made room"
                await asyncio.sleep(0.02)
        if started.job is not None:
            (done,) = await transfers.wait([started.job.job_id], 10.0)
            assert done.state == "done", done
        self.service.manager.finish_request(req, False)
        return data

    async def onload(self, keys: list[bytes]) -> tuple[str, list[bytes]]:
        """One onload of ``keys`` into device blocks 32..; the job's state and the bytes."""
        transfers = self.service.transfers()
        req = self._req()
        self.service.manager.start_request(req, None)
        blocks = list(range(32, 32 + len(keys)))
        deadline = time.monotonic() + 10
        while True:
            try:
                started = transfers.onload(req, self.cache_id, keys, blocks)
                break
            except KeyNotReadyError:
                # No room in the pool to promote into yet (blocks held while a tier writes
                # them behind): an engine told 409 asks again. Once accepted, one job brings
                # every key up and loads it.
                assert time.monotonic() < deadline, "the onload was never accepted"
                await asyncio.sleep(0.02)
        assert started.job is not None
        (done,) = await transfers.wait([started.job.job_id], 10.0)
        self.service.manager.finish_request(req, False)
        return done.state, [self.dev.read(b) for b in blocks]

    def _req(self) -> str:
        self.calls += 1
        return f"engine-{self.calls}"


async def demote(service: Service, engine: Engine, name: str) -> dict[bytes, bytes]:
    """Store N blocks, then enough others that the pool lets them all go; wait until the chain
    names ``name`` for each of the N. Their bytes."""
    first = keys_of(*range(N))
    data = await engine.offload(first, seed=1000)
    await engine.offload(keys_of(*range(100, 100 + POOL_BLOCKS)), seed=2000)
    pool = service.pool_manager
    assert all(pool.slot_of(k) is None for k in first)  # all evicted from the pool

    async def named() -> bool:
        return await service.tiers.found(first, "check") == [name] * N

    await until(f"{name} holds the demoted blocks", named)
    return data


async def test_a_block_the_pool_lets_go_is_found_in_the_tier(backend: Backend) -> None:
    async with serving(backend) as (service, engine):
        assert service.tiers.names == [backend.name]
        await demote(service, engine, backend.name)
        # Never stored: absent everywhere.
        assert await service.tiers.found(keys_of(999), None) == [None]
        assert service.tiers.states()[backend.name]["state"] == "ok"
        assert service.tiers.details() == {}


async def test_one_onload_brings_the_blocks_up_from_the_tier(backend: Backend) -> None:
    async with serving(backend) as (service, engine):
        data = await demote(service, engine, backend.name)
        keys = list(data)
        state, got = await engine.onload(keys)
        assert state == "done"
        assert got == [data[k] for k in keys]
        # Promoted into the pool: hits now.
        pool = service.pool_manager
        assert all(pool.slot_of(k) is not None for k in keys)


async def test_a_broken_tier_drops_what_it_is_given_and_recovers(backend: Backend) -> None:
    async with serving(backend) as (service, engine):
        data = await demote(service, engine, backend.name)
        tier = service.tiers.get(backend.name)
        assert tier is not None
        backend.breaks(tier)

        async def degraded() -> bool:
            return not tier.health().ok

        await until("degraded", degraded)
        # The pool keeps taking stores while the tier drops what it is given.
        more = await engine.offload(keys_of(*range(200, 200 + POOL_BLOCKS)), seed=3000)
        assert f"{backend.name}_tier" in service.tiers.details()
        assert service.tiers.states()[backend.name]["state"] == "degraded"
        # The pool still serves its own blocks.
        state, got = await engine.onload(list(more)[-4:])
        assert state == "done"
        assert got == [more[k] for k in list(more)[-4:]]
        # A broken tier names a block only if it still serves it whole (the disk still reads
        # what it holds; the others name nothing).
        keys = list(data)
        named = [k for k, t in zip(keys, await service.tiers.found(keys, None), strict=True) if t]
        if named:
            state, got = await engine.onload(named)
            assert state == "done"
            assert got == [data[k] for k in named]
        backend.mends(tier)

        async def recovered() -> bool:
            return tier.health().ok

        await until("recovered", recovered)
        # Taking demotions again.
        later = keys_of(*range(300, 300 + N))
        await engine.offload(later, seed=4000)
        await engine.offload(keys_of(*range(400, 400 + POOL_BLOCKS)), seed=5000)

        async def taken() -> bool:
            return await service.tiers.found(later, None) == [backend.name] * N

        await until(f"{backend.name} takes demotions again", taken)


async def test_a_burst_of_stores_three_times_the_pool_reaches_the_tier(backend: Backend) -> None:
    """Six offloads of 8 new blocks back to back into a pool of 16: every block the pool let
    go is in the tier (the remote and object tiers stage the queued ones the pool evicts before
    their put), and loads back with its bytes."""
    async with serving(backend) as (service, engine):
        data: dict[bytes, bytes] = {}
        for i in range(3 * POOL_BLOCKS // N):
            data |= await engine.offload(keys_of(*range(200 + i * N, 200 + (i + 1) * N)), 3000 + i)
        pool = service.pool_manager
        gone = [k for k in data if pool.slot_of(k) is None]
        assert len(gone) >= 2 * POOL_BLOCKS

        async def all_there() -> bool:
            return await service.tiers.found(gone, "check") == [backend.name] * len(gone)

        await until(f"{backend.name} holds every block the pool let go", all_there)
        sample = gone[:N]
        state, got = await engine.onload(sample)
        assert state == "done"
        assert got == [data[k] for k in sample]


async def test_a_restarted_service_finds_the_tier_s_blocks(backend: Backend) -> None:
    async with serving(backend) as (service, engine):
        data = await demote(service, engine, backend.name)
    async with serving(backend) as (again, engine):
        keys = list(data)
        assert await again.tiers.found(keys, None) == [backend.name] * N
        state, got = await engine.onload(keys)
        assert state == "done"
        assert got == [data[k] for k in keys]


# ---------------------------------------------------------------------- the chain itself


async def test_the_first_tier_that_holds_a_key_names_it(tmp_path: Path) -> None:
    """memory before disk: a block both hold is named memory; one only the disk holds, disk."""
    memory_tier.STORES.clear()
    settings = make_settings(
        num_blocks=POOL_BLOCKS,
        tiers=["memory", "disk"],
        metrics_enabled=False,
        disk_dir=tmp_path / "disk",
        disk_bytes=64 * 4096 + 65536,
        disk_admit_after=1,
    )
    service = Service(settings)
    async with service.running():
        engine = Engine(service)
        try:
            data = await demote(service, engine, "memory")
            keys = list(data)
            disk = service.tiers.get("disk")
            assert isinstance(disk, DiskLink)

            async def on_disk() -> bool:
                return await disk.found(keys, None) == [True] * N

            await until("the disk holds them too", on_disk)
            assert await service.tiers.found(keys, None) == ["memory"] * N
            memory = service.tiers.get("memory")
            assert isinstance(memory, memory_tier.MemoryTier)
            for key in keys[:3]:
                del memory.blocks[key]
            assert await service.tiers.found(keys, None) == ["disk"] * 3 + ["memory"] * 5
            state, got = await engine.onload(keys)  # from both tiers in one call
            assert state == "done"
            assert got == [data[k] for k in keys]
        finally:
            engine.close()


@pytest.mark.parametrize(
    ("tiers", "extra", "says"),
    [
        (["tape"], {}, "no tier named 'tape'"),
        (["memory", "memory"], {}, "named twice"),
        (["disk"], {}, "the disk tier needs --disk-dir"),
        (
            ["memory"],
            {"disk_dir": "/tmp/kvo-left-out", "disk_bytes": 1 << 20},
            "disk tier is configured but not in",
        ),
    ],
)
def test_a_chain_that_cannot_be_built_is_refused_naming_tiers(
    tiers: list[str], extra: dict[str, Any], says: str
) -> None:
    settings = make_settings(tiers=tiers, metrics_enabled=False, **extra)
    if says.startswith("the disk tier needs"):
        # Caught when the tier opens: the chain itself is well formed.
        service = Service(settings)
        assert service.tiers.names == ["disk"]

        async def start() -> None:
            async with service.running():
                pass

        with pytest.raises(ConfigError) as err:
            asyncio.run(start())
    else:
        with pytest.raises(ConfigError) as err:
            Service(settings)
    assert err.value.field == "tiers"
    assert says in str(err.value)


def test_without_tiers_the_flags_build_the_chain_disk_first(tmp_path: Path) -> None:
    settings = make_settings(
        metrics_enabled=False,
        disk_dir=tmp_path / "d",
        disk_bytes=1 << 20,
        remote_tier="mooncake",
        mooncake_master="store:1",
        mooncake_metadata="http://store/metadata",
    )
    assert Service(settings).tiers.names == ["disk", "remote"]
    assert Service(make_settings(metrics_enabled=False)).tiers.names == []


def test_a_tier_name_must_be_a_short_lowercase_identifier_and_not_a_lookup_state() -> None:
    from app.core.tier import register

    for bad in ("hit", "miss", "pending", "pool", "Disk", "s3-tier", "x" * 17, ""):
        with pytest.raises(ValueError, match="refused"):
            register(bad, memory_tier.MemoryBackend())
    with pytest.raises(ValueError, match="already registered"):
        register("memory", memory_tier.MemoryBackend())


def test_the_remote_backend_is_the_registered_one_unless_overridden() -> None:
    from app.core.tier import backends

    names = list(backends())
    assert names.index("disk") < names.index("remote")
    assert isinstance(backends()["remote"], RemoteBackend)
    assert "memory" in backends()  # this module's import registered it


async def test_a_namespace_given_away_drops_its_blocks_on_a_tier_the_service_never_names(
    tmp_path: Path,
) -> None:
    """The tenancy deletes a dropped namespace's blocks through the contract (``identities``,
    ``drop``): on the memory tier as on the disk, at a reload and at start."""
    from tests.api.test_namespace_owner import ALICE, POOL, store_blocks, tenants
    from tests.api.test_tenancy import tenants_running, write_tenants

    memory_tier.STORES.clear()
    memory_tier.STORES["gone@carol"] = collections.OrderedDict({b"k": b"x"})  # not served
    keys = [f"{i:032x}" for i in range(1, 3 * POOL + 1)]
    async with tenants_running(tmp_path, tenants(["a1", "a2"], ["b1"]), tiers=["memory"]) as t:
        assert "gone@carol" not in memory_tier.STORES  # swept at start
        await store_blocks(t, ALICE, "a2", keys)

        async def held() -> bool:
            return len(memory_tier.STORES.get("a2@alice", ())) == 2 * POOL

        await until("the memory tier holds alice's evicted blocks", held)
        write_tenants(t.path, tenants(["a1"], ["b1", "a2"]))
        assert await t.tenancy.reload()
        assert "a2@alice" not in memory_tier.STORES
        assert t.tenancy.spaces["a2"].tenant == "bob"


async def test_a_new_backend_is_in_the_tier_families_and_the_stats_by_its_name() -> None:
    """Metrics, stats and readiness of a tier come from the contract: the memory tier, which
    no service file names, exports the ``kvoffload_tier_*`` families under its own name."""
    memory_tier.STORES.clear()
    settings = make_settings(num_blocks=POOL_BLOCKS, tiers=["memory"])
    service = Service(settings)
    async with service.running():
        engine = Engine(service)
        try:
            data = await demote(service, engine, "memory")
            await engine.onload(list(data))
            registry = service.registry
            assert registry is not None

            def value(name: str, **labels: str) -> float | None:
                return registry.get_sample_value(name, {"tier": "memory", **labels})

            assert value("kvoffload_tier_up") == 1
            # The first N, and the N pool blocks their promotion evicted in turn.
            assert value("kvoffload_tier_blocks") == 2 * N
            assert value("kvoffload_tier_demoted_blocks_total") == 2 * N
            assert value("kvoffload_tier_promoted_blocks_total") == N
            assert value("kvoffload_tier_bytes_read_total") == N * settings.block_bytes
            tier = service.tiers.get("memory")
            assert isinstance(tier, memory_tier.MemoryTier)
            tier.down = True
            assert value("kvoffload_tier_up") == 0
            assert value("kvoffload_tier_incidents_total") == 1
            assert service.details()["memory_tier"].startswith("degraded: switched down")
            assert service.tiers.states()["memory"]["state"] == "degraded"
        finally:
            engine.close()
