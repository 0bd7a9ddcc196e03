"""Simulated engines against a live ``kvoffload serve``: the driver of the load and soak tests
(``tests/load/test_load.py``; ``run_load`` is the entry point).

One asyncio loop (plus, optionally, worker processes for the engines) runs against one server
on 127.0.0.1:

- **Engines** (``LoadConfig.engines`` tasks, one HTTP connection each, on the driver's loop or
  spread over ``processes`` worker processes when one Python client cannot keep up). Each owns
  a shared-memory "device" KV cache (``ShmDevice``: real bytes) and runs request lives one
  after another over a shared key space (``KeySpace``: chains of hashed blocks whose heads are
  shared prompt prefixes, and conversations whose next turn extends the previous chain). A
  life: start the request (alone, or batched with its lookup), look the chain up, load the hit
  prefix (an ``onload`` job into device blocks, or ``prepare-load`` and a read straight from the
  mapped host pool), check every loaded byte against the key's content, store the rest (an
  ``offload`` job, or ``prepare-store``, a write into the mapped pool and ``complete-store``),
  wait for its jobs, finish. Some lives abort (with their store job in flight, or with their
  own pool copy in flight); some *vanish*: they stop calling while holding pins or pending
  stores, and only the lease TTL gives those back. An engine stops after ``max_requests`` lives
  or at the deadline, whichever comes first.
- **The operator** switches the eviction policy through the admin API every ``switch_every_s``,
  cycling through every registered policy (``If-Match`` on the generation it last saw), checks
  ``free + pending + ready == num_blocks`` and ``pinned <= ready`` in the admin stats, probes the
  admin API without a token (401) and with a wrong one (403), and clears the cache once.
- **The event follower** reads ``GET /v1/events`` and keeps the set of blocks reported stored
  and not since reported removed or cleared. After the run each of them must still be a hit,
  and the server's ready count must equal the set's size: no block lost, none unreported.
- **The sampler** reads the server's ``/proc/<pid>/status`` every ``rss_every_s``.

Every HTTP answer passes through a ``Recorder`` (an httpx transport wrapper): calls are counted
by status and error code, server errors are kept, and every body and header is scanned for
secrets (the admin token, canary environment values).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import mmap
import multiprocessing
import os
import random
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
from kvoffload_client.client import AsyncKVOffloadClient, Batch, Job, KVOffloadError

from testsupport.procfs import proc_cpu_seconds, proc_status
from testsupport.shm_device import ShmDevice

# Refusals an engine meets in normal operation: a hit evicted (or cleared) between its lookup and
# its load, and a store that finds every block pinned or pending.
EXPECTED_ERRORS = frozenset({(409, "key_not_ready"), (507, "no_space")})
KIB = 1024


def content_of(key: bytes, size: int) -> bytes:
    """The bytes every engine computes for block ``key``: a function of the key alone."""
    digest = hashlib.blake2b(key, digest_size=32).digest()
    return (digest * (size // 32 + 1))[:size]


def chain(parent: bytes, length: int, salt: bytes = b"") -> list[bytes]:
    """``length`` block hashes, each hashing its parent (vLLM-style prefix chaining)."""
    keys = []
    for i in range(length):
        parent = hashlib.blake2b(parent + salt + i.to_bytes(4, "little"), digest_size=16).digest()
        keys.append(parent)
    return keys


class KeySpace:
    """Request chains over shared prompt prefixes with Zipf-like popularity.

    A request takes a head of one of ``prefixes`` shared chains and adds a tail unique to it;
    with ``continue_rate`` it is instead the next turn of the engine's previous conversation
    (its whole chain plus a new tail). Chains are at most ``max_blocks`` long.
    """

    def __init__(
        self,
        seed: int,
        *,
        prefixes: int = 24,
        prefix_blocks: tuple[int, int] = (2, 10),
        tail_blocks: tuple[int, int] = (1, 6),
        max_blocks: int = 16,
        continue_rate: float = 0.25,
    ) -> None:
        rng = random.Random(seed)
        self.prefixes = [
            chain(f"prefix-{seed}-{i}".encode(), rng.randint(*prefix_blocks))
            for i in range(prefixes)
        ]
        self.weights = [1.0 / (i + 1) for i in range(prefixes)]
        self.tail_blocks = tail_blocks
        self.max_blocks = max_blocks
        self.continue_rate = continue_rate

    def request(self, rng: random.Random, uid: str, previous: list[bytes] | None) -> list[bytes]:
        """The chain of a new request named ``uid``."""
        tail = rng.randint(*self.tail_blocks)
        if previous and rng.random() < self.continue_rate:
            head = previous[: self.max_blocks - tail]
        else:
            prefix = rng.choices(self.prefixes, self.weights)[0]
            head = prefix[: rng.randint(1, len(prefix))]
        return (head + chain(head[-1], tail, uid.encode()))[: self.max_blocks]


# --------------------------------------------------------------------------- observation


def _error_code(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "?"


class Recorder:
    """Counts answers by status and by (status, error code); keeps 5xx and secret sightings."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self.secrets = sorted({s.encode() for s in secrets if s})
        self.calls = 0
        self.statuses: Counter[int] = Counter()
        self.errors: Counter[tuple[int, str]] = Counter()
        self.server_errors: list[str] = []
        self.leaks: list[str] = []

    def record(
        self, method: str, path: str, status: int, headers: httpx.Headers, body: bytes
    ) -> None:
        """Account for one answer."""
        self.calls += 1
        self.statuses[status] += 1
        if status >= 400:
            self.errors[(status, _error_code(body))] += 1
        if status >= 500 and status != 507 and len(self.server_errors) < 50:
            self.server_errors.append(f"{method} {path} -> {status}: {body[:300]!r}")
        blob = body + b"\n" + b"\n".join(k + b": " + v for k, v in headers.raw)
        for secret in self.secrets:
            if secret in blob and len(self.leaks) < 50:
                self.leaks.append(f"{method} {path} ({status}) returned a secret")

    def server_error_count(self) -> int:
        """Answers with a 5xx status, but for 507 ``no_space`` (the documented answer of a
        store that finds no evictable block; counted in ``errors``)."""
        fives = sum(n for status, n in self.statuses.items() if status >= 500)
        return fives - self.errors[(507, "no_space")]


