"""S3 clients on a real Ceph RADOS Gateway: GET/PUT GB/s, GET latency, CPU per GB, vs boto3.

The gateway is a one-node Ceph cluster brought up here from nothing (``testsupport/rgw.py``:
one monitor, one memstore OSD, one ``radosgw``, all on 127.0.0.1; Debian's ``ceph-mon ceph-osd
radosgw ceph-common``) and torn down at the end. The clients, each on the same objects:

- ``boto3`` (the baseline): one client shared by a thread pool of ``concurrency`` threads
  (``max_pool_connections`` as many), path-style addressing, checksums only when required
  (``request_checksum_calculation`` / ``response_checksum_validation`` = ``when_required``);
- ``boto3-crc``: the same with boto3's default checksums (``when_supported``): a CRC32 of every
  PUT body, sent as ``x-amz-checksum-crc32`` (RGW 16 accepts and ignores it), and GETs that ask
  for checksums (``x-amz-checksum-mode``; RGW 16 sends none, so nothing is checked);
- ``aiobotocore``: botocore on asyncio (aiohttp), the same settings as ``boto3``, ``concurrency``
  requests in flight from one event loop;
- ``obstore``: the Rust ``object_store`` crate through obstore's async API (``get_async`` +
  ``bytes_async``, ``put_async``), ``concurrency`` requests in flight from one event loop;
- ``obstore-unsigned``: the same with ``unsigned_payload``: the PUT signature does not cover
  the body, so neither the client nor the gateway hashes it (SHA-256). Over plain HTTP botocore
  always signs the body.

Per object size (``--sizes``, KiB) and concurrency (``--concurrency``): a batch is ``--objects``
GETs (of objects written once before, the same for every client) or PUTs (each client its own
keys, overwritten each round), timed from the first request to the last reply. Each of
``--runs`` runs has ``--rounds`` rounds, and in each round every client runs one batch, in an
order that rotates from round to round, so a load drifting over the run weighs on all clients
alike. GB/s: the median over all rounds; ratio to boto3: the median of the same-round ratios.
CPU: this process's CPU seconds (all its threads) per GB moved, and the gateway's plus the
OSD's (``/proc``) per GB, over all rounds. One GET's latency: ``--latency-gets`` GETs one at a
time per client and size in each run (clients taking turns in chunks of 10), p50 / p99 over
all runs.

Then a probe of each client's behaviour (``--no-probe`` skips it): the exception a missing
key, a missing bucket, a wrong secret, a SIGSTOPped gateway (a 1 s timeout, no retries) and
a 503 SlowDown raise (a second cluster whose gateway serves one request at a time:
``rgw_max_concurrent_requests = 1``; 32 GETs at once, without retries, then with retries:
botocore's standard mode with 3 attempts, obstore's default of 10 with backoff).

Usage: ``.venv/bin/python bench/s3_clients.py`` (needs ``pip install obstore boto3
aiobotocore`` and Ceph's binaries; about 2.5 minutes on 2 cores); ``--quick`` (20 s) for a
smoke run. Prints the tables, writes ``bench/results/s3_clients.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.metadata
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import obstore  # noqa: E402

from bench import harness  # noqa: E402
from testsupport import procfs  # noqa: E402
from testsupport.rgw import RadosGateway  # noqa: E402

KIB = 1024
BASELINE = "boto3"
CLIENTS = ("boto3", "boto3-crc", "aiobotocore", "obstore", "obstore-unsigned")
BUCKET = "bench"


def versions() -> dict[str, str]:
    """Installed versions of the client libraries and of the gateway."""
    out: dict[str, str] = {}
    for dist in ("obstore", "boto3", "botocore", "aiobotocore", "aiohttp", "urllib3"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "missing"
    try:
        out["radosgw"] = subprocess.run(
            ["radosgw", "--version"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out["radosgw"] = "unknown"
    return out


def botocore_settings(checksums: bool, concurrency: int, **extra: Any) -> dict[str, Any]:
    """The botocore Config keywords every botocore-based client here gets."""
    settings: dict[str, Any] = {
        "s3": {"addressing_style": "path"},
        "max_pool_connections": concurrency,
        "retries": {"mode": "standard", "max_attempts": 3},
        "connect_timeout": 5,
        "read_timeout": 30,
    }
    if not checksums:
        settings["request_checksum_calculation"] = "when_required"
        settings["response_checksum_validation"] = "when_required"
    settings.update(extra)
    return settings


# ------------------------------------------------------------------------------- clients


def make_boto3(gw: RadosGateway, concurrency: int, *, checksums: bool = False, **extra: Any) -> Any:
    """A boto3 S3 client for the gateway's user; ``extra``: botocore Config keywords (a
    ``secret`` keyword replaces the secret key)."""
    import boto3
    from botocore.config import Config

    secret = extra.pop("secret", gw.secret_key)
    return boto3.client(
        "s3",
        endpoint_url=gw.endpoint,
        region_name=gw.region,
        aws_access_key_id=gw.access_key,
        aws_secret_access_key=secret,
        config=Config(**botocore_settings(checksums, concurrency, **extra)),
    )


def make_aiobotocore(gw: RadosGateway, concurrency: int, **extra: Any) -> Any:
    """An aiobotocore S3 client (an async context manager) with ``make_boto3``'s settings."""
    # Imported by name: aiobotocore ships no type information.
    config = importlib.import_module("aiobotocore.config").AioConfig
    session = importlib.import_module("aiobotocore.session").get_session()
    secret = extra.pop("secret", gw.secret_key)
    return session.create_client(
        "s3",
        endpoint_url=gw.endpoint,
        region_name=gw.region,
        aws_access_key_id=gw.access_key,
        aws_secret_access_key=secret,
        config=config(**botocore_settings(False, concurrency, **extra)),
    )


