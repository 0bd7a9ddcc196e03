"""HTTP benchmark of the engine API's hot routes against two floors measured in the same run.

Servers (each one process, pinned to one core, uvloop + httptools, no access log):

- ``bare``: a plain ASGI app answering a fixed body the size of a lookup(64) answer;
- ``noop``: a FastAPI route with a path parameter answering the same fixed body;
- ``kvoffload``: ``kvoffload serve`` (CPU pool), request ``bench`` started, 32 of the 64 keys
  stored, so a lookup answers 32 hits then 32 misses.

The load generator is a separate process pinned to another core: a raw asyncio HTTP/1.1
keep-alive client (one request in flight per connection), over TCP or the Unix socket, at 1 and
32 connections. Each scenario runs several short rounds, interleaved across servers so drifting
background load hits every server alike; the table shows medians of calls/s, p50 and p99.

Also measured: ``batch`` = one ``POST /v1/batch`` of 16 lookup ops of 4 keys each (one
scheduler step: 16 requests, 64 keys in all) against a single lookup of 64 keys.

Targets: lookup(64) >= 0.8x the FastAPI no-op (calls/s), p99 <= 10 ms at 32 connections, the
Unix socket at least as fast as TCP, batch(16 ops) < 3x a single lookup (p50 latency at one
connection).

Two more suites measure what observability costs, each as a same-run ratio of two kvoffload
servers that differ in one setting only (rounds interleaved, medians; server CPU per call from
``/proc``, the fairest number on a small, noisy machine):

- ``obs``: lookup(64) with metrics on and the log at ``info`` (one JSON line per call, written
  to a file) against metrics off and the log at ``warning``; shadow evaluation off in both.
  Target: the observability costs < 15% of calls/s.
- ``shadow``: full request lives (``PUT`` start, lookup, prepare-store, complete-store,
  ``DELETE`` finish; 32 keys, the first 16 shared by the requests of one of 256 documents
  picked with a skewed law, the rest new) with shadow evaluation on (defaults: every policy,
  25% of prefix trees, 5% of a core at most) against off; metrics and logs on in both. Target:
  < 10% of lives/s. The shadow server's admin API then says the sample rate it settled on
  (halved each time its CPU budget could not keep up) and what it simulated since.

One suite measures what engine credentials cost, the same way:

- ``tenants``: lookup(64) against a server with a tenants file (one tenant, one namespace of
  the same pool size; every call carries ``Authorization: Bearer`` and
  ``X-KVOffload-Namespace``) and against one without (no headers). Target: tenants on >= 0.95x
  off (calls/s and server CPU per call, 32 connections).

Writes ``bench/results/http_bench.json``. Run from the repository root:
``.venv/bin/python bench/http_bench.py [--quick] [--suite all|floors|obs|shadow|tenants]``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402
from testsupport import procfs  # noqa: E402

RESULTS = harness.RESULTS_DIR / "http_bench.json"
LOOKUP_PATH = "/v1/requests/bench/lookup"
BATCH_PATH = "/v1/batch"
NUM_KEYS = 64
BATCH_OPS = 16
LIFE_CALLS = 5
LIFE_SHARED_KEYS = 16
LIFE_OWN_KEYS = 16
LIFE_DOCUMENTS = 256
OBS_TARGET = 0.85
TENANTS_TARGET = 0.95
BENCH_TOKEN = "bench-tenant-token-" + "0" * 24  # a throwaway token for a loopback run
BENCH_NAMESPACE = "bench-ns"
SHADOW_TARGET = 0.90
_CONTENT_LENGTH = re.compile(rb"content-length:\s*(\d+)", re.IGNORECASE)
_OK_STATUSES = (b"200", b"201")


# --------------------------------------------------------------------------- floors


def _fixed_body(size: int) -> bytes:
    """A JSON body of exactly ``size`` bytes."""
    head = b'{"pad":"'
    return head + b"x" * max(0, size - len(head) - 2) + b'"}'


def bare_app(body: bytes) -> Any:
    """A plain ASGI app: every HTTP call gets ``body``."""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    start = {"type": "http.response.start", "status": 200, "headers": headers}
    payload = {"type": "http.response.body", "body": body}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        await send(start)
        await send(payload)

    return app


def noop_app(body: bytes) -> Any:
    """FastAPI, one route with a path parameter, answering ``body``."""
    from fastapi import FastAPI
    from fastapi.responses import Response

    app = FastAPI()

    @app.post("/v1/requests/{req_id}/lookup")
    async def lookup(req_id: str) -> Response:
        return Response(body, media_type="application/json")

    return app


def serve_floor(kind: str, port: int, uds: str, body_size: int) -> None:
    """Run a floor server on 127.0.0.1:``port`` and ``uds`` until SIGTERM."""
    import uvloop

    from app.server import Listener, bind_tcp, bind_unix, uvicorn_config

    body = _fixed_body(body_size)
    app = bare_app(body) if kind == "bare" else noop_app(body)
    server = Listener(uvicorn_config(app))  # the service's own settings: a like-for-like floor
    sockets = [bind_tcp("127.0.0.1", port), bind_unix(Path(uds))]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, lambda: setattr(server, "should_exit", True))
        await server.serve(sockets=sockets)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())


# --------------------------------------------------------------------------- load generator


class _Connection(asyncio.Protocol):
    """One keep-alive connection sending ``next_request()`` as soon as an answer is complete."""

    def __init__(
        self, next_request: Callable[[], bytes], stats: _LoadStats, stop_at: float, done: Any
    ) -> None:
        self.next_request = next_request
        self.stats = stats
        self.stop_at = stop_at
        self.done = done
        self.buffer = bytearray()
        self.sent_at = 0.0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        self._send()

    def _send(self) -> None:
        assert self.transport is not None
        request = self.next_request()
        self.sent_at = time.perf_counter()
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        buf = self.buffer
        buf += data
        while True:
            end_of_head = buf.find(b"\r\n\r\n")
            if end_of_head < 0:
                return
            match = _CONTENT_LENGTH.search(buf, 0, end_of_head)
            end = end_of_head + 4 + (int(match.group(1)) if match else 0)
            if len(buf) < end:
                return
            ok = buf[9:12] in _OK_STATUSES
            del buf[:end]
            now = time.perf_counter()
            self.stats.latencies.append(now - self.sent_at)
            if not ok:
                self.stats.errors += 1
            if now >= self.stop_at:
                assert self.transport is not None
                self.transport.close()
                return
            self._send()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


@dataclass
class _LoadStats:
    latencies: list[float]
    errors: int = 0


class _Lives:
    """The calls of request lives, one life after another, for one connection.

    Each life: start, lookup, prepare-store, complete-store (all keys: those not pending are
    ignored), finish. Its 32 keys: the 16 of a document (shared with every life of that
    document; the document drawn with a skewed law, so some prefixes are hot) then 16 of its
    own.
    """

    def __init__(self, tag: str, rng: random.Random) -> None:
        self.tag = tag
        self.rng = rng
        self.life = 0
        self.step = LIFE_CALLS
        self.req_id = ""
        self.keys_body = b""

    @staticmethod
    def _key(text: str) -> str:
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()

    def _new_life(self) -> None:
        self.life += 1
        self.req_id = f"{self.tag}-{self.life}"
        doc = min(int(self.rng.expovariate(1 / 24)), LIFE_DOCUMENTS - 1)
        keys = [self._key(f"doc{doc}-{i}") for i in range(LIFE_SHARED_KEYS)]
        keys += [self._key(f"{self.req_id}-{i}") for i in range(LIFE_OWN_KEYS)]
        self.keys_body = json.dumps(keys).encode()
        self.step = 0

    def __call__(self) -> bytes:
        if self.step == LIFE_CALLS:
            self._new_life()
        step = self.step
        self.step += 1
        base = f"/v1/requests/{self.req_id}"
        if step == 0:
            return f"PUT {base} HTTP/1.1\r\nHost: bench\r\nContent-Length: 0\r\n\r\n".encode()
        if step == 1:
            return http_request(f"{base}/lookup", b'{"keys":' + self.keys_body + b"}")
        if step == 2:
            return http_request(f"{base}/prepare-store", b'{"keys":' + self.keys_body + b"}")
        if step == 3:
            body = b'{"keys":' + self.keys_body + b',"success":true}'
            return http_request(f"{base}/complete-store", body)
        return f"DELETE {base} HTTP/1.1\r\nHost: bench\r\n\r\n".encode()


Source = Callable[[int], Callable[[], bytes]]


def fixed(request: bytes) -> Source:
    """Every connection sends ``request`` over and over."""
    return lambda _conn: lambda: request


def lives(seed: int) -> Source:
    """Every connection runs request lives (``_Lives``), its req_ids unique to this run."""
    run = f"{os.getpid()}x{seed}"
    return lambda conn: _Lives(f"b{run}c{conn}", random.Random(seed * 1000 + conn))


async def _drive(address: str, source: Source, connections: int, seconds: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    stats = _LoadStats([])
    stop_at = time.perf_counter() + seconds
    finished = []
    for conn in range(connections):
        done = loop.create_future()
        finished.append(done)

        def factory(done: Any = done, conn: int = conn) -> _Connection:
            return _Connection(source(conn), stats, stop_at, done)

        if address.startswith("/"):
            await loop.create_unix_connection(factory, address)
        else:
            host, port = address.rsplit(":", 1)
            await loop.create_connection(factory, host, int(port))
    started = time.perf_counter()
    await asyncio.gather(*finished)
    elapsed = time.perf_counter() - started
    lat = sorted(stats.latencies)
    n = len(lat)
    return {
        "calls": n,
        "calls_per_s": n / elapsed,
        "p50_ms": lat[n // 2] * 1e3 if n else float("nan"),
        "p99_ms": lat[min(n - 1, int(n * 0.99))] * 1e3 if n else float("nan"),
        "errors": stats.errors,
    }


def http_request(path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    """A keep-alive HTTP/1.1 POST of a JSON body (with ``headers`` besides the usual ones)."""
    extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    head = (
        f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        f"{extra}Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def run_load(address: str, source: Source, connections: int, seconds: float) -> dict[str, Any]:
    """Drive one scenario with uvloop (in the load-generator process)."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_drive(address, source, connections, min(0.3, seconds / 4)))  # warm-up
        return runner.run(_drive(address, source, connections, seconds))


