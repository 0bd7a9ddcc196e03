"""Tests of the kvoffload tier inside vLLM 0.33's real tiering code (CPU only).

They need vLLM, which the default environment does not have: without it this directory is not
collected, unless ``KVOFFLOAD_REQUIRE_VLLM=1`` (set by ``make test-vllm``), where a missing vLLM
is an error, never a skip.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("KVOFFLOAD_REQUIRE_VLLM") == "1":
        raise RuntimeError(
            "KVOFFLOAD_REQUIRE_VLLM=1 but vllm is not importable: run `make test-vllm`, which "
            "installs it into .venv-vllm"
        )
    collect_ignore_glob = ["*"]
else:
    # vLLM and torch warn at import (deprecations of their own); under filterwarnings=error
    # that would fail the first test that happens to trigger the import. Import them here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import kvoffload_client.vllm  # noqa: F401
        import torch.utils.mkldnn  # noqa: F401
        import vllm.v1.kv_offload.tiering.spec  # noqa: F401

    from kvoffload_client.client import KVOffloadAdminClient

    from testsupport.server import TOKEN, ServerProcess

    SERVE_FLAGS = ("--block-bytes", "4096", "--num-blocks", "256")

    def serve(workdir: Path, *extra: str) -> ServerProcess:
        """A ``kvoffload serve`` on ``workdir/kv.sock`` whose blocks are one simulated chunk."""
        return ServerProcess(workdir, *SERVE_FLAGS, *extra)

    def leases(srv: ServerProcess) -> list[dict[str, Any]]:
        """Requests the service tracks that hold pins or pending stores."""
        with KVOffloadAdminClient(srv.admin_url, token=TOKEN) as admin:
            tracked = admin.requests()["requests"]
        return [r for r in tracked if r["pins"] or r["pending_stores"]]

    def tracked(srv: ServerProcess) -> int:
        with KVOffloadAdminClient(srv.admin_url, token=TOKEN) as admin:
            return int(admin.requests()["total"])

    @pytest.fixture(autouse=True)
    def _no_shm_leftovers() -> Iterator[None]:
        yield
        for path in Path("/dev/shm").glob("vllm_offload_t-*"):
            path.unlink(missing_ok=True)