def make_obstore(
    gw: RadosGateway,
    *,
    bucket: str = BUCKET,
    secret: str | None = None,
    unsigned: bool = False,
    retries: int | None = 2,
    timeout: str = "30s",
) -> Any:
    """An obstore S3Store on the gateway (plain HTTP allowed; path-style is its default with
    an ``endpoint``); ``retries`` None: obstore's default (10)."""
    from obstore.store import S3Store

    return S3Store(
        bucket,
        endpoint=gw.endpoint,
        region=gw.region,
        access_key_id=gw.access_key,
        secret_access_key=secret or gw.secret_key,
        unsigned_payload=unsigned,
        client_options={"allow_http": True, "timeout": timeout, "connect_timeout": "5s"},
        retry_config={} if retries is None else {"max_retries": retries},
    )


class Client:
    """One S3 client library driven at a given concurrency. ``loop`` runs the async clients'
    coroutines (one event loop for the whole bench)."""

    name = ""

    def __init__(self, gw: RadosGateway, concurrency: int, loop: asyncio.Runner) -> None:
        self.gw, self.concurrency, self.loop = gw, concurrency, loop

    def put_batch(self, keys: list[str], body: bytes) -> None:
        raise NotImplementedError

    def get_batch(self, keys: list[str]) -> int:
        """GET every key; the bytes received."""
        raise NotImplementedError

    def get_sequential(self, keys: list[str]) -> list[float]:
        """GET the keys one at a time; each one's seconds (request to last byte)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release connections and threads."""


class Boto3Client(Client):
    name = "boto3"
    checksums = False

    def __init__(self, gw: RadosGateway, concurrency: int, loop: asyncio.Runner) -> None:
        super().__init__(gw, concurrency, loop)
        self.s3 = make_boto3(gw, concurrency, checksums=self.checksums)
        self.pool = ThreadPoolExecutor(concurrency)

    def _get(self, key: str) -> int:
        return len(self.s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())

    def _put(self, key: str, body: bytes) -> None:
        self.s3.put_object(Bucket=BUCKET, Key=key, Body=body)

    def put_batch(self, keys: list[str], body: bytes) -> None:
        list(self.pool.map(self._put, keys, [body] * len(keys)))

    def get_batch(self, keys: list[str]) -> int:
        return sum(self.pool.map(self._get, keys))

    def get_sequential(self, keys: list[str]) -> list[float]:
        out = []
        for key in keys:
            t = time.perf_counter()
            self._get(key)
            out.append(time.perf_counter() - t)
        return out

    def close(self) -> None:
        self.pool.shutdown()
        self.s3.close()