class RecordingTransport(httpx.AsyncBaseTransport):
    """An httpx transport that reads each answer whole and shows it to a ``Recorder``."""

    def __init__(self, recorder: Recorder, inner: httpx.AsyncBaseTransport | None = None) -> None:
        self.recorder = recorder
        self.inner = inner or httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        try:
            body = await response.aread()
        finally:
            await response.aclose()
        self.recorder.record(
            request.method, request.url.path, response.status_code, response.headers, body
        )
        return httpx.Response(response.status_code, headers=response.headers, content=body)

    async def aclose(self) -> None:
        await self.inner.aclose()


class EventFollower:
    """Follows ``GET /v1/events``; ``resident`` = blocks stored and not removed or cleared since."""

    def __init__(self, client: AsyncKVOffloadClient) -> None:
        self.client = client
        self.after = 0
        self.instance: str | None = None
        self.resident: set[bytes] = set()
        self.events = 0
        self.stored = 0
        self.removed = 0
        self.cleared = 0
        self.fell_behind = False

    async def poll(self) -> bool:
        """Read one page and apply it; True when caught up with the server."""
        page = await self.client.events(self.after, 10000)
        if page.fell_behind or (self.instance is not None and page.instance != self.instance):
            self.fell_behind = True
        self.instance = page.instance
        for event in page.events:
            self.events += 1
            if event.type == "BlockStored":
                self.resident.update(event.block_hashes)
                self.stored += len(event.block_hashes)
            elif event.type == "BlockRemoved":
                self.resident.difference_update(event.block_hashes)
                self.removed += len(event.block_hashes)
            else:
                self.resident.clear()
                self.cleared += 1
        self.after = page.next_after
        return page.next_after >= page.latest_seq

    async def follow(self, stop: asyncio.Event, every_s: float) -> None:
        """Poll until ``stop`` is set, pausing ``every_s`` whenever caught up."""
        while not stop.is_set():
            if await self.poll():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), every_s)

    async def catch_up(self) -> None:
        """Poll until nothing is left to read."""
        while not await self.poll():
            pass


