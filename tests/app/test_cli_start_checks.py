"""Start-up refusals and warnings of ``kvoffload serve`` that name the right setting: both
listeners on one port (#43.3), a block larger than memory (#43.4), a mistyped ``KVOFFLOAD_*``
variable and tier name (#43.6)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from app import cli, server
from app.core import lower_tiers, transfers
from app.core.tier import backends
from app.settings import ConfigError, Settings, load_settings, unknown_variables
from app.telemetry.logging import fields_of, unconfigure_logging


@pytest.mark.parametrize(
    ("host", "admin_host"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("localhost", "127.0.0.1"),
        ("::1", "localhost"),
    ],
)
def test_both_listeners_on_one_port_are_refused_in_one_line(
    host: str, admin_host: str, capsys: pytest.CaptureFixture[str], started: list[Any]
) -> None:
    argv = ["serve", "--port", "19077", "--admin-port", "19077"]
    assert cli.main([*argv, "--host", host, "--admin-host", admin_host]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("kvoffload: --admin-port / KVOFFLOAD_ADMIN_PORT = 19077: ")
    assert "the engine listener's port too (--port / KVOFFLOAD_PORT" in line
    assert line.endswith("accepted: another port, or 0 for any")
    assert not started


def test_a_wildcard_overlaps_every_address_and_other_ports_or_addresses_start() -> None:
    tokens = {"admin_token": "t0ken-0123456789", "tenants": None}
    with pytest.raises(ConfigError, match="--admin-port"):
        load_settings(**tokens, admin_host="0.0.0.0", port=9000, admin_port=9000)
    assert load_settings(port=9000, admin_port=9001).admin_port == 9001
    assert load_settings(port=0, admin_port=0).port == 0
    assert load_settings(host="127.0.0.1", admin_host="127.0.0.2", port=9000, admin_port=9000)


def test_a_block_larger_than_memory_blames_block_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfers, "available_memory", lambda: 1 << 30)
    with pytest.raises(ConfigError) as refused:
        transfers.check_machine(Settings(device="cpu", block_bytes=1 << 40))
    assert refused.value.field == "block_bytes"
    assert str(refused.value).startswith("--block-bytes / KVOFFLOAD_BLOCK_BYTES = 1099511627776: ")
    assert str(refused.value).endswith(f"accepted: at most {1 << 30} bytes")
    # A block that fits, too many of them: the number of blocks, as before.
    with pytest.raises(ConfigError) as refused:
        transfers.check_machine(Settings(device="cpu", block_bytes=1 << 20, num_blocks=2048))
    assert refused.value.field == "num_blocks"


def test_unknown_variables_are_found_with_the_closest_setting() -> None:
    environ = {
        "KVOFFLOAD_NUM_BLOCK": "100",
        "kvoffload_port": "9000",  # a setting's, in another case: read
        "KVOFFLOAD_ADMIN_URL": "http://x",  # the admin command's
        "KVOFFLOAD_TOKEN_FILE": "/t",  # the vLLM tier's
        "KVOFFLOAD_WHATEVER": "1",
        "PATH": "/bin",
    }
    assert unknown_variables(environ) == [
        ("KVOFFLOAD_NUM_BLOCK", "KVOFFLOAD_NUM_BLOCKS"),
        ("KVOFFLOAD_WHATEVER", None),
    ]


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """``kvoffload serve`` with ``run`` replaced: the settings it would have run with."""
    ran: list[Any] = []
    monkeypatch.setattr(server, "run", ran.append)
    yield ran
    unconfigure_logging()  # the handlers write to this test's captured streams


def test_serve_warns_of_a_mistyped_variable_in_one_log_line(
    started: list[Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KVOFFLOAD_NUM_BLOCK", "100")
    assert cli.main(["serve", "--log-format", "json"]) == 0
    assert started[0].num_blocks == 4096
    (warning,) = [r for r in caplog.records if r.getMessage() == "unknown variable ignored"]
    assert warning.levelno == logging.WARNING
    fields = fields_of(warning)
    assert fields == {"variable": "KVOFFLOAD_NUM_BLOCK", "did_you_mean": "KVOFFLOAD_NUM_BLOCKS"}
    assert "100" not in json.dumps(fields)  # names only: a value may be a secret


def test_a_mistyped_tier_gets_a_did_you_mean() -> None:
    settings = Settings(tiers=["disks"])
    with pytest.raises(ConfigError) as refused:
        lower_tiers.chain_order(settings, backends())
    assert "no tier named 'disks' (did you mean 'disk'?)" in str(refused.value)
