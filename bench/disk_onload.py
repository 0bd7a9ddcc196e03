"""Disk onload at an engine's call size (issue #46, part 1): the engine's view against the
device's best plain reader, in the same rounds, with CPU seconds per GB and a time breakdown.

A real ``kvoffload serve`` (CPU, a pool of ``--pool-blocks``, a disk tier under ``--dir``) holds
``--blocks`` blocks of ``--block-kib`` KiB of random bytes on disk only (offloaded, then demoted
out of the pool before every call). An engine-like client (``KVOffloadClient`` with a registered
shm KV cache) onloads them in calls of N blocks (``--calls``, default 16 and 64); a call is timed
from the ``onload`` request to ``wait_jobs`` answering that its job is done, i.e. the bytes are
in the engine's cache.

The baseline, in the same round, alternating order with the onloads: the best plain reader of
the same number of bytes from a file of its own on the same filesystem, each the faster of

- ``seq``: one thread, ``O_DIRECT``, one ``preadv`` per block, in order;
- ``4x``: four threads, ``O_DIRECT``, one ``preadv`` per block;

both into private anonymous memory on huge pages (where THP allows), the buffers a reader would
choose. Ratio per round: reader seconds / onload seconds for the round's calls; the table gives
the median over rounds of each run and the median over ``--runs`` runs (fresh servers). CPU
s/GB: the server's CPU time (``/proc``, to the nanosecond) over the round's onloads, and the
reader's own CPU time.

``--breakdown`` runs the server under a shim that timestamps the stages of each onload inside
the server (the read system calls, the MAC checks and copies into pool slots, the promotion's
end, the copy to the engine's cache, the job's collection, the waiter's answer) and prints
where a call's time goes: median milliseconds from the call's start at which each stage starts
and ends, its summed time (stages overlap) and its summed CPU time. The shim wraps the
server's functions by name; a stage it cannot find is left out and named.

Run: ``.venv/bin/python bench/disk_onload.py`` (``--quick``: one run of 3 rounds; add
``--breakdown``). Writes ``bench/results/disk_onload.json``. Targets (#46): onload >= 0.8x the
best plain reader at 16 and 64 blocks a call, and >= 2x the 16-block GB/s of 7b6bdc3.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import mmap
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvoffload_client.client import KVOffloadClient  # noqa: E402

from bench import harness  # noqa: E402
from testsupport import procfs  # noqa: E402
from testsupport.server import ServerProcess  # noqa: E402
from testsupport.shm_device import ShmDevice  # noqa: E402
from transfer.disk import disk_bytes_for  # noqa: E402

KiB = 1 << 10
TARGET = 0.8
SPANS_ENV = "DISK_ONLOAD_SPANS"
#: Stages the breakdown shim times: (module, class or None, function, stage, coroutine?).
STAGES: tuple[tuple[str, str | None, str, str, bool], ...] = (
    ("app.core.transfers", "Transfers", "onload", "onload handler", False),
    ("transfer.disk", "DiskStore", "submit_reads", "reads submitted", False),
    ("os", None, "preadv", "read syscalls", False),
    ("transfer.disk_reads", "DiskReads", "_read_run", "read runs", False),
    ("transfer.disk_reads", "DiskReads", "_check_run", "MAC checks + pool copy", False),
    ("app.core.promotion", "Promotions", "_settle", "promotion settled", True),
    ("transfer.cpu_worker", "CpuTransferWorker", "_execute", "copy to engine cache", False),
    ("app.core.background", "CompletionPump", "report_finished", "completion reported", False),
    ("app.telemetry.observer", "Observer", "transfer_done", "job observed", False),
    ("app.core.transfers", "Transfers", "collect", "job collected", False),
    ("app.core.transfers", "Transfers", "wait", "wait_jobs handler", True),
)


# --------------------------------------------------------------------------- the shim


def serve_with_spans(argv: list[str]) -> int:
    """``kvoffload serve`` with the stages in ``STAGES`` timestamped; on SIGUSR1 the spans
    (stage, start, end in ``time.perf_counter``, the same clock as the client's, and the
    thread's CPU seconds in between) are written as JSON to the file named by
    ``$DISK_ONLOAD_SPANS``."""
    import importlib

    spans: list[tuple[str, float, float, float]] = []
    missing: list[str] = []

    def timed(f: Callable[..., Any], stage: str, is_async: bool) -> Callable[..., Any]:
        if is_async:

            @functools.wraps(f)
            async def run_async(*a: Any, **k: Any) -> Any:
                t = time.perf_counter()
                try:
                    return await f(*a, **k)
                finally:  # a coroutine's CPU is not its thread's between awaits: not counted
                    spans.append((stage, t, time.perf_counter(), 0.0))

            return run_async

        @functools.wraps(f)
        def run(*a: Any, **k: Any) -> Any:
            t, cpu = time.perf_counter(), time.thread_time()
            try:
                return f(*a, **k)
            finally:
                spans.append((stage, t, time.perf_counter(), time.thread_time() - cpu))

        return run

    for module, cls, name, stage, is_async in STAGES:
        owner: Any = importlib.import_module(module)
        if cls is not None:
            owner = getattr(owner, cls, None)
        f = getattr(owner, name, None) if owner is not None else None
        if f is None:
            missing.append(stage)
            continue
        setattr(owner, name, timed(f, stage, is_async))

    def dump(*_: object) -> None:
        record = {"spans": list(spans), "missing": missing}
        Path(os.environ[SPANS_ENV]).write_text(json.dumps(record))

    signal.signal(signal.SIGUSR1, dump)
    from app.cli import main

    return main(argv)


# --------------------------------------------------------------------------- readers


def huge_buffer(nbytes: int) -> mmap.mmap:
    """Private anonymous memory, on transparent huge pages where the kernel allows."""
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with suppress(OSError):
            buf.madvise(mmap.MADV_HUGEPAGE)
    buf.write(b"\1" * nbytes)  # faulted in before any timed read
    return buf


class Readers:
    """The plain readers of a file of their own: ``seq`` and ``4x`` (module docstring)."""

    def __init__(self, directory: Path, blocks: int, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.blocks = blocks
        self.path = directory / "plain-reader.bin"
        with self.path.open("wb") as fh:
            for _ in range(blocks):
                fh.write(os.urandom(block_bytes))
            fh.flush()
            os.fsync(fh.fileno())
        self.buf = huge_buffer(blocks * block_bytes)
        self.views = [
            memoryview(self.buf)[i * block_bytes : (i + 1) * block_bytes] for i in range(blocks)
        ]
        self.pool = concurrent.futures.ThreadPoolExecutor(4)

    def read(self, kind: str, first: int, count: int) -> None:
        """Read blocks ``first .. first + count`` (``kind``: ``seq`` or ``4x``)."""
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
        bb = self.block_bytes
        try:

            def one(i: int) -> None:
                if os.preadv(fd, [self.views[i]], i * bb) != bb:
                    raise OSError("short read")

            if kind == "seq":
                for i in range(first, first + count):
                    one(i)
            else:
                list(self.pool.map(one, range(first, first + count)))
        finally:
            os.close(fd)

    def close(self) -> None:
        self.pool.shutdown()
        for v in self.views:
            v.release()
        self.buf.close()
        self.path.unlink(missing_ok=True)


# --------------------------------------------------------------------------- the service


@contextmanager
def serving(args: argparse.Namespace, work: Path, spans: Path | None) -> Iterator[ServerProcess]:
    block_bytes = args.block_kib * KiB
    srv = ServerProcess(
        work,
        *("--num-blocks", str(args.pool_blocks), "--block-bytes", str(block_bytes)),
        *("--disk-dir", str(work / "disk"), "--disk-admit-after", "1"),
        *("--disk-bytes", str(disk_bytes_for(4 * args.blocks, block_bytes))),
        *args.serve_arg,
        env=None if spans is None else {SPANS_ENV: str(spans)},
    )
    if spans is not None:
        at = srv.argv.index("-m")
        srv.argv[at : at + 2] = [str(Path(__file__).resolve()), "--serve-with-spans"]
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


class Engine:
    """The client side: a registered shm cache the size of the largest call, and the keys."""

    def __init__(self, srv: ServerProcess, blocks: int, block_bytes: int, device: int) -> None:
        self.client = KVOffloadClient(srv.url)
        self.dev = ShmDevice(device, block_bytes)
        self.cache = self.client.register_kv_cache(self.dev.spec()).cache_id
        self.client.start_request("bench")
        self.keys = [os.urandom(16) for _ in range(blocks)]
        self.data: dict[bytes, bytes] = {}
        for at in range(0, blocks, device):
            chunk = self.keys[at : at + device]
            for i, key in enumerate(chunk):
                self.data[key] = os.urandom(block_bytes)
                self.dev.write(i, self.data[key])
            self.wait(self.client.offload("bench", self.cache, chunk, list(range(len(chunk)))))

    def wait(self, started: Any) -> None:
        waited = self.client.wait_jobs([started.job_id], timeout_s=60)
        if not waited.done or waited.jobs[0].state != "done":
            raise RuntimeError(f"job did not end done: {waited}")

    def to_disk_only(self, keys: list[bytes]) -> None:
        """Demote ``keys`` out of the pool and wait until every one looks up ``disk``."""
        deadline = time.monotonic() + 30
        while True:
            self.client.demote("bench", keys)
            if set(self.client.lookup("bench", keys).results) == {"disk"}:
                return
            if time.monotonic() > deadline:
                raise RuntimeError("blocks not on disk only after 30 s")
            time.sleep(0.05)

    def onload(self, keys: list[bytes]) -> tuple[float, float]:
        """One timed onload call; (start, end) in ``time.perf_counter``. Checks the bytes."""
        t0 = time.perf_counter()
        started = self.client.onload("bench", self.cache, keys, list(range(len(keys))))
        if started.job_id is not None:
            self.wait(started)
        t1 = time.perf_counter()
        for i in (0, len(keys) - 1):
            if self.dev.read(i) != self.data[keys[i]]:
                raise RuntimeError("onloaded bytes differ from the offloaded ones")
        return t0, t1

    def close(self) -> None:
        self.client.close()
        self.dev.close()


# --------------------------------------------------------------------------- one run


def one_run(args: argparse.Namespace, call: int, base: Path, breakdown: bool) -> dict[str, Any]:
    """A fresh server; ``--rounds`` rounds of the blocks onloaded ``call`` at a time, each round
    with both plain readers in alternating order."""
    block_bytes = args.block_kib * KiB
    work = Path(tempfile.mkdtemp(prefix="disk-onload-", dir=base))
    spans_file = work / "spans.json" if breakdown else None
    readers = Readers(work, args.blocks, block_bytes)
    rounds: list[dict[str, float]] = []
    calls: list[tuple[float, float]] = []
    try:
        with serving(args, work, spans_file) as srv:
            engine = Engine(srv, args.blocks, block_bytes, max(call, 16))
            assert srv.proc is not None
            pid = srv.proc.pid
            try:
                for r in range(args.rounds + 1):  # round 0 warms up, untimed
                    row: dict[str, float] = {}
                    order = ["tier", "seq", "4x"] if r % 2 else ["seq", "4x", "tier"]
                    for part in order:
                        if part == "tier":
                            tier_s, cpu_s = 0.0, 0.0
                            for at in range(0, args.blocks, call):
                                keys = engine.keys[at : at + call]
                                engine.to_disk_only(keys)
                                cpu0 = procfs.proc_run_seconds(pid)
                                t0, t1 = engine.onload(keys)
                                cpu_s += procfs.proc_run_seconds(pid) - cpu0
                                tier_s += t1 - t0
                                if r:
                                    calls.append((t0, t1))
                            row["tier_s"], row["tier_cpu_s"] = tier_s, cpu_s
                        else:
                            reader_s, cpu = 0.0, time.process_time()
                            for at in range(0, args.blocks, call):
                                t0 = time.perf_counter()
                                readers.read(part, at, min(call, args.blocks - at))
                                reader_s += time.perf_counter() - t0
                            row[f"{part}_s"] = reader_s
                            row[f"{part}_cpu_s"] = time.process_time() - cpu
                    if r:
                        rounds.append(row)
                spans = None
                if spans_file is not None:
                    os.kill(pid, signal.SIGUSR1)
                    deadline = time.monotonic() + 10
                    while not spans_file.exists() and time.monotonic() < deadline:
                        time.sleep(0.05)
                    spans = json.loads(spans_file.read_text())
            finally:
                engine.close()
    finally:
        readers.close()
    gb = args.blocks * block_bytes / 1e9
    per_round = []
    for row in rounds:
        best = min(row["seq_s"], row["4x_s"])
        per_round.append(
            {
                **row,
                "ratio": best / row["tier_s"],
                "tier_gbps": gb / row["tier_s"],
                "best_gbps": gb / best,
                "tier_cpu_s_per_gb": row["tier_cpu_s"] / gb,
            }
        )
    out: dict[str, Any] = {"call_blocks": call, "rounds": per_round}
    for k in ("ratio", "tier_gbps", "best_gbps", "tier_cpu_s_per_gb"):
        out[k] = statistics.median(p[k] for p in per_round)
    for k in ("seq", "4x"):
        out[f"{k}_gbps"] = statistics.median(gb / row[f"{k}_s"] for row in rounds)
        out[f"{k}_cpu_s_per_gb"] = statistics.median(row[f"{k}_cpu_s"] / gb for row in rounds)
    if spans is not None:
        out["breakdown"] = stage_table(spans, calls)
    return out


def stage_table(record: dict[str, Any], calls: list[tuple[float, float]]) -> dict[str, Any]:
    """Per stage: the median over calls of when it first started and last ended (ms from the
    call's start), of its summed time and of its summed CPU time (its threads'; 0 for a
    coroutine); the calls' own median length."""
    spans = record["spans"]
    table: dict[str, dict[str, list[float]]] = {}
    for t0, t1 in calls:
        mine = [s for s in spans if t0 <= s[1] <= t1]
        for stage in dict.fromkeys(s[0] for s in mine):
            of = [s for s in mine if s[0] == stage]
            row = table.setdefault(
                stage, {"start": [], "end": [], "sum": [], "cpu": [], "count": []}
            )
            row["start"].append((min(s[1] for s in of) - t0) * 1e3)
            row["end"].append((max(s[2] for s in of) - t0) * 1e3)
            row["sum"].append(sum(s[2] - s[1] for s in of) * 1e3)
            row["cpu"].append(sum(s[3] for s in of) * 1e3)
            row["count"].append(len(of))
    order = [stage for _, _, _, stage, _ in STAGES]
    stages = {
        stage: {k: statistics.median(v) for k, v in table[stage].items()}
        for stage in order
        if stage in table
    }
    call_ms = statistics.median((t1 - t0) * 1e3 for t0, t1 in calls)
    return {"call_ms": call_ms, "stages": stages, "missing": record["missing"]}


# --------------------------------------------------------------------------- main


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-with-spans":
        sys.exit(serve_with_spans(sys.argv[2:]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", default="16,64", help="blocks per onload call, comma-separated")
    ap.add_argument("--blocks", type=int, default=64, help="blocks on disk, onloaded per round")
    ap.add_argument("--block-kib", type=int, default=1024)
    ap.add_argument("--pool-blocks", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3, help="fresh servers per call size")
    ap.add_argument("--breakdown", action="store_true", help="time the stages inside the server")
    ap.add_argument("--dir", default=str(Path(__file__).resolve().parent / ".disk-bench"))
    ap.add_argument("--serve-arg", action="append", default=[], help="extra serve argument")
    ap.add_argument("--quick", action="store_true", help="one run of 3 rounds")
    ap.add_argument("--out", default=str(harness.RESULTS_DIR / "disk_onload.json"))
    args = ap.parse_args()
    if args.quick:
        args.runs, args.rounds = 1, 3
    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"machine": harness.machine(), "args": vars(args), "calls": []}
    print(
        f"{'call':>5} {'run':>4} {'onload GB/s':>12} {'best reader':>12} {'seq':>6} {'4x':>6} "
        f"{'ratio':>6} {'CPU s/GB':>9} {'reader CPU s/GB':>16}"
    )
    for call in (int(c) for c in args.calls.split(",")):
        runs = []
        for run in range(args.runs):
            r = one_run(args, call, base, args.breakdown and run == 0)
            runs.append(r)
            reader_cpu = min(r["seq_cpu_s_per_gb"], r["4x_cpu_s_per_gb"])
            print(
                f"{call:>5} {run + 1:>4} {r['tier_gbps']:>12.2f} {r['best_gbps']:>12.2f} "
                f"{r['seq_gbps']:>6.2f} {r['4x_gbps']:>6.2f} {r['ratio']:>5.2f}x "
                f"{r['tier_cpu_s_per_gb']:>9.2f} {reader_cpu:>16.2f}"
            )
        summary = {
            k: statistics.median(r[k] for r in runs)
            for k in ("ratio", "tier_gbps", "best_gbps", "tier_cpu_s_per_gb")
        }
        print(
            f"{call:>5} {'med':>4} {summary['tier_gbps']:>12.2f} {summary['best_gbps']:>12.2f} "
            f"{'':>6} {'':>6} {summary['ratio']:>5.2f}x {summary['tier_cpu_s_per_gb']:>9.2f}"
            f"   target >= {TARGET}x: {'met' if summary['ratio'] >= TARGET else 'NOT met'}"
        )
        results["calls"].append({"call_blocks": call, "runs": runs, **summary})
        for r in runs:
            if "breakdown" in r:
                print_breakdown(call, r["breakdown"])
    harness.write_results(Path(args.out), results)


def print_breakdown(call: int, b: dict[str, Any]) -> None:
    print(f"\nwhere a {call}-block onload's time goes (median ms from the call's start):")
    print(f"{'stage':<24} {'starts':>7} {'ends':>7} {'summed':>7} {'CPU':>7} {'count':>6}")
    for stage, row in b["stages"].items():
        print(
            f"{stage:<24} {row['start']:>7.2f} {row['end']:>7.2f} {row['sum']:>7.2f} "
            f"{row['cpu']:>7.2f} {row['count']:>6.0f}"
        )
    print(f"{'the call (engine view)':<24} {0:>7.2f} {b['call_ms']:>7.2f}")
    if b["missing"]:
        print(f"(stages not found in this tree: {', '.join(b['missing'])})")
    print()


if __name__ == "__main__":
    main()
