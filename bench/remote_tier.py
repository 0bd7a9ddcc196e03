"""Remote tier: bandwidth, lookup cost, cross-node hit ratio and one-call onload, each against a
same-run baseline.

Four parts (``--part a,b,c,d``; default all), all on loopback (127.0.0.1; one machine, so the
"nodes" share its cores and memory, and TCP never leaves the host).

**(a) Put and get GB/s through ``MooncakeTier`` vs the raw Mooncake client.** Workload: a
real ``mooncake_master`` (with its HTTP metadata server), a holder process that contributes
the store's memory (a Mooncake client with a segment and nothing else), and in this process
two clients that contribute none, so every byte crosses the transfer engine to the holder:

- **tier**: a ``MooncakeTier`` over a host pool, ``put_from`` then ``get_into`` of one batch;
- **raw** (the baseline, same run): a bare ``MooncakeDistributedStore`` over a second pool of
  the same size, registered the same way, doing the same ``batch_put_from`` and
  ``batch_get_into`` calls with the same names, sizes and replica count.

Each repetition writes fresh keys (a put of a stored key would be answered without moving
bytes), runs raw and tier in alternating order, and checks that the tier's reads equal what it
wrote. A repetition's keys are removed two repetitions later, once their lease has run out (1 s
here; a read slower than its lease fails with LEASE_EXPIRED). Block sizes 256 KiB and 1 MiB,
one batch of ``--batch-mib`` per call. GB/s are medians; a ratio is the median over
repetitions of raw seconds / tier seconds (per-repetition pairs cancel the machine's drift,
which moved single-round ratios by +-25% on a 2-core VM).
Target: >= 0.8x.

**(b) lookup(64) calls/s for pool-resident keys, tier on vs off.** Two ``kvoffload serve``
processes that differ only in ``--remote-tier mooncake`` (the on one connected to a master and
holder as in (a)), 64 keys stored in each pool, then lookups of those 64 keys driven by
``bench/http_bench.py``'s load generator (keep-alive HTTP/1.1 over TCP, at 1 and 8
connections), rounds interleaved between the two servers; server and load generator pinned to
different cores when there are two. Medians of calls/s; ratio = on / off. Target: >= 0.9x (a
lookup whose keys the pool holds never asks the remote tier).

**(c) Cross-node replay of the shipped trace.** ``bench/data/mooncake_synthetic_trace.jsonl``
(``manager.replay.parse_trace``), requests alternating between two ``kvoffload serve`` nodes
with a small pool each (``--replay-blocks``, 1024 blocks of 4 KiB by default). Each request, as
an engine would: lookup; when the leading blocks include ``remote`` ones, prepare-load (409:
they are promoted), lookups until they are hits (or not), prepare-load and complete-load of
the leading hits; prepare-store and complete-store of the rest; finish. Hit ratio = leading
blocks served (pool hits + remote hits promoted) / blocks, for the two nodes sharing one
Mooncake Store (write-behind of every stored block) vs the same two nodes without a remote
tier (each node alone with its own half of the requests), same run, same requests.

**(d) One-call onload of remote-only keys vs the raw client's batch get.** An in-process
service (the apps over ASGI, as the tests run it) whose remote tier is a client of the cluster
of (a) lending no memory, with a registered shm CPU KV cache. Per repetition the raw client of
(a) puts ``--batch-mib`` of fresh blocks under the tier's own names (so the node finds them
only remotely); then, in alternating order, the raw client's ``batch_get_into`` of those objects
into its own pool, and one ``onload`` of their keys into the device cache, timed from the call
to its job's end (the promotion's get into the pool, then the pool -> device copy). The bytes
in the device cache are checked against the raw put. Ratio = raw seconds / onload seconds,
median of the per-repetition ratios; the tier's get inside the onload is stamped, and its own
ratio (raw get / that get, same repetition) isolates kvoffload's get path from the job's setup
and the pool -> device copy. Each block
size runs with the CPU backend's default copy threads (``--copy-threads 0``: half the cores)
and with one per core (the copy follows the get, so the cores are free by then). Target: >=
0.8x.

Run: ``.venv/bin/python bench/remote_tier.py`` after ``make test-remote`` (which installs the
``mooncake`` extra; ``--quick`` for a smaller run). Prints a table per part and writes
``bench/results/remote_tier.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

with warnings.catch_warnings():
    # CPU-only torch wheels warn when NumPy is absent; nothing here uses NumPy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch

from kvoffload_client.client import KVOffloadAdminClient, KVOffloadClient, KVOffloadError  # noqa: E402

from bench import harness, http_bench  # noqa: E402
from transfer import HostPool, MooncakeConfig, MooncakeTier, remote_name  # noqa: E402

BLOCK_SIZES = (256 << 10, 1 << 20)
TARGET = 0.80
LOOKUP_TARGET = 0.90
LOOKUP_KEYS = 64
REPLAY_BLOCK_BYTES = 4 << 10
# How long a replayed request waits for its remote blocks to be promoted before going on.
PROMOTE_WAIT_S = 2.0
LEASE_MS = 1000
KEPT_REPS = 2  # repetitions whose keys stay stored while their leases run out
HOST = "127.0.0.1"

# The holder: a Mooncake client whose only job is to lend the store its segment until its
# stdin closes. It prints one line once set up.
HOLDER = """
import sys
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
rc = s.setup(sys.argv[1], sys.argv[2], int(sys.argv[3]), 0, "tcp", "", sys.argv[4])
print(rc, flush=True)
sys.stdin.read()
"""


def master_binary() -> str:
    found = shutil.which("mooncake_master", path=str(Path(sys.executable).parent))
    found = found or shutil.which("mooncake_master")
    if found is None:
        sys.exit("mooncake_master not found: run `make test-remote` (installs the mooncake extra)")
    return found


@contextlib.contextmanager
def mooncake_cluster(segment_bytes: int, workdir: Path) -> Iterator[tuple[str, str]]:
    """A master and a holder on loopback; yields (master address, metadata URL)."""
    rpc, http, metrics = harness.free_port(), harness.free_port(), harness.free_port()
    argv = [
        master_binary(),
        f"--rpc_port={rpc}",
        f"--rpc_address={HOST}",
        "--enable_http_metadata_server=true",
        f"--http_metadata_server_host={HOST}",
        f"--http_metadata_server_port={http}",
        f"--metrics_port={metrics}",
        f"--default_kv_lease_ttl={LEASE_MS}",
    ]
    master_log = (workdir / "master.log").open("wb")
    master = subprocess.Popen(argv, stdout=master_log, stderr=subprocess.STDOUT)
    holder: subprocess.Popen[bytes] | None = None
    address, url = f"{HOST}:{rpc}", f"http://{HOST}:{http}/metadata"
    try:
        deadline = time.monotonic() + 30
        while not port_open(http):
            if master.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"mooncake_master did not start (log: {workdir / 'master.log'})")
            time.sleep(0.1)
        holder_log = (workdir / "holder.log").open("wb")
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, HOST, url, str(segment_bytes), address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=holder_log,
        )
        assert holder.stdout is not None
        if holder.stdout.readline().strip() != b"0":
            sys.exit(f"the holder could not set up (log: {workdir / 'holder.log'})")
        yield address, url
    finally:
        if holder is not None:
            if holder.stdin is not None:
                holder.stdin.close()
            harness.stop_server(holder, grace_s=10)
            if holder.stdout is not None:
                holder.stdout.close()
        harness.stop_server(master, grace_s=5)
        master_log.close()


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((HOST, port)) == 0


class RawClient:
    """The baseline: a bare Mooncake client over its own pool, registered like the tier's."""

    def __init__(self, pool: HostPool, address: str, url: str, namespace: str) -> None:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        self.pool, self.namespace = pool, namespace
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(HOST, url, 0, 0, "tcp", "", address)
        if rc != 0:
            raise RuntimeError(f"raw client setup answered {rc}")
        self.base = pool.tensor.data_ptr()
        if self.store.register_buffer(self.base, pool.total_bytes) != 0:
            raise RuntimeError("raw client could not register its pool")
        self.config = ReplicateConfig()
        self.config.replica_num = 1

    def _args(self, keys: list[bytes], slots: list[int]) -> tuple[list[str], list[int], list[int]]:
        bb = self.pool.block_bytes
        names = [remote_name(self.namespace, k) for k in keys]
        return names, [self.base + s * bb for s in slots], [bb] * len(keys)

    def put_from(self, keys: list[bytes], slots: list[int]) -> list[bool]:
        names, ptrs, sizes = self._args(keys, slots)
        return [c == 0 for c in self.store.batch_put_from(names, ptrs, sizes, self.config)]

    def get_into(self, keys: list[bytes], slots: list[int]) -> list[bool]:
        names, ptrs, sizes = self._args(keys, slots)
        bb = self.pool.block_bytes
        return [c == bb for c in self.store.batch_get_into(names, ptrs, sizes)]

    def remove(self, keys: list[bytes], namespace: str) -> None:
        """Remove ``keys`` of ``namespace`` (the tier's too: it has no removal of its own)."""
        names = [remote_name(namespace, k) for k in keys]
        deadline = time.monotonic() + 10
        while any(c not in (0, -704) for c in self.store.batch_remove(names)):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)  # the put's lease (--default_kv_lease_ttl) has not run out yet

    def close(self) -> None:
        self.store.unregister_buffer(self.base)
        self.store.close()