class PoolView:
    """The server's host pool, mapped in this process (what an engine that copies by itself
    does with ``GET /v1/pool``)."""

    def __init__(self, path: str, num_blocks: int, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, num_blocks * block_bytes)
        finally:
            os.close(fd)

    def read(self, slot: int) -> bytes:
        start = slot * self.block_bytes
        return bytes(self._map[start : start + self.block_bytes])

    def write(self, slot: int, data: bytes) -> None:
        start = slot * self.block_bytes
        self._map[start : start + self.block_bytes] = data

    def close(self) -> None:
        self._map.close()


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Target:
    """The server under load."""

    url: str
    admin_url: str
    token: str
    pid: int
    secrets: tuple[str, ...] = ()


@dataclass(frozen=True)
class LoadConfig:
    """How hard and how long to push (the run ends at ``seconds`` or ``max_requests`` lives
    per engine, whichever comes first)."""

    engines: int = 32
    # Worker processes the engines are spread over (1: every engine on the driver's loop).
    processes: int = 1
    seconds: float = 20.0
    max_requests: int = 400
    seed: int = 1234
    device_blocks: int = 16
    abort_rate: float = 0.08
    vanish_rate: float = 0.04
    pool_path_rate: float = 0.3
    batch_rate: float = 0.5
    touch_rate: float = 0.3
    engine_copy_fail_rate: float = 0.02
    switch_every_s: float = 1.0
    clear_at: float = 0.5
    follow_every_s: float = 0.1
    rss_every_s: float = 0.25
    warmup: float = 0.3
    quiesce_s: float = 30.0
    job_wait_s: float = 20.0


@dataclass
class LoadReport:
    """What a run did and saw; ``problems`` lists every check that failed."""

    engines: int
    seconds: float = 0.0
    calls: int = 0
    lives: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    errors: Counter[tuple[int, str]] = field(default_factory=Counter)
    jobs: Counter[str] = field(default_factory=Counter)
    blocks_verified: int = 0
    switches: Counter[str] = field(default_factory=Counter)
    policies: list[str] = field(default_factory=list)
    clear: dict[str, Any] | None = None
    server_errors: int = 0
    leaks: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    final_blocks: dict[str, int] = field(default_factory=dict)
    live_requests: int = -1
    resident_tracked: int = 0
    blocks_lost: int = -1
    events: int = 0
    rss_kib: list[tuple[float, int, int]] = field(default_factory=list)
    rss_baseline_kib: int = 0
    rss_peak_kib: int = 0
    server_cpu_s: float = 0.0

    @property
    def calls_per_s(self) -> float:
        return self.calls / self.seconds if self.seconds else 0.0

    @property
    def rss_growth_mib(self) -> float:
        return (self.rss_peak_kib - self.rss_baseline_kib) / KIB

    def problem(self, text: str) -> None:
        if len(self.problems) < 100:
            self.problems.append(text)

    def summary(self) -> str:
        """One paragraph for the test log."""
        lines = [
            f"load: {self.engines} engines x {self.seconds:.1f}s, {self.calls} calls "
            f"({self.calls_per_s:.0f} calls/s; server CPU {self.server_cpu_s:.1f}s, "
            f"{100 * self.server_cpu_s / max(self.seconds, 1e-9):.0f}% of one core)",
            f"  lives {dict(self.lives)}",
            f"  statuses {dict(sorted(self.statuses.items()))}, errors {dict(self.errors)}",
            f"  jobs {dict(self.jobs)}, blocks verified {self.blocks_verified}",
            f"  policy switches {dict(self.switches)}, clear {self.clear}",
            f"  events {self.events}, tracked resident {self.resident_tracked}, "
            f"lost {self.blocks_lost}, final blocks {self.final_blocks}, "
            f"live requests {self.live_requests}",
            f"  server RSS baseline {self.rss_baseline_kib / KIB:.1f} MiB, "
            f"peak {self.rss_peak_kib / KIB:.1f} MiB (+{self.rss_growth_mib:.1f} MiB)",
            f"  5xx {self.server_errors}, secret sightings {len(self.leaks)}, "
            f"problems {len(self.problems)}",
        ]
        return "\n".join(lines)


