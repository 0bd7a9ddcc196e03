"""An engine that dies holding leases: the service expires them and its log names the request.

The engine runs in its own process, loads a prefix another engine stored, and hangs in the copy
(its copy thread blocked): the service holds the load's pins under vLLM's request id. The
process is then killed; the service's lease TTL frees the pins, and its JSON log line says
which request lost them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tests.vllm.conftest import leases, serve
from testsupport.vllm_sim import SimEngine, keys_of, kv_transfer_config

ROOT = Path(__file__).resolve().parents[2]
REQ_ID = "cmpl-dead-7c1e-0"

HUNG_ENGINE = """
import sys, time
sys.path.insert(0, sys.argv[2])
from kvoffload_client.vllm.copier import Copier
from testsupport.vllm_sim import SimEngine, keys_of, kv_transfer_config
Copier._copy = lambda self, task: time.sleep(3600)  # hangs mid-copy
engine = SimEngine("t-dead-hung", kv_transfer_config(sys.argv[1], cpu_chunks=16))
engine.run_request(sys.argv[3], keys_of(range(500, 506)), max_steps=100000)
"""


def test_dead_engines_leases_expire_and_the_log_names_its_request(tmp_path: Path):
    flags = ("--lease-ttl-s", "2", "--lease-check-interval-s", "0.2", "--job-deadline-s", "1")
    with serve(tmp_path, *flags, "--log-format", "json", "--log-level", "info").serving() as srv:
        url = f"unix://{srv.uds}"
        writer = SimEngine("t-dead-writer", kv_transfer_config(url, cpu_chunks=16))
        try:
            writer.run_request("dead-writer-1", keys_of(range(500, 506)))
            writer.settle()
        finally:
            writer.close()
        hung = subprocess.Popen(
            [sys.executable, "-c", HUNG_ENGINE, url, str(ROOT), REQ_ID],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 60
            while not any(r["req_id"] == REQ_ID and r["pins"] for r in leases(srv)):
                assert time.monotonic() < deadline, "the hung engine never pinned its load"
                assert hung.poll() is None
                time.sleep(0.1)
        finally:
            hung.kill()
            hung.wait()
        deadline = time.monotonic() + 30
        while leases(srv):
            assert time.monotonic() < deadline, leases(srv)
            time.sleep(0.2)
    lines = [json.loads(line) for line in srv.log().splitlines() if line.startswith("{")]
    expired = [line for line in lines if line.get("req_id") == REQ_ID]
    assert expired
    assert any(line.get("pins_released") for line in expired)