def timed(fn: Callable[[], list[bool]], what: str) -> float:
    started = time.perf_counter()
    ok = fn()
    seconds = time.perf_counter() - started
    if not all(ok):
        raise RuntimeError(f"{what}: {ok.count(False)} of {len(ok)} keys failed")
    return seconds


def put_then_get(
    client: RawClient | MooncakeTier, keys: list[bytes], src: list[int], dst: list[int]
) -> tuple[float, float]:
    """Seconds of one ``put_from`` of ``keys`` out of ``src`` and one ``get_into`` ``dst``."""
    put = timed(lambda: client.put_from(keys, src), f"{type(client).__name__} put")
    get = timed(lambda: client.get_into(keys, dst), f"{type(client).__name__} get")
    return put, get


def run_size(
    block_bytes: int, batch_bytes: int, reps: int, address: str, url: str
) -> dict[str, Any]:
    """Median put and get GB/s of the tier and the raw client at one block size."""
    n = batch_bytes // block_bytes
    # Half the pool is written from, half read into, so a read never lands on its source.
    tier_pool = HostPool.create(2 * n, block_bytes, pin=False)
    raw_pool = HostPool.create(2 * n, block_bytes, pin=False)
    for pool in (tier_pool, raw_pool):
        pool.tensor[:n].copy_(torch.randint(0, 256, (n, block_bytes), dtype=torch.uint8))
    namespace = f"bench-{secrets.token_hex(4)}"
    cfg = MooncakeConfig(
        master=address,
        metadata_url=url,
        local_hostname=HOST,
        segment_bytes=0,
        local_buffer_bytes=0,
        timeout_s=60.0,
    )
    tier = MooncakeTier(tier_pool, namespace + "-tier", cfg)
    raw = RawClient(raw_pool, address, url, namespace + "-raw")
    src, dst = list(range(n)), list(range(n, 2 * n))
    stored: collections.deque[list[bytes]] = collections.deque()
    seconds: dict[str, list[float]] = {
        f"{w}_{op}": [] for w in ("tier", "raw") for op in ("put", "get")
    }
    try:
        if not tier.health().ok:
            raise RuntimeError(f"tier did not connect: {tier.health().last_error}")
        for rep in range(reps + 1):  # the first is a warm-up
            keys = [f"{rep}-{i}".encode() for i in range(n)]
            order: list[tuple[str, RawClient | MooncakeTier]] = [("raw", raw), ("tier", tier)]
            if rep % 2:
                order.reverse()
            times: dict[str, float] = {}
            for name, client in order:
                times[f"{name}_put"], times[f"{name}_get"] = put_then_get(client, keys, src, dst)
            if not torch.equal(tier_pool.tensor[:n], tier_pool.tensor[n:]):
                raise RuntimeError("the tier read back bytes that differ from what it wrote")
            if rep:
                for k, v in times.items():
                    seconds[k].append(v)
            stored.append(keys)
            while len(stored) > KEPT_REPS:
                old = stored.popleft()
                raw.remove(old, raw.namespace)
                raw.remove(old, tier.namespace)
    finally:
        raw.close()
        tier.close()
        tier_pool.close()
        raw_pool.close()
    gbps = {k: batch_bytes / statistics.median(v) / 1e9 for k, v in seconds.items()}

    def paired(op: str) -> float:
        """Median over repetitions of raw seconds / tier seconds (the two ran back to back)."""
        return statistics.median(
            r / t for r, t in zip(seconds[f"raw_{op}"], seconds[f"tier_{op}"], strict=True)
        )

    return {
        "block_bytes": block_bytes,
        "blocks_per_batch": n,
        "batch_bytes": batch_bytes,
        "reps": reps,
        "seconds": seconds,
        **{f"{k}_gbps": v for k, v in gbps.items()},
        "put_ratio": paired("put"),
        "get_ratio": paired("get"),
    }


