"""GPU check of the CUDA transfer backend: correctness, CUDA IPC, and bandwidth.

On a CUDA machine, in this order (each section's outcome is written to the JSON as soon as it
is known, so a crash or the watchdog still leaves what was measured):

1. ``correctness``: a pinned pool and a mixed CUDA cache (4 tensors, fp16/bf16/fp32/int8,
   block_dim 0, 1 and 2) registered in-process; store random blocks to random slots and check
   every host byte, then load them into other blocks and check every device byte. Run with the
   default staging buffer, with a tiny one (many chunks), and with the torch copy path instead
   of the raw ``cudaMemcpyAsync`` path.
2. ``ipc``: a child process (``tests/transfer/ipc_child.py``, the GPU test's engine) allocates
   the cache on the GPU and exports it by CUDA IPC handle (``export_cuda_ipc_handle``); the
   service side registers it from the JSON body, stores and loads, and the child checks the
   loaded bytes in its own memory.
3. ``bandwidth``: D2H (store) and H2D (load) GB/s of whole-cache jobs, 4 tensors per cache,
   block sizes 64 KiB to 4 MiB, device blocks in random order and host slots either in runs
   (contiguous) or scattered, against one large copy between a pinned buffer and the GPU (and
   between the pool itself and the GPU). Medians of several repetitions. Target: >= 85% of the
   plain pinned copy.

   Also the vLLM-like layout (80 bf16 tensors ``[2, N, 16, 8, 128]``, block_dim 1: a 5 MiB
   block). Fails when 2 MiB blocks or the vLLM-like layout, store or load, runs or
   scattered, fall under the target. Each row names the copy path (batch, 2d, staged).
4. ``cuda_tests``: ``pytest -m gpu tests/transfer`` in a child process.

Prints tables, writes ``bench/results/gpu_check.json``; exits 0 when every check passed, 1 when
one failed, and 2 with one line when no CUDA device is visible (a device run never passes
vacuously). Meant to finish in under eight minutes on one H200; a watchdog stops it at
``--budget`` seconds. Not covered yet (issue #20): concurrent store + load, small-job latency,
a 64 GiB pool's registration time, an engine killed mid-copy, a deadline with DMA in flight,
a second visible device remapped.

Run: ``.venv/bin/python bench/gpu_check.py`` (``--quick`` for a smaller run).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import select
import signal
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
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
from tests.transfer import ipc_child  # noqa: E402
from tests.transfer.kvref import MIXED_LAYOUT, bytes_per_block, host_block, shapes  # noqa: E402
from transfer import HostPool, KVCacheRegistry, KVCacheSpec, TransferJob  # noqa: E402

OUT_DEFAULT = harness.RESULTS_DIR / "gpu_check.json"
TARGET = 0.85
Layout = Sequence[tuple[list[int], str, int]]  # (shape, dtype, block_dim) per tensor

REPORT: dict[str, Any] = {"benchmark": "gpu_check", "sections": {}}
OUT_PATH = OUT_DEFAULT


def save() -> None:
    harness.write_results(OUT_PATH, REPORT, quiet=True)


def section(name: str, fn: Callable[[], dict[str, Any]]) -> bool:
    """Run one section; record its result or its traceback; True when it passed."""
    print(f"== {name}", flush=True)
    started = time.perf_counter()
    try:
        result = fn()
        ok = bool(result.get("ok", True))
    except Exception:
        result = {"ok": False, "error": traceback.format_exc()}
        ok = False
        print(result["error"], flush=True)
    result["seconds"] = round(time.perf_counter() - started, 3)
    REPORT["sections"][name] = result
    save()
    print(f"   {'PASS' if ok else 'FAIL'} ({result['seconds']} s)", flush=True)
    return ok


def layout_for(n: int) -> Layout:
    """The tests' mixed layout (``tests.transfer.kvref.MIXED_LAYOUT``) with ``n`` blocks."""
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


def run_job(worker: Any, job: TransferJob, timeout: float = 60.0) -> Any:
    jid = worker.submit(job)
    results = worker.wait([jid], timeout=timeout)
    if not results:
        raise RuntimeError(f"job {jid} did not finish within {timeout} s")
    return results[0]


def check_round_trip(staging_bytes: int, raw_memcpy: bool) -> dict[str, Any]:
    from transfer.cuda_worker import CudaTransferWorker

    n, slots_n = 96, 128
    layout = layout_for(n)
    bb = block_bytes(layout)
    pool = HostPool.create(slots_n, bb)
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
            "store": {"ok": r.ok, "reason": r.reason, "bad_slots": bad_store[:5]},
            "load": {"ok": r2.ok, "reason": r2.reason, "bad_blocks": bad_load[:5]},
        }
    finally:
        if worker is not None:
            worker.shutdown()
        pool.close()


def correctness() -> dict[str, Any]:
    from transfer.cuda_worker import DEFAULT_STAGING_BYTES

    runs = {
        "default_staging_raw": check_round_trip(DEFAULT_STAGING_BYTES, True),
        "tiny_staging_raw": check_round_trip(3000, True),
        "default_staging_torch_copies": check_round_trip(DEFAULT_STAGING_BYTES, False),
    }
    for name, r in runs.items():
        print(
            f"   {name}: ok={r['ok']} pinned={r['pinned']} raw_memcpy={r['raw_memcpy']}", flush=True
        )
    return {"ok": all(r["ok"] for r in runs.values()), "runs": runs}


