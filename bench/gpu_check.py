"""GPU check of the CUDA transfer backend: correctness, CUDA IPC, bandwidth, and failure paths.

On a CUDA machine, in this order (each section's outcome is written to the JSON as soon as it
is known, so a crash or the watchdog still leaves what was measured). Each section runs under
its own time cap; one that raises or runs past its cap is reported (``ERROR``) and the next one
runs. Every gated figure is a row of one table: ``PASS``, ``FAIL``, ``ERROR``, ``SKIP`` (could
not be checked on this machine: never a pass) or ``INFO`` (measured, not gated).

1. ``correctness``: a pinned pool and a mixed CUDA cache (4 tensors, fp16/bf16/fp32/int8,
   block_dim 0, 1 and 2) registered in-process; store random blocks to random slots and check
   every host byte, then load them into other blocks and check every device byte. Run with the
   default staging buffer, with a tiny one (many chunks), and with torch copies instead of the
   raw ``cudaMemcpyAsync`` path.
2. ``ipc``: a child process (``testsupport/ipc_child.py``) allocates the cache and exports it
   by CUDA IPC handle; the service side registers it from the JSON body, stores and loads, and
   the child checks the loaded bytes in its own memory. Then the ordering: the child queues
   half a second of GPU sleep and a write of new bytes on a stream of its own, records an
   interprocess event and at once asks for a store. With the event as ``wait_event`` every
   stored block must hold the new bytes (gated); without it the stale blocks are counted
   (INFO: the race the event closes, proof that the gate can fail).
3. ``bandwidth``: D2H (store) and H2D (load) GB/s of whole-cache jobs, device blocks in random
   order and host slots in runs or scattered, against one plain copy of the same bytes between
   a pinned buffer and the GPU. Medians of several repetitions. Gated (>= 0.85x): 2 MiB blocks
   of 4 tensors, and two vLLM-like layouts, bf16 ``[2, N, 16, H, 128]`` per layer with
   block_dim 1: ``vllm80`` (80 layers, H = 4: Llama-70B's at tensor parallel 2, a 2.5 MiB
   block, the closest to 2 MiB 80 such tensors allow) and ``vllm32`` (32 layers, H = 8:
   Llama-8B's, exactly 2 MiB). Other block sizes are INFO rows.
4. ``concurrent``: a store and a load of 512 MiB each submitted together vs each alone;
   gated: both succeed and together move bytes at >= 0.85x the faster one alone.
5. ``small_jobs``: 1-block jobs (64 KiB) one at a time, submit to result: p50 and p99
   (gated: p99 <= 5 ms), and a burst of 1000 (jobs/s, INFO).
6. ``deadline``: a job whose deadline passes with its DMA in flight fails ``"deadline"`` and is
   reported only once its streams are idle (nothing freed under the DMA); a shutdown with
   copies in flight waits for them before saying ``quiesced`` (only then is the pool unpinned).
7. ``engine_killed``: an engine process (``bench/gpu_engine_child.py``) exports a 4 GiB CUDA
   cache; it is registered with ``lease_s`` (registry and CUDA worker, driven as the service's
   lease loop drives them: the device image lacks the HTTP stack), offloads are started, and
   the engine is SIGKILLed mid-copy. Gated: the lease lapses and the registration is gone,
   every job ends, ``torch.cuda.mem_get_info`` shows the engine's memory freed, and the worker
   still stores an in-process cache's bytes right (or, had a sticky CUDA error been seen,
   refuses for the service to restart).
8. ``remap``: with two or more GPUs, an engine started with ``CUDA_VISIBLE_DEVICES`` reordered
   registers its ``cuda:0`` by ``device_uuid``: the service must open it on its own GPU 1 and
   store the right bytes, and must refuse the same handle named ``cuda:0`` without the UUID.
   With one GPU: SKIP.
9. ``pool_registration``: time to allocate and to pin (``cudaHostRegister``) a 64 GiB pool;
   when available memory or ``/dev/shm`` cannot hold 64 GiB (or the section's time cap would
   not allow it), a smaller pool, said so, with the time scaled to 64 GiB. Gated: the pool is
   pinned, and 64 GiB pin in <= 60 s.
10. ``cuda_tests``: ``pytest -m gpu tests/transfer`` in a child process.

Prints one table, writes ``bench/results/gpu_check.json`` (``--out``); exits 0 when no row
failed or errored (``--strict``: and none was skipped), 1 otherwise, and 2 with one line when
no CUDA device is visible (a device run never passes vacuously). Meant to finish in under eight
minutes on one H200; ``--budget`` seconds (470) stop it (partial results written).

Run with a Python whose torch has CUDA, from the repository root: ``python3 bench/gpu_check.py``
(``--quick`` for a smaller run, ``--shm-dir`` for the pools when ``/dev/shm`` is small,
``--strict`` to fail on a skipped check). It needs torch and this repository only (no
service dependencies): the repository's ``.venv`` holds a CPU torch where there is no GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import functools
import gc
import hashlib
import json
import math
import os
import platform
import random
import select
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

with warnings.catch_warnings():
    # CPU-only torch wheels warn when NumPy is absent; nothing here uses NumPy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch

from bench import harness  # noqa: E402
from bench.gpu_engine_child import pattern_byte  # noqa: E402
from testsupport import ipc_child  # noqa: E402
from testsupport.kvref import MIXED_LAYOUT, bytes_per_block, host_block, shapes  # noqa: E402
from transfer import HostPool, KVCacheRegistry, KVCacheSpec, TransferJob  # noqa: E402
from transfer.worker import Direction  # noqa: E402

OUT_DEFAULT = harness.RESULTS_DIR / "gpu_check.json"
TARGET = 0.85
SMALL_JOB_P99_MS = 5.0
POOL_GIB = 64
POOL_PIN_TARGET_S = 60.0
Layout = Sequence[tuple[list[int], str, int]]  # (shape, dtype, block_dim) per tensor

REPORT: dict[str, Any] = {"benchmark": "gpu_check", "sections": {}}
OUT_PATH = OUT_DEFAULT
SHM_DIR = Path("/dev/shm")
STATUSES = ("PASS", "FAIL", "ERROR", "SKIP", "INFO")


# -------------------------------------------------------------------- rows, table, verdict


@dataclass(frozen=True)
class Row:
    """One line of the table: a gated figure (PASS / FAIL), a section that broke (ERROR), a
    check this machine cannot make (SKIP, never a pass) or a figure shown only (INFO)."""

    section: str
    what: str
    measured: str
    target: str
    status: str

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")


def gate(section: str, what: str, measured: str, target: str, ok: bool) -> Row:
    return Row(section, what, measured, target, "PASS" if ok else "FAIL")


def info(section: str, what: str, measured: str) -> Row:
    return Row(section, what, measured, "-", "INFO")


def error_row(section: str, what: str, exc: BaseException) -> Row:
    """What broke, in the table: the exception's first line, cut to 100 characters."""
    first = (f"{type(exc).__name__}: {exc}".splitlines() or [type(exc).__name__])[0]
    return Row(section, what, first[:100], "runs", "ERROR")