# --------------------------------------------------------------------------- (b) lookups


def remote_flags(address: str, url: str) -> tuple[str, ...]:
    """``kvoffload serve`` flags for a remote tier at this master that lends it no memory."""
    return (
        "--remote-tier",
        "mooncake",
        "--mooncake-master",
        address,
        "--mooncake-metadata",
        url,
        "--mooncake-local-hostname",
        HOST,
        "--mooncake-segment-bytes",
        "0",
    )


def wait_remote_ok(server: http_bench.Server, timeout_s: float = 60) -> None:
    with KVOffloadAdminClient(f"http://{HOST}:{server.admin_port}") as admin:
        deadline = time.monotonic() + timeout_s
        while admin.stats()["tiers"]["remote"]["state"] != "ok":
            if time.monotonic() > deadline:
                sys.exit(f"{server.name}: remote tier not ok within {timeout_s} s")
            time.sleep(0.2)


def store_resident(server: http_bench.Server, keys: list[bytes]) -> None:
    """Request ``bench`` started, ``keys`` stored: a lookup of them answers all hits."""
    with KVOffloadClient(f"http://{server.tcp()}") as client:
        client.start_request("bench")
        spec = client.prepare_store("bench", keys)
        client.complete_store("bench", spec.keys_to_store)
        if client.lookup("bench", keys).hit_prefix != len(keys):
            raise RuntimeError(f"{server.name}: the stored keys are not all hits")