# --------------------------------------------------------------------------- orchestration


def _pinned(core: int | None) -> Any:
    if core is None:
        return None
    return lambda: os.sched_setaffinity(0, {core})


def _wait_tcp(port: int, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"server on port {port} did not come up")


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    uds: str
    admin_port: int = 0

    def tcp(self) -> str:
        return f"127.0.0.1:{self.port}"


def start_kvoffload(
    tmp: Path, core: int | None, name: str = "kvoffload", extra: tuple[str, ...] = ()
) -> Server:
    """``kvoffload serve`` with the bench's pool; ``extra`` flags win; its log goes to a file."""
    port, admin = harness.free_port(), harness.free_port()
    uds = str(tmp / f"{name}.sock")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    argv = [
        sys.executable,
        "-m",
        "app.cli",
        "serve",
        "--port",
        str(port),
        "--admin-port",
        str(admin),
        "--uds",
        uds,
        "--num-blocks",
        "4096",
        "--block-bytes",
        "4096",
        "--device",
        "cpu",
        "--log-level",
        "warning",
        *extra,
    ]
    with (tmp / f"{name}.log").open("wb") as log:
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, preexec_fn=_pinned(core), stdout=log, stderr=log
        )
    _wait_tcp(port, proc)
    server = Server(name, proc, port, uds)
    server.admin_port = admin
    return server


