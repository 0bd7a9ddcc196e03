"""Object tier (S3): one-call onload and demotion against the raw client, and two nodes sharing a
bucket, on a real Ceph RADOS Gateway brought up here (``testsupport/rgw.py``, 127.0.0.1).

**(a) One-call onload of object-only keys vs the raw client's parallel GETs.** An in-process
service (the apps over ASGI, as the tests run it) with the object tier alone below a pool of N
blocks and a registered shm CPU KV cache. Per repetition the engine stores N fresh blocks
(written behind to the bucket), then N others, which evict the first N from the pool: those are
object-only. Then, in alternating order: the raw client's GETs of those N objects
(``obstore.get`` on ``--concurrency`` threads, the tier's own concurrency, nothing checked or
copied), and one ``onload`` of their keys into the device cache, timed from the call to its
job's end (GETs with their MAC checks into the pool, then the pool -> device copy). Bytes in the
device cache are checked. Ratio = raw seconds / onload seconds, median of the per-repetition
ratios. Target: >= 0.8x. ``--mib 16`` with 1 MiB blocks is an engine's call size (16 blocks).
The gateway is left ``SETTLE_S`` after the stores before the reads: reads right after a write
burst take it 2-3x as long, raw or not, and fell on whichever side read first.

**(b) Demotion (write-behind) vs the raw client's parallel PUTs.** The same service: N fresh
blocks stored (prepare-store, bytes written into their pool slots, complete-store), timed from
the complete-store to the last of them written to the bucket; against the raw client's PUTs of
N objects of the same size (block and MAC) on ``--concurrency`` threads, in alternating order.
Target: >= 0.8x.

**(c) Two nodes, one bucket.** The shipped trace (``bench/data``), its requests alternating
between two ``kvoffload serve`` processes with small pools (``--replay-blocks`` of 4 KiB), each
request run as an engine runs it (``bench/remote_tier.py``'s replay: lookup, promotion of the
leading ``object`` keys, load of the leading hits, store of the rest): hit ratio (leading blocks
served / blocks) and bytes read from the bucket, the two nodes sharing the bucket against the
same two nodes without it.

**(d) Layout: one object per block, or several blocks packed in one.** The raw client alone,
``--mib`` of 256 KiB blocks on ``--concurrency`` threads, in alternating rounds: one object per
block (PUT each, GET each: the tier's layout) against four blocks packed in one 1 MiB object
(PUT each pack; GET each pack whole, as a load that wants all four; and GET each block as a
256 KiB range of its pack, as a load of scattered blocks does).

**(e) What a miss costs a lookup.** An in-process service with the object tier: lookups of 32
keys the pool lacks and the bucket does not hold, fresh keys each time (one HEAD each, all at
once), the same 32 asked again (as an engine asks a waiting request's prefix step after step:
answered by the negative cache, ``--object-negative-cache-s``), and 32 pool hits (the bucket
never asked), in rotating order; p50 of each.

Run (root, Debian's Ceph installed; ``make test-object``'s cluster): ``.venv/bin/python
bench/object_tier.py [--quick]``. Prints a table per part and writes
``bench/results/object_tier.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvoffload_client.client import KVOffloadAdminClient  # noqa: E402

from bench import harness, http_bench  # noqa: E402
from bench.remote_tier import replay_nodes  # noqa: E402
from testsupport.rgw import RadosGateway  # noqa: E402

BLOCK_SIZES = (256 << 10, 1 << 20)
#: Seconds the gateway is left after the stores that make the keys object-only, before (a) reads.
SETTLE_S = 0.5
TARGET = 0.80
REPLAY_BLOCK_BYTES = 4 << 10
HOST = "127.0.0.1"


def make_bucket(rgw: RadosGateway) -> str:
    """A new bucket on the gateway (boto3, path-style)."""
    import boto3
    from botocore.config import Config

    s3 = boto3.client(
        "s3",
        endpoint_url=rgw.endpoint,
        region_name=rgw.region,
        aws_access_key_id=rgw.access_key,
        aws_secret_access_key=rgw.secret_key,
        config=Config(
            s3={"addressing_style": "path"}, request_checksum_calculation="when_required"
        ),
    )
    name = f"bench-{secrets.token_hex(4)}"
    s3.create_bucket(Bucket=name)
    return name


class Raw:
    """The baseline: the same client library, on as many threads as the tier, nothing else."""

    def __init__(self, rgw: RadosGateway, bucket: str, concurrency: int) -> None:
        from obstore.store import S3Store

        self.store = S3Store(
            bucket,
            endpoint=rgw.endpoint,
            region=rgw.region,
            access_key_id=rgw.access_key,
            secret_access_key=rgw.secret_key,
            client_options={"allow_http": True},
        )
        self.pool = concurrent.futures.ThreadPoolExecutor(concurrency)

    def get(self, paths: list[str]) -> float:
        import obstore

        def one(path: str) -> int:
            return len(obstore.get(self.store, path).bytes())

        return self._timed(one, paths)

    def put(self, paths: list[str], body: bytes) -> float:
        import obstore

        def one(path: str) -> int:
            obstore.put(self.store, path, body)
            return len(body)

        return self._timed(one, paths)

    def _timed(self, fn: Callable[[str], int], paths: list[str]) -> float:
        t = time.perf_counter()
        list(self.pool.map(fn, paths))
        return time.perf_counter() - t

    def close(self) -> None:
        self.pool.shutdown()


async def size_part(
    rgw: RadosGateway, block: int, mib: int, reps: int, concurrency: int
) -> dict[str, Any]:
    """Parts (a) and (b) at one block size."""
    from app.core.object import ObjectLink
    from testsupport.api_harness import make_settings, running
    from transfer.s3 import MAC_BYTES

    n = mib * (1 << 20) // block
    bucket = make_bucket(rgw)
    settings = make_settings(
        num_blocks=n,
        block_bytes=block,
        tiers=["object"],
        object_bucket=bucket,
        object_endpoint=rgw.endpoint,
        object_region=rgw.region,
        object_concurrency=concurrency,
        object_timeout_s=60.0,
        object_batch_blocks=max(64, n),
        object_queue_blocks=4 * n,
        job_deadline_s=60.0,
        lease_ttl_s=120.0,
        max_keys_per_call=8192,
        max_body_bytes=4 << 20,
    )
    raw = Raw(rgw, bucket, concurrency)
    out: dict[str, list[float]] = {"raw_get": [], "onload": [], "raw_put": [], "demote": []}
    async with running(settings) as h:
        link = h.service.tiers.get("object")
        assert isinstance(link, ObjectLink)
        dev, cache_id = await h.device(n)
        pool = h.service.transfers().pool
        run = secrets.token_hex(3)
        written: dict[str, bytes] = {}

        async def store(req: str, keys: list[str]) -> float:
            """Store ``keys`` (random bytes); seconds from complete-store to all written."""
            await h.start(req)
            r = await h.post(f"/v1/requests/{req}/prepare-store", {"keys": keys})
            assert r.status_code == 200, r.text
            body = r.json()
            for key, slot in zip(body["keys_to_store"], body["slots"], strict=True):
                data = os.urandom(block)
                pool.tensor[slot].numpy()[:] = memoryview(data)
                written[key] = data
            want = link.counts["written"] + len(body["keys_to_store"])
            t = time.perf_counter()
            r = await h.post(f"/v1/requests/{req}/complete-store", {"keys": keys})
            assert r.status_code == 200, r.text
            while link.counts["written"] < want:
                if link.counts["dropped_queue_full"] or not link.tier.health().ok:
                    raise RuntimeError(f"write-behind failed: {link.state()}")
                await asyncio.sleep(0.001)
            took = time.perf_counter() - t
            await h.client.delete(f"/v1/requests/{req}")
            return took

        for rep in range(reps + 1):  # the first is a warm-up
            keys = [f"{run}{rep:04x}{i:06x}".ljust(32, "0") for i in range(n)]
            filler = [f"{run}{rep:04x}{i:06x}".ljust(32, "f") for i in range(n)]
            times: dict[str, float] = {}
            # (b): demotion of `keys` against raw PUTs of as many objects.
            body = os.urandom(block + MAC_BYTES)
            for who in (("raw", "tier"), ("tier", "raw"))[rep % 2]:
                if who == "raw":
                    paths = [f"raw/{run}/{rep}/{i}" for i in range(n)]
                    times["raw_put"] = await asyncio.to_thread(raw.put, paths, body)
                else:
                    times["demote"] = await store(f"s{rep}", keys)
            await store(f"f{rep}", filler)  # evicts `keys`: object-only now
            # Reads right after a write burst take the gateway 2-3x as long (the raw client's
            # as much as the tier's): without a pause, whichever side read first paid for it.
            await asyncio.sleep(SETTLE_S)
            # (a): onload of `keys` against raw GETs of their objects.
            paths = [link.store.path(bytes.fromhex(k)) for k in keys]
            for who in (("raw", "tier"), ("tier", "raw"))[rep % 2]:
                if who == "raw":
                    times["raw_get"] = await asyncio.to_thread(raw.get, paths)
                    continue
                req = f"on{rep}"
                await h.start(req)
                t = time.perf_counter()
                r = await h.post(
                    f"/v1/requests/{req}/onload",
                    {"cache_id": cache_id, "keys": keys, "device_blocks": list(range(n))},
                )
                if r.status_code != 202:
                    raise RuntimeError(f"onload answered {r.status_code}: {r.text}")
                job = await h.wait(r.json()["job_id"], timeout_s=120)
                times["onload"] = time.perf_counter() - t
                if job["state"] != "done":
                    raise RuntimeError(f"onload job {job}")
                await h.client.delete(f"/v1/requests/{req}")
            for i in (0, n - 1):
                if dev.read(i) != written[keys[i]]:
                    raise RuntimeError("the onload brought bytes that differ from those stored")
            written.clear()
            if rep:
                for k, v in times.items():
                    out[k].append(v)
        counters = link.tier.health().counters
        dev.close()
    raw.close()
    nbytes = n * block
    onload = [a / b for a, b in zip(out["raw_get"], out["onload"], strict=True)]
    demote = [a / b for a, b in zip(out["raw_put"], out["demote"], strict=True)]
    return {
        "block_bytes": block,
        "blocks": n,
        "concurrency": concurrency,
        "seconds": out,
        "raw_get_gbps": nbytes / statistics.median(out["raw_get"]) / 1e9,
        "onload_gbps": nbytes / statistics.median(out["onload"]) / 1e9,
        "raw_put_gbps": nbytes / statistics.median(out["raw_put"]) / 1e9,
        "demote_gbps": nbytes / statistics.median(out["demote"]) / 1e9,
        "onload_ratio_by_rep": onload,
        "onload_ratio": statistics.median(onload),
        "demote_ratio_by_rep": demote,
        "demote_ratio": statistics.median(demote),
        "checksum_failures": counters["checksum_failures"],
    }


def layout_part(rgw: RadosGateway, mib: int, reps: int, concurrency: int) -> dict[str, Any]:
    """(d): one object per 256 KiB block against packs of four, raw client."""
    import obstore

    block, per = 256 << 10, 4
    n = mib * (1 << 20) // block
    raw = Raw(rgw, make_bucket(rgw), concurrency)
    data = os.urandom(block * per)
    cols = ("put_each", "put_packed", "get_each", "get_packed", "get_ranges")
    out: dict[str, list[float]] = {c: [] for c in cols}
    run = secrets.token_hex(3)

    def ranged(path: str) -> int:
        at = int(path.rsplit("@", 1)[1])
        name = path.rsplit("@", 1)[0]
        return len(obstore.get_range(raw.store, name, start=at * block, length=block))

    for rep in range(reps + 1):
        each = [f"each/{run}/{rep}/{i}" for i in range(n)]
        packs = [f"packed/{run}/{rep}/{i}" for i in range(n // per)]
        ranges = [f"{p}@{j}" for p in packs for j in range(per)]
        times: dict[str, float] = {}
        order = [("each", "packed"), ("packed", "each")][rep % 2]
        for who in order:
            if who == "each":
                times["put_each"] = raw.put(each, data[:block])
            else:
                times["put_packed"] = raw.put(packs, data)
        for who in order:
            if who == "each":
                times["get_each"] = raw.get(each)
            else:
                times["get_packed"] = raw.get(packs)
                times["get_ranges"] = raw._timed(ranged, ranges)
        if rep:
            for k, v in times.items():
                out[k].append(v)
    raw.close()
    nbytes = n * block
    rec: dict[str, Any] = {"block_bytes": block, "blocks_per_pack": per, "blocks": n}
    rec["seconds"] = out
    for c in cols:
        rec[f"{c}_gbps"] = nbytes / statistics.median(out[c]) / 1e9
    for c in ("put_packed", "get_packed", "get_ranges"):
        base = "put_each" if c.startswith("put") else "get_each"
        rec[f"{c}_vs_each"] = statistics.median(
            [a / b for a, b in zip(out[base], out[c], strict=True)]
        )
    return rec


async def lookup_part(rgw: RadosGateway, reps: int) -> dict[str, Any]:
    """(e): lookups of 32 misses (the bucket asked) against 32 pool hits."""
    from testsupport.api_harness import make_settings, running

    settings = make_settings(
        num_blocks=64,
        tiers=["object"],
        object_bucket=make_bucket(rgw),
        object_endpoint=rgw.endpoint,
        object_region=rgw.region,
        object_lookup_timeout_s=1.0,
    )
    hits = [f"{i:032x}" for i in range(32)]
    again = [f"a{i:031x}" for i in range(32)]
    out: dict[str, list[float]] = {"misses": [], "misses_again": [], "hits": []}
    async with running(settings) as h:
        await h.start("r")
        r = await h.post("/v1/requests/r/prepare-store", {"keys": hits})
        assert r.status_code == 200, r.text
        r = await h.post("/v1/requests/r/complete-store", {"keys": hits})
        assert r.status_code == 200, r.text
        for rep in range(20 * reps):
            misses = [f"e{rep:07x}{i:024x}" for i in range(32)]
            kinds = [("misses", misses), ("misses_again", again), ("hits", hits)]
            for who, keys in kinds[rep % 3 :] + kinds[: rep % 3]:
                t = time.perf_counter()
                r = await h.post("/v1/requests/r/lookup", {"keys": keys})
                out[who].append(time.perf_counter() - t)
                want = "hit" if who == "hits" else "miss"
                assert r.json()["results"] == [want] * 32, r.text
    return {
        "keys": 32,
        "seconds": out,
        "misses_p50_ms": 1000 * statistics.median(out["misses"]),
        "misses_again_p50_ms": 1000 * statistics.median(out["misses_again"]),
        "hits_p50_ms": 1000 * statistics.median(out["hits"]),
    }


def replay_part(rgw: RadosGateway, workdir: Path, num_blocks: int, limit: int) -> dict[str, Any]:
    """(c): two nodes sharing a bucket vs the same two nodes without it."""
    requests = harness.read_trace(limit=limit)
    bucket = make_bucket(rgw)
    pool_flags = ("--num-blocks", str(num_blocks), "--block-bytes", str(REPLAY_BLOCK_BYTES))
    object_flags = (
        "--object-bucket",
        bucket,
        "--object-endpoint",
        rgw.endpoint,
        "--object-region",
        rgw.region,
        "--object-lookup-timeout-s",
        "0.5",
    )
    out: dict[str, Any] = {"trace": harness.TRACE.name, "num_blocks": num_blocks}
    for mode in ("shared", "alone"):
        extra = pool_flags + (object_flags if mode == "shared" else ())
        servers = [
            http_bench.start_kvoffload(workdir, None, f"{mode}-{n}", extra=extra) for n in range(2)
        ]
        try:
            if mode == "shared":
                for server in servers:
                    wait_ok(server)
            out[mode] = replay_nodes(servers, requests, f"{mode}-{secrets.token_hex(3)}", "object")
            if mode == "shared":
                tiers = []
                for server in servers:
                    with KVOffloadAdminClient(f"http://{HOST}:{server.admin_port}") as admin:
                        tiers.append(admin.stats()["tiers"]["object"])
                out[mode]["object"] = [
                    {
                        "written": t["written"],
                        "bytes_read": t["counters"]["bytes_read"],
                        "gets": t["counters"]["gets"],
                        "checksum_failures": t["counters"]["checksum_failures"],
                        "dropped": t["queue"]["dropped"],
                    }
                    for t in tiers
                ]
        finally:
            for server in servers:
                harness.stop_server(server.proc)
    out["ratio"] = out["shared"]["hit_ratio"] / out["alone"]["hit_ratio"]
    return out


def wait_ok(server: http_bench.Server, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    with KVOffloadAdminClient(f"http://{HOST}:{server.admin_port}") as admin:
        while admin.stats()["tiers"]["object"]["state"] != "ok":
            if time.monotonic() > deadline:
                raise RuntimeError("the object tier did not become ok")
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--parts",
        default="ab,c,d,e",
        help="ab (onload, demotion), c (two nodes), d (layout), e (a miss's cost)",
    )
    ap.add_argument("--mib", type=int, default=32, help="MiB per timed call (a, b)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=16, help="the tier's and the raw client's")
    ap.add_argument("--replay-blocks", type=int, default=1024)
    ap.add_argument("--replay-requests", type=int, default=1000)
    ap.add_argument("--quick", action="store_true", help="8 MiB, 2 reps, 200 requests")
    ap.add_argument("--out", default=str(harness.RESULTS_DIR / "object_tier.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.mib, args.reps, args.replay_requests = 8, 2, 200
    parts = set(args.parts.split(","))
    record: dict[str, Any] = {
        "bench": "object_tier",
        "machine": harness.machine(),
        "args": vars(args),
    }
    with tempfile.TemporaryDirectory(prefix="kvoffload-object-bench-") as tmp:
        rgw = RadosGateway(Path(tmp) / "rgw").start()
        os.environ["AWS_ACCESS_KEY_ID"] = rgw.access_key
        os.environ["AWS_SECRET_ACCESS_KEY"] = rgw.secret_key
        record["gateway"] = {"store": rgw.store, "start_s": rgw.timings.get("first_put")}
        try:
            if "ab" in parts:
                rows = [
                    asyncio.run(size_part(rgw, b, args.mib, args.reps, args.concurrency))
                    for b in BLOCK_SIZES
                ]
                record["sizes"] = rows
                print_sizes(rows, args.mib)
            if "d" in parts:
                record["layout"] = layout_part(rgw, args.mib, args.reps, args.concurrency)
                print_layout(record["layout"])
            if "e" in parts:
                record["lookups"] = asyncio.run(lookup_part(rgw, args.reps))
                lk = record["lookups"]
                print(
                    f"\n(e) lookup of 32 keys, p50: {lk['misses_p50_ms']:.2f} ms when the "
                    f"bucket is asked (none there), {lk['misses_again_p50_ms']:.2f} ms for the "
                    f"same misses again (negative cache), {lk['hits_p50_ms']:.2f} ms when the "
                    "pool holds them"
                )
            if "c" in parts:
                record["replay"] = replay_part(
                    rgw, Path(tmp), args.replay_blocks, args.replay_requests
                )
                print_replay(record["replay"])
        finally:
            rgw.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")
    return 0


def print_sizes(rows: list[dict[str, Any]], mib: int) -> None:
    print(f"\n(a, b) {mib} MiB per call; GB/s medians; ratio = median of per-repetition ratios")
    print("   block | raw GET  onload  ratio >=0.8 | raw PUT  demotion  ratio >=0.8")
    for r in rows:
        print(
            f"{r['block_bytes'] >> 10:>5} KiB | {r['raw_get_gbps']:7.3f} {r['onload_gbps']:7.3f}"
            f" {r['onload_ratio']:6.2f} {'pass' if r['onload_ratio'] >= TARGET else 'FAIL':>5} |"
            f" {r['raw_put_gbps']:7.3f} {r['demote_gbps']:9.3f} {r['demote_ratio']:6.2f}"
            f" {'pass' if r['demote_ratio'] >= TARGET else 'FAIL':>5}"
        )


def print_layout(rec: dict[str, Any]) -> None:
    print(
        f"\n(d) {rec['blocks']} blocks of 256 KiB, raw client, GB/s medians; ratio to one object "
        "per block, median of per-repetition ratios"
    )
    print(
        f"  PUT: one object per block {rec['put_each_gbps']:.3f}, packed by "
        f"{rec['blocks_per_pack']} {rec['put_packed_gbps']:.3f} ({rec['put_packed_vs_each']:.2f}x)"
    )
    print(
        f"  GET: one object per block {rec['get_each_gbps']:.3f}, whole packs "
        f"{rec['get_packed_gbps']:.3f} ({rec['get_packed_vs_each']:.2f}x), blocks as ranges "
        f"of packs {rec['get_ranges_gbps']:.3f} ({rec['get_ranges_vs_each']:.2f}x)"
    )


def print_replay(part: dict[str, Any]) -> None:
    shared, alone = part["shared"], part["alone"]
    read = sum(t["bytes_read"] for t in shared["object"])
    print(
        f"\n(c) {shared['requests']} requests of {part['trace']} over two nodes of "
        f"{part['num_blocks']} blocks: hit ratio {shared['hit_ratio']:.3f} sharing a bucket "
        f"({shared['remote_hits']} blocks from it, {read / 1e6:.1f} MB read) against "
        f"{alone['hit_ratio']:.3f} alone ({part['ratio']:.2f}x)"
    )


if __name__ == "__main__":
    sys.exit(main())