def lookup_part(
    address: str, url: str, workdir: Path, rounds: int, seconds: float
) -> dict[str, Any]:
    """lookup(64) of pool-resident keys, tier on vs off (see the module docstring)."""
    cores = sorted(os.sched_getaffinity(0))
    server_core, load_core = (cores[0], cores[1]) if len(cores) > 1 else (None, None)
    servers = {
        "on": http_bench.start_kvoffload(
            workdir, server_core, "tier-on", extra=remote_flags(address, url)
        ),
        "off": http_bench.start_kvoffload(workdir, server_core, "tier-off"),
    }
    try:
        wait_remote_ok(servers["on"])
        keys = [os.urandom(16) for _ in range(LOOKUP_KEYS)]
        for server in servers.values():
            store_resident(server, keys)
        body = json.dumps({"keys": [k.hex() for k in keys]}).encode()
        request = http_bench.http_request(http_bench.LOOKUP_PATH, body)
        scenarios: list[http_bench.Scenario] = [
            (name, server, "tcp", request, conns)
            for conns in (1, 8)
            for name, server in servers.items()
        ]
        table = http_bench.run_rounds(scenarios, rounds, seconds, load_core)
        with KVOffloadAdminClient(f"http://{HOST}:{servers['on'].admin_port}") as admin:
            remote = admin.stats()["tiers"]["remote"]
    finally:
        for server in servers.values():
            harness.stop_server(server.proc)
    rows = []
    for conns in (1, 8):
        on, off = table[("on", "tcp", conns)], table[("off", "tcp", conns)]
        rows.append(
            {
                "connections": conns,
                "on": on,
                "off": off,
                "ratio": on["calls_per_s"] / off["calls_per_s"],
                "errors": on["errors"] + off["errors"],
            }
        )
    # Pool hits only: the tier must never have been asked.
    return {"rows": rows, "remote_exists_calls": remote["counters"]["exists_calls"]}


# --------------------------------------------------------------------------- (c) replay


def leading(results: list[str], states: tuple[str, ...]) -> int:
    n = 0
    for r in results:
        if r not in states:
            break
        n += 1
    return n


def replay_request(
    client: KVOffloadClient, req: str, keys: list[bytes], tier: str = "remote"
) -> tuple[int, int]:
    """One trace request as an engine runs it; (pool hits, hits in ``tier`` promoted) of its
    leading blocks."""
    client.start_request(req)
    first = client.lookup(req, keys).results
    reach = leading(first, ("hit", tier))
    prefix = leading(first, ("hit",))
    if reach > prefix:
        wanted = keys[:reach]
        try:
            client.prepare_load(req, wanted)
        except KVOffloadError as exc:
            if exc.status != 409:
                raise
        deadline = time.monotonic() + PROMOTE_WAIT_S
        while True:
            now = client.lookup(req, wanted).results
            if "pending" not in now or time.monotonic() > deadline:
                break
            time.sleep(0.002)
        prefix = leading(now, ("hit",))
    pool = sum(1 for r in first[:prefix] if r == "hit")
    if prefix:
        client.prepare_load(req, keys[:prefix])
        client.complete_load(req, keys[:prefix])
    rest = keys[prefix:]
    if rest:
        spec = client.prepare_store(req, rest)
        if spec.keys_to_store:
            client.complete_store(req, spec.keys_to_store)
    client.finish_request(req)
    return pool, prefix - pool


