"""Dynamo's standalone KV indexer as a subprocess on this host, and its HTTP API: ``register``
a kvoffload publisher as an instance, ``query`` which instances hold a prompt's prefix.

Shared by ``tests/router`` and ``bench/router.py``. The indexer runs from the Python that
``KVOFFLOAD_DYNAMO_PYTHON`` names (``.venv-dynamo``); this module itself imports no Dynamo.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from testsupport.polling import until
from testsupport.ports import free_port
from testsupport.server import ROOT, ServerProcess

MODEL = "kv-model"
BLOCK_TOKENS = 4
#: The environment with Dynamo's runtime (``make test-router`` builds ``.venv-dynamo``).
DYNAMO_PYTHON = Path(os.environ.get("KVOFFLOAD_DYNAMO_PYTHON", ROOT / ".venv-dynamo/bin/python"))


def dynamo_missing() -> str | None:
    """Why Dynamo's indexer cannot run here (None: it can)."""
    if not DYNAMO_PYTHON.exists():
        return f"{DYNAMO_PYTHON} does not exist"
    probe = subprocess.run(
        [str(DYNAMO_PYTHON), "-c", "import dynamo._core"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if probe.returncode != 0:
        return f"{DYNAMO_PYTHON} cannot import dynamo._core: {probe.stderr.strip()[-500:]}"
    return None


class Indexer:
    """One ``run_kv_indexer`` process (one thread) on a free port; its log in ``log_path``."""

    def __init__(self, workdir: Path, model: str = MODEL) -> None:
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"indexer-{self.port}.log"
        args = ["--port", str(self.port), "--threads", "1"]
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    str(DYNAMO_PYTHON),
                    "-c",
                    f"import dynamo._core as c; c.run_kv_indexer({args!r})",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.http = httpx.Client(base_url=self.url, timeout=10)
        until("the indexer answers /health", self._healthy, 60)

    def _healthy(self) -> bool | None:
        if self.proc.poll() is not None:
            raise AssertionError(f"the indexer exited:\n{self.log()}")
        return True if self.http.get("/health").status_code == 200 else None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def register(self, instance_id: int, srv: ServerProcess, endpoints: tuple[str, str]) -> None:
        """Subscribe to ``srv``'s publisher as instance ``instance_id``."""
        pub, replay = endpoints
        body = {
            "instance_id": instance_id,
            "endpoint": pub,
            "replay_endpoint": replay,
            "model_name": self.model,
            "block_size": BLOCK_TOKENS,
        }
        r = self.http.post("/register", json=body)
        assert r.status_code == 201, r.text

    def query(self, tokens: list[int]) -> dict[str, dict[str, Any]]:
        """Each instance holding a prefix of ``tokens``: its ``longest_matched`` and the
        tokens of it in each tier (``gpu``, ``cpu``, ``disk``)."""
        r = self.http.post("/query", json={"token_ids": tokens, "model_name": self.model})
        assert r.status_code == 200, r.text
        instances: dict[str, dict[str, Any]] = r.json()["instances"]
        return instances

    def until(
        self, tokens: list[int], check: Callable[[dict[str, dict[str, Any]]], bool]
    ) -> dict[str, dict[str, Any]]:
        """Query until ``check`` holds of the answer (events reach the indexer in their own
        time); AssertionError with the last answer and the indexer's log past 30 s."""
        last: dict[str, dict[str, Any]] = {}

        def probe() -> dict[str, dict[str, Any]] | None:
            nonlocal last
            last = self.query(tokens)
            return last if check(last) else None

        try:
            return until(f"indexer answer for {tokens[:8]}...", probe, 30, every_s=0.1)
        except AssertionError:
            raise AssertionError(f"last answer {last}; indexer log:\n{self.log()}") from None

    def stop(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