def start_floor(kind: str, tmp: Path, core: int | None, body_size: int) -> Server:
    port = harness.free_port()
    uds = str(tmp / f"{kind}.sock")
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--serve-floor",
        kind,
        "--port",
        str(port),
        "--uds",
        uds,
        "--body-size",
        str(body_size),
    ]
    proc = subprocess.Popen(argv, cwd=ROOT, preexec_fn=_pinned(core))
    _wait_tcp(port, proc)
    return Server(kind, proc, port, uds)


def prepare_kvoffload(
    server: Server, keys: list[bytes] | None = None, headers: dict[str, str] | None = None
) -> tuple[bytes, bytes, int]:
    """Start request ``bench``, store half the keys (random ones unless given); the lookup and
    batch bodies, answer size. ``headers``: the credentials of a server with tenants."""
    import httpx
    from kvoffload_client.client import KVOffloadClient

    if keys is None:
        keys = [os.urandom(16) for _ in range(NUM_KEYS)]
    credentials: dict[str, Any] = {}
    if headers:
        credentials = {"token": BENCH_TOKEN, "namespace": BENCH_NAMESPACE}
    with KVOffloadClient(f"http://{server.tcp()}", **credentials) as client:
        client.start_request("bench")
        spec = client.prepare_store("bench", keys[: NUM_KEYS // 2])
        client.complete_store("bench", spec.keys_to_store)
        answer = httpx.post(
            f"http://{server.tcp()}{LOOKUP_PATH}",
            json={"keys": [k.hex() for k in keys]},
            headers=headers,
        )
        answer.raise_for_status()
        assert answer.json()["hit_prefix"] == NUM_KEYS // 2
        per_op = NUM_KEYS // BATCH_OPS
        ops = [
            {"op": "lookup", "req_id": "bench", "keys": [k.hex() for k in keys[i : i + per_op]]}
            for i in range(0, NUM_KEYS, per_op)
        ]
        batch = client.batch(ops)
        assert all(r.ok for r in batch)
    lookup_body = json.dumps({"keys": [k.hex() for k in keys]}).encode()
    batch_body = json.dumps({"ops": ops}).encode()
    return lookup_body, batch_body, len(answer.content)


def load_once(
    address: str, request: bytes | None, connections: int, seconds: float, core: int | None
) -> dict[str, Any]:
    """One scenario run in a fresh load-generator process (``request`` None: request lives)."""
    with tempfile.NamedTemporaryFile(suffix=".req") as f:
        f.write(request or b"")
        f.flush()
        argv = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--load",
            address,
            "--request-file" if request is not None else "--lives",
            f.name if request is not None else str(random.randrange(1 << 30)),
            "--connections",
            str(connections),
            "--seconds",
            str(seconds),
        ]
        out = subprocess.run(
            argv,
            cwd=ROOT,
            capture_output=True,
            check=True,
            timeout=seconds * 4 + 30,
            preexec_fn=_pinned(core),
        )
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "calls_per_s": statistics.median(r["calls_per_s"] for r in runs),
        "p50_ms": statistics.median(r["p50_ms"] for r in runs),
        "p99_ms": statistics.median(r["p99_ms"] for r in runs),
        "cpu_us_per_call": statistics.median(r["cpu_us_per_call"] for r in runs),
        "errors": sum(r["errors"] for r in runs),
        "rounds": len(runs),
    }