def replay_nodes(
    servers: list[http_bench.Server], requests: list[list[bytes]], tag: str, tier: str = "remote"
) -> dict[str, Any]:
    """The requests alternating between ``servers``; hit counts per node and in all (hits
    promoted from ``tier`` counted as ``remote_hits``)."""
    clients = [KVOffloadClient(uds=s.uds, timeout=30) for s in servers]
    per_node: list[dict[str, Any]] = [
        {"blocks": 0, "pool_hits": 0, "remote_hits": 0} for _ in servers
    ]
    started = time.perf_counter()
    try:
        for i, keys in enumerate(requests):
            node = i % len(servers)
            pool, remote = replay_request(clients[node], f"{tag}-{i}", keys, tier)
            per_node[node]["blocks"] += len(keys)
            per_node[node]["pool_hits"] += pool
            per_node[node]["remote_hits"] += remote
    finally:
        for client in clients:
            client.close()
    elapsed = time.perf_counter() - started
    for counts in per_node:
        counts["hit_ratio"] = (counts["pool_hits"] + counts["remote_hits"]) / counts["blocks"]
    blocks = sum(c["blocks"] for c in per_node)
    pool = sum(c["pool_hits"] for c in per_node)
    remote = sum(c["remote_hits"] for c in per_node)
    return {
        "requests": len(requests),
        "blocks": blocks,
        "pool_hits": pool,
        "remote_hits": remote,
        "hit_ratio": (pool + remote) / blocks,
        "nodes": per_node,
        "seconds": elapsed,
    }


def replay_part(
    address: str, url: str, workdir: Path, num_blocks: int, limit: int
) -> dict[str, Any]:
    """Two nodes sharing the store vs the same two nodes alone (see the module docstring)."""
    trace = harness.read_trace(limit=limit)
    requests = [[bytes(k) for k in keys] for keys in trace]
    pool_flags = ("--num-blocks", str(num_blocks), "--block-bytes", str(REPLAY_BLOCK_BYTES))
    out: dict[str, Any] = {
        "trace": harness.TRACE.name,
        "num_blocks": num_blocks,
        "block_bytes": REPLAY_BLOCK_BYTES,
    }
    for mode in ("shared", "alone"):
        extra = pool_flags + (remote_flags(address, url) if mode == "shared" else ())
        servers = [
            http_bench.start_kvoffload(workdir, None, f"{mode}-{n}", extra=extra) for n in range(2)
        ]
        try:
            if mode == "shared":
                for server in servers:
                    wait_remote_ok(server)
            out[mode] = replay_nodes(servers, requests, f"{mode}-{secrets.token_hex(3)}")
            if mode == "shared":
                remotes = []
                for server in servers:
                    with KVOffloadAdminClient(f"http://{HOST}:{server.admin_port}") as admin:
                        remotes.append(admin.stats()["tiers"]["remote"])
                out[mode]["remote"] = [
                    {k: r[k] for k in ("state", "written", "queue", "promotions", "counters")}
                    for r in remotes
                ]
        finally:
            for server in servers:
                harness.stop_server(server.proc)
    out["ratio"] = out["shared"]["hit_ratio"] / out["alone"]["hit_ratio"]
    return out


# --------------------------------------------------------------------------- report