class Boto3CrcClient(Boto3Client):
    name = "boto3-crc"
    checksums = True


class AsyncClient(Client):
    """A client with async get/put: ``concurrency`` of them in flight at once."""

    async def aget(self, key: str) -> int:
        raise NotImplementedError

    async def aput(self, key: str, body: bytes) -> None:
        raise NotImplementedError

    async def _bounded(self, calls: list[Awaitable[Any]]) -> list[Any]:
        """Await ``calls`` with at most ``concurrency`` of them in flight."""
        gate = asyncio.Semaphore(self.concurrency)

        async def one(call: Awaitable[Any]) -> Any:
            async with gate:
                return await call

        return await asyncio.gather(*(one(c) for c in calls))

    def put_batch(self, keys: list[str], body: bytes) -> None:
        self.loop.run(self._bounded([self.aput(k, body) for k in keys]))

    def get_batch(self, keys: list[str]) -> int:
        return sum(self.loop.run(self._bounded([self.aget(k) for k in keys])))

    def get_sequential(self, keys: list[str]) -> list[float]:
        async def timed() -> list[float]:
            out = []
            for key in keys:
                t = time.perf_counter()
                await self.aget(key)
                out.append(time.perf_counter() - t)
            return out

        return self.loop.run(timed())


class AiobotocoreClient(AsyncClient):
    name = "aiobotocore"

    def __init__(self, gw: RadosGateway, concurrency: int, loop: asyncio.Runner) -> None:
        super().__init__(gw, concurrency, loop)
        self.stack = contextlib.AsyncExitStack()
        self.s3 = loop.run(self.stack.enter_async_context(make_aiobotocore(gw, concurrency)))

    async def aget(self, key: str) -> int:
        response = await self.s3.get_object(Bucket=BUCKET, Key=key)
        async with response["Body"] as body:
            return len(await body.read())

    async def aput(self, key: str, body: bytes) -> None:
        await self.s3.put_object(Bucket=BUCKET, Key=key, Body=body)

    def close(self) -> None:
        self.loop.run(self.stack.aclose())


class ObstoreClient(AsyncClient):
    name = "obstore"
    unsigned = False

    def __init__(self, gw: RadosGateway, concurrency: int, loop: asyncio.Runner) -> None:
        super().__init__(gw, concurrency, loop)
        self.store = make_obstore(gw, unsigned=self.unsigned)

    async def aget(self, key: str) -> int:
        result = await obstore.get_async(self.store, key)
        return len(await result.bytes_async())

    async def aput(self, key: str, body: bytes) -> None:
        await obstore.put_async(self.store, key, body)


class ObstoreUnsignedClient(ObstoreClient):
    name = "obstore-unsigned"
    unsigned = True


CLIENT_CLASSES: dict[str, type[Client]] = {
    c.name: c
    for c in (Boto3Client, Boto3CrcClient, AiobotocoreClient, ObstoreClient, ObstoreUnsignedClient)
}


# ------------------------------------------------------------------------------ measuring


@dataclass
class Sample:
    seconds: float
    client_cpu_s: float
    server_cpu_s: float


@dataclass
class Cell:
    """The samples of one (op, size, concurrency, client), one per round."""

    samples: list[Sample] = field(default_factory=list)


def server_cpu(gw: RadosGateway) -> float:
    """CPU seconds so far of the gateway and the OSD together."""
    pids = gw.pids()
    return sum(procfs.proc_cpu_seconds(pids[n]) for n in ("client.rgw.gw", "osd.0"))


def timed(gw: RadosGateway, fn: Callable[[], object]) -> Sample:
    cpu0, srv0, t0 = time.process_time(), server_cpu(gw), time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    return Sample(seconds, time.process_time() - cpu0, server_cpu(gw) - srv0)


@contextlib.contextmanager
def clients_for(
    names: list[str], gw: RadosGateway, concurrency: int, loop: asyncio.Runner
) -> Iterator[dict[str, Client]]:
    made: dict[str, Client] = {}
    try:
        for name in names:
            made[name] = CLIENT_CLASSES[name](gw, concurrency, loop)
        yield made
    finally:
        for client in made.values():
            client.close()