Scenario = tuple[str, Server, str, bytes | None, int]  # name, server, transport, request, conns


def run_rounds(
    scenarios: list[Scenario], rounds: int, seconds: float, load_core: int | None
) -> dict[tuple[str, str, int], dict[str, Any]]:
    """Every scenario ``rounds`` times, interleaved; the medians by (name, transport, conns)."""
    runs: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for _ in range(rounds):
        for name, server, transport, request, conns in scenarios:
            address = server.tcp() if transport == "tcp" else server.uds
            cpu_before = procfs.proc_cpu_seconds(server.proc.pid)
            result = load_once(address, request, conns, seconds, load_core)
            # CPU per call includes the warm-up calls the generator does not count;
            # scale by the counted share of the run (warm-up is a quarter, at most).
            cpu = procfs.proc_cpu_seconds(server.proc.pid) - cpu_before
            share = seconds / (seconds + min(0.3, seconds / 4))
            result["cpu_us_per_call"] = cpu * share / max(1, result["calls"]) * 1e6
            runs.setdefault((name, transport, conns), []).append(result)
    return {key: median_of(value) for key, value in runs.items()}


def floors_suite(
    tmp: Path, args: argparse.Namespace, cores: tuple[int | None, int | None]
) -> dict[str, Any]:
    server_core, load_core = cores
    seconds = 0.6 if args.quick else 1.5
    rounds = 2 if args.quick else 3
    servers: list[Server] = []
    try:
        kv = start_kvoffload(tmp, server_core)
        servers.append(kv)
        lookup_body, batch_body, answer_size = prepare_kvoffload(kv)
        servers.append(start_floor("bare", tmp, server_core, answer_size))
        servers.append(start_floor("noop", tmp, server_core, answer_size))
        lookup_req = http_request(LOOKUP_PATH, lookup_body)
        batch_req = http_request(BATCH_PATH, batch_body)

        scenarios: list[Scenario] = []
        for server in servers:
            for transport in ("tcp", "uds"):
                for conns in (1, 32):
                    name = "lookup(64)" if server.name == "kvoffload" else server.name
                    scenarios.append((name, server, transport, lookup_req, conns))
        for transport in ("tcp", "uds"):
            for conns in (1, 32):
                scenarios.append((f"batch({BATCH_OPS} ops)", kv, transport, batch_req, conns))
        table = run_rounds(scenarios, rounds, seconds, load_core)
    finally:
        for server in servers:
            harness.stop_server(server.proc)
    return report(table, answer_size, len(lookup_body), len(batch_body))


_OBS_OFF = ("--metrics-enabled", "false", "--log-level", "warning", "--shadow-enabled", "false")
_OBS_ON = ("--metrics-enabled", "true", "--log-level", "info", "--shadow-enabled", "false")
_SHADOW_OFF = ("--log-level", "info", "--shadow-enabled", "false")
_SHADOW_ON = ("--log-level", "info", "--shadow-enabled", "true")


def obs_suite(
    tmp: Path, args: argparse.Namespace, cores: tuple[int | None, int | None]
) -> dict[str, Any]:
    """Metrics + logs on against off (lookup), shadow on against off (request lives)."""
    server_core, load_core = cores
    seconds = 0.8 if args.quick else 1.5
    rounds = 3 if args.quick else 7
    servers: list[Server] = []
    try:
        scenarios: list[Scenario] = []
        if args.suite in ("all", "obs"):
            off = start_kvoffload(tmp, server_core, "obs-off", _OBS_OFF)
            on = start_kvoffload(tmp, server_core, "obs-on", _OBS_ON)
            servers += [off, on]
            keys = [os.urandom(16) for _ in range(NUM_KEYS)]
            lookup_body, _, _ = prepare_kvoffload(off, keys)
            prepare_kvoffload(on, keys)
            lookup_req = http_request(LOOKUP_PATH, lookup_body)
            for conns in (1, 32):
                for server in (off, on):
                    scenarios.append((server.name, server, "tcp", lookup_req, conns))
        shadow_on: Server | None = None
        if args.suite in ("all", "shadow"):
            off = start_kvoffload(tmp, server_core, "shadow-off", _SHADOW_OFF)
            shadow_on = start_kvoffload(tmp, server_core, "shadow-on", _SHADOW_ON)
            servers += [off, shadow_on]
            for server in (off, shadow_on):
                scenarios.append((server.name, server, "tcp", None, 32))
        table = run_rounds(scenarios, rounds, seconds, load_core)
        shadow_stats = None if shadow_on is None else shadow_accounting(shadow_on)
    finally:
        for server in servers:
            harness.stop_server(server.proc)
    app_level = app_cost_suite(args, server_core) if args.suite in ("all", "obs") else None
    return report_obs(table, shadow_stats, app_level)