def print_bandwidth(rows: list[dict[str, Any]], batch: int, reps: int) -> None:
    print(
        f"(a) Remote tier on Mooncake Store (TCP, loopback, one holder), {batch >> 20} MiB per "
        f"batch call, median of {reps}; ratio = raw seconds / MooncakeTier seconds, median of the "
        "repetitions (each runs both, in alternating order)"
    )
    header = (
        f"{'block':>8} {'put GB/s':>9} {'raw':>6} {'ratio':>6} "
        f"{'get GB/s':>9} {'raw':>6} {'ratio':>6}  target {TARGET}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        ok = min(r["put_ratio"], r["get_ratio"]) >= TARGET
        print(
            f"{r['block_bytes'] >> 10:>6}Ki {r['tier_put_gbps']:>9.2f} {r['raw_put_gbps']:>6.2f} "
            f"{r['put_ratio']:>6.2f} {r['tier_get_gbps']:>9.2f} {r['raw_get_gbps']:>6.2f} "
            f"{r['get_ratio']:>6.2f}  {'ok' if ok else 'MISS'}"
        )


def print_lookups(part: dict[str, Any], rounds: int) -> None:
    print(
        f"(b) lookup({LOOKUP_KEYS}) of pool-resident keys over TCP, kvoffload serve with "
        f"--remote-tier mooncake vs without, median of {rounds} interleaved rounds"
    )
    header = (
        f"{'conns':>5} {'on calls/s':>11} {'off calls/s':>12} {'ratio':>6} "
        f"{'on p99 ms':>10} {'off p99 ms':>11} {'on cpu us':>10} {'off cpu us':>11}  "
        f"target {LOOKUP_TARGET}"
    )
    print(header)
    print("-" * len(header))
    for r in part["rows"]:
        on, off = r["on"], r["off"]
        print(
            f"{r['connections']:>5} {on['calls_per_s']:>11.0f} {off['calls_per_s']:>12.0f} "
            f"{r['ratio']:>6.2f} {on['p99_ms']:>10.2f} {off['p99_ms']:>11.2f} "
            f"{on['cpu_us_per_call']:>10.0f} {off['cpu_us_per_call']:>11.0f}  "
            f"{'ok' if r['ratio'] >= LOOKUP_TARGET else 'MISS'}"
        )
    print(
        "cpu us = server CPU per call (from /proc); remote exists calls made by the tier-on "
        f"server: {part['remote_exists_calls']}"
    )


def print_replay(part: dict[str, Any]) -> None:
    shared, alone = part["shared"], part["alone"]
    print(
        f"(c) {part['trace']}: {shared['requests']} requests alternating between two nodes, "
        f"{part['num_blocks']} blocks of {part['block_bytes'] >> 10} KiB each"
    )
    header = f"{'setup':<28} {'hit ratio':>9} {'pool hits':>10} {'remote hits':>12} {'s':>6}"
    print(header)
    print("-" * len(header))
    print(
        f"{'two nodes, one Mooncake':<28} {shared['hit_ratio']:>9.3f} {shared['pool_hits']:>10} "
        f"{shared['remote_hits']:>12} {shared['seconds']:>6.1f}"
    )
    for n, node in enumerate(alone["nodes"]):
        print(
            f"{f'node {n} alone':<28} {node['hit_ratio']:>9.3f} {node['pool_hits']:>10} "
            f"{0:>12} {'':>6}"
        )
    print(
        f"{'two nodes alone, together':<28} {alone['hit_ratio']:>9.3f} {alone['pool_hits']:>10} "
        f"{0:>12} {alone['seconds']:>6.1f}"
    )
    best = max(node["hit_ratio"] for node in alone["nodes"])
    verdict = "ok" if shared["hit_ratio"] > best else "MISS"
    print(f"shared / alone: {part['ratio']:.2f}x; above either node alone: {verdict}")


# --------------------------------------------------------------------------- (d) one-call onload


async def onload_size(
    block_bytes: int, batch_bytes: int, reps: int, address: str, url: str, copy_threads: int
) -> dict[str, Any]:
    """One ``onload`` of remote-only keys (promotion and device copy in one job) against the
    raw client's ``batch_get_into`` of the same objects, paired per repetition; the service
    with ``--copy-threads copy_threads``."""
    from app.core.remote import RemoteLink
    from testsupport.api_harness import make_settings, running

    n = batch_bytes // block_bytes
    settings = make_settings(
        num_blocks=2 * n,
        block_bytes=block_bytes,
        remote_tier="mooncake",
        mooncake_master=address,
        mooncake_metadata=url,
        mooncake_local_hostname=HOST,
        mooncake_segment_bytes=0,
        remote_timeout_s=60.0,
        job_deadline_s=60.0,
        lease_ttl_s=120.0,
        max_keys_per_call=8192,
        max_body_bytes=4 << 20,
        copy_threads=copy_threads,
    )
    raw_pool = HostPool.create(2 * n, block_bytes, pin=False)
    raw_pool.tensor[:n].copy_(torch.randint(0, 256, (n, block_bytes), dtype=torch.uint8))
    raw_s: list[float] = []
    onload_s: list[float] = []
    phases: list[dict[str, float]] = []
    async with running(settings) as h:
        link = h.service.tiers.get("remote")
        assert isinstance(link, RemoteLink)
        used_threads = getattr(h.service.transfers().worker, "copy_threads", None)
        deadline = time.monotonic() + 60
        while not link.tier.health().ok:
            if time.monotonic() > deadline:
                raise RuntimeError(f"tier did not connect: {link.tier.health().last_error}")
            await asyncio.sleep(0.1)
        raw = RawClient(raw_pool, address, url, link.tier.namespace)
        # Both pools' pages touched once, as a serving node's are (the raw pool's above).
        h.service.transfers().pool.tensor.zero_()
        raw_pool.tensor[n:].zero_()
        dev, cache_id = await h.device(n)
        # Stamps (profile): the tier's get inside each onload.
        gets: list[tuple[float, float]] = []
        real_get = link.tier.get_into

        def get_into(keys: Any, slots: Any) -> list[bool]:
            t = time.perf_counter()
            try:
                ok: list[bool] = real_get(keys, slots)
                return ok
            finally:
                gets.append((t, time.perf_counter()))

        link.tier.get_into = get_into  # type: ignore[method-assign]
        stored: collections.deque[list[bytes]] = collections.deque()
        # Fresh names per run: a put of a name the store holds keeps the bytes it has.
        run = os.urandom(4).hex()
        try:
            for rep in range(reps + 1):  # the first is a warm-up
                keys = [f"d{run}-{rep}-{i}".encode() for i in range(n)]
                # Written by the raw client under the tier's names: remote-only for the node.
                timed(functools.partial(raw.put_from, keys, list(range(n))), "raw put")
                times: dict[str, float] = {}
                for who in (("raw", "tier"), ("tier", "raw"))[rep % 2]:
                    if who == "raw":
                        dst = list(range(n, 2 * n))
                        times["raw"] = timed(functools.partial(raw.get_into, keys, dst), "raw get")
                        continue
                    req = f"on{rep}"
                    await h.start(req)
                    gets.clear()
                    started = time.perf_counter()
                    r = await h.post(
                        f"/v1/requests/{req}/onload",
                        {
                            "cache_id": cache_id,
                            "keys": [k.hex() for k in keys],
                            "device_blocks": list(range(n)),
                        },
                    )
                    if r.status_code != 202:
                        raise RuntimeError(f"onload answered {r.status_code}: {r.text}")
                    job = await h.wait(r.json()["job_id"], timeout_s=60)
                    times["tier"] = time.perf_counter() - started
                    if gets:
                        phases.append(
                            {
                                "to_get": gets[0][0] - started,
                                "get": gets[-1][1] - gets[0][0],
                                "after_get": started + times["tier"] - gets[-1][1],
                            }
                        )
                    if job["state"] != "done":
                        raise RuntimeError(f"onload job {job}")
                    await h.client.delete(f"/v1/requests/{req}")
                for i in (0, n - 1):
                    if dev.read(i) != bytes(raw_pool.tensor[i].numpy()):
                        raise RuntimeError("the onload brought bytes that differ from the raw put")
                if rep:
                    raw_s.append(times["raw"])
                    onload_s.append(times["tier"])
                stored.append(keys)
                while len(stored) > KEPT_REPS:
                    raw.remove(stored.popleft(), raw.namespace)
        finally:
            while stored:  # room in the segment for the next run
                raw.remove(stored.popleft(), raw.namespace)
            raw.close()
            dev.close()
    raw_pool.close()
    ratios = [a / b for a, b in zip(raw_s, onload_s, strict=True)]
    # The tier's get inside each onload against the raw get of the same objects in the same
    # repetition: kvoffload's get path alone, without the setup and the pool -> device copy.
    tier_gets = [p["get"] for p in phases[1:]]
    get_ratios = [a / b for a, b in zip(raw_s, tier_gets, strict=True)]
    return {
        "block_bytes": block_bytes,
        "copy_threads": used_threads,
        "blocks": n,
        "batch_bytes": batch_bytes,
        "reps": reps,
        "seconds": {"raw_get": raw_s, "onload": onload_s},
        "raw_get_gbps": batch_bytes / statistics.median(raw_s) / 1e9,
        "onload_gbps": batch_bytes / statistics.median(onload_s) / 1e9,
        "ratio_by_rep": ratios,
        "ratio": statistics.median(ratios),
        "get_ratio_by_rep": get_ratios,
        "get_ratio": statistics.median(get_ratios),
        "onload_phases_median_s": {
            k: statistics.median(p[k] for p in phases[1:]) for k in ("to_get", "get", "after_get")
        },
    }


def copy_thread_settings() -> list[int]:
    """Part (d)'s copy threads: the default (0: half the cores), and one per core where that
    is more (at most the setting's bound)."""
    from transfer.cpu_worker import default_copy_threads

    per_core = min(os.cpu_count() or 1, 64)
    return [0] if per_core == default_copy_threads() else [0, per_core]


def print_onloads(rows: list[dict[str, Any]]) -> None:
    print("(d) one onload of remote-only keys vs the raw client's batch get, paired per rep")
    print(
        f"{'block':>8} | {'copy threads':>12} | {'raw get GB/s':>12} | {'onload GB/s':>11} | "
        f"{'ratio':>5} | >= 0.8"
    )
    for row in rows:
        ok = "pass" if row["ratio"] >= TARGET else "FAIL"
        print(
            f"{row['block_bytes'] >> 10:>5} KiB | {row['copy_threads']:>12} | "
            f"{row['raw_get_gbps']:>12.2f} | {row['onload_gbps']:>11.2f} | "
            f"{row['ratio']:>5.2f} | {ok}"
        )
    for row in rows:
        ph = row["onload_phases_median_s"]
        print(
            f"  {row['block_bytes'] >> 10} KiB, {row['copy_threads']} copy thread(s): onload "
            "phases (ms): to the get "
            f"{ph['to_get'] * 1e3:.1f}, the get {ph['get'] * 1e3:.1f} (raw "
            f"{statistics.median(row['seconds']['raw_get']) * 1e3:.1f}), after it "
            f"{ph['after_get'] * 1e3:.1f}; the get's ratio (raw / kvoffload's) "
            f"{row['get_ratio']:.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller run")
    parser.add_argument("--part", default="a,b,c,d", help="parts to run, e.g. b,c (default all)")
    parser.add_argument("--batch-mib", type=int, default=0, help="(a) bytes per batch (MiB)")
    parser.add_argument("--replay-blocks", type=int, default=1024, help="(c) pool blocks per node")
    parser.add_argument("--replay-requests", type=int, default=0, help="(c) first N (0: all)")
    parser.add_argument("--out", default=str(harness.RESULTS_DIR / "remote_tier.json"))
    args = parser.parse_args(argv)
    parts = set(args.part.split(","))
    if not parts <= {"a", "b", "c", "d"}:
        parser.error(f"--part: a, b, c and d only, not {args.part!r}")
    batch = (args.batch_mib or (16 if args.quick else 64)) << 20
    reps = 3 if args.quick else 15
    rounds, seconds = (3, 1.0) if args.quick else (7, 2.0)
    limit = args.replay_requests or (1500 if args.quick else 0)
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvobench-remote-{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    record: dict[str, Any] = {
        "benchmark": "remote_tier",
        "quick": args.quick,
        "parts": sorted(parts),
        "network": "loopback (127.0.0.1)",
        "machine": harness.machine(torch=torch.__version__, mooncake=mooncake_version()),
    }
    if "a" in parts:
        rows = []
        # Room for the repetitions kept stored and the one running, of both clients, with
        # margin below the master's eviction watermark.
        segment = 2 * (KEPT_REPS + 1) * batch * 3 // 2
        with mooncake_cluster(segment_bytes=segment, workdir=workdir) as (address, url):
            for size in BLOCK_SIZES:
                rows.append(run_size(size, batch, reps, address, url))
        print_bandwidth(rows, batch, reps)
        record["a_bandwidth"] = {"target_ratio": TARGET, "reps": reps, "results": rows}
    if "d" in parts:
        # The raw client's puts of the repetitions kept stored and the running one.
        segment = (KEPT_REPS + 2) * batch * 3 // 2
        with mooncake_cluster(segment_bytes=segment, workdir=workdir) as (address, url):
            onloads = [
                asyncio.run(onload_size(size, batch, reps, address, url, threads))
                for size in BLOCK_SIZES
                for threads in copy_thread_settings()
            ]
        print_onloads(onloads)
        record["d_onload"] = {"target_ratio": TARGET, "reps": reps, "results": onloads}
    if parts & {"b", "c"}:
        # Room for every block of the trace (about 44k distinct blocks of 4 KiB) and margin.
        with mooncake_cluster(segment_bytes=512 << 20, workdir=workdir) as (address, url):
            if "b" in parts:
                lookups = lookup_part(address, url, workdir, rounds, seconds)
                print_lookups(lookups, rounds)
                record["b_lookups"] = {
                    "target_ratio": LOOKUP_TARGET,
                    "rounds": rounds,
                    "seconds_per_round": seconds,
                    **lookups,
                }
            if "c" in parts:
                replayed = replay_part(address, url, workdir, args.replay_blocks, limit)
                print_replay(replayed)
                record["c_replay"] = replayed
    elapsed = time.perf_counter() - started
    print(f"({elapsed:.1f} s)")
    record["seconds"] = elapsed
    harness.write_results(Path(args.out), record)
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


def mooncake_version() -> str:
    from importlib import metadata

    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return f"{dist} {metadata.version(dist)}"
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
