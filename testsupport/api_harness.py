"""In-process API harness: one ``Service`` behind the engine and admin apps, lifespans running.

Calls go through ``httpx.AsyncClient`` over ``httpx.ASGITransport`` (no sockets). Settings are
small (32 blocks of 4 KiB, CPU transfers) and the environment's ``KVOFFLOAD_*`` variables are
cleared so they cannot leak into a test.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from app.core.service import Service
from app.http.apps import create_admin_app, create_app
from app.http.openapi import KVOffloadAPI
from app.settings import Settings
from app.telemetry.calls import CallInfo
from testsupport.shm_device import ShmDevice

TOKEN = "test-admin-token"
BLOCK = 4096


def make_settings(**overrides: Any) -> Settings:
    """Small test settings; ``overrides`` win."""
    base: dict[str, Any] = {
        "num_blocks": 32,
        "block_bytes": BLOCK,
        "device": "cpu",
        "admin_token": TOKEN,
        "lease_ttl_s": 60.0,
        "job_deadline_s": 5.0,
        "lease_check_interval_s": 0.05,
        "max_keys_per_call": 256,
        "max_body_bytes": 64 * 1024,
        "event_buffer_size": 1024,
        "shutdown_grace_s": 2.0,
    }
    base.update(overrides)
    return Settings(**base)


def hexkeys(*ids: int, width: int = 8) -> list[str]:
    """Readable hex keys: ``hexkeys(1, 2) == ["0000000000000001", "0000000000000002"]``."""
    return [i.to_bytes(width, "big").hex() for i in ids]


@dataclass
class Harness:
    """A running service, its two apps and a client for each."""

    settings: Settings
    service: Service
    app: KVOffloadAPI
    admin_app: KVOffloadAPI
    client: httpx.AsyncClient
    admin: httpx.AsyncClient
    calls: list[CallInfo] = field(default_factory=list)
    devices: list[ShmDevice] = field(default_factory=list)

    async def start(self, req_id: str = "r1") -> None:
        """Start request ``req_id``."""
        r = await self.client.put(f"/v1/requests/{req_id}")
        assert r.status_code in (200, 201), r.text

    async def post(self, path: str, body: Any) -> httpx.Response:
        """POST a JSON body to the engine API."""
        return await self.client.post(path, json=body)

    async def device(self, num_blocks: int = 16) -> tuple[ShmDevice, str]:
        """A registered shm device cache of ``num_blocks`` blocks and its cache id."""
        dev = ShmDevice(num_blocks, self.settings.block_bytes)
        self.devices.append(dev)
        r = await self.post("/v1/kv-caches", dev.spec())
        assert r.status_code == 201, r.text
        return dev, r.json()["cache_id"]

    async def wait(self, job_id: int, timeout_s: float = 5.0) -> dict[str, Any]:
        """Wait for one job; its record."""
        r = await self.post("/v1/jobs/wait", {"job_ids": [job_id], "timeout_s": timeout_s})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["done"], body
        job: dict[str, Any] = body["jobs"][0]
        return job


@contextlib.asynccontextmanager
async def running(settings: Settings, **service_kwargs: Any) -> AsyncIterator[Harness]:
    """A ``Harness`` whose apps' lifespans run for the duration of the block."""
    service = Service(settings, **service_kwargs)
    calls: list[CallInfo] = []
    app = create_app(settings, service=service, hooks=[calls.append])
    admin_app = create_admin_app(settings, service, hooks=[calls.append])
    devices: list[ShmDevice] = []
    try:
        async with (
            app.router.lifespan_context(app),
            admin_app.router.lifespan_context(admin_app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app), base_url="http://engine"
            ) as client,
            httpx.AsyncClient(
                transport=httpx.ASGITransport(admin_app),
                base_url="http://admin",
                headers={"authorization": f"Bearer {TOKEN}"},
            ) as admin,
        ):
            yield Harness(settings, service, app, admin_app, client, admin, calls, devices)
    finally:
        for dev in devices:
            dev.close()
