"""Remote tier bandwidth: put and get GB/s through ``MooncakeTier`` vs the raw Mooncake client.

Workload, on loopback: a real ``mooncake_master`` (with its HTTP metadata server), a holder
process that contributes the store's memory (a Mooncake client with a segment and nothing
else), and in this process two clients that contribute none, so every byte crosses the
transfer engine to the holder:

- **tier**: a ``MooncakeTier`` over a host pool, ``put_from`` then ``get_into`` of one batch;
- **raw** (the baseline, same run): a bare ``MooncakeDistributedStore`` over a second pool of
  the same size, registered the same way, doing the same ``batch_put_from`` and
  ``batch_get_into`` calls with the same names, sizes and replica count.

Each repetition writes fresh keys (a put of a stored key would be answered without moving
bytes), runs raw and tier in alternating order, and checks that the tier's reads equal what it
wrote. A repetition's keys are removed two repetitions later, once their lease has run out (1 s
here; a read slower than its lease fails with LEASE_EXPIRED). Block sizes 256 KiB and 1 MiB,
one batch of ``--batch-mib`` per call. Figures are medians; the ratio is tier over raw.
Target: >= 0.8x.

Run: ``.venv/bin/python bench/remote_tier.py`` after ``make test-remote`` (which installs the
``mooncake`` extra; ``--quick`` for a smaller run). Prints a table and writes
``bench/results/remote_tier.json``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
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

from bench import harness  # noqa: E402
from transfer import HostPool, MooncakeConfig, MooncakeTier, remote_name  # noqa: E402

BLOCK_SIZES = (256 << 10, 1 << 20)
TARGET = 0.80
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
    return {
        "block_bytes": block_bytes,
        "blocks_per_batch": n,
        "batch_bytes": batch_bytes,
        "reps": reps,
        "seconds": seconds,
        **{f"{k}_gbps": v for k, v in gbps.items()},
        "put_ratio": gbps["tier_put"] / gbps["raw_put"],
        "get_ratio": gbps["tier_get"] / gbps["raw_get"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller run")
    parser.add_argument("--batch-mib", type=int, default=0, help="bytes per batch call (MiB)")
    parser.add_argument("--out", default=str(harness.RESULTS_DIR / "remote_tier.json"))
    args = parser.parse_args(argv)
    batch = (args.batch_mib or (16 if args.quick else 64)) << 20
    reps = 3 if args.quick else 15
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvobench-remote-{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rows = []
    # Room for the repetitions kept stored and the one running, of both clients, with margin
    # below the master's eviction watermark.
    segment = 2 * (KEPT_REPS + 1) * batch * 3 // 2
    with mooncake_cluster(segment_bytes=segment, workdir=workdir) as (
        address,
        url,
    ):
        for size in BLOCK_SIZES:
            rows.append(run_size(size, batch, reps, address, url))
    elapsed = time.perf_counter() - started

    print(
        f"Remote tier on Mooncake Store (TCP, loopback, one holder), {batch >> 20} MiB per "
        f"batch call, median of {reps}; ratio = MooncakeTier / raw client"
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
    print(f"({elapsed:.1f} s)")
    harness.write_results(
        Path(args.out),
        {
            "benchmark": "remote_tier",
            "part": "a: put/get GB/s, MooncakeTier vs raw client",
            "quick": args.quick,
            "target_ratio": TARGET,
            "machine": harness.machine(torch=torch.__version__, mooncake=mooncake_version()),
            "seconds": elapsed,
            "results": rows,
        },
    )
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
