"""Reference geometry for the tests: what a host block must hold, computed the slow, obvious way.

Shared by the test process, the engine subprocess (``tests.transfer.engine_proc``) and
``bench/gpu_check.py``. Imports torch: import it only where torch is installed.
"""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Sequence

import torch

# (shape with N where the block dimension goes, dtype, block_dim): several tensors, mixed
# dtypes, block_dim other than 0, outer > 1.
MIXED_LAYOUT: list[tuple[list[int | str], str, int]] = [
    ([2, "N", 4, 8], "float16", 1),  # K/V first, like vLLM's flash-attn layout
    (["N", 2, 16], "bfloat16", 0),
    ([3, 2, "N", 5], "float32", 2),
    (["N", 64], "int8", 0),
]


def shapes(layout: Sequence[tuple[list[int | str], str, int]], n: int) -> list[list[int]]:
    return [[n if d == "N" else int(d) for d in shape] for shape, _dt, _bd in layout]


def mixed_layout(n: int) -> list[tuple[list[int], str, int]]:
    """``MIXED_LAYOUT`` with ``n`` device blocks: ``(shape, dtype, block_dim)`` per tensor."""
    return [
        (s, dt, bd) for s, (_x, dt, bd) in zip(shapes(MIXED_LAYOUT, n), MIXED_LAYOUT, strict=True)
    ]


def bytes_per_block(shape: Sequence[int], dtype: str, block_dim: int) -> int:
    itemsize: int = getattr(torch, dtype).itemsize
    return math.prod(shape) // shape[block_dim] * itemsize


def block_bytes_of(layout: Sequence[tuple[list[int | str], str, int]], n: int) -> int:
    return sum(
        bytes_per_block(s, dt, bd)
        for s, (_shape, dt, bd) in zip(shapes(layout, n), layout, strict=True)
    )


def device_block(
    flat: torch.Tensor, shape: Sequence[int], itemsize: int, bd: int, b: int
) -> torch.Tensor:
    """Bytes of device block ``b`` of one tensor, in host order (outer-major)."""
    outer = math.prod(shape[:bd])
    n = shape[bd]
    inner = math.prod(shape[bd + 1 :]) * itemsize
    return flat.view(outer, n, inner)[:, b, :].reshape(-1)


def host_block(
    flats: Sequence[torch.Tensor],
    layout: Sequence[tuple[Sequence[int], str, int]],
    b: int,
) -> torch.Tensor:
    """The host block device block ``b`` must become: every tensor's part, in tensor order."""
    parts = [
        device_block(f, shape, getattr(torch, dt).itemsize, bd, b)
        for f, (shape, dt, bd) in zip(flats, layout, strict=True)
    ]
    return torch.cat(parts)


def unique_prefix(tag: str) -> str:
    return f"kvotest-{tag}-{os.getpid()}-{secrets.token_hex(4)}"
