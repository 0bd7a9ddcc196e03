"""``make object-local`` (``deploy/tools/local_s3.py``) for real: the cluster comes up with its
bucket and a 0600 credentials file in a private directory, the ``kvoffload serve`` command it
prints runs the object tier against it as printed (only the ports are added), and Ctrl-C
(SIGINT) stops it all and removes the directory."""

from __future__ import annotations

import configparser
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from testsupport import rgw as rgw_module
from testsupport.server import TOKEN, ServerProcess

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "deploy" / "tools" / "local_s3.py"


def printed_command(lines: list[str]) -> list[str]:
    """The ``kvoffload serve`` command the tool printed (its continuation lines joined)."""
    start = next(i for i, line in enumerate(lines) if "kvoffload serve" in line)
    text = lines[start].rstrip("\n").removesuffix("\\") + lines[start + 1]
    return shlex.split(text)


def test_object_local_serves_a_bucket_the_printed_command_uses(
    ceph_installed: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    runs = tmp_path / "tmp"
    runs.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    env["TMPDIR"] = str(runs)
    proc = subprocess.Popen(
        [sys.executable, str(TOOL), "--bucket", "kv-test"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(5)]
        assert lines[0].startswith("object-local: S3 at http://127.0.0.1:"), lines
        argv = printed_command(lines)
        assign, command = argv[0], argv[1:]
        name, _, credentials = assign.partition("=")
        assert name == "AWS_SHARED_CREDENTIALS_FILE"
        home = Path(credentials).parent
        assert home.parent == runs
        assert home.stat().st_mode & 0o777 == 0o700
        assert Path(credentials).stat().st_mode & 0o777 == 0o600
        keys = configparser.ConfigParser()
        keys.read(credentials)
        endpoint = command[command.index("--object-endpoint") + 1]
        status, _ = rgw_module._s3_request(
            int(endpoint.rsplit(":", 1)[1]),
            keys["default"]["aws_access_key_id"],
            keys["default"]["aws_secret_access_key"],
            "GET",
            "/kv-test",
            b"",
            5.0,
        )
        assert status == 200, "the bucket was made, and the file's keys reach it"
        assert command[:2] == ["kvoffload", "serve"]
        server = ServerProcess(
            tmp_path, *command[2:], env={"AWS_SHARED_CREDENTIALS_FILE": credentials}
        )
        with server.serving():
            headers = {"Authorization": f"Bearer {TOKEN}"}
            # The tier's probe lists the bucket every second: ok for two seconds on end means
            # probes found it (a missing bucket or refused keys turn it degraded at once).
            tier: dict[str, object] = {}
            for _ in range(300):
                stats = httpx.get(f"{server.admin_url}/admin/v1/stats", headers=headers).json()
                tier = stats["tiers"]["object"]
                assert (tier["state"], tier["bucket"]) == ("ok", "kv-test"), tier
                if float(str(tier["seconds_in_state"])) >= 2.0:
                    break
                time.sleep(0.1)
            else:
                pytest.fail(f"the tier never held ok for 2 s: {tier}")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert not home.exists()
        assert list(runs.iterdir()) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