# --------------------------------------------------------------------------- the actors


class Run:
    """Shared state of one load run."""

    def __init__(self, target: Target, cfg: LoadConfig) -> None:
        self.target = target
        self.cfg = cfg
        self.recorder = Recorder((target.token, *target.secrets))
        # Probes that must be refused (401/403) are counted apart from the engines' calls.
        self.probes = Recorder((target.token, *target.secrets))
        self.report = LoadReport(cfg.engines)
        self.keys = KeySpace(cfg.seed, max_blocks=cfg.device_blocks)
        self.deadline = 0.0
        self.started = 0.0
        self.pool: PoolView | None = None
        self.block_bytes = 0

    def client(self, timeout: float = 30.0) -> AsyncKVOffloadClient:
        return AsyncKVOffloadClient(
            self.target.url, timeout=timeout, transport=RecordingTransport(self.recorder)
        )

    def admin(self, recorder: Recorder, token: str | None) -> httpx.AsyncClient:
        headers = {} if token is None else {"authorization": f"Bearer {token}"}
        return httpx.AsyncClient(
            base_url=self.target.admin_url,
            headers=headers,
            timeout=30.0,
            transport=RecordingTransport(recorder),
        )

    def going(self) -> bool:
        return time.monotonic() < self.deadline


class Engine:
    """One simulated engine; see the module docstring."""

    def __init__(self, run: Run, index: int) -> None:
        self.run = run
        self.cfg = run.cfg
        self.index = index
        self.rng = random.Random(run.cfg.seed * 1000 + index)
        self.client = run.client()
        self.device: ShmDevice | None = None
        self.cache_id = ""
        self.previous: list[bytes] | None = None

    def content(self, key: bytes) -> bytes:
        return content_of(key, self.run.block_bytes)

    def check(self, got: bytes, key: bytes, where: str) -> None:
        if got == self.content(key):
            self.run.report.blocks_verified += 1
        else:
            self.run.report.problem(f"engine {self.index}: wrong bytes for {key.hex()} ({where})")

    async def main(self) -> None:
        report = self.run.report
        self.device = ShmDevice(
            self.cfg.device_blocks, self.run.block_bytes, name=f"load-engine-{self.index}"
        )
        try:
            self.cache_id = (await self.client.register_kv_cache(self.device.spec())).cache_id
            n = 0
            while n < self.cfg.max_requests and self.run.going():
                req_id = f"load-e{self.index}-r{n}"
                n += 1
                try:
                    report.lives[await self.life(req_id)] += 1
                except KVOffloadError as exc:
                    report.lives["failed"] += 1
                    report.problem(f"engine {self.index} {req_id}: unexpected {exc}")
                    with contextlib.suppress(KVOffloadError):
                        await self.client.finish_request(req_id, abort=True)
                except httpx.TransportError as exc:
                    report.lives["failed"] += 1
                    report.problem(f"engine {self.index} {req_id}: transport error {exc!r}")
            await self.client.unregister_kv_cache(self.cache_id)
        finally:
            await self.client.aclose()
            self.device.close()

    async def life(self, req_id: str) -> str:
        """One request life; returns how it ended (finish, abort, vanish)."""
        cfg, rng, c = self.cfg, self.rng, self.client
        keys = self.run.keys.request(rng, req_id, self.previous)
        self.previous = keys
        draw = rng.random()
        fate = (
            "vanish"
            if draw < cfg.vanish_rate
            else "abort"
            if draw < cfg.vanish_rate + cfg.abort_rate
            else "finish"
        )
        via_pool = fate == "vanish" or rng.random() < cfg.pool_path_rate

        if rng.random() < cfg.batch_rate:
            results = await c.batch(Batch().start_request(req_id).lookup(req_id, keys))
            for op in results:
                if op.error is not None:
                    raise op.error
            assert results[1].result is not None
            hit = int(results[1].result["hit_prefix"])
        else:
            await c.start_request(req_id)
            hit = (await c.lookup(req_id, keys)).hit_prefix

        pinned = False
        if hit and via_pool:
            hit, pinned = await self.load_via_pool(req_id, keys[:hit], keep=fate == "vanish")
        elif hit:
            hit = await self.load_via_job(req_id, keys[:hit])

        rest = keys[hit:]
        if via_pool:
            outcome = await self.store_via_pool(req_id, rest, fate)
            if outcome == "aborted":
                return "abort"
            if fate == "vanish":
                if pinned or outcome == "pending":
                    return "vanish"  # silent from now on, holding leases
                fate = "finish"  # nothing held: a vanish would only leave a bare record
        else:
            aborted = await self.store_via_job(req_id, rest, hit, abort=fate == "abort")
            if aborted:
                return "abort"
        released = await c.finish_request(req_id, abort=fate == "abort")
        if fate == "finish" and (released.pins_released or released.stores_dropped):
            self.run.report.problem(f"{req_id}: a normal finish released leases: {released}")
        return fate

    async def wait(self, job_id: int) -> Job:
        waited = await self.client.wait_jobs([job_id], timeout_s=self.cfg.job_wait_s)
        job = waited.jobs[0]
        if not waited.done:
            self.run.report.problem(f"job {job_id} still running after {self.cfg.job_wait_s}s")
        self.run.report.jobs[f"{job.direction} {job.state} {job.reason or ''}".strip()] += 1
        return job

    async def load_via_pool(self, req_id: str, keys: list[bytes], keep: bool) -> tuple[int, bool]:
        """prepare-load, read the slots from the mapped pool; (blocks loaded, still pinned)."""
        assert self.run.pool is not None
        try:
            slots = await self.client.prepare_load(req_id, keys)
        except KVOffloadError as exc:
            if (exc.status, exc.code) == (409, "key_not_ready"):
                return 0, False
            raise
        for key, slot in zip(keys, slots, strict=True):
            self.check(self.run.pool.read(slot), key, f"pool slot {slot}")
        if keep:
            return len(keys), True
        await self.client.complete_load(req_id, keys)
        return len(keys), False

    async def load_via_job(self, req_id: str, keys: list[bytes]) -> int:
        """onload into device blocks 0..n-1, wait, check the bytes; blocks loaded."""
        assert self.device is not None
        try:
            started = await self.client.onload(req_id, self.cache_id, keys, range(len(keys)))
        except KVOffloadError as exc:
            if (exc.status, exc.code) == (409, "key_not_ready"):
                return 0
            raise
        assert started.job_id is not None
        job = await self.wait(started.job_id)
        if job.state != "done":
            return 0  # the device blocks hold nothing useful: recompute them
        for b, key in enumerate(keys):
            self.check(self.device.read(b), key, f"device block {b}")
        if self.rng.random() < self.cfg.touch_rate:
            await self.client.touch(req_id, keys)
        return len(keys)

    async def store_via_job(self, req_id: str, keys: list[bytes], first: int, abort: bool) -> bool:
        """Compute the blocks into the device, offload them; True if it aborted meanwhile."""
        assert self.device is not None
        if not keys:
            return False
        for i, key in enumerate(keys):
            self.device.write(first + i, self.content(key))
        try:
            started = await self.client.offload(
                req_id, self.cache_id, keys, range(first, first + len(keys))
            )
        except KVOffloadError as exc:
            if (exc.status, exc.code) == (507, "no_space"):
                return False
            raise
        if abort:  # the engine gives up with its store job in flight
            await self.client.finish_request(req_id, abort=True)
        if started.job_id is not None:
            await self.wait(started.job_id)
        return abort

    async def store_via_pool(self, req_id: str, keys: list[bytes], fate: str) -> str | None:
        """prepare-store, write the slots, complete-store.

        Returns "pending" when it left its stores pending (a vanishing engine), "aborted" when
        it aborted the request with its copy in flight, else None.
        """
        assert self.run.pool is not None
        if not keys:
            return None
        try:
            spec = await self.client.prepare_store(req_id, keys)
        except KVOffloadError as exc:
            if (exc.status, exc.code) == (507, "no_space"):
                return None
            raise
        todo = spec.keys_to_store
        if not todo:
            return None
        if fate == "vanish":
            return "pending"
        for key, slot in zip(todo, spec.slots, strict=True):
            self.run.pool.write(slot, self.content(key))
        if fate == "abort":
            # Aborted while its own copy was running; the copy then reports, and is dropped.
            await self.client.finish_request(req_id, abort=True)
            done = await self.client.complete_store(req_id, todo, success=True)
            if done.completed or sorted(done.dropped) != sorted(todo):
                self.run.report.problem(f"{req_id}: complete-store after abort: {done}")
            return "aborted"
        ok = self.rng.random() >= self.cfg.engine_copy_fail_rate
        done = await self.client.complete_store(req_id, todo, success=ok)
        if sorted(done.completed if ok else done.dropped) != sorted(todo):
            self.run.report.problem(f"{req_id}: complete-store(success={ok}): {done}")
        return None


