"""What every test shares: an environment without ``KVOFFLOAD_*`` variables, and a small disk.

The service reads its settings from ``KVOFFLOAD_*`` variables, so a variable left in the shell
would change what a test builds or starts; each test runs with none (a test sets its own).
``tmpfs`` mounts an 8 MiB filesystem of the test's own, for a disk that really fills up.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVOFFLOAD_"):
            monkeypatch.delenv(name)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs, mode 0700, unmounted after the test (root only: skipped otherwise, or
    where the container may not mount)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(mnt)],
        check=False,
        capture_output=True,
    )
    if done.returncode != 0:
        pytest.skip("mount -t tmpfs refused here (no CAP_SYS_ADMIN in this container)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
