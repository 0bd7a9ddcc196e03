"""SGLang HiCache L3 pages/s: kvoffload's backend against SGLang's own ``file`` backend.

One run, one machine: SGLang 0.5.23's real host pool (``MHATokenToKVPoolHost``, ``page_first``,
CPU) with pages of ``--page-tokens`` tokens (4 layers, 8 KV heads of 128, fp16: 512 KiB a page
at 32 tokens). Each round writes ``--pages`` new pages in calls of ``--batch`` (SGLang's own
call size is at most 128) and reads them back into other host pages, through:

- ``file``: SGLang's ``HiCacheFile`` in a fresh directory (``--dir``, default a temporary one),
  through the calls SGLang's controller makes for it (``batch_set`` of each page's
  ``get_data_page``, ``batch_get`` into flat pages, then ``set_from_flat_data_page``);
- ``kvoffload v1``: ``KVOffloadStorage`` with ``interface_v1`` (``batch_set_v1`` /
  ``batch_get_v1``: copies between the page regions and the mapped pool), against a real
  ``kvoffload serve`` on a Unix socket;
- ``kvoffload legacy``: the same backend through the calls the ``file`` backend gets.

Prints the median pages/s over ``--rounds`` per backend and direction, and each one's ratio to
``file`` measured in the same run; writes ``bench/results/sglang_backend.json``. Needs SGLang:
``make bench-sglang`` (``.venv-sglang``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from testsupport import sglang_stubs as stubs  # noqa: E402

stubs.install()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    from bench import harness
    from testsupport import sglang_pools as P
    from testsupport.server import ServerProcess

RESULTS = harness.RESULTS_DIR / "sglang_backend.json"
LAYERS, HEADS, HEAD_DIM = 4, 8, 128
Op = Callable[[list[str], torch.Tensor], bool]


def page_bytes(page_tokens: int) -> int:
    return 2 * LAYERS * HEADS * HEAD_DIM * page_tokens * P.DTYPE.itemsize


def legacy_ops(backend: Any, host: Any, page: int) -> tuple[Op, Op]:
    """``set`` and ``get`` as SGLang's controller makes them for a non-v1 backend."""

    def put(keys: list[str], idx: torch.Tensor) -> bool:
        data = [host.get_data_page(int(idx[i * page])) for i in range(len(keys))]
        return bool(backend.batch_set(keys, data))

    def get(keys: list[str], idx: torch.Tensor) -> bool:
        targets = [host.get_dummy_flat_data_page() for _ in keys]
        got = backend.batch_get(keys, targets)
        for i, t in enumerate(got):
            if t is None:
                return False
            host.set_from_flat_data_page(int(idx[i * page]), t)
        return True

    return put, get


def v1_ops(backend: Any) -> tuple[Op, Op]:
    def put(keys: list[str], idx: torch.Tensor) -> bool:
        return all(backend.batch_set_v1(keys, idx))

    def get(keys: list[str], idx: torch.Tensor) -> bool:
        return all(backend.batch_get_v1(keys, idx))

    return put, get


def one_round(
    ops: tuple[Op, Op], pools: P.Pools, keys: list[str], batch: int, page: int
) -> tuple[float, float]:
    """(pages/s set, pages/s got) of one round: ``keys`` written from the first host pages and
    read back into the pages after them; bytes compared after."""
    put, get = ops
    n = len(keys)
    src = torch.arange(0, n * page)
    dst = torch.arange(n * page, 2 * n * page)
    start = time.perf_counter()
    for i in range(0, n, batch):
        assert put(keys[i : i + batch], src[i * page : (i + batch) * page]), "a set failed"
    set_s = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(0, n, batch):
        assert get(keys[i : i + batch], dst[i * page : (i + batch) * page]), "a get failed"
    get_s = time.perf_counter() - start
    assert P.page_bytes(pools.host, dst[: 2 * page]) == P.page_bytes(pools.host, src[: 2 * page])
    return n / set_s, n / get_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=256, help="pages written and read a round")
    parser.add_argument("--batch", type=int, default=64, help="pages per call (SGLang: <= 128)")
    parser.add_argument("--page-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="the file backend's directory")
    args = parser.parse_args()
    page, n = args.page_tokens, args.pages
    pb = page_bytes(page)
    geometry = {"page": page, "layers": LAYERS, "heads": HEADS, "head_dim": HEAD_DIM}
    pools = P.make_pools("page_first", seed=1, device_tokens=n * page, **geometry)
    work = Path(tempfile.mkdtemp(prefix="sglang-bench-"))
    file_dir = args.dir or work / "file"
    server = ServerProcess(work, "--block-bytes", str(pb), "--num-blocks", str(2 * n))
    server.start()
    rates: dict[str, dict[str, list[float]]] = {}
    try:
        url = f"unix://{server.uds}"
        file_cfg = P.storage_config({"file_storage_path": str(file_dir)}, "page_first")
        file_backend = HiCacheFile(file_cfg)
        kv_v1 = P.backend(pools, P.extra_config(url, v1=True))
        kv_legacy = P.backend(pools, P.extra_config(url, v1=False))
        arms = {
            "file": legacy_ops(file_backend, pools.host, page),
            "kvoffload v1": v1_ops(kv_v1),
            "kvoffload legacy": legacy_ops(kv_legacy, pools.host, page),
        }
        for r in range(args.rounds):
            for a, (name, ops) in enumerate(arms.items()):
                # New keys every round and arm: every set is a write, every get a read.
                keys = P.page_keys(P.tokens(seed=100 * r + a, pages=n))
                if name != "file":
                    server_clear(server)
                s, g = one_round(ops, pools, keys, args.batch, page)
                rates.setdefault(name, {"set": [], "get": []})
                rates[name]["set"].append(s)
                rates[name]["get"].append(g)
            file_backend.clear()
        counters = {"kvoffload v1": kv_v1.counters, "kvoffload legacy": kv_legacy.counters}
        kv_v1.close()
        kv_legacy.close()
    finally:
        server.stop()
    medians = {
        name: {d: statistics.median(v) for d, v in dirs.items()} for name, dirs in rates.items()
    }
    base = medians["file"]
    print(
        f"SGLang HiCache L3, {n} pages of {pb // 1024} KiB a round, {args.batch} a call, "
        f"{args.rounds} rounds (median pages/s; ratio to file, same run)"
    )
    print(f"{'backend':<18}{'set pages/s':>14}{'x file':>9}{'get pages/s':>14}{'x file':>9}")
    for name, m in medians.items():
        print(
            f"{name:<18}{m['set']:>14.0f}{m['set'] / base['set']:>9.2f}"
            f"{m['get']:>14.0f}{m['get'] / base['get']:>9.2f}"
        )
    harness.write_results(
        RESULTS,
        {
            "machine": harness.machine(torch=torch.__version__),
            "sglang": "0.5.23",
            "params": vars(args) | {"dir": str(file_dir), "page_bytes": pb},
            "rounds": rates,
            "median_pages_per_s": medians,
            "ratio_to_file": {
                name: {d: m[d] / base[d] for d in ("set", "get")} for name, m in medians.items()
            },
            "counters": counters,
        },
    )


def server_clear(server: ServerProcess) -> None:
    """Empty the pool between rounds, so that every round's sets find room without eviction."""
    from kvoffload_client.client import KVOffloadAdminClient

    from testsupport.server import TOKEN

    with KVOffloadAdminClient(server.admin_url, token=TOKEN) as admin:
        admin.clear_cache()


if __name__ == "__main__":
    main()