async def operate(run: Run, stop: asyncio.Event) -> None:
    """The operator; see the module docstring."""
    report = run.report
    async with (
        run.admin(run.recorder, run.target.token) as admin,
        run.admin(run.probes, None) as anonymous,
        run.admin(run.probes, run.target.token + "-not") as wrong,
    ):
        info = (await admin.get("/admin/v1/policy")).json()
        policies = [p for p in info["available"] if p != info["name"]] + [info["name"]]
        report.policies = list(info["available"])
        generation = info["generation"]
        i = 0
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), run.cfg.switch_every_s)
            if stop.is_set():
                break
            name = policies[i % len(policies)]
            i += 1
            r = await admin.put(
                "/admin/v1/policy",
                json={"name": name, "params": {}},
                headers={"if-match": f'"{generation}"'},
            )
            if r.status_code == 200 and r.json()["to"]["name"] == name:
                generation = r.json()["to"]["generation"]
                report.switches[name] += 1
            else:
                report.problem(f"policy switch to {name}: {r.status_code} {r.text[:200]}")
            blocks = (await admin.get("/admin/v1/stats")).json()["blocks"]
            if blocks["free"] + blocks["pending"] + blocks["ready"] != blocks["num_blocks"]:
                report.problem(f"block counts do not add up: {blocks}")
            if blocks["pinned"] > blocks["ready"]:
                report.problem(f"more pinned than ready: {blocks}")
            elapsed = time.monotonic() - run.started
            if report.clear is None and elapsed >= run.cfg.seconds * run.cfg.clear_at:
                r = await admin.post("/admin/v1/cache/clear")
                report.clear = r.json() if r.status_code == 200 else {"status": r.status_code}
            for client, status in ((anonymous, 401), (wrong, 403)):
                r = await client.get("/admin/v1/stats")
                if r.status_code != status:
                    report.problem(f"admin probe expected {status}, got {r.status_code}")


