"""Sizes take units (#43.5): every byte-size setting reads ``100M``, ``64KiB``, ``200GiB`` from
flags, variables and the config file (K, M, G, T: powers of 1000; Ki, Mi, Gi, Ti: of 1024, as
Kubernetes writes quantities), and ``--help`` prints their defaults in units."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.cli import main
from app.settings import (
    SIZE_ACCEPTED,
    ConfigError,
    Settings,
    format_size,
    is_size,
    load_settings,
    parse_size,
)
from tests.api.test_settings import parse_serve

SIZES = [
    ("100M", 100_000_000),
    ("100MB", 100_000_000),
    ("100m", 100_000_000),
    ("64k", 64_000),
    ("64Ki", 65536),
    ("64KiB", 65536),
    ("64 KiB", 65536),
    ("200GiB", 200 << 30),
    ("1.5Gi", 3 << 29),
    ("2T", 2 * 10**12),
    ("1TiB", 1 << 40),
    ("214748364800", 214748364800),
]


@pytest.mark.parametrize(("text", "size"), SIZES)
def test_a_size_reads_units(text: str, size: int) -> None:
    assert parse_size(text) in (size, text)  # a bare integer is left to pydantic
    assert load_settings(disk_bytes=text).disk_bytes == size


def test_every_byte_setting_is_a_size() -> None:
    named = {name for name in Settings.model_fields if name.endswith("_bytes")}
    assert named == {name for name, field in Settings.model_fields.items() if is_size(field)}
    assert len(named) >= 9


def test_sizes_from_flags_variables_and_the_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "kv.toml"
    config.write_text('disk_staging_bytes = "256MiB"\nobject_bytes = "1T"\n')
    monkeypatch.setenv("KVOFFLOAD_MAX_BODY_BYTES", "16MiB")
    s = parse_serve("--config", str(config), "--block-bytes", "128KiB", "--disk-bytes", "100G")
    assert (s.block_bytes, s.disk_bytes) == (128 << 10, 100 * 10**9)
    assert s.max_body_bytes == 16 << 20
    assert (s.disk_staging_bytes, s.object_bytes) == (256 << 20, 10**12)


@pytest.mark.parametrize("text", ["lots", "1.5", "64KB2", "K", "1.0000000001K", "64 XiB", "-1K"])
def test_a_value_that_is_not_a_size_is_refused_in_one_line(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", f"--disk-bytes={text}"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"kvoffload: --disk-bytes / KVOFFLOAD_DISK_BYTES = {text!r}: {SIZE_ACCEPTED}"
    assert "powers of 1000" in line
    assert "powers of 1024" in line


def test_a_size_out_of_bounds_says_so() -> None:
    with pytest.raises(ConfigError, match="too small; accepted: a size in bytes greater than 0"):
        load_settings(block_bytes="0KiB")


def test_the_config_file_refusal_names_its_key(tmp_path: Path) -> None:
    config = tmp_path / "kv.toml"
    config.write_text('disk_bytes = "lots"\n')
    with pytest.raises(ConfigError) as refused:
        load_settings(config=config)
    assert f"key disk_bytes = 'lots': {SIZE_ACCEPTED}" in str(refused.value)


def test_help_prints_sizes_in_units(capsys: pytest.CaptureFixture[str]) -> None:
    assert [format_size(n) for n in (65536, 8 << 20, 64 << 30, 10**8, 0, 1000 + 1)] == [
        "64 KiB",
        "8 MiB",
        "64 GiB",
        "100 MB",
        "0",
        "1001",
    ]
    with pytest.raises(SystemExit):
        main(["serve", "--help-all"])
    out = " ".join(capsys.readouterr().out.split())
    block = out.partition("--block-bytes BLOCK_BYTES")[2].partition(" --")[0]
    assert block.strip() == "bytes per host block (default: 64 KiB); env KVOFFLOAD_BLOCK_BYTES"
    assert "(default: 8 MiB)" in out.partition("--max-body-bytes")[2].partition(" --")[0]