def read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise TimeoutError(f"child sent nothing within {timeout} s")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"child exited (code {proc.poll()})")
    return line


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
        pool = HostPool.create(slots_n, block_bytes(layout))
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
        # Let go of the child's memory before the child exits.
        worker.shutdown()
        registry.close()
        del cache, before
        torch.cuda.synchronize()
        ok = r.ok and r2.ok and not bad_store and not bad_load
        return {
            "ok": ok,
            "handle_fields": handle_keys,
            "store": {"ok": r.ok, "reason": r.reason, "bad_slots": bad_store[:5]},
            "load": {"ok": r2.ok, "reason": r2.reason, "bad_blocks_seen_by_child": bad_load[:5]},
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


VLLM_TENSORS = 80
VLLM_INNER = [16, 8, 128]  # [2, N, 16, 8, 128] bf16 per tensor: 64 KiB of a block each
VLLM_BLOCK_BYTES = VLLM_TENSORS * 2 * 16 * 8 * 128 * 2


def bandwidth_for(
    bb: int, dev_big: torch.Tensor, base: tuple[float, float], reps: int, layout: str = "4"
) -> list[dict[str, Any]]:
    """Store / load GB/s of whole-cache jobs; ``layout`` "4" (4 fp16 tensors, block_dim 0) or
    "vllm80" (80 bf16 tensors [2, N, 16, 8, 128], block_dim 1; ``bb`` is then its block)."""
    from transfer.cuda_worker import CudaTransferWorker

    total = dev_big.numel()
    n = total // bb
    rows = []
    pool = HostPool.create(n, bb)
    worker = None
    try:
        pool_d2h, pool_h2d = copy_rates(pool.tensor.view(-1)[: n * bb], dev_big[: n * bb], reps)
        registry = KVCacheRegistry(pool)
        if layout == "vllm80":
            tensors = [
                torch.empty(2, n, *VLLM_INNER, dtype=torch.bfloat16, device="cuda:0").fill_(i)
                for i in range(VLLM_TENSORS)
            ]
            dims = [1] * VLLM_TENSORS
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


def bandwidth(total: int, reps: int, sizes: list[int]) -> dict[str, Any]:
    dev_big = torch.empty(total, dtype=torch.uint8, device="cuda:0").fill_(3)
    base = pinned_baseline(dev_big, reps)
    print(f"   pinned copy baseline: D2H {base[0]:.1f} GB/s, H2D {base[1]:.1f} GB/s", flush=True)
    rows: list[dict[str, Any]] = []
    runs = [(bb, "4") for bb in sizes] + [(VLLM_BLOCK_BYTES, "vllm80")]
    for bb, layout in runs:
        rows += bandwidth_for(bb, dev_big, base, reps, layout)
        REPORT["sections"]["bandwidth_partial"] = {"baseline": base, "rows": rows}
        save()
    REPORT["sections"].pop("bandwidth_partial", None)
    # The target: >= TARGET x a plain pinned copy at 2 MiB blocks (4 tensors) and with the
    # vLLM-like layout, store and load, slot runs and scattered slots alike.
    gated = [r for r in rows if r["block_bytes"] == (2 << 20) or r["layout"] == "vllm80"]
    meets = bool(gated) and all(
        min(float(r["store_ratio"]), float(r["load_ratio"])) >= TARGET for r in gated
    )
    return {
        "ok": meets,
        "target_ratio": TARGET,
        "meets_target_2mib_and_vllm80": meets,
        "baseline": {"pinned_d2h_gbps": base[0], "pinned_h2d_gbps": base[1]},
        "rows": rows,
    }


def cuda_tests() -> dict[str, Any]:
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
        timeout=240,
    )
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:]
    print(f"   pytest -m gpu tests/transfer: {tail[0] if tail else '(no output)'}", flush=True)
    return {"ok": proc.returncode == 0, "returncode": proc.returncode, "summary": tail}


def on_alarm(signum: int, frame: FrameType | None) -> None:
    REPORT["watchdog"] = "stopped by the watchdog"
    save()
    print("watchdog: out of time, partial results written", flush=True)
    os._exit(1)


def main(argv: list[str] | None = None) -> int:
    global OUT_PATH
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller run")
    parser.add_argument("--out", default=str(OUT_DEFAULT))
    parser.add_argument("--budget", type=float, default=470.0, help="watchdog, seconds")
    args = parser.parse_args(argv)
    OUT_PATH = Path(args.out)
    REPORT["quick"] = args.quick
    if not torch.cuda.is_available():
        # A device run must never pass vacuously: no device is a failure, in one line.
        print(
            f"gpu_check: FAIL: no CUDA device visible (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda}); nothing was checked"
        )
        return 2
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(int(args.budget))
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
    print(f"gpu_check on {machine['gpu']} (torch {machine['torch']}, CUDA {machine['cuda']})")
    save()
    ok = section("correctness", correctness)
    ok = section("ipc", ipc) and ok
    total = (256 << 20) if args.quick else (1 << 30)
    sizes = [2 << 20] if args.quick else [64 << 10, 256 << 10, 1 << 20, 2 << 20, 4 << 20]
    ok = section("bandwidth", lambda: bandwidth(total, 3 if args.quick else 5, sizes)) and ok
    ok = section("cuda_tests", cuda_tests) and ok
    REPORT["ok"] = ok
    save()
    print(f"gpu_check: {'all checks passed' if ok else 'SOME CHECKS FAILED'}; wrote {OUT_PATH}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