async def sample_rss(run: Run, stop: asyncio.Event) -> None:
    """Sample the server's memory until ``stop``."""
    while not stop.is_set():
        st = proc_status(run.target.pid)
        run.report.rss_kib.append((time.monotonic() - run.started, st["VmRSS"], st["RssAnon"]))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), run.cfg.rss_every_s)


async def quiesce(run: Run, admin: httpx.AsyncClient) -> dict[str, Any]:
    """Wait until no pin, pending store, live request or job is left; the last stats."""
    deadline = time.monotonic() + run.cfg.quiesce_s
    while True:
        stats: dict[str, Any] = (await admin.get("/admin/v1/stats")).json()
        b = stats["blocks"]
        idle = (b["pinned"], b["pending"], stats["live_requests"], stats["jobs"]["running"])
        if idle == (0, 0, 0, 0) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.2)


async def check_resident(run: Run, keys: Sequence[bytes], limit: int) -> list[bytes]:
    """The keys of ``keys`` that are not a hit now (looked up by a request of its own)."""
    lost: list[bytes] = []
    async with run.client() as c:
        await c.start_request("load-final-check")
        for i in range(0, len(keys), limit):
            part = list(keys[i : i + limit])
            results = (await c.lookup("load-final-check", part)).results
            lost.extend(k for k, r in zip(part, results, strict=True) if r != "hit")
        await c.finish_request("load-final-check")
    return lost


