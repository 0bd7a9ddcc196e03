"""A disk tier whose index would not fit in memory is refused at start, saying what it would
cost (the trap: a huge --disk-bytes passed the disk's space check and took gigabytes)."""

from __future__ import annotations

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
