"""``make object-local`` (``deploy/tools/local_s3.py``) where it cannot start: without Ceph it
says which Debian packages to install, with a bad bucket name which names are accepted, and
in both cases leaves nothing behind. The cluster itself: ``tests/object/test_local_s3.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "deploy" / "tools" / "local_s3.py"


def run_tool(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The tool with a PATH that holds no Ceph binary and TMPDIR a fresh directory."""
    empty = tmp_path / "bin"
    empty.mkdir(exist_ok=True)
    runs = tmp_path / "tmp"
    runs.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_RUNTIME_DIR", "PATH")}
    env |= {"PATH": str(empty), "TMPDIR": str(runs)}
    return subprocess.run(
        [sys.executable, str(TOOL), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_without_ceph_it_names_the_packages_and_leaves_nothing(tmp_path: Path) -> None:
    done = run_tool(tmp_path)
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert "radosgw" in lines[0]
    assert (
        "apt-get install --no-install-recommends ceph-mon ceph-osd radosgw ceph-common"
        in (lines[0])
    )
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_bad_bucket_name_is_refused_naming_the_flag(tmp_path: Path) -> None:
    done = run_tool(tmp_path, "--bucket", "Not_A_Bucket")
    assert done.returncode == 2
    assert "--bucket 'Not_A_Bucket'" in done.stderr
    assert "accepted: 3 to 63 lowercase letters" in done.stderr
    assert list((tmp_path / "tmp").iterdir()) == []