async def run_engines(run: Run, indices: Iterable[int]) -> None:
    """Run the engines numbered ``indices`` on this loop until they are all done."""
    await asyncio.gather(*(Engine(run, i).main() for i in indices))


@dataclass
class EnginePart:
    """What the engines of one worker process did and saw (picklable, merged by the parent)."""

    statuses: Counter[int]
    errors: Counter[tuple[int, str]]
    calls: int
    server_errors: list[str]
    leaks: list[str]
    lives: Counter[str]
    jobs: Counter[str]
    blocks_verified: int
    problems: list[str]


def engine_process(
    target: Target,
    cfg: LoadConfig,
    indices: list[int],
    started: float,
    pool_path: str,
    num_blocks: int,
    block_bytes: int,
) -> EnginePart:
    """Worker process body: run ``indices`` until the run's deadline (``time.monotonic`` is
    one clock for every process of the machine); what they did."""
    run = Run(target, cfg)
    run.started, run.deadline = started, started + cfg.seconds
    run.block_bytes = block_bytes
    run.pool = PoolView(pool_path, num_blocks, block_bytes)
    try:
        asyncio.run(run_engines(run, indices))
    finally:
        run.pool.close()
    rec, rep = run.recorder, run.report
    return EnginePart(
        rec.statuses,
        rec.errors,
        rec.calls,
        rec.server_errors,
        rec.leaks,
        rep.lives,
        rep.jobs,
        rep.blocks_verified,
        rep.problems,
    )


async def run_engine_processes(run: Run, pool_path: str, num_blocks: int) -> None:
    """Spread the engines over ``cfg.processes`` worker processes; fold their findings into
    ``run`` as if they had run here."""
    cfg = run.cfg
    loop = asyncio.get_running_loop()
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(cfg.processes, mp_context=context) as pool:
        parts = await asyncio.gather(
            *(
                loop.run_in_executor(
                    pool,
                    engine_process,
                    run.target,
                    cfg,
                    list(range(k, cfg.engines, cfg.processes)),
                    run.started,
                    pool_path,
                    num_blocks,
                    run.block_bytes,
                )
                for k in range(cfg.processes)
            )
        )
    rec, rep = run.recorder, run.report
    for part in parts:
        rec.statuses.update(part.statuses)
        rec.errors.update(part.errors)
        rec.calls += part.calls
        rec.server_errors.extend(part.server_errors)
        rec.leaks.extend(part.leaks)
        rep.lives.update(part.lives)
        rep.jobs.update(part.jobs)
        rep.blocks_verified += part.blocks_verified
        for problem in part.problems:
            rep.problem(problem)