def rotated(names: list[str], by: int) -> list[str]:
    by %= len(names)
    return names[by:] + names[:by]


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (0..1) of xs, nearest rank."""
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


# --------------------------------------------------------------------------------- probe


def describe(exc: BaseException) -> dict[str, Any]:
    """An exception's class, and what botocore parsed (status, code) or the start of the
    message."""
    out: dict[str, Any] = {"type": f"{type(exc).__module__}.{type(exc).__qualname__}"}
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        out["status"] = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        out["code"] = response.get("Error", {}).get("Code")
    else:
        out["message"] = " ".join(str(exc).split())[:160]
    return out


def probe_errors(gw: RadosGateway, loop: asyncio.Runner) -> dict[str, dict[str, Any]]:
    """What each client raises for a missing key, a missing bucket, a wrong secret, and a
    paused gateway (1 s timeout, no retries), with the seconds each took."""
    bad = "wrong-secret-key-000000000000000000000000"
    quick: dict[str, Any] = {
        "connect_timeout": 1,
        "read_timeout": 1,
        "retries": {"total_max_attempts": 1},
    }
    b_good, b_bad, b_quick = (
        make_boto3(gw, 4),
        make_boto3(gw, 4, secret=bad),
        make_boto3(gw, 4, **quick),
    )
    b_good.put_object(Bucket=BUCKET, Key="probe", Body=b"probe")

    def boto3_get(s3: Any, bucket: str, key: str) -> Callable[[], object]:
        return lambda: s3.get_object(Bucket=bucket, Key=key)["Body"].read()

    def obstore_get(store: Any, key: str) -> Callable[[], object]:
        async def get() -> object:
            return await (await obstore.get_async(store, key)).bytes_async()

        return lambda: loop.run(get())

    def aio_get(bucket: str, key: str, **extra: Any) -> Callable[[], object]:
        async def get() -> object:
            async with make_aiobotocore(gw, 4, **extra) as s3:
                response = await s3.get_object(Bucket=bucket, Key=key)
                async with response["Body"] as body:
                    return await body.read()

        return lambda: loop.run(get())

    cases: dict[str, dict[str, Callable[[], object]]] = {
        "boto3": {
            "missing_key": boto3_get(b_good, BUCKET, "no/such/key"),
            "missing_bucket": boto3_get(b_good, "no-such-bucket", "k"),
            "wrong_secret": boto3_get(b_bad, BUCKET, "probe"),
            "paused_gateway": boto3_get(b_quick, BUCKET, "probe"),
        },
        "aiobotocore": {
            "missing_key": aio_get(BUCKET, "no/such/key"),
            "missing_bucket": aio_get("no-such-bucket", "k"),
            "wrong_secret": aio_get(BUCKET, "probe", secret=bad),
            "paused_gateway": aio_get(BUCKET, "probe", **quick),
        },
        "obstore": {
            "missing_key": obstore_get(make_obstore(gw, retries=0), "no/such/key"),
            "missing_bucket": obstore_get(
                make_obstore(gw, bucket="no-such-bucket", retries=0), "k"
            ),
            "wrong_secret": obstore_get(make_obstore(gw, secret=bad, retries=0), "probe"),
            "paused_gateway": obstore_get(make_obstore(gw, retries=0, timeout="1s"), "probe"),
        },
    }
    out: dict[str, dict[str, Any]] = {}
    for client, calls in cases.items():
        out[client] = {}
        for case, call in calls.items():
            if case == "paused_gateway":
                gw.pause_gateway()
            t = time.perf_counter()
            try:
                call()
                result: dict[str, Any] = {"type": "no error"}
            except Exception as exc:
                result = describe(exc)
            finally:
                if case == "paused_gateway":
                    gw.resume_gateway()
            result["seconds"] = round(time.perf_counter() - t, 2)
            out[client][case] = result
    for s3 in (b_good, b_bad, b_quick):
        s3.close()
    return out


def probe_503(loop: asyncio.Runner, workdir: Path) -> dict[str, dict[str, Any]]:
    """A gateway that serves one request at a time (``rgw_max_concurrent_requests = 1``)
    answers the others 503 SlowDown: 32 concurrent GETs of 1 MiB per client, once without
    retries (what the error looks like) and once with the client's default retries
    (botocore's standard mode: 3 attempts; obstore: 10 retries with backoff): how many
    failed, and how long the 32 took."""
    gw = RadosGateway(
        workdir, rgw_debug=0, extra_conf={"client.rgw.gw": {"rgw max concurrent requests": "1"}}
    ).start()
    out: dict[str, dict[str, Any]] = {}
    try:
        admin = make_boto3(gw, 4)
        admin.create_bucket(Bucket=BUCKET)
        admin.put_object(Bucket=BUCKET, Key="k", Body=os.urandom(1 << 20))
        admin.close()
        requests = 32

        def boto3_run(retries: bool) -> list[dict[str, Any]]:
            extra: dict[str, Any] = {} if retries else {"retries": {"total_max_attempts": 1}}
            s3 = make_boto3(gw, requests, **extra)
            errors: list[dict[str, Any]] = []

            def one(_: int) -> None:
                try:
                    s3.get_object(Bucket=BUCKET, Key="k")["Body"].read()
                except Exception as exc:
                    errors.append(describe(exc))

            with ThreadPoolExecutor(requests) as pool:
                list(pool.map(one, range(requests)))
            s3.close()
            return errors

        async def gather_errors(get: Callable[[], Awaitable[object]]) -> list[dict[str, Any]]:
            errors: list[dict[str, Any]] = []

            async def one() -> None:
                try:
                    await get()
                except Exception as exc:
                    errors.append(describe(exc))

            await asyncio.gather(*(one() for _ in range(requests)))
            return errors

        def aio_run(retries: bool) -> list[dict[str, Any]]:
            extra: dict[str, Any] = {} if retries else {"retries": {"total_max_attempts": 1}}

            async def run() -> list[dict[str, Any]]:
                async with make_aiobotocore(gw, requests, **extra) as s3:

                    async def get() -> object:
                        response = await s3.get_object(Bucket=BUCKET, Key="k")
                        async with response["Body"] as body:
                            return await body.read()

                    return await gather_errors(get)

            return loop.run(run())

        def obstore_run(retries: bool) -> list[dict[str, Any]]:
            store = make_obstore(gw, retries=None if retries else 0)

            async def get() -> object:
                return await (await obstore.get_async(store, "k")).bytes_async()

            return loop.run(gather_errors(get))

        runners: dict[str, Callable[[bool], list[dict[str, Any]]]] = {
            "boto3": boto3_run,
            "aiobotocore": aio_run,
            "obstore": obstore_run,
        }
        for retries in (False, True):
            for name, run in runners.items():
                t = time.perf_counter()
                errors = run(retries)
                out.setdefault(name, {})["with_retries" if retries else "no_retries"] = {
                    "requests": requests,
                    "failed": len(errors),
                    "seconds": round(time.perf_counter() - t, 2),
                    "errors": sorted({str(e) for e in errors})[:3],
                }
    finally:
        gw.close()
    return out


# ---------------------------------------------------------------------------------- main


@dataclass
class Plan:
    """What one bench run measures."""

    names: list[str]
    sizes: list[int]
    concurrencies: list[int]
    objects: int
    runs: int
    rounds: int
    latency_gets: int


@dataclass
class Results:
    cells: dict[tuple[str, int, int, str], Cell] = field(default_factory=dict)
    latency: dict[tuple[int, str], list[float]] = field(default_factory=dict)


def seed(gw: RadosGateway, plan: Plan) -> tuple[dict[int, bytes], dict[int, list[str]]]:
    """The bucket, a body per size, and ``plan.objects`` objects per size to GET."""
    s3 = make_boto3(gw, 16)
    s3.create_bucket(Bucket=BUCKET)
    bodies = {size: os.urandom(size) for size in plan.sizes}
    get_keys = {size: [f"get/{size}/{i:04d}" for i in range(plan.objects)] for size in plan.sizes}
    with ThreadPoolExecutor(16) as pool:
        for size in plan.sizes:
            keys = get_keys[size]
            list(
                pool.map(
                    lambda k, b=bodies[size]: s3.put_object(Bucket=BUCKET, Key=k, Body=b), keys
                )
            )
    s3.close()
    return bodies, get_keys


def measure_run(
    gw: RadosGateway,
    loop: asyncio.Runner,
    plan: Plan,
    run: int,
    bodies: dict[int, bytes],
    get_keys: dict[int, list[str]],
    results: Results,
) -> None:
    """One run: every (size, concurrency) cell's rounds, then the one-at-a-time GETs."""
    for concurrency in plan.concurrencies:
        with clients_for(plan.names, gw, concurrency, loop) as clients:
            for size in plan.sizes:
                body = bodies[size]
                put_keys = {
                    name: [f"put/{name}/{size}/{i:04d}" for i in range(plan.objects)]
                    for name in plan.names
                }
                for name, client in clients.items():  # warm-up: connections, first calls
                    assert client.get_batch(get_keys[size][:1]) == size, name
                    client.get_batch(get_keys[size][: 2 * concurrency])
                    client.put_batch(put_keys[name][:concurrency], body)
                for rnd in range(plan.rounds):
                    for op in ("GET", "PUT"):
                        for name in rotated(plan.names, run * plan.rounds + rnd):
                            client = clients[name]
                            call: Callable[[], object] = (
                                functools.partial(client.get_batch, get_keys[size])
                                if op == "GET"
                                else functools.partial(client.put_batch, put_keys[name], body)
                            )
                            cell = results.cells.setdefault((op, size, concurrency, name), Cell())
                            cell.samples.append(timed(gw, call))
                print(
                    f"run {run + 1}/{plan.runs}: {size // KIB} KiB x {concurrency} done", flush=True
                )
    # One GET at a time: latency, the clients taking turns in chunks of 10.
    with clients_for(plan.names, gw, 1, loop) as clients:
        for size in plan.sizes:
            keys = get_keys[size]
            for start in range(0, plan.latency_gets, 10):
                chunk = [keys[(start + i) % len(keys)] for i in range(10)]
                for name in rotated(plan.names, start // 10):
                    results.latency.setdefault((size, name), []).extend(
                        clients[name].get_sequential(chunk)
                    )


def summarize(plan: Plan, results: Results) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Throughput rows and latency rows (see the module docstring for the statistics)."""
    rows: list[dict[str, Any]] = []
    for (op, size, concurrency, name), cell in results.cells.items():
        base = results.cells[(op, size, concurrency, BASELINE)]
        gb = plan.objects * size / 1e9
        total_gb = gb * len(cell.samples)
        ratios = [b.seconds / s.seconds for s, b in zip(cell.samples, base.samples, strict=True)]
        rows.append(
            {
                "op": op,
                "size": size,
                "concurrency": concurrency,
                "client": name,
                "gb_s": gb / statistics.median(s.seconds for s in cell.samples),
                "ratio_to_boto3": statistics.median(ratios),
                # Totals over the rounds: /proc counts CPU in 10 ms ticks, coarse for one batch.
                "client_cpu_s_per_gb": sum(s.client_cpu_s for s in cell.samples) / total_gb,
                "server_cpu_s_per_gb": sum(s.server_cpu_s for s in cell.samples) / total_gb,
                "samples_s": [round(s.seconds, 4) for s in cell.samples],
            }
        )
    rank = {name: i for i, name in enumerate(plan.names)}
    rows.sort(key=lambda r: (r["op"], r["size"], r["concurrency"], rank[r["client"]]))
    latency_rows: list[dict[str, Any]] = []
    for size in plan.sizes:
        base_p50 = pct(results.latency[(size, BASELINE)], 0.5)
        for name in plan.names:
            xs = results.latency[(size, name)]
            latency_rows.append(
                {
                    "size": size,
                    "client": name,
                    "gets": len(xs),
                    "p50_ms": pct(xs, 0.5) * 1e3,
                    "p99_ms": pct(xs, 0.99) * 1e3,
                    "p50_ratio_to_boto3": pct(xs, 0.5) / base_p50,
                }
            )
    return rows, latency_rows


def print_tables(
    plan: Plan,
    rows: list[dict[str, Any]],
    latency_rows: list[dict[str, Any]],
    probe: dict[str, Any],
) -> None:
    print()
    print(
        f"{plan.objects} objects per batch, {plan.runs} runs x {plan.rounds} rounds, medians; "
        "x boto3: median of same-round ratios; CPU: seconds per GB moved"
    )
    header = (
        f"{'op':<4}{'size':>9}{'conc':>5}  {'client':<17}{'GB/s':>6}{'x boto3':>9}"
        f"{'client CPU':>12}{'gw+osd CPU':>12}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['op']:<4}{r['size'] // KIB:>6} KiB{r['concurrency']:>5}  {r['client']:<17}"
            f"{r['gb_s']:>6.3f}{r['ratio_to_boto3']:>9.2f}"
            f"{r['client_cpu_s_per_gb']:>12.2f}{r['server_cpu_s_per_gb']:>12.2f}"
        )
    print()
    print(f"one GET at a time ({latency_rows[0]['gets']} per client and size)")
    print(f"{'size':>9}  {'client':<17}{'p50 ms':>8}{'p99 ms':>8}{'p50 x boto3':>13}")
    for r in latency_rows:
        print(
            f"{r['size'] // KIB:>6} KiB  {r['client']:<17}{r['p50_ms']:>8.2f}{r['p99_ms']:>8.2f}"
            f"{r['p50_ratio_to_boto3']:>13.2f}"
        )
    if not probe:
        return
    print()
    print("errors and timeouts (no retries unless said):")
    for client, cases in probe["errors"].items():
        for case, result in cases.items():
            what = result.get("code") or result.get("message", "")
            print(
                f"  {client:<12}{case:<16}{result['type']:<45}{result.get('status', '')!s:>4} "
                f"{what!s:.50} ({result['seconds']} s)"
            )
    for client, modes in probe["slowdown_503"].items():
        for mode, result in modes.items():
            print(
                f"  {client:<12}503 {mode:<13}{result['failed']}/{result['requests']} failed "
                f"in {result['seconds']} s {result['errors'][:1]}"
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256,1024", help="object sizes in KiB")
    ap.add_argument("--concurrency", default="8,16")
    ap.add_argument("--objects", type=int, default=64, help="objects per batch")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="rounds per run and cell")
    ap.add_argument("--latency-gets", type=int, default=100, help="per client, size and run")
    ap.add_argument("--clients", default=",".join(CLIENTS))
    ap.add_argument("--store", choices=["memstore", "bluestore"], default="memstore")
    ap.add_argument("--no-probe", action="store_true", help="skip the error/timeout probe")
    ap.add_argument("--quick", action="store_true", help="1 run, 1 round, 16 objects")
    ap.add_argument("--out", default=str(harness.RESULTS_DIR / "s3_clients.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.runs, args.rounds, args.objects, args.latency_gets = 1, 1, 16, 20
    plan = Plan(
        names=args.clients.split(","),
        sizes=[int(s) * KIB for s in args.sizes.split(",")],
        concurrencies=[int(c) for c in args.concurrency.split(",")],
        objects=args.objects,
        runs=args.runs,
        rounds=args.rounds,
        latency_gets=args.latency_gets,
    )
    if BASELINE not in plan.names:
        ap.error(f"the baseline {BASELINE} must be among --clients")

    results = Results()
    probe: dict[str, Any] = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="s3-bench-") as scratch, asyncio.Runner() as loop:
        # Logging every request (debug rgw 1) would cost the gateway CPU the clients need.
        gw = RadosGateway(Path(scratch) / "rgw", store=args.store, rgw_debug=0).start()
        print(f"gateway {gw.endpoint} ({args.store}) up in {gw.timings['first_put']} s")
        try:
            bodies, get_keys = seed(gw, plan)
            for run in range(plan.runs):
                measure_run(gw, loop, plan, run, bodies, get_keys, results)
            if not args.no_probe:
                probe["errors"] = probe_errors(gw, loop)
        finally:
            gw.close()
        if not args.no_probe:
            probe["slowdown_503"] = probe_503(loop, Path(scratch) / "rgw-503")
    rows, latency_rows = summarize(plan, results)
    print_tables(plan, rows, latency_rows, probe)
    print(f"({time.monotonic() - started:.0f} s)")
    record: dict[str, Any] = {
        "benchmark": "s3_clients",
        "machine": harness.machine(store=args.store, versions=versions()),
        "baseline": BASELINE,
        "plan": plan.__dict__,
        "rows": rows,
        "latency": latency_rows,
        "probe": probe,
        "seconds": round(time.monotonic() - started),
    }
    harness.write_results(Path(args.out), record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
