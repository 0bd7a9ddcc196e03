"""A disk tier whose index would not fit in memory is refused at start, saying what it would
cost (the trap: a huge --disk-bytes passed the disk's space check and took gigabytes)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import app.core.disk as disk_module
from app.core.disk import INDEX_MEMORY_PER_SLOT, check_index_memory, memory_available
from app.settings import ConfigError, Settings
from transfer.disk import disk_bytes_for


def test_an_index_larger_than_the_memory_available_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(disk_module, "memory_available", lambda: 100 * INDEX_MEMORY_PER_SLOT)
    fits = Settings(disk_dir=Path("/tmp"), disk_bytes=disk_bytes_for(100, 4096), block_bytes=4096)
    check_index_memory(fits)
    big = Settings(disk_dir=Path("/tmp"), disk_bytes=disk_bytes_for(101, 4096), block_bytes=4096)
    with pytest.raises(ConfigError) as refused:
        check_index_memory(big)
    message = str(refused.value)
    assert "--disk-bytes" in message
    assert "101 slots of 4096 bytes" in message
    assert f"accepted: at most {disk_bytes_for(100, 4096)} bytes" in message


def test_the_machine_s_memory_is_read() -> None:
    available = memory_available()
    assert available is None or available > 0


def test_the_bound_named_also_fits_the_disk_s_free_space(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The size a refusal suggests is one the next start accepts: not above the free space of
    the filesystem the directory would be made on (checked at open, after this)."""
    monkeypatch.setattr(disk_module, "memory_available", lambda: 100 * INDEX_MEMORY_PER_SLOT)
    monkeypatch.setattr(disk_module, "_free_bytes", lambda d: 50 * 4096)
    big = Settings(
        disk_dir=tmp_path / "not" / "made", disk_bytes=disk_bytes_for(101, 4096), block_bytes=4096
    )
    with pytest.raises(ConfigError) as refused:
        check_index_memory(big)
    assert f"accepted: at most {50 * 4096} bytes (the free space under {big.disk_dir})" in str(
        refused.value
    )


def test_free_space_is_read_from_the_nearest_existing_parent(tmp_path: Path) -> None:
    vfs = os.statvfs(tmp_path)
    assert disk_module._free_bytes(tmp_path / "a" / "b") == pytest.approx(
        vfs.f_bavail * vfs.f_frsize, rel=0.01
    )