def format_table(rows: Sequence[Row]) -> str:
    """The rows as one fixed-width text table."""
    head = ("section", "check", "measured", "target", "result")
    cells = [head, *[(r.section, r.what, r.measured, r.target, r.status) for r in rows]]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(head))).rstrip() for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def verdict(rows: Sequence[Row], *, strict: bool = False) -> tuple[int, str]:
    """(exit code, one summary line). 1 when a row failed or errored, when nothing was gated
    at all (a run that checked nothing must not pass), or with ``strict`` when one was skipped;
    else 0. A skipped row never counts as a pass."""
    count = {s: sum(r.status == s for r in rows) for s in STATUSES}
    parts = [f"{count[s]} {s.lower()}" for s in ("PASS", "FAIL", "ERROR", "SKIP") if count[s]]
    summary = ", ".join(parts) or "nothing checked"
    skipped = [f"{r.section}: {r.what}" for r in rows if r.status == "SKIP"]
    if count["FAIL"] or count["ERROR"]:
        return 1, f"gpu_check: SOME CHECKS FAILED ({summary})"
    if not count["PASS"]:
        return 1, f"gpu_check: FAIL: no target was checked ({summary})"
    if skipped and strict:
        return 1, f"gpu_check: FAIL (--strict): not checked: {'; '.join(skipped)}"
    tail = f"; NOT checked (no pass): {'; '.join(skipped)}" if skipped else ""
    return 0, f"gpu_check: every checked target met ({summary}){tail}"


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) by nearest rank (values need not be sorted)."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q * len(ordered) - 1e-9)))
    return ordered[rank - 1]