_APP_COST_MODES = {"off": _OBS_OFF, "on": _OBS_ON}


def write_bench_tenants(tmp: Path) -> Path:
    """A tenants file of one tenant whose one namespace is the bench's pool size (owner-only:
    the service refuses a tenants file others can read)."""
    path = tmp / "tenants.toml"
    path.write_text(
        f'[tenants.bench]\ntokens = ["{BENCH_TOKEN}"]\n'
        f"namespaces = {{ {BENCH_NAMESPACE} = 4096 }}\n",
        encoding="utf-8",
    )
    path.chmod(0o600)
    return path


def tenants_suite(
    tmp: Path, args: argparse.Namespace, cores: tuple[int | None, int | None]
) -> dict[str, Any]:
    """lookup(64) with a bearer token and namespace header (tenants on) against no tenants."""
    server_core, load_core = cores
    seconds = 0.8 if args.quick else 1.5
    rounds = 3 if args.quick else 7
    headers = {"Authorization": f"Bearer {BENCH_TOKEN}", "X-KVOffload-Namespace": BENCH_NAMESPACE}
    servers: list[Server] = []
    try:
        off = start_kvoffload(tmp, server_core, "tenants-off")
        servers.append(off)
        on = start_kvoffload(
            tmp, server_core, "tenants-on", ("--tenants", str(write_bench_tenants(tmp)))
        )
        servers.append(on)
        keys = [os.urandom(16) for _ in range(NUM_KEYS)]
        lookup_body, _, _ = prepare_kvoffload(off, keys)
        prepare_kvoffload(on, keys, headers)
        requests = {off.name: http_request(LOOKUP_PATH, lookup_body)}
        requests[on.name] = http_request(LOOKUP_PATH, lookup_body, headers)
        scenarios: list[Scenario] = [
            (server.name, server, "tcp", requests[server.name], conns)
            for conns in (1, 32)
            for server in (off, on)
        ]
        table = run_rounds(scenarios, rounds, seconds, load_core)
    finally:
        for server in servers:
            harness.stop_server(server.proc)
    return report_tenants(table)


def report_tenants(table: dict[tuple[str, str, int], dict[str, Any]]) -> dict[str, Any]:
    print_load_table(
        "engine credentials cost: lookup(64), tenants on vs off (same run, medians)", table
    )
    ratios: dict[str, float] = {}
    for conns in (1, 32):
        on, off = table[("tenants-on", "tcp", conns)], table[("tenants-off", "tcp", conns)]
        ratios[f"tenants_on_vs_off_calls_c{conns}"] = on["calls_per_s"] / off["calls_per_s"]
        ratios[f"tenants_off_vs_on_cpu_c{conns}"] = off["cpu_us_per_call"] / on["cpu_us_per_call"]
        ratios[f"tenants_cpu_us_per_call_added_c{conns}"] = (
            on["cpu_us_per_call"] - off["cpu_us_per_call"]
        )
    targets = {
        "tenants on >= 0.95x off (lookup calls/s, 32 conns)": (
            ratios["tenants_on_vs_off_calls_c32"] >= TENANTS_TARGET
        ),
        "tenants on >= 0.95x off (server CPU per call, 32 conns)": (
            ratios["tenants_off_vs_on_cpu_c32"] >= TENANTS_TARGET
        ),
        "no errors": all(r["errors"] == 0 for r in table.values()),
    }
    print_verdict(ratios, targets)
    return {"results": result_rows(table), "ratios": ratios, "targets": targets}


def print_load_table(
    title: str,
    table: dict[tuple[str, str, int], dict[str, Any]],
    workload: Callable[[str], str] | None = None,
) -> None:
    """A suite's servers under load, one row per (server, connections); with ``workload``, a
    column naming what each server was driven with."""
    label = f"{'workload':<12} " if workload is not None else ""
    header = (
        f"{'server':<12} {label}{'conns':>5} {'calls/s':>10} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'cpu us/call':>11} {'errors':>6}"
    )
    print(f"\n{title}")
    print(header)
    print("-" * len(header))
    for (name, _, conns), r in table.items():
        cell = f"{workload(name):<12} " if workload is not None else ""
        print(
            f"{name:<12} {cell}{conns:>5} {r['calls_per_s']:>10.0f} {r['p50_ms']:>8.3f} "
            f"{r['p99_ms']:>8.3f} {r['cpu_us_per_call']:>11.1f} {r['errors']:>6}"
        )


