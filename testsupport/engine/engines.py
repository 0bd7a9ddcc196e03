"""Engine processes for the tests (``testsupport/engine/driver.py``) and their kv-transfer configs.

``EngineProcess`` starts one engine in a session of its own (the driver, and vLLM's engine core
process under it), talks to it over a pipe, and stops it: ``quit``, then the whole session is
killed if it lingers; vLLM's shared host-tier file of the engine is removed either way.

Shared by ``tests/engine`` and ``bench/engine_e2e.py``; the driver it starts needs vLLM.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# What vLLM's CPU engine needs on a small machine: one OpenMP thread, not pinned to a core, and
# 1 GiB of KV cache. PYTHONHASHSEED: engines share blocks only with the same block hash seed.
ENGINE_ENV = {
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "PYTHONHASHSEED": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
START_TIMEOUT_S = 240.0


def kv_transfer_config(
    url: str,
    cpu_chunks: int,
    chunk_bytes: int,
    tier: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """docs/vllm.md's CPU engine configuration: vLLM's tiering with the host-copy worker
    (``kvoffload_client.vllm.cpu``), a primary tier of ``cpu_chunks`` chunks and kvoffload at
    ``url`` as its secondary tier (extra tier keys in ``tier``)."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "CPUTieringOffloadingSpec",
            "spec_module_path": "kvoffload_client.vllm.cpu",
            "cpu_bytes_to_use": cpu_chunks * chunk_bytes,
            "secondary_tiers": [
                {
                    "type": "KVOffloadTier",
                    "module_path": "kvoffload_client.vllm",
                    "url": url,
                    **(tier or {}),
                }
            ],
        },
    }


def direct_transfer_config(url: str, **keys: Any) -> dict[str, Any]:
    """docs/vllm.md's CPU engine on kvoffload's pool alone (``kvoffload_client.vllm.direct``),
    the service at ``url`` (more of the spec's keys in ``keys``)."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "KVOffloadSpec",
            "spec_module_path": "kvoffload_client.vllm.direct",
            "url": url,
            **keys,
        },
    }


@dataclass
class Output:
    tokens: list[int]
    logprobs: list[float]
    cached: int  # prompt tokens the engine did not compute


class EngineError(RuntimeError):
    """The engine process ended or did not answer; the message carries its log's tail."""


class EngineProcess:
    """One engine process (see the module docstring)."""

    def __init__(
        self,
        workdir: Path,
        name: str,
        model: Path,
        kv_config: dict[str, Any] | None,
        engine: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """``engine``: more ``LLM`` arguments (``testsupport/engine/driver.py``); ``env``: variables
        over ``ENGINE_ENV``."""
        self.name = name
        self.engine_id = f"kvoffload-test-{name}-{uuid.uuid4().hex[:8]}"
        config = None if kv_config is None else {**kv_config, "engine_id": self.engine_id}
        self.log_path = workdir / f"engine-{name}.log"
        self.argv = [sys.executable, "-m", "testsupport.engine.driver", str(model), "ANSWER_FD"]
        self.argv += [json.dumps(config), json.dumps(engine or {})]
        self.env = {**ENGINE_ENV, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self._answers = -1
        self._buffer = b""

    def start(self) -> EngineProcess:
        """Launch; ``wait_ready`` waits for the engine."""
        read, write = os.pipe()
        argv = [str(write) if a == "ANSWER_FD" else a for a in self.argv]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                env={**env, **self.env},
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(write,),
                start_new_session=True,
            )
        os.close(write)
        self._answers = read
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> EngineProcess:
        answer = self._read(timeout)
        if answer.get("ready") is not True:
            raise EngineError(f"engine {self.name}: {answer}\n{self.log_tail()}")
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def submit(self, command: dict[str, Any]) -> None:
        """Send a command; ``receive`` reads its answer (answers come in order)."""
        assert self.proc is not None
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(command) + "\n").encode())
        self.proc.stdin.flush()

    def receive(self, timeout: float = 120.0) -> dict[str, Any]:
        return self._read(timeout)

    def ask(self, command: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
        self.submit(command)
        return self._read(timeout)

    def generate(self, prompts: list[list[int]], max_tokens: int = 16) -> list[Output]:
        return self.timed_generate(prompts, max_tokens)[0]

    def timed_generate(
        self, prompts: list[list[int]], max_tokens: int = 16
    ) -> tuple[list[Output], float]:
        """The outputs, and the seconds the engine's ``generate`` took."""
        answer = self.ask({"op": "generate", "prompts": prompts, "max_tokens": max_tokens})
        if "outputs" not in answer:
            raise EngineError(f"engine {self.name}: {answer}\n{self.log_tail()}")
        return [Output(**o) for o in answer["outputs"]], float(answer["seconds"])

    def reset(self, connector: bool = True) -> None:
        """Empty the engine's prefix cache and, with ``connector``, vLLM's host tier (never
        kvoffload)."""
        answer = self.ask({"op": "reset", "connector": connector})
        if answer.get("reset") is not True:
            raise EngineError(f"engine {self.name}: reset refused: {answer}")

    def wait_exit(self, timeout: float) -> int:
        """The exit status of an engine that ends by itself (a refused start)."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        finally:
            self._cleanup()

    def quit(self) -> None:
        """Ask the engine to end, without waiting (``stop`` waits)."""
        proc = self.proc
        if proc is None or proc.stdin is None or proc.stdin.closed:
            return
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.stdin.write(b'{"op": "quit"}\n')
                proc.stdin.flush()
                proc.stdin.close()

    def stop(self, timeout: float = 60.0) -> None:
        """``quit``, wait up to ``timeout`` for the engine to end, then kill its session."""
        proc = self.proc
        if proc is None:
            return
        try:
            self.quit()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout)
        finally:
            # vLLM's engine core is a child in the same session: nothing of it may outlive us.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            self._cleanup()

    def _cleanup(self) -> None:
        if self.proc is not None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        if self._answers >= 0:
            os.close(self._answers)
            self._answers = -1
        for leftover in Path("/dev/shm").glob(f"vllm_offload_{self.engine_id}*"):
            leftover.unlink(missing_ok=True)

    def _read(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineError(
                    f"engine {self.name}: no answer in {timeout:g} s\n{self.log_tail()}"
                )
            ready, _, _ = select.select([self._answers], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = os.read(self._answers, 1 << 16)
            if not chunk:
                raise EngineError(f"engine {self.name} ended\n{self.log_tail()}")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        answer: dict[str, Any] = json.loads(line)
        return answer
