"""What differs between the vLLM releases the engine side supports: 0.32 and 0.33.

The tier's interface (``vllm.v1.kv_offload.tiering``) is the same in both but for what 0.33 added,
which the tier either defines for 0.33 only or does without:

- ``ConfigInfoMapping`` (the labels of ``vllm:kv_offload_config_info``) exists from 0.33; on 0.32
  the tier's ``config_info`` is never called and the name is a plain alias here.
- 0.33's tiering manager has a lock and a tier-poll thread; 0.32 has neither. The tier does not
  rely on them: it does not opt in to off-thread polling, so both releases call it from the
  scheduler thread only, and its own threads share state through ``Shared`` alone.
- 0.33 calls ``on_schedule_end`` last in a step; 0.32 calls it before the step's
  ``on_request_finished``, so what the tier records after it waits for the next step, which
  ``has_pending_work`` asks for.
- 0.33's workers take ``expedited`` on ``submit_load``; ``kvoffload_client.vllm.cpu`` accepts it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

log = logging.getLogger("kvoffload.vllm_tier")

#: The vLLM releases the engine side is written and tested for (the client's ``vllm`` extra).
SUPPORTED_VLLM = ((0, 32), (0, 33))

if TYPE_CHECKING:
    ConfigInfoMapping = Mapping[str, str | int | float | bool]
else:
    try:
        from vllm.v1.kv_offload.base import ConfigInfoMapping
    except ImportError:  # vLLM 0.32
        ConfigInfoMapping = Mapping[str, str | int | float | bool]


def release(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string such as ``0.32.0`` or ``0.33.1.dev3+cpu``; None
    when it does not start with two numbers."""
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def warn_if_unsupported(version: str) -> bool:
    """Log a warning when ``version`` (vLLM's) is not a supported release; whether it is."""
    supported = release(version) in SUPPORTED_VLLM
    if not supported:
        names = " and ".join(f"{a}.{b}" for a, b in SUPPORTED_VLLM)
        log.warning(
            "kvoffload tier: vLLM %s is not a release this tier supports (%s); its tiering "
            "interface may differ",
            version,
            names,
        )
    return supported
