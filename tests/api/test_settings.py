"""Settings precedence (flags > env > file > defaults), validation, and the serve flags."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest
from pydantic import SecretStr, ValidationError

from app.cli import _build_parser, settings_from_args
from app.settings import ConfigError, Settings, flag_name, load_settings


def _serve_parser() -> argparse.ArgumentParser:
    parser = _build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            serve: argparse.ArgumentParser = action.choices["serve"]
            return serve
    raise AssertionError("no serve subcommand")


def parse_serve(*argv: str) -> Settings:
    return settings_from_args(_build_parser().parse_args(["serve", *argv]))


def test_defaults_are_a_working_cpu_service_on_loopback() -> None:
    s = Settings()
    assert (s.host, s.port, s.admin_host, s.admin_port) == ("127.0.0.1", 8000, "127.0.0.1", 8001)
    assert (s.num_blocks, s.policy, s.device, s.uds) == (4096, "lru", "auto", None)
    assert s.admin_token_value() is None


def test_flags_beat_env_beat_file_beat_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "kv.toml"
    cfg.write_text('num_blocks = 111\nport = 9001\npolicy = "arc"\nblock_bytes = 8192\n')
    monkeypatch.setenv("KVOFFLOAD_NUM_BLOCKS", "222")
    monkeypatch.setenv("KVOFFLOAD_PORT", "9002")
    s = parse_serve("--config", str(cfg), "--num-blocks", "333")
    assert s.num_blocks == 333  # flag
    assert s.port == 9002  # env over file
    assert s.policy == "arc"  # file over default
    assert s.block_bytes == 8192
    assert s.admin_port == 8001  # default


def test_config_file_from_env_and_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "kv.json"
    cfg.write_text(
        json.dumps({"num_blocks": 7, "policy": "slru", "policy_params": {"protected_ratio": 0.5}})
    )
    monkeypatch.setenv("KVOFFLOAD_CONFIG", str(cfg))
    s = Settings()
    assert (s.num_blocks, s.policy_params) == (7, {"protected_ratio": 0.5})


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("kv.toml", "num_blocks = [", "not valid TOML"),
        ("kv.json", "{", "not valid JSON"),
        ("kv.yaml", "a: 1", "ending in .toml or .json"),
        ("kv.toml", "no_such_setting = 1", "Extra inputs are not permitted"),
        ("kv.json", "[1, 2]", "of settings at the top"),
    ],
)
def test_bad_config_files_are_refused(tmp_path: Path, name: str, text: str, match: str) -> None:
    cfg = tmp_path / name
    cfg.write_text(text)
    with pytest.raises((ValueError, ValidationError), match=match):
        Settings(config=cfg)


def test_missing_config_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--config / KVOFFLOAD_CONFIG .*cannot read it"):
        Settings(config=tmp_path / "absent.toml")


def test_policy_params_from_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    s = parse_serve("--policy", "lfu", "--policy-param", "history_factor=3")
    assert s.policy_params == {"history_factor": 3}
    monkeypatch.setenv("KVOFFLOAD_POLICY", "slru")
    monkeypatch.setenv("KVOFFLOAD_POLICY_PARAMS", '{"protected_ratio": 0.5}')
    assert Settings().policy_params == {"protected_ratio": 0.5}


def test_admin_token_from_env_or_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVOFFLOAD_ADMIN_TOKEN", "s3cret")
    s = Settings()
    assert s.admin_token_value() == "s3cret"
    assert "s3cret" not in repr(s)
    monkeypatch.delenv("KVOFFLOAD_ADMIN_TOKEN")
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    token_file.chmod(0o600)
    assert parse_serve("--admin-token-file", str(token_file)).admin_token_value() == "from-file"
    with pytest.raises(ValidationError, match="KVOFFLOAD_ADMIN_TOKEN is set too"):
        Settings(admin_token=SecretStr("a"), admin_token_file=token_file)
    token_file.write_text("  \n")
    with pytest.raises(ValidationError, match="empty"):
        Settings(admin_token_file=token_file)


def test_admin_token_is_not_a_flag() -> None:
    with pytest.raises(SystemExit):
        _build_parser().parse_args(["serve", "--admin-token", "x"])


@pytest.mark.parametrize(
    "overrides",
    [
        {"device": "gpu"},
        {"device": "cuda:x"},
        {"num_blocks": 0},
        {"max_transfer_params_bytes": 0},
        {"port": 70000},
        {"lease_ttl_s": 10, "job_deadline_s": 10},
        {"log_level": "loud"},
        {"fault_fail_rate": 2},
        {"fault_fail_rate": 0.6, "fault_hang_rate": 0.6},
    ],
)
def test_invalid_settings_are_refused(overrides: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        Settings(**overrides)  # type: ignore[arg-type]


def test_every_setting_but_the_tokens_is_a_flag() -> None:
    args = _build_parser().parse_args(["serve"])
    assert vars(args) == {"command": "serve"}  # unset flags stay unset (env/file/defaults apply)
    flags = {a.dest for a in _serve_parser()._actions if a.dest not in ("help",)}
    dests = flags
    assert set(Settings.model_fields) - {"admin_token", "metrics_token"} <= dests


def test_invalid_flag_value_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    from app.cli import main

    assert main(["serve", "--num-blocks", "lots"]) == 2
    assert "--num-blocks / KVOFFLOAD_NUM_BLOCKS = 'lots'" in capsys.readouterr().err


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o602, 0o606, 0o666])
def test_an_admin_token_file_others_can_read_or_write_is_refused(tmp_path: Path, mode: int) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-file-0123456789\n")
    token_file.chmod(mode)
    with pytest.raises(ValidationError, match=f"by others \\(mode {mode:04o}\\)") as caught:
        Settings(admin_token_file=token_file)
    assert "from-file-0123456789" not in str(caught.value)
    token_file.chmod(mode & 0o770)
    assert Settings(admin_token_file=token_file).admin_token_value() == "from-file-0123456789"


def test_mooncake_masters_are_one_address_or_the_etcd_of_ha_masters() -> None:
    remote: dict[str, Any] = {
        "remote_tier": "mooncake",
        "mooncake_metadata": "etcd://10.0.0.9:2379",
    }
    for master in ("10.0.0.1:50051", "etcd://10.0.0.9:2379", "etcd://10.0.0.9:2379;10.0.0.8:2379"):
        assert Settings(**remote, mooncake_master=master).mooncake_master == master
    for master, field in (
        ("10.0.0.1", "--mooncake-master"),
        ("10.0.0.1:1;10.0.0.2:1", "--mooncake-master"),
        ("etcd://10.0.0.9", "--mooncake-master"),
    ):
        with pytest.raises(ValidationError, match=field):
            Settings(**remote, mooncake_master=master)
    with pytest.raises(ValidationError, match="--mooncake-metadata"):
        Settings(**{**remote, "mooncake_metadata": "etcd://"}, mooncake_master="10.0.0.1:1")


def test_fewer_tracked_blocks_than_one_put_is_refused() -> None:
    remote: dict[str, Any] = {
        "remote_tier": "mooncake",
        "mooncake_master": "10.0.0.1:50051",
        "mooncake_metadata": "http://10.0.0.1:8080/metadata",
        "remote_batch_blocks": 64,
    }
    assert Settings(**remote, remote_tracked_blocks=64).remote_tracked_blocks == 64
    with pytest.raises(ValidationError, match=r"--remote-tracked-blocks.*at least --remote-batch"):
        Settings(**remote, remote_tracked_blocks=63)


def _bounded_fields() -> list[tuple[str, str]]:
    """(field, a value past one of its bounds) for every bounded numeric setting."""
    out: list[tuple[str, str]] = []
    for name, field in Settings.model_fields.items():
        for item in field.metadata:
            for bound, past in (("gt", 0), ("ge", -1), ("lt", 0), ("le", 1)):
                if hasattr(item, bound):
                    out.append((name, str(getattr(item, bound) + past)))
    return out


@pytest.mark.parametrize(("field", "value"), _bounded_fields())
def test_every_out_of_range_value_is_refused_saying_what_is_accepted(
    field: str, value: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        load_settings(**{field: value})
    line = str(refused.value)
    flag = flag_name(field)
    assert flag is not None
    assert line.startswith(f"{flag} / KVOFFLOAD_{field.upper()} = {value!r}: too "), line
    assert "; accepted: a" in line, line


@pytest.mark.parametrize(
    "field", [n for n, f in Settings.model_fields.items() if get_origin(f.annotation) is Literal]
)
def test_every_value_outside_a_choice_is_refused_listing_the_choices(field: str) -> None:
    choices = get_args(Settings.model_fields[field].annotation)
    with pytest.raises(ConfigError) as refused:
        load_settings(**{field: "nonsense"})
    line = str(refused.value)
    assert ": accepted: " in line, line
    assert all(str(choice) in line.partition("accepted: ")[2] for choice in choices), line


def test_a_bad_config_file_value_names_the_file_and_key_not_the_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "kv.toml"
    cfg.write_text('num_blocks = -5\npolicy = "nope"\nuds_mode = 0o777\n')
    with pytest.raises(ConfigError) as refused:
        load_settings(config=cfg)
    where = f"--config / KVOFFLOAD_CONFIG = {str(cfg)!r}"
    too_small = "too small; accepted: an integer greater than 0"
    assert f"{where}: key num_blocks = -5: {too_small}" in str(refused.value)
    assert f"{where}: key policy = 'nope': unknown policy; accepted: arc" in str(refused.value)
    assert f"{where}: key uds_mode = '0777': accepted: 0600" in str(refused.value)
    assert "--num-blocks" not in str(refused.value)
    # A variable over the file's value: the refusal is the variable's (the file's is unused).
    monkeypatch.setenv("KVOFFLOAD_NUM_BLOCKS", "0")
    monkeypatch.setenv("KVOFFLOAD_CONFIG", str(cfg))
    with pytest.raises(ConfigError) as refused:
        load_settings(policy="lru", uds_mode="0600")
    assert str(refused.value) == (
        "--num-blocks / KVOFFLOAD_NUM_BLOCKS = '0': too small; accepted: an integer greater than 0"
    )


@pytest.mark.anyio
async def test_copy_threads_reach_the_cpu_worker() -> None:
    from testsupport.api_harness import make_settings, running
    from transfer.cpu_worker import default_copy_threads

    for asked, used in ((0, default_copy_threads()), (3, 3)):
        async with running(make_settings(copy_threads=asked)) as h:
            worker = h.service.transfers().worker
            assert getattr(worker, "copy_threads", None) == used, (asked, worker)


@pytest.mark.parametrize(
    ("device", "index"), [("cpu", None), ("auto", None), ("cuda", 0), ("cuda:3", 3)]
)
def test_the_gpu_the_device_names(device: str, index: int | None) -> None:
    """The pool is registered from this GPU's context (``HostPool.create(pin_device=...)``)."""
    assert Settings.model_construct(device=device).cuda_index == index


def test_the_service_pins_its_pool_from_the_gpu_it_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from app.core import transfers
    from transfer import HostPool

    asked: list[dict[str, Any]] = []

    def create(*args: Any, **kwargs: Any) -> Any:
        asked.append(kwargs)
        raise OSError("stop here")

    monkeypatch.setattr(transfers, "check_machine", lambda settings: None)
    monkeypatch.setattr(HostPool, "create", create)
    with pytest.raises(ConfigError, match="stop here"):
        asyncio.run(transfers.Transfers.open(Settings(device="cuda:2"), None, lambda: None))  # type: ignore[arg-type]
    assert asked[0]["pin_device"] == 2
