"""A GPU "engine" process for ``bench/gpu_check.py``: a CUDA KV cache exported by IPC handle.

``python -m bench.gpu_engine_child '{"blocks": N, "inner_bytes": B, "tensors": T}'`` allocates
``T`` uint8 tensors ``[N, B]`` (block_dim 0) on its ``cuda:0``, fills block ``b`` of tensor ``t``
with the byte ``pattern_byte(b, t)``, and prints one JSON line ``{"spec": ..., "pid": ...,
"bytes": ...}``: a registration body with ``cuda_ipc`` handles and the ``device_uuid`` of its
``cuda:0`` (so a service with another ``CUDA_VISIBLE_DEVICES`` finds the same GPU). It then
holds the memory until stdin says ``exit`` or closes, or until it is killed (the check kills it
mid-copy on purpose).
"""

from __future__ import annotations

import json
import os
import sys
import warnings

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch


def pattern_byte(block: int, tensor: int) -> int:
    """The byte every byte of block ``block`` of tensor ``tensor`` holds."""
    return (block * 31 + tensor * 7) % 251


def main() -> None:
    from transfer import export_cuda_ipc_handle

    cfg = json.loads(sys.argv[1])
    n, inner, count = int(cfg["blocks"]), int(cfg["inner_bytes"]), int(cfg["tensors"])
    tensors = []
    for t in range(count):
        values = ((torch.arange(n, dtype=torch.int64) * 31 + t * 7) % 251).to(torch.uint8)
        x = torch.empty((n, inner), dtype=torch.uint8, device="cuda:0")
        x.copy_(values.to("cuda:0")[:, None].expand(n, inner))
        tensors.append(x)
    torch.cuda.synchronize()
    spec = {
        "name": str(cfg.get("name", "gpu-check-engine")),
        "device": "cuda:0",
        "device_uuid": str(torch.cuda.get_device_properties(0).uuid),
        "tensors": [
            {"shape": [n, inner], "dtype": "uint8", "block_dim": 0, "handle": h}
            for h in (export_cuda_ipc_handle(x) for x in tensors)
        ],
    }
    print(json.dumps({"spec": spec, "pid": os.getpid(), "bytes": n * inner * count}), flush=True)
    for line in sys.stdin:
        if line.strip() == "exit":
            break


if __name__ == "__main__":
    main()