async def run_load(target: Target, cfg: LoadConfig) -> LoadReport:
    """Drive one load run and check its end state; see the module docstring."""
    run = Run(target, cfg)
    report = run.report
    stop_engines_side = asyncio.Event()
    stop_sampler = asyncio.Event()
    follower_client = run.client()
    follower = EventFollower(follower_client)
    async with run.client() as c:
        pool = await c.pool()
    run.block_bytes = pool.block_bytes
    run.pool = PoolView(pool.path, pool.num_blocks, pool.block_bytes)
    cpu_before = proc_cpu_seconds(target.pid)
    run.started = time.monotonic()
    run.deadline = run.started + cfg.seconds
    sampler = asyncio.create_task(sample_rss(run, stop_sampler))
    try:
        helpers = [
            asyncio.create_task(operate(run, stop_engines_side)),
            asyncio.create_task(follower.follow(stop_engines_side, cfg.follow_every_s)),
        ]
        try:
            if cfg.processes <= 1:
                await run_engines(run, range(cfg.engines))
            else:
                await run_engine_processes(run, pool.path, pool.num_blocks)
        finally:
            report.seconds = time.monotonic() - run.started
            report.calls = run.recorder.calls
            report.server_cpu_s = proc_cpu_seconds(target.pid) - cpu_before
            stop_engines_side.set()
            await asyncio.gather(*helpers)

        async with run.admin(run.recorder, target.token) as admin:
            stats = await quiesce(run, admin)
            await follower.catch_up()
            report.final_blocks = dict(stats["blocks"])
            report.live_requests = stats["live_requests"]
            report.events = follower.events
            report.resident_tracked = len(follower.resident)
            lost = await check_resident(run, sorted(follower.resident), pool.max_keys_per_call)
            report.blocks_lost = len(lost)
            for key in lost[:10]:
                report.problem(f"block {key.hex()} was reported stored, never removed, is gone")
            blocks = (await admin.get("/admin/v1/stats")).json()["blocks"]
            if blocks["ready"] != len(follower.resident):
                report.problem(
                    f"{blocks['ready']} blocks ready but the events leave "
                    f"{len(follower.resident)} resident"
                )
            if follower.fell_behind:
                report.problem("the event follower fell behind (events were dropped)")
            b = report.final_blocks
            if (b["pinned"], b["pending"], report.live_requests) != (0, 0, 0):
                report.problem(f"leases left after every request ended or expired: {stats}")
            if b["free"] + b["ready"] != b["num_blocks"]:
                report.problem(f"free + ready != capacity at rest: {b}")
        # One more sample after the quiescent state, then stop the sampler.
        await asyncio.sleep(cfg.rss_every_s)
    finally:
        stop_sampler.set()
        await sampler
        await follower_client.aclose()
        run.pool.close()

    report.statuses = run.recorder.statuses
    report.errors = run.recorder.errors
    report.server_errors = run.recorder.server_error_count() + run.probes.server_error_count()
    report.leaks = run.recorder.leaks + run.probes.leaks
    for refusal, n in run.recorder.errors.items():
        if refusal not in EXPECTED_ERRORS:
            report.problem(f"unexpected error answers {refusal}: {n}")
    if set(run.probes.statuses) - {401, 403}:
        report.problem(f"admin probes were not all refused: {dict(run.probes.statuses)}")
    warm = [s for s in report.rss_kib if s[0] <= cfg.seconds * cfg.warmup] or report.rss_kib[:1]
    report.rss_baseline_kib = max(s[1] for s in warm)
    report.rss_peak_kib = max(s[1] for s in report.rss_kib)
    return report
