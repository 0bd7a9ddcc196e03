"""A GPU "engine" for the CUDA IPC test: exports CUDA tensors by IPC handle and checks blocks.

Protocol (JSON lines on stdin/stdout): it first prints ``{"spec": ...}`` (a registration
body with ``cuda_ipc`` handles); then ``{"op": "digest", "blocks": [...]}`` answers
``{"digests": [...]}`` (one string per block, over every tensor); ``{"op": "write_after",
"cycles": C, "value": V}`` queues, on a stream of its own, a GPU sleep of ``C`` cycles and then
a write of the byte ``V`` over every tensor, records an interprocess event after them and
answers at once ``{"event": "<hex of its IPC handle>"}`` (the writes still running: what an
engine's forward pass looks like to the service); ``{"op": "exit"}`` ends it. Run as
``python -m testsupport.ipc_child`` on a CUDA machine (``tests/transfer/test_gpu.py``,
``bench/gpu_check.py``). Imports torch: import it only where torch is installed.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch

from testsupport.kvref import MIXED_LAYOUT, device_block, shapes
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
    kept: list[object] = []  # an exported event must outlive the jobs that wait on it
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        if cmd["op"] == "write_after":
            stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            with torch.cuda.stream(stream):
                torch.cuda._sleep(int(cmd["cycles"]))  # type: ignore[no-untyped-call]
                for flat in flats:
                    flat.fill_(int(cmd["value"]))
            event = torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]
            event.record(stream)
            kept.append((stream, event))
            handle = bytes(event.ipc_handle())  # type: ignore[no-untyped-call]
            print(json.dumps({"event": handle.hex()}), flush=True)
            continue
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