def pool_size_for(
    want: int, available: int | None, shm_free: int | None, unit: int = 1 << 30
) -> tuple[int, str | None]:
    """The pool to time: ``want`` bytes when memory (at most 3/4 of what is available) and
    ``/dev/shm`` (at most 9/10 of its free space) allow, else the largest multiple of ``unit``
    that fits, with a note saying why it is smaller (0: nothing fits)."""
    limits = []
    if available is not None:
        limits.append((available * 3 // 4, f"available memory {available >> 20} MiB"))
    if shm_free is not None:
        limits.append((shm_free * 9 // 10, f"/dev/shm free {shm_free >> 20} MiB"))
    size, note = want, None
    for cap, why in limits:
        if cap < size:
            size, note = cap // unit * unit, f"scaled from {want >> 30} GiB: {why}"
    return size, note


# -------------------------------------------------------------------- sections, caps, report


class SectionTimeout(Exception):
    """A section ran past its time cap."""


def save() -> None:
    harness.write_results(OUT_PATH, REPORT, quiet=True)


def _on_cap(signum: int, frame: FrameType | None) -> None:
    raise SectionTimeout("section ran past its time cap")


@contextlib.contextmanager
def time_cap(seconds: float) -> Iterator[None]:
    """Raise ``SectionTimeout`` in this (main) thread after ``seconds`` (when Python runs
    again: a CUDA call blocked in C finishes first; the global watchdog covers that)."""
    old = signal.signal(signal.SIGALRM, _on_cap)
    signal.setitimer(signal.ITIMER_REAL, max(0.01, seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_section(
    name: str, fn: Callable[[], dict[str, Any]], cap_s: float, rows: list[Row]
) -> list[Row]:
    """Run one section under ``cap_s``; its rows (or one ERROR row) join ``rows``."""
    print(f"== {name} (cap {cap_s:.0f} s)", flush=True)
    started = time.perf_counter()
    try:
        with time_cap(cap_s):
            result = fn()
        got = [Row(**r) for r in result.pop("rows", [])]
        if not got:
            got = [Row(name, "section", "no figures", "-", "ERROR")]
    except SectionTimeout:
        result = {"error": f"ran past its cap of {cap_s:.0f} s"}
        got = [Row(name, "section", result["error"], f"<= {cap_s:.0f} s", "ERROR")]
    except Exception as exc:
        result = {"error": traceback.format_exc()}
        print(result["error"], flush=True)
        got = [error_row(name, "section", exc)]
    finally:
        with contextlib.suppress(Exception):
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    result["seconds"] = round(time.perf_counter() - started, 3)
    result["rows"] = [asdict(r) for r in got]
    REPORT["sections"][name] = result
    rows.extend(got)
    REPORT["rows"] = [asdict(r) for r in rows]
    save()
    worst = next((s for s in ("ERROR", "FAIL", "SKIP") if any(r.status == s for r in got)), "ok")
    print(f"   {worst} ({result['seconds']} s)", flush=True)
    return got


def rows_of(*rows: Row) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]


# -------------------------------------------------------------------- shared helpers


def layout_for(n: int) -> Layout:
    """The tests' mixed layout (``testsupport.kvref.MIXED_LAYOUT``) with ``n`` blocks."""
    return [
        (shape, dt, bd)
        for shape, (_x, dt, bd) in zip(shapes(MIXED_LAYOUT, n), MIXED_LAYOUT, strict=True)
    ]


def block_bytes(layout: Layout) -> int:
    return sum(bytes_per_block(shape, dt, bd) for shape, dt, bd in layout)


def random_tensors(layout: Layout, seed: int, device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(
            0,
            256,
            (torch.Size(shape).numel() * getattr(torch, dt).itemsize,),
            dtype=torch.uint8,
            generator=gen,
        )
        .view(getattr(torch, dt))
        .view(shape)
        .to(device)
        for shape, dt, _bd in layout
    ]


def new_pool(num_blocks: int, bb: int, **kwargs: Any) -> HostPool:
    """A host pool (a sealed memfd), pinned unless ``pin=False``."""
    return HostPool.create(num_blocks, bb, **kwargs)


def shm_free(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def run_job(worker: Any, job: TransferJob, timeout: float = 60.0) -> Any:
    jid = worker.submit(job)
    results = worker.wait([jid], timeout=timeout)
    if not results:
        raise RuntimeError(f"job {jid} did not finish within {timeout} s")
    return results[0]


def flat_cache(n: int, bb: int, tensors: int = 4, device: str = "cuda:0") -> list[torch.Tensor]:
    """``tensors`` uint8 tensors ``[n, bb / tensors]`` (block_dim 0) on ``device``."""
    inner = bb // tensors
    return [
        torch.empty(n, inner, dtype=torch.uint8, device=device).fill_(i) for i in range(tensors)
    ]


def read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise TimeoutError(f"child sent nothing within {timeout} s")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"child exited (code {proc.poll()})")
    return line


def start_engine(cfg: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Any:
    """``bench/gpu_engine_child.py`` with ``cfg``; (process, its first JSON line)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.gpu_engine_child", json.dumps(dict(cfg))],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=None if env is None else dict(env),
    )
    try:
        hello = json.loads(read_line(proc, 120))
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, hello


def end_engine(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(Exception):
        if proc.poll() is None and proc.stdin is not None:
            proc.stdin.write("exit\n")
            proc.stdin.close()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for f in (proc.stdin, proc.stdout):
        with contextlib.suppress(Exception):
            if f is not None:
                f.close()


# -------------------------------------------------------------------- 1. correctness


def check_round_trip(staging_bytes: int, raw_memcpy: bool) -> dict[str, Any]:
    from transfer.cuda_worker import CudaTransferWorker

    n, slots_n = 96, 128
    layout = layout_for(n)
    bb = block_bytes(layout)
    pool = new_pool(slots_n, bb)
    worker = None
    try:
        registry = KVCacheRegistry(pool)
        tensors = random_tensors(layout, seed=1, device="cuda:0")
        cache = registry.register_tensors("check", tensors, [bd for _s, _d, bd in layout])
        originals = [t.clone() for t in cache.tensors]
        torch.cuda.synchronize()  # an engine finishes writing before it asks to store
        worker = CudaTransferWorker(
            pool, registry, staging_bytes=staging_bytes, raw_memcpy=raw_memcpy
        )
        rng = random.Random(staging_bytes)
        blocks = rng.sample(range(n), 80)
        slots = list(range(3, 43)) + rng.sample(range(50, slots_n), 40)
        r = run_job(worker, TransferJob("store", cache.cache_id, blocks, slots, 60.0))
        bad_store = []
        if r.ok:
            cpu_orig = [o.cpu() for o in originals]
            bad_store = [
                s
                for b, s in zip(blocks, slots, strict=True)
                if not torch.equal(pool.tensor[s], host_block(cpu_orig, layout, b))
            ]
        for t in cache.tensors:
            t.zero_()
        torch.cuda.synchronize()
        targets = rng.sample(range(n), 80)
        r2 = run_job(worker, TransferJob("load", cache.cache_id, targets, slots, 60.0))
        bad_load = []
        if r2.ok:
            torch.cuda.synchronize()
            now = [t.cpu() for t in cache.tensors]
            cpu_orig = [o.cpu() for o in originals]
            bad_load = [
                t
                for t, b in zip(targets, blocks, strict=True)
                if not torch.equal(host_block(now, layout, t), host_block(cpu_orig, layout, b))
            ]
        ok = r.ok and r2.ok and not bad_store and not bad_load
        return {
            "ok": ok,
            "pinned": pool.pinned,
            "raw_memcpy": worker.raw_memcpy,
            "copy_path": worker.copy_path,
            "store": {"ok": r.ok, "reason": r.reason, "bad_slots": bad_store[:5]},
            "load": {"ok": r2.ok, "reason": r2.reason, "bad_blocks": bad_load[:5]},
        }
    finally:
        if worker is not None:
            worker.shutdown()
        pool.close()


def correctness() -> dict[str, Any]:
    from transfer.cuda_worker import DEFAULT_STAGING_BYTES

    ways = {
        "default staging, raw": (DEFAULT_STAGING_BYTES, True),
        "tiny staging, raw": (3000, True),
        "default staging, torch copies": (DEFAULT_STAGING_BYTES, False),
    }
    runs: dict[str, Any] = {}
    rows = []
    for name, (staging, raw) in ways.items():
        try:
            r = runs[name] = check_round_trip(staging, raw)
        except SectionTimeout:
            raise
        except Exception as exc:  # one way failing leaves the others checked
            print(traceback.format_exc(), flush=True)
            runs[name] = {"error": traceback.format_exc()}
            rows.append(error_row("correctness", f"round trip, {name}", exc))
            continue
        rows.append(
            gate(
                "correctness",
                f"round trip, {name}",
                f"{'bytes equal' if r['ok'] else 'MISMATCH'} [{r['copy_path']}, "
                f"{'pinned' if r['pinned'] else 'pageable'}]",
                "every byte",
                r["ok"],
            )
        )
    return {"runs": runs, "rows": rows_of(*rows)}


# -------------------------------------------------------------------- 2. ipc


def ipc() -> dict[str, Any]:
    from transfer.cuda_worker import CudaTransferWorker

    n, slots_n = ipc_child.N, 64
    moved = n // 2
    proc = subprocess.Popen(
        [sys.executable, "-m", ipc_child.__name__],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    pool = registry = worker = None
    try:
        spec = json.loads(read_line(proc, 60))["spec"]
        handle_keys = sorted(spec["tensors"][0]["handle"])
        layout = [(t["shape"], t["dtype"], t["block_dim"]) for t in spec["tensors"]]
        pool = new_pool(slots_n, block_bytes(layout))
        registry = KVCacheRegistry(pool)
        cache = registry.register(KVCacheSpec.from_dict(spec))
        worker = CudaTransferWorker(pool, registry)
        rng = random.Random(5)
        blocks = rng.sample(range(n), moved)
        slots = rng.sample(range(slots_n), moved)
        # What the child holds, read through the IPC mapping, before anything moves.
        before = [t.cpu() for t in cache.tensors]
        r = run_job(worker, TransferJob("store", cache.cache_id, blocks, slots, 60.0))
        bad_store = [
            s
            for b, s in zip(blocks, slots, strict=True)
            if not torch.equal(pool.tensor[s], host_block(before, layout, b))
        ]
        targets = rng.sample(range(n), moved)
        r2 = run_job(worker, TransferJob("load", cache.cache_id, targets, slots, 60.0))
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"op": "digest", "blocks": targets}) + "\n")
        proc.stdin.flush()
        digests = json.loads(read_line(proc, 60))["digests"]
        want = [hashlib.sha256(bytes(pool.tensor[s].tolist())).hexdigest() for s in slots]
        bad_load = [t for t, d, w in zip(targets, digests, want, strict=True) if d != w]
        order = ordering(proc, worker, pool, cache.cache_id, blocks, slots)
        # Let go of the child's memory before the child exits.
        worker.shutdown()
        registry.close()
        del cache, before
        torch.cuda.synchronize()
        ok = r.ok and r2.ok and not bad_store and not bad_load
        row = gate(
            "ipc",
            "store + load through a CUDA IPC handle",
            f"store {'ok' if r.ok else r.reason}, load {'ok' if r2.ok else r2.reason}, "
            f"{len(bad_store)} bad slots, {len(bad_load)} bad blocks seen by the engine",
            "every byte",
            ok,
        )
        return {
            "handle_fields": handle_keys,
            "store": {"ok": r.ok, "reason": r.reason, "bad_slots": bad_store[:5]},
            "load": {"ok": r2.ok, "reason": r2.reason, "bad_blocks_seen_by_child": bad_load[:5]},
            "ordering": order["fresh"],
            "rows": rows_of(row, *order["rows"]),
        }
    finally:
        if worker is not None:
            worker.shutdown()
        if registry is not None:
            registry.close()
        if pool is not None:
            pool.close()
        try:
            if proc.stdin is not None:
                proc.stdin.write('{"op": "exit"}\n')
                proc.stdin.close()
            proc.wait(timeout=30)
        except Exception:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


ORDER_SLEEP_CYCLES = 1_000_000_000  # about half a second of GPU time before the writes


def ordering(
    proc: subprocess.Popen[str],
    worker: Any,
    pool: HostPool,
    cache_id: str,
    blocks: list[int],
    slots: list[int],
) -> dict[str, Any]:
    """A store asked while the engine's writes still run: with the engine's ``wait_event``
    it must copy the new bytes (gated); without it, what it copies is the race the event
    closes (INFO: the stale blocks show that the check can fail)."""
    assert proc.stdin is not None
    fresh: dict[str, dict[str, Any]] = {}
    for name, with_event, value in (("without", False, 0x5A), ("with", True, 0xA5)):
        op = {"op": "write_after", "cycles": ORDER_SLEEP_CYCLES, "value": value}
        proc.stdin.write(json.dumps(op) + "\n")
        proc.stdin.flush()
        handle = bytes.fromhex(json.loads(read_line(proc, 60))["event"])
        job = TransferJob(
            "store", cache_id, blocks, slots, 60.0, wait_event=handle if with_event else None
        )
        r = run_job(worker, job)
        got = sum(bool((pool.tensor[s] == value).all()) for s in slots)
        fresh[name] = {"ok": r.ok, "reason": r.reason, "fresh_blocks": got}
        proc.stdin.write(json.dumps({"op": "digest", "blocks": []}) + "\n")  # child syncs
        proc.stdin.flush()
        read_line(proc, 60)
    n = len(slots)
    done = fresh["with"]
    rows = [
        gate(
            "ipc",
            "a store waits on the engine's wait_event (its writes still running)",
            f"{done['fresh_blocks']}/{n} blocks hold the new bytes"
            + ("" if done["ok"] else f" ({done['reason']})"),
            f"{n}/{n}",
            bool(done["ok"]) and done["fresh_blocks"] == n,
        ),
        info(
            "ipc",
            "the same store without wait_event",
            f"{fresh['without']['fresh_blocks']}/{n} blocks new (stale ones: the race)",
        ),
    ]
    return {"fresh": fresh, "rows": rows}


# -------------------------------------------------------------------- 3. bandwidth


def timed(fn: Callable[[], object], reps: int) -> list[float]:
    fn()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
    return out


def gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / 1e9 / statistics.median(seconds)


def copy_rates(host: torch.Tensor, dev: torch.Tensor, reps: int) -> tuple[float, float]:
    """(D2H, H2D) GB/s of one large copy between ``host`` and ``dev``."""
    n = host.numel()
    d2h = gbps(n, timed(lambda: host.copy_(dev, non_blocking=True), reps))
    h2d = gbps(n, timed(lambda: dev.copy_(host, non_blocking=True), reps))
    return d2h, h2d


def pinned_baseline(dev: torch.Tensor, reps: int) -> tuple[float, float]:
    pinned = torch.empty(dev.numel(), dtype=torch.uint8, pin_memory=True).fill_(1)
    return copy_rates(pinned, dev, reps)


def job_rate(worker: Any, job: TransferJob, nbytes: int, reps: int) -> float:
    def go() -> None:
        r = run_job(worker, job, 120.0)
        if not r.ok:
            raise RuntimeError(f"{job.direction} failed: {r.reason}")

    return gbps(nbytes, timed(go, reps))


# name -> (tensors, [block, heads, head_size] after [2, N]); bf16, block_dim 1
VLLM_LAYOUTS: dict[str, tuple[int, list[int]]] = {
    "vllm80": (80, [16, 4, 128]),  # Llama-70B at TP 2: 80 x 32 KiB = 2.5 MiB per block
    "vllm32": (32, [16, 8, 128]),  # Llama-8B: 32 x 64 KiB = 2 MiB per block
}


def vllm_block_bytes(name: str) -> int:
    tensors, inner = VLLM_LAYOUTS[name]
    per = 2 * 2  # K and V, bf16
    for d in inner:
        per *= d
    return tensors * per


def bandwidth_for(
    bb: int, dev_big: torch.Tensor, base: tuple[float, float], reps: int, layout: str = "4"
) -> list[dict[str, Any]]:
    """Store / load GB/s of whole-cache jobs; ``layout`` "4" (4 fp16 tensors, block_dim 0) or
    a name of ``VLLM_LAYOUTS`` (``bb`` is then its block)."""
    from transfer.cuda_worker import CudaTransferWorker

    total = dev_big.numel()
    n = total // bb
    rows = []
    pool = new_pool(n, bb)
    worker = None
    try:
        pool_d2h, pool_h2d = copy_rates(pool.tensor.view(-1)[: n * bb], dev_big[: n * bb], reps)
        registry = KVCacheRegistry(pool)
        if layout in VLLM_LAYOUTS:
            count, inner = VLLM_LAYOUTS[layout]
            tensors = [
                torch.empty(2, n, *inner, dtype=torch.bfloat16, device="cuda:0").fill_(i)
                for i in range(count)
            ]
            dims = [1] * count
        else:
            half_words = bb // 4 // 2  # 4 float16 tensors of bb/4 bytes per block each
            tensors = [
                torch.empty(n, half_words, dtype=torch.float16, device="cuda:0").fill_(i)
                for i in range(4)
            ]
            dims = [0, 0, 0, 0]
        cache = registry.register_tensors(f"bw{layout}-{bb}", tensors, dims)
        torch.cuda.synchronize()
        worker = CudaTransferWorker(pool, registry)
        rng = random.Random(bb)
        blocks = rng.sample(range(n), n)
        patterns = {"slot_runs": list(range(n)), "scattered": rng.sample(range(n), n)}
        for pattern, slots in patterns.items():
            store = job_rate(
                worker, TransferJob("store", cache.cache_id, blocks, slots, 120.0), n * bb, reps
            )
            load = job_rate(
                worker, TransferJob("load", cache.cache_id, blocks, slots, 120.0), n * bb, reps
            )
            row = {
                "layout": layout,
                "copy_path": worker.copy_path,
                "block_bytes": bb,
                "pattern": pattern,
                "store_gbps": store,
                "load_gbps": load,
                "store_ratio": store / base[0],
                "load_ratio": load / base[1],
                "pool_d2h_gbps": pool_d2h,
                "pool_h2d_gbps": pool_h2d,
                "pinned": pool.pinned,
                "raw_memcpy": worker.raw_memcpy,
            }
            rows.append(row)
            print(
                f"   {layout:>6} {bb >> 10:>5} KiB {pattern:>10} [{worker.copy_path}]: "
                f"store {store:6.1f} GB/s ({row['store_ratio']:.2f})  "
                f"load {load:6.1f} GB/s ({row['load_ratio']:.2f})  "
                f"[pool copy D2H {pool_d2h:.1f} H2D {pool_h2d:.1f}]",
                flush=True,
            )
    finally:
        if worker is not None:
            worker.shutdown()
        pool.close()
    return rows


def is_gated(row: Mapping[str, Any]) -> bool:
    return row["layout"] in VLLM_LAYOUTS or int(row["block_bytes"]) == (2 << 20)


def bandwidth_rows(rows: Sequence[Mapping[str, Any]]) -> list[Row]:
    """One table row per (layout, block, pattern, direction): gated at ``TARGET`` for 2 MiB
    blocks and the vLLM-like layouts, INFO otherwise."""
    out = []
    for r in rows:
        size = int(r["block_bytes"])
        shown = f"{size >> 20} MiB" if size % (1 << 20) == 0 else f"{size / (1 << 20):.2f} MiB"
        if size < (1 << 20):
            shown = f"{size >> 10} KiB"
        tensors = VLLM_LAYOUTS[r["layout"]][0] if r["layout"] in VLLM_LAYOUTS else 4
        for d in ("store", "load"):
            what = f"{d} {r['layout']} ({tensors} tensors) {shown} {r['pattern']}"
            measured = f"{r[f'{d}_gbps']:.1f} GB/s = {r[f'{d}_ratio']:.2f}x [{r['copy_path']}]"
            if is_gated(r):
                ok = float(r[f"{d}_ratio"]) >= TARGET
                out.append(gate("bandwidth", what, measured, f">= {TARGET}x pinned copy", ok))
            else:
                out.append(info("bandwidth", what, measured))
    return out


def bandwidth(total: int, reps: int, sizes: list[int]) -> dict[str, Any]:
    dev_big = torch.empty(total, dtype=torch.uint8, device="cuda:0").fill_(3)
    base = pinned_baseline(dev_big, reps)
    print(f"   pinned copy baseline: D2H {base[0]:.1f} GB/s, H2D {base[1]:.1f} GB/s", flush=True)
    rows: list[dict[str, Any]] = []
    broken: list[Row] = []
    runs = [(bb, "4") for bb in sizes] + [(vllm_block_bytes(n), n) for n in VLLM_LAYOUTS]
    for bb, layout in runs:
        try:
            rows += bandwidth_for(bb, dev_big, base, reps, layout)
        except SectionTimeout:
            raise
        except Exception as exc:  # one layout failing leaves the others measured
            print(traceback.format_exc(), flush=True)
            broken.append(error_row("bandwidth", f"layout {layout}, {bb} B blocks", exc))
        REPORT["sections"]["bandwidth_partial"] = {"baseline": base, "rows": rows}
        save()
    REPORT["sections"].pop("bandwidth_partial", None)
    table = [
        info("bandwidth", "pinned copy baseline", f"D2H {base[0]:.1f}, H2D {base[1]:.1f} GB/s"),
        *bandwidth_rows(rows),
        *broken,
    ]
    return {
        "target_ratio": TARGET,
        "baseline": {"pinned_d2h_gbps": base[0], "pinned_h2d_gbps": base[1]},
        "measurements": rows,
        "rows": rows_of(*table),
    }


# -------------------------------------------------------------------- 4. concurrent


def concurrent(reps: int, bb: int = 2 << 20, n: int = 512) -> dict[str, Any]:
    """A store and a load of the same size (half the blocks each: 512 MiB by default),
    alone and submitted together."""
    from transfer.cuda_worker import CudaTransferWorker

    half = n // 2
    pool = new_pool(n, bb)
    worker = None
    try:
        registry = KVCacheRegistry(pool)
        cache = registry.register_tensors("concurrent", flat_cache(n, bb), [0] * 4)
        torch.cuda.synchronize()
        worker = CudaTransferWorker(pool, registry)
        store = TransferJob("store", cache.cache_id, list(range(half)), list(range(half)), 60.0)
        load = TransferJob("load", cache.cache_id, list(range(half, n)), list(range(half, n)), 60.0)
        nbytes = half * bb

        def alone(job: TransferJob) -> float:
            def go() -> None:
                r = run_job(worker, job)
                if not r.ok:
                    raise RuntimeError(f"{job.direction} failed: {r.reason}")

            return statistics.median(timed(go, reps))

        both_load_s: list[float] = []

        def together() -> None:
            assert worker is not None
            ids = [worker.submit(store), worker.submit(load)]
            results = {r.job_id: r for r in worker.wait(ids, timeout=60)}
            if len(results) != 2 or not all(r.ok for r in results.values()):
                raise RuntimeError(f"concurrent jobs failed: {list(results.values())}")
            both_load_s.append(results[ids[1]].seconds)

        t_store, t_load = alone(store), alone(load)
        t_both = statistics.median(timed(together, reps))
        store_gbps, load_gbps = nbytes / t_store / 1e9, nbytes / t_load / 1e9
        both_gbps = 2 * nbytes / t_both / 1e9
        faster = max(store_gbps, load_gbps)
        ratio = both_gbps / faster
        load_slowdown = statistics.median(both_load_s) / t_load
        rows = [
            info(
                "concurrent",
                f"each alone ({half * bb / (1 << 20):g} MiB)",
                f"store {store_gbps:.1f}, load {load_gbps:.1f} GB/s",
            ),
            gate(
                "concurrent",
                "store + load together",
                f"{both_gbps:.1f} GB/s = {ratio:.2f}x the faster alone",
                f">= {TARGET}x the faster alone",
                ratio >= TARGET,
            ),
            info(
                "concurrent",
                "load's time beside a store",
                f"{load_slowdown:.2f}x its time alone "
                f"(duplex: {both_gbps / (store_gbps + load_gbps):.2f}x the sum)",
            ),
        ]
        return {
            "store_alone_gbps": store_gbps,
            "load_alone_gbps": load_gbps,
            "together_gbps": both_gbps,
            "ratio_to_faster_alone": ratio,
            "load_slowdown": load_slowdown,
            "rows": rows_of(*rows),
        }
    finally:
        if worker is not None:
            worker.shutdown()
        pool.close()


# -------------------------------------------------------------------- 5. small jobs


def small_jobs(count: int, burst: int, bb: int = 64 << 10, n: int = 256) -> dict[str, Any]:
    """1-block jobs: latency one at a time (submit to result), then a burst's throughput."""
    from transfer.cuda_worker import CudaTransferWorker

    pool = new_pool(n, bb)
    worker = None
    try:
        registry = KVCacheRegistry(pool)
        cache = registry.register_tensors("small", flat_cache(n, bb), [0] * 4)
        torch.cuda.synchronize()
        worker = CudaTransferWorker(pool, registry)
        rng = random.Random(7)
        lat: list[float] = []
        for i in range(count + 20):
            direction: Direction = "store" if i % 2 == 0 else "load"
            b, s = rng.randrange(n), rng.randrange(n)
            t0 = time.perf_counter()
            r = run_job(worker, TransferJob(direction, cache.cache_id, [b], [s], 10.0), 10.0)
            dt = time.perf_counter() - t0
            if not r.ok:
                raise RuntimeError(f"small {direction} failed: {r.reason}")
            if i >= 20:  # the first ones warm streams and threads up
                lat.append(dt)
        t0 = time.perf_counter()
        ids = [
            worker.submit(
                TransferJob(
                    "store" if i % 2 == 0 else "load", cache.cache_id, [i % n], [i % n], 60.0
                )
            )
            for i in range(burst)
        ]
        results = worker.wait(ids, timeout=60)
        burst_s = time.perf_counter() - t0
        failed = [r for r in results if not r.ok]
        p50, p99 = percentile(lat, 0.50) * 1e3, percentile(lat, 0.99) * 1e3
        rows = [
            info("small_jobs", f"1-block ({bb >> 10} KiB) job, p50 of {count}", f"{p50:.3f} ms"),
            gate(
                "small_jobs",
                f"1-block ({bb >> 10} KiB) job, p99 of {count}",
                f"{p99:.3f} ms",
                f"<= {SMALL_JOB_P99_MS} ms",
                p99 <= SMALL_JOB_P99_MS,
            ),
            gate(
                "small_jobs",
                f"burst of {burst} 1-block jobs",
                f"{len(results) - len(failed)}/{burst} ok, {burst / burst_s:.0f} jobs/s",
                "all ok",
                len(results) == burst and not failed,
            ),
        ]
        return {
            "latency_ms": {"p50": p50, "p99": p99, "max": max(lat) * 1e3, "count": count},
            "burst": {"jobs": burst, "seconds": burst_s, "failed": len(failed)},
            "rows": rows_of(*rows),
        }
    finally:
        if worker is not None:
            worker.shutdown()
        pool.close()


# -------------------------------------------------------------------- 6. deadline


def _streams_idle(worker: Any) -> bool:
    return all(s.query() for lane in worker._lanes.values() for s in lane.streams.values())


def deadline_in_flight(bb: int = 2 << 20, n: int = 512) -> dict[str, Any]:
    """A job past its deadline with its DMA queued: reported failed, and only once the DMA
    ended; a shutdown with copies queued waits for them before the pool may be unpinned."""
    from transfer.cuda_worker import CudaTransferWorker

    pool = new_pool(n, bb)
    workers: list[Any] = []
    try:
        registry = KVCacheRegistry(pool)
        cache = registry.register_tensors("deadline", flat_cache(n, bb), [0] * 4)
        torch.cuda.synchronize()
        # The whole job queued on the stream at once: its DMA runs past a short deadline.
        worker = CudaTransferWorker(pool, registry, max_inflight_bytes=n * bb)
        workers.append(worker)
        every = list(range(n))

        def job(deadline_s: float) -> TransferJob:
            return TransferJob("store", cache.cache_id, every, every, deadline_s)

        full = [run_job(worker, job(60.0)) for _ in range(3)]
        if not all(r.ok for r in full):
            raise RuntimeError(f"the full store failed: {[r.reason for r in full]}")
        t_full = statistics.median(r.seconds for r in full)
        short = max(t_full / 4, 1e-4)
        r = run_job(worker, job(short))
        idle_at_report = _streams_idle(worker)
        late = r.seconds / short
        rows = [
            info("deadline", f"full {n * bb >> 20} MiB store", f"{t_full * 1e3:.1f} ms"),
            gate(
                "deadline",
                f"deadline {short * 1e3:.1f} ms, DMA queued",
                f"ok={r.ok} reason={r.reason!r}, reported at {late:.1f}x the deadline",
                "fails 'deadline'",
                (not r.ok) and r.reason == "deadline",
            ),
            gate(
                "deadline",
                "streams idle when the failure is reported",
                "idle" if idle_at_report else "COPIES STILL QUEUED",
                "idle (nothing freed under a DMA)",
                idle_at_report,
            ),
        ]
        # A shutdown with the DMA in flight: waits for it, then says quiesced.
        jid = worker.submit(job(60.0))
        worker.shutdown(timeout=0.0)
        idle = _streams_idle(worker)
        rows.append(
            gate(
                "deadline",
                "shutdown with copies in flight",
                f"quiesced={worker.quiesced}, streams {'idle' if idle else 'busy'}, "
                f"pool {'pinned' if pool.pinned else 'NOT pinned'} until then",
                "quiesced, idle, pinned",
                worker.quiesced and idle and pool.pinned,
            )
        )
        # With no time to wait (sync_timeout_s=0) it may not quiesce: then the pool must
        # stay pinned (HostPool.close(unpin=False)), as the service does.
        quick = CudaTransferWorker(pool, registry, max_inflight_bytes=n * bb, sync_timeout_s=0.0)
        workers.append(quick)
        quick.submit(job(60.0))
        until = time.monotonic() + 2
        while time.monotonic() < until and quick.in_flight():  # until its copies are queued
            if any(lane.inflight[True] for lane in quick._lanes.values()):
                break
            time.sleep(0.0005)
        quick.shutdown(timeout=0.0)
        rows.append(
            info(
                "deadline",
                "shutdown without waiting (sync 0 s)",
                f"quiesced={quick.quiesced}: the pool "
                f"{'may be unpinned' if quick.quiesced else 'stays pinned (close(unpin=False))'}",
            )
        )
        torch.cuda.synchronize()
        return {
            "full_store_s": t_full,
            "deadline_s": short,
            "result": {"ok": r.ok, "reason": r.reason, "seconds": r.seconds},
            "idle_at_report": idle_at_report,
            "shutdown_job": jid,
            "quiesced_after_wait": worker.quiesced,
            "quiesced_without_wait": quick.quiesced,
            "rows": rows_of(*rows),
        }
    finally:
        for w in workers:
            w.shutdown()
        torch.cuda.synchronize()
        pool.close(unpin=all(w.quiesced for w in workers))


# -------------------------------------------------------------------- 7. engine killed


def _copies_after_kill(
    worker: Any, registry: KVCacheRegistry, pool: HostPool, bb: int, tensors: int
) -> tuple[str, bool]:
    """A store of an in-process cache after the kill: its bytes, or the poisoned worker's
    refusal (the service then exits for its supervisor to restart it)."""
    from transfer import WorkerClosedError

    n = 8
    own = registry.register_tensors("after-kill", flat_cache(n, bb, tensors), [0] * tensors)
    want = torch.arange(tensors, dtype=torch.uint8).repeat_interleave(bb // tensors)
    try:
        r = run_job(
            worker, TransferJob("store", own.cache_id, list(range(n)), list(range(n)), 30.0)
        )
    except WorkerClosedError as exc:
        return f"refused: {exc}", worker.fatal is not None
    finally:
        registry.unregister(own.cache_id)
    bad = sum(not torch.equal(pool.tensor[i], want) for i in range(n))
    return ("ok" if r.ok else f"failed: {r.reason}") + f", {bad} bad blocks", r.ok and bad == 0


def engine_killed(quick: bool, lease_s: float = 1.0) -> dict[str, Any]:
    """An engine SIGKILLed with offloads of its cache running: the lease lapses, the jobs
    end, its GPU memory is freed and the worker is not poisoned. Run at the transfer layer,
    what the service's lease loop does (``Transfers.expire_caches``: ``expire``, then
    ``drop_cache``), because the device image lacks the HTTP stack; the loop itself and the
    HTTP side of leases are tested on the CPU (``tests/api/test_gpu_path.py``)."""
    from transfer.cuda_worker import CudaTransferWorker

    bb, tensors = 2 << 20, 4
    n = 512 if quick else 2048  # 1 or 4 GiB of 2 MiB blocks
    free_before = torch.cuda.mem_get_info(0)[0]
    proc, hello = start_engine(
        {"blocks": n, "inner_bytes": bb // tensors, "tensors": tensors, "name": "killed"}
    )
    out: dict[str, Any] = {"engine_bytes": hello["bytes"]}
    pool = registry = worker = None
    try:
        pool = new_pool(n, bb)
        registry = KVCacheRegistry(pool)
        worker = CudaTransferWorker(pool, registry)
        free_with = torch.cuda.mem_get_info(0)[0]
        cache = registry.register(KVCacheSpec.from_dict({**hello["spec"], "lease_s": lease_s}))
        cache_id = cache.cache_id
        del cache  # only the registry and the jobs hold the mappings from here on
        per = n // 4
        jobs = [  # four offloads back to back: the first one runs, the others queue
            worker.submit(
                TransferJob(
                    "store",
                    cache_id,
                    list(range(k * per, (k + 1) * per)),
                    list(range(k * per, (k + 1) * per)),
                    30.0,
                )
            )
            for k in range(4)
        ]
        running_at_kill = len(worker.in_flight())  # before: a job may end in between
        done_at_kill = len(worker.poll_finished())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        killed_at = time.monotonic()
        gone = False
        while time.monotonic() - killed_at < lease_s + 10:
            for expired in registry.expire():
                worker.drop_cache(expired.cache_id, "kv cache lease expired")
            if all(c.cache_id != cache_id for c in registry.list()):
                gone = True
                break
            time.sleep(0.05)
        out["registration_gone_after_s"] = round(time.monotonic() - killed_at, 3)
        results = worker.wait(jobs, timeout=30.0)
        ended = len(results) + done_at_kill >= len(jobs)
        out["jobs"] = [{"job_id": r.job_id, "ok": r.ok, "reason": r.reason} for r in results]
        freed = False
        want = free_with + hello["bytes"] * 9 // 10
        free_after = torch.cuda.mem_get_info(0)[0]
        end = time.monotonic() + 15
        while time.monotonic() < end:
            gc.collect()
            torch.cuda.synchronize()
            free_after = torch.cuda.mem_get_info(0)[0]
            if free_after >= want:
                freed = True
                break
            time.sleep(0.1)
        after, after_ok = _copies_after_kill(worker, registry, pool, bb, tensors)
        mib = 1 << 20
        rows = [
            info(
                "engine_killed",
                f"{len(jobs)} offloads of {per * bb >> 20} MiB when the engine was killed",
                f"{running_at_kill} queued or copying, {done_at_kill} ended by then"
                + ("" if running_at_kill else " (none left: NOT killed mid-copy)"),
            ),
            gate(
                "engine_killed",
                f"lease ({lease_s:g} s) lapses, registration gone",
                f"gone after {out['registration_gone_after_s']} s" if gone else "STILL LISTED",
                "gone",
                gone,
            ),
            gate(
                "engine_killed",
                "every job ended",
                ", ".join("ok" if j["ok"] else str(j["reason"]) for j in out["jobs"]) or "none",
                "ended",
                ended,
            ),
            gate(
                "engine_killed",
                "engine's GPU memory freed",
                f"free {free_before // mib} -> {free_with // mib} (engine up) -> "
                f"{free_after // mib} MiB",
                f">= {want // mib} MiB",
                freed,
            ),
            gate(
                "engine_killed",
                "the worker copies afterwards (or, poisoned, refuses for a restart)",
                after,
                "bytes equal / refused",
                after_ok,
            ),
        ]
        out.update(
            free_mib={"before": free_before // mib, "with": free_with // mib},
            free_after_mib=free_after // mib,
            fatal=worker.fatal,
            rows=rows_of(*rows),
        )
        return out
    finally:
        if proc.poll() is None:
            proc.kill()
        end_engine(proc)
        try:
            if worker is not None:
                worker.shutdown()
        finally:
            if registry is not None:
                registry.close()
            if pool is not None:
                pool.close(unpin=worker is None or worker.quiesced)


# -------------------------------------------------------------------- 8. remap


def remapped_env(count: int, visible: str | None) -> dict[str, str]:
    """An environment whose ``CUDA_VISIBLE_DEVICES`` swaps this process's GPUs 0 and 1."""
    ids = (
        [v.strip() for v in visible.split(",") if v.strip()]
        if visible
        else [str(i) for i in range(count)]
    )
    ids[0], ids[1] = ids[1], ids[0]
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(ids)}


def remap() -> dict[str, Any]:
    from transfer.cuda_worker import CudaTransferWorker
    from transfer.errors import RegistrationError

    count = torch.cuda.device_count()
    if count < 2:
        row = Row(
            "remap",
            "second visible device remapped",
            f"{count} GPU visible",
            "needs >= 2 GPUs",
            "SKIP",
        )
        print("   SKIP: one GPU visible; the remapped second device was NOT checked", flush=True)
        return {"gpus": count, "rows": rows_of(row)}
    n, bb, tensors = 64, 256 << 10, 2
    env = remapped_env(count, os.environ.get("CUDA_VISIBLE_DEVICES"))
    proc, hello = start_engine(
        {"blocks": n, "inner_bytes": bb // tensors, "tensors": tensors, "name": "remap"}, env
    )
    pool = new_pool(n, bb)
    worker = None
    try:
        registry = KVCacheRegistry(pool)
        spec = hello["spec"]
        cache = registry.register(KVCacheSpec.from_dict(spec))
        worker = CudaTransferWorker(pool, registry)
        every = list(range(n))
        r = run_job(worker, TransferJob("store", cache.cache_id, every, every, 60.0))
        inner = bb // tensors
        bad = [
            b
            for b in range(n)
            for t in range(tensors)
            if not bool((pool.tensor[b, t * inner : (t + 1) * inner] == pattern_byte(b, t)).all())
        ]
        devices = list(cache.devices)
        no_uuid = {k: v for k, v in spec.items() if k != "device_uuid"}
        no_uuid["name"] = "remap-no-uuid"
        try:
            registry.register(KVCacheSpec.from_dict(no_uuid))
            refused = "accepted"
        except RegistrationError as exc:
            refused = f"refused: {str(exc)[:80]}"
        rows = [
            gate(
                "remap",
                "engine's cuda:0 named by device_uuid",
                f"opened on {','.join(devices)}; store {'ok' if r.ok else r.reason}, "
                f"{len(bad)} bad blocks",
                "cuda:1, every byte",
                r.ok and not bad and devices == ["cuda:1"] * tensors,
            ),
            gate(
                "remap",
                "the same handle as cuda:0 without device_uuid",
                refused,
                "refused",
                refused.startswith("refused"),
            ),
        ]
        return {"gpus": count, "devices": devices, "rows": rows_of(*rows)}
    finally:
        if worker is not None:
            worker.shutdown()
        pool.close()
        end_engine(proc)


# -------------------------------------------------------------------- 9. pool registration


def _meminfo_available() -> int | None:
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/meminfo") as f:
            line = next(ln for ln in f if ln.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    return None


def _time_pool(size: int, bb: int) -> dict[str, Any]:
    from transfer import host_pool

    t0 = time.perf_counter()
    pool = new_pool(size // bb, bb, pin=False)
    t1 = time.perf_counter()
    try:
        flat = pool.tensor.view(-1)
        chunk = host_pool._pin_chunk_bytes(bb, host_pool.MAX_PIN_CHUNK_BYTES)
        t2 = time.perf_counter()
        chunks = host_pool._register(flat, chunk)
        t3 = time.perf_counter()
        host_pool._unregister(chunks)
        t4 = time.perf_counter()
    finally:
        pool.close()
    return {
        "bytes": size,
        "alloc_s": t1 - t0,
        "pin_s": t3 - t2,
        "unpin_s": t4 - t3,
        "pinned": bool(chunks),
        "chunks": len(chunks),
    }


def pool_registration(cap_s: float) -> dict[str, Any]:
    bb = 2 << 20
    want = POOL_GIB << 30
    avail = _meminfo_available()
    free = shm_free(SHM_DIR)
    size, note = pool_size_for(want, avail, free)
    if size < (1 << 30):
        row = Row(
            "pool_registration",
            f"{POOL_GIB} GiB pool pinned",
            f"no room for even 1 GiB ({note})",
            "needs memory",
            "SKIP",
        )
        return {"available": avail, "shm_free": free, "rows": rows_of(row)}
    probe = _time_pool(1 << 30, bb)
    per_gib = probe["alloc_s"] + probe["pin_s"] + probe["unpin_s"]
    fits = int(max(1.0, (cap_s * 0.6 - per_gib) / max(per_gib, 1e-3)))
    if size >> 30 > fits:
        size = fits << 30
        note = f"{note + '; ' if note else ''}scaled to {fits} GiB to fit the section's time cap"
    timed_pool = _time_pool(size, bb) if size > (1 << 30) else probe
    gib = timed_pool["bytes"] / (1 << 30)
    pin_64 = timed_pool["pin_s"] / gib * POOL_GIB
    label = f"{gib:.0f} GiB" + ("" if note is None else " (scaled, see note)")
    rows = [
        info(
            "pool_registration",
            f"{label}: allocate + pre-fault",
            f"{timed_pool['alloc_s']:.2f} s ({gib / timed_pool['alloc_s']:.1f} GiB/s)",
        ),
        gate(
            "pool_registration",
            f"{label}: cudaHostRegister",
            f"{timed_pool['pin_s']:.2f} s ({timed_pool['chunks']} chunks)"
            + ("" if timed_pool["pinned"] else " FAILED: pageable"),
            "pinned",
            bool(timed_pool["pinned"]),
        ),
        gate(
            "pool_registration",
            f"{POOL_GIB} GiB pin time" + ("" if note is None else " (scaled linearly)"),
            f"{pin_64:.1f} s",
            f"<= {POOL_PIN_TARGET_S:.0f} s",
            pin_64 <= POOL_PIN_TARGET_S,
        ),
    ]
    if note is not None:
        print(f"   note: {note}", flush=True)
        rows.append(info("pool_registration", "note", note))
    return {
        "available": avail,
        "shm_free": free,
        "note": note,
        "probe_1gib": probe,
        "timed": timed_pool,
        "pin_seconds_at_64gib": pin_64,
        "rows": rows_of(*rows),
    }


# -------------------------------------------------------------------- 10. cuda tests


def cuda_tests(timeout_s: float) -> dict[str, Any]:
    """The CUDA tests of tests/transfer (``-m gpu``), in a child pytest."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-m",
            "gpu",
            "-p",
            "no:cacheprovider",
            "tests/transfer",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=max(10.0, timeout_s),
    )
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:]
    summary = tail[0] if tail else "(no output)"
    row = gate(
        "cuda_tests", "pytest -m gpu tests/transfer", summary[:100], "passes", proc.returncode == 0
    )
    return {"returncode": proc.returncode, "summary": tail, "rows": rows_of(row)}


# -------------------------------------------------------------------- main


def hard_stop() -> None:
    """The global watchdog: write what was measured and leave, whatever runs."""
    REPORT["watchdog"] = "stopped by the watchdog"
    with contextlib.suppress(Exception):
        save()
    print("watchdog: out of time, partial results written", flush=True)
    os._exit(1)


def no_device_line() -> str:
    return (
        f"gpu_check: FAIL: no CUDA device visible (torch {torch.__version__}, CUDA build "
        f"{torch.version.cuda}); nothing was checked"
    )


def main(argv: list[str] | None = None) -> int:
    global OUT_PATH, SHM_DIR
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller run")
    parser.add_argument("--out", default=str(OUT_DEFAULT))
    parser.add_argument("--budget", type=float, default=470.0, help="watchdog, seconds")
    parser.add_argument("--strict", action="store_true", help="a skipped check fails the run")
    parser.add_argument(
        "--shm-dir",
        default=str(SHM_DIR),
        help="where the pools live (a container's /dev/shm is often 64 MB: give a larger tmpfs)",
    )
    args = parser.parse_args(argv)
    OUT_PATH = Path(args.out)
    SHM_DIR = Path(args.shm_dir)
    REPORT["quick"] = args.quick
    if not torch.cuda.is_available():
        # A device run must never pass vacuously: no device is a failure, in one line.
        print(no_device_line())
        return 2
    began = time.monotonic()
    watchdog = threading.Timer(args.budget, hard_stop)
    watchdog.daemon = True
    watchdog.start()
    faulthandler.dump_traceback_later(args.budget + 20, exit=True)  # stuck in C: still ends
    REPORT["cuda"] = True
    REPORT["machine"] = {
        "gpu": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    machine = REPORT["machine"]
    avail, free = _meminfo_available(), shm_free(SHM_DIR)
    machine.update(mem_available=avail, shm_dir=str(SHM_DIR), shm_free=free)
    gib = 1 << 30
    print(
        f"gpu_check on {machine['gpu']} x{machine['gpus']} (torch {machine['torch']}, CUDA "
        f"{machine['cuda']}); memory available "
        f"{'?' if avail is None else f'{avail / gib:.0f} GiB'}, {SHM_DIR} free "
        f"{'?' if free is None else f'{free / gib:.1f} GiB'}"
    )
    if free is not None and free < 6 * gib:
        print(f"   warning: {SHM_DIR} holds under 6 GiB: pools will not fit; pass --shm-dir")
    save()
    q = args.quick
    total = (256 << 20) if q else (1 << 30)
    sizes = [2 << 20] if q else [64 << 10, 256 << 10, 1 << 20, 2 << 20, 4 << 20]
    rows: list[Row] = []

    def left(reserve: float = 0.0) -> float:
        return float(args.budget) - (time.monotonic() - began) - reserve

    # (name, run, cap in seconds): the caps add up to more than the budget on purpose (they
    # bound a stuck section); each is cut to what the budget leaves, minus the tests' share.
    plan: list[tuple[str, Callable[[float], dict[str, Any]], float]] = [
        ("correctness", lambda cap: correctness(), 60),
        ("ipc", lambda cap: ipc(), 60),
        ("bandwidth", lambda cap: bandwidth(total, 3 if q else 5, sizes), 150),
        ("concurrent", lambda cap: concurrent(3 if q else 5), 30),
        ("small_jobs", lambda cap: small_jobs(300 if q else 1000, 1000), 30),
        ("deadline", lambda cap: deadline_in_flight(), 30),
        ("engine_killed", lambda cap: engine_killed(q), 60),
        ("remap", lambda cap: remap(), 45),
        ("pool_registration", lambda cap: pool_registration(cap), 90),
        ("cuda_tests", lambda cap: cuda_tests(cap - 5), 150),
    ]
    for name, fn, cap in plan:
        reserve = 0.0 if name == "cuda_tests" else 60.0  # keep time for the CUDA tests
        budget = min(cap, left(reserve))
        if budget < 5:
            rows.append(Row(name, "section", "no time left in the budget", "runs", "ERROR"))
            REPORT["rows"] = [asdict(r) for r in rows]
            save()
            print(f"== {name}: ERROR, no time left", flush=True)
            continue
        run_section(name, functools.partial(fn, budget), budget, rows)
    watchdog.cancel()
    faulthandler.cancel_dump_traceback_later()
    code, line = verdict(rows, strict=args.strict)
    print()
    print(format_table(rows))
    REPORT["ok"] = code == 0
    REPORT["verdict"] = line
    REPORT["rows"] = [asdict(r) for r in rows]
    save()
    print(f"{line}; wrote {OUT_PATH}")
    return code


if __name__ == "__main__":
    sys.exit(main())