def print_verdict(ratios: dict[str, float], targets: dict[str, bool]) -> None:
    """The ratios and the targets met or missed, as every suite prints them."""
    print("\nratios")
    for key, value in ratios.items():
        print(f"  {key:<38} {value:8.3f}")
    print("\ntargets")
    for key, ok in targets.items():
        print(f"  [{'ok' if ok else 'MISS'}] {key}")


def result_rows(table: dict[tuple[str, str, int], dict[str, Any]]) -> list[dict[str, Any]]:
    """A suite's table as JSON rows."""
    return [{"server": n, "transport": t, "connections": c, **r} for (n, t, c), r in table.items()]


def app_cost(mode: str, calls: int) -> float:
    """CPU microseconds per lookup(64) call of the engine app itself, called as ASGI in this
    process (no HTTP server, no sockets): what observability adds to the service's own work,
    free of the noise of other processes (``time.process_time``)."""
    import io

    from app.http.apps import create_app
    from app.settings import Settings
    from app.telemetry.logging import configure_logging

    flags = dict(zip(_APP_COST_MODES[mode][::2], _APP_COST_MODES[mode][1::2], strict=True))
    settings = Settings(
        num_blocks=4096,
        block_bytes=4096,
        device="cpu",
        metrics_enabled=flags["--metrics-enabled"] == "true",
        shadow_enabled=False,
        log_level=cast(Any, flags["--log-level"]),
    )
    configure_logging(settings.log_level, stream=io.StringIO(), fmt="json")
    app = create_app(settings)
    keys = [os.urandom(16).hex() for _ in range(NUM_KEYS)]

    call = harness.asgi_call(app)

    async def run() -> float:
        async with app.router.lifespan_context(app):
            await call("PUT", "/v1/requests/bench", b"")
            half = json.dumps({"keys": keys[: NUM_KEYS // 2]}).encode()
            await call("POST", "/v1/requests/bench/prepare-store", half)
            await call("POST", "/v1/requests/bench/complete-store", half)
            body = json.dumps({"keys": keys}).encode()
            for _ in range(calls // 10):  # warm-up
                await call("POST", LOOKUP_PATH, body)
            started = time.process_time()
            for _ in range(calls):
                assert await call("POST", LOOKUP_PATH, body) == 200
            return (time.process_time() - started) / calls * 1e6

    return asyncio.run(run())


def app_cost_suite(args: argparse.Namespace, core: int | None) -> dict[str, Any]:
    """``app_cost`` of observability off and on, each round in fresh processes, interleaved."""
    calls = 5000 if args.quick else 20000
    rounds = 3 if args.quick else 5
    costs: dict[str, list[float]] = {mode: [] for mode in _APP_COST_MODES}
    for _ in range(rounds):
        for mode in _APP_COST_MODES:
            out = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--app-cost", mode,
                 "--calls", str(calls)],
                cwd=ROOT, capture_output=True, check=True, timeout=300,
                preexec_fn=_pinned(core),
            )  # fmt: skip
            costs[mode].append(float(out.stdout))
    off, on = statistics.median(costs["off"]), statistics.median(costs["on"])
    print(
        f"\napp-level CPU per lookup(64) (in process, no HTTP server; medians of {rounds}): "
        f"off {off:.1f} us, on {on:.1f} us, +{on - off:.1f} us (+{(on / off - 1) * 100:.0f}%)"
    )
    return {"off_us": off, "on_us": on, "rounds": costs}


def shadow_accounting(server: Server) -> dict[str, Any]:
    """What the shadow server simulated (after letting its drain catch up for a moment)."""
    import httpx

    url = f"http://127.0.0.1:{server.admin_port}/admin/v1/policy/shadow"
    answer: dict[str, Any] = {}
    for _ in range(50):
        answer = httpx.get(url, timeout=10).json()
        if not answer["queued"]:
            break
        time.sleep(0.1)
    return {
        "sample_rate": answer["sample_rate"],
        "restarts": answer["restarts"],
        "observed": answer["observed"],
        "sampled": answer["sampled"],
        "queued": answer["queued"],
        "dropped": answer["dropped"],
        "live_prefix_hit_ratio": answer["live_prefix_hit_ratio"],
        "projected": {p["policy"]: p["projected_hit_ratio"] for p in answer["policies"]},
    }


def report_obs(
    table: dict[tuple[str, str, int], dict[str, Any]],
    shadow: dict[str, Any] | None,
    app_level: dict[str, Any] | None,
) -> dict[str, Any]:
    print_load_table(
        "observability cost (same run, medians)",
        table,
        workload=lambda name: "lives" if name.startswith("shadow") else "lookup(64)",
    )
    ratios: dict[str, float] = {}
    targets: dict[str, bool] = {}
    for conns in (1, 32):
        if ("obs-on", "tcp", conns) in table:
            on, off = table[("obs-on", "tcp", conns)], table[("obs-off", "tcp", conns)]
            ratios[f"obs_on_vs_off_calls_c{conns}"] = on["calls_per_s"] / off["calls_per_s"]
            ratios[f"obs_cpu_us_per_call_added_c{conns}"] = (
                on["cpu_us_per_call"] - off["cpu_us_per_call"]
            )
            ratios[f"obs_off_vs_on_cpu_c{conns}"] = off["cpu_us_per_call"] / on["cpu_us_per_call"]
    if "obs_on_vs_off_calls_c32" in ratios:
        targets["obs on >= 0.85x off (lookup calls/s, 32 conns)"] = (
            ratios["obs_on_vs_off_calls_c32"] >= OBS_TARGET
        )
        targets["obs on >= 0.85x off (server CPU per call, 32 conns)"] = (
            ratios["obs_off_vs_on_cpu_c32"] >= OBS_TARGET
        )
    if app_level is not None and ("obs-off", "tcp", 32) in table:
        # The server's CPU per call with observability off, plus what the app-level
        # measurement says observability adds: the calls/s ratio without other load's noise.
        base = table[("obs-off", "tcp", 32)]["cpu_us_per_call"]
        added = app_level["on_us"] - app_level["off_us"]
        ratios["obs_app_us_added_per_call"] = added
        ratios["obs_on_vs_off_estimated_from_app_cost_c32"] = base / (base + added)
        targets["obs on >= 0.85x off (server CPU off + app-level cost added)"] = (
            ratios["obs_on_vs_off_estimated_from_app_cost_c32"] >= OBS_TARGET
        )
    if ("shadow-on", "tcp", 32) in table:
        on, off = table[("shadow-on", "tcp", 32)], table[("shadow-off", "tcp", 32)]
        ratios["shadow_on_vs_off_lives"] = on["calls_per_s"] / off["calls_per_s"]
        ratios["shadow_off_vs_on_cpu"] = off["cpu_us_per_call"] / on["cpu_us_per_call"]
        ratios["shadow_lives_per_s_on"] = on["calls_per_s"] / LIFE_CALLS
        ratios["shadow_lives_per_s_off"] = off["calls_per_s"] / LIFE_CALLS
        targets["shadow on >= 0.90x off (lives/s)"] = (
            ratios["shadow_on_vs_off_lives"] >= SHADOW_TARGET
        )
        targets["shadow on >= 0.90x off (server CPU per call)"] = (
            ratios["shadow_off_vs_on_cpu"] >= SHADOW_TARGET
        )
        if shadow is not None:
            targets["shadow evaluation alive (requests simulated since its last restart)"] = (
                shadow["sampled"] > 0
            )
    targets["no errors"] = all(r["errors"] == 0 for r in table.values())
    if shadow is not None:
        print(f"\nshadow accounting: {json.dumps(shadow)}")
    print_verdict(ratios, targets)
    return {
        "results": result_rows(table),
        "ratios": ratios,
        "targets": targets,
        "shadow": shadow,
        "app_level": app_level,
    }


def main_bench(args: argparse.Namespace) -> int:
    cores = sorted(os.sched_getaffinity(0))
    pinned: tuple[int | None, int | None] = (cores[0], cores[1]) if len(cores) > 1 else (None, None)
    if pinned[0] is None:
        print("warning: one core only; server and load generator are not pinned apart")
    out: dict[str, Any] = {
        "quick": args.quick,
        "suite": args.suite,
        "cpu_count": os.cpu_count(),
        "affinity": sorted(os.sched_getaffinity(0)),
    }
    with tempfile.TemporaryDirectory(prefix="kvbench-") as tmpdir:
        tmp = Path(tmpdir)
        if args.suite in ("all", "floors"):
            out["floors"] = floors_suite(tmp, args, pinned)
        if args.suite in ("all", "obs", "shadow"):
            out["observability"] = obs_suite(tmp, args, pinned)
        if args.suite in ("all", "tenants"):
            out["tenants"] = tenants_suite(tmp, args, pinned)
    print()
    harness.write_results(RESULTS, out)
    return 0


def report(
    table: dict[tuple[str, str, int], dict[str, Any]],
    answer_size: int,
    lookup_size: int,
    batch_size: int,
) -> dict[str, Any]:
    print(
        f"\nlookup of {NUM_KEYS} keys (request {lookup_size} B, answer {answer_size} B); "
        f"batch = {BATCH_OPS} lookup ops of {NUM_KEYS // BATCH_OPS} keys ({batch_size} B)"
    )
    header = (
        f"{'scenario':<18} {'transport':<9} {'conns':>5} {'calls/s':>10} "
        f"{'p50 ms':>8} {'p99 ms':>8} {'cpu us/call':>11} {'errors':>6}"
    )
    print(header)
    print("-" * len(header))
    for (name, transport, conns), r in table.items():
        print(
            f"{name:<18} {transport:<9} {conns:>5} {r['calls_per_s']:>10.0f} "
            f"{r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} {r['cpu_us_per_call']:>11.1f} "
            f"{r['errors']:>6}"
        )

    def rate(name: str, transport: str, conns: int) -> float:
        return float(table[(name, transport, conns)]["calls_per_s"])

    lookup = "lookup(64)"
    batch = f"batch({BATCH_OPS} ops)"
    ratios: dict[str, float] = {}
    for transport in ("tcp", "uds"):
        for conns in (1, 32):
            sfx = f"{transport}_c{conns}"
            ratios[f"lookup_vs_noop_{sfx}"] = rate(lookup, transport, conns) / rate(
                "noop", transport, conns
            )
            ratios[f"lookup_vs_bare_{sfx}"] = rate(lookup, transport, conns) / rate(
                "bare", transport, conns
            )
            ratios[f"batch_time_vs_lookup_{sfx}"] = rate(lookup, transport, conns) / rate(
                batch, transport, conns
            )
        ratios[f"uds_vs_tcp_lookup_c{32}"] = rate(lookup, "uds", 32) / rate(lookup, "tcp", 32)
    ratios["uds_vs_tcp_lookup_c1"] = rate(lookup, "uds", 1) / rate(lookup, "tcp", 1)

    def cpu(name: str, transport: str) -> float:
        return float(table[(name, transport, 32)]["cpu_us_per_call"])

    # Server CPU per call: the framework's cost without the noise of other load on the host.
    for transport in ("tcp", "uds"):
        ratios[f"cpu_noop_over_lookup_{transport}_c32"] = cpu("noop", transport) / cpu(
            lookup, transport
        )
        ratios[f"cpu_batch_over_lookup_{transport}_c32"] = cpu(batch, transport) / cpu(
            lookup, transport
        )
    p50_batch = table[(batch, "tcp", 1)]["p50_ms"] / table[(lookup, "tcp", 1)]["p50_ms"]
    targets = {
        "lookup >= 0.8x noop (tcp, 32 conns)": ratios["lookup_vs_noop_tcp_c32"] >= 0.8,
        "lookup >= 0.8x noop (tcp, 1 conn)": ratios["lookup_vs_noop_tcp_c1"] >= 0.8,
        "lookup p99 <= 10 ms at 32 conns (tcp)": table[(lookup, "tcp", 32)]["p99_ms"] <= 10.0,
        "lookup p99 <= 10 ms at 32 conns (uds)": table[(lookup, "uds", 32)]["p99_ms"] <= 10.0,
        "uds >= tcp (lookup, 32 conns)": ratios["uds_vs_tcp_lookup_c32"] >= 1.0,
        "batch(16) p50 < 3x lookup p50 (tcp, 1 conn)": p50_batch < 3.0,
        "no errors": all(r["errors"] == 0 for r in table.values()),
    }
    print("\nratios")
    for key, value in ratios.items():
        print(f"  {key:<34} {value:6.2f}")
    print(f"  {'batch_p50_vs_lookup_p50_tcp_c1':<34} {p50_batch:6.2f}")
    print("\ntargets")
    for key, ok in targets.items():
        print(f"  [{'ok' if ok else 'MISS'}] {key}")

    return {
        "num_keys": NUM_KEYS,
        "batch_ops": BATCH_OPS,
        "answer_bytes": answer_size,
        "results": [
            {"scenario": n, "transport": t, "connections": c, **r} for (n, t, c), r in table.items()
        ],
        "ratios": {**ratios, "batch_p50_vs_lookup_p50_tcp_c1": p50_batch},
        "targets": targets,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short rounds (smoke run)")
    parser.add_argument(
        "--suite",
        choices=["all", "floors", "obs", "shadow", "tenants"],
        default="all",
        help="floors: the hot routes against bare/noop; obs: metrics+logs on/off; "
        "shadow: shadow evaluation on/off; tenants: engine credentials on/off (default: all)",
    )
    # Internal modes: the floor servers and the load generator run as separate processes.
    parser.add_argument("--serve-floor", choices=["bare", "noop"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--uds", help=argparse.SUPPRESS)
    parser.add_argument("--body-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--load", help=argparse.SUPPRESS)
    parser.add_argument("--request-file", help=argparse.SUPPRESS)
    parser.add_argument("--lives", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--app-cost", choices=sorted(_APP_COST_MODES), help=argparse.SUPPRESS)
    parser.add_argument("--calls", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--connections", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_floor:
        serve_floor(args.serve_floor, args.port, args.uds, args.body_size)
        return 0
    if args.app_cost:
        print(app_cost(args.app_cost, args.calls))
        return 0
    if args.load:
        if args.lives is not None:
            source = lives(args.lives)
        else:
            source = fixed(Path(args.request_file).read_bytes())
        print(json.dumps(run_load(args.load, source, args.connections, args.seconds)))
        return 0
    return main_bench(args)


if __name__ == "__main__":
    sys.exit(main())
