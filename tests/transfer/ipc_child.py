"""A GPU "engine" for the CUDA IPC test: exports CUDA tensors by IPC handle and checks blocks.

Protocol (JSON lines on stdin/stdout): it first prints ``{"spec": ...}`` (a registration
body with ``cuda_ipc`` handles); then ``{"op": "digest", "blocks": [...]}`` answers
``{"digests": [...]}`` (one string per block, over every tensor), and ``{"op": "exit"}`` ends
it. Run as ``python -m tests.transfer.ipc_child`` on a CUDA machine.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch

from tests.transfer.kvref import MIXED_LAYOUT, device_block, shapes
from transfer import export_cuda_ipc_handle

N = 24


def main() -> None:
    gen = torch.Generator().manual_seed(5)
    layout = [
        (s, dt, bd) for s, (_x, dt, bd) in zip(shapes(MIXED_LAYOUT, N), MIXED_LAYOUT, strict=True)
    ]
    tensors = [
        torch.randint(-100, 100, shape, generator=gen).to(getattr(torch, dt)).cuda()
        for shape, dt, _bd in layout
    ]
    torch.cuda.synchronize()
    spec = {
        "name": "ipc-engine",
        "device": "cuda:0",
        "tensors": [
            {"shape": shape, "dtype": dt, "block_dim": bd, "handle": export_cuda_ipc_handle(t)}
            for t, (shape, dt, bd) in zip(tensors, layout, strict=True)
        ],
    }
    print(json.dumps({"spec": spec}), flush=True)
    flats = [t.reshape(-1).view(torch.uint8) for t in tensors]
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        torch.cuda.synchronize()
        digests = []
        for b in cmd["blocks"]:
            h = hashlib.sha256()
            for flat, (shape, dt, bd) in zip(flats, layout, strict=True):
                part = device_block(flat, shape, getattr(torch, dt).itemsize, bd, b).cpu()
                h.update(bytes(part.tolist()))
            digests.append(h.hexdigest())
        print(json.dumps({"digests": digests}), flush=True)


if __name__ == "__main__":
    main()
