"""``kvoffload serve``'s on/off settings as switches (``--x``, ``--x BOOL``, ``--no-x``) and an
unknown option answered with the closest known one."""

from __future__ import annotations

import argparse

import pytest

from app.cli import _build_parser, commands, settings_from_args


def settings(*argv: str) -> dict[str, object]:
    s = settings_from_args(_build_parser().parse_args(["serve", *argv]))
    return {"shadow": s.shadow_enabled, "pin": s.pin_memory, "by_name": s.registration_by_name}


def test_a_switch_alone_is_on_no_is_off_and_a_value_is_taken_as_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("KVOFFLOAD_SHADOW_ENABLED", "KVOFFLOAD_PIN_MEMORY", "KVOFFLOAD_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    assert settings("--no-shadow-enabled")["shadow"] is False
    assert settings("--no-shadow-enabled", "--shadow-enabled")["shadow"] is True  # last wins
    assert settings("--shadow-enabled", "false")["shadow"] is False
    assert settings("--pin-memory", "--num-blocks", "64")["pin"] is True
    assert settings("--no-pin-memory")["pin"] is False
    assert settings()["pin"] is None  # not given: the setting's default


def test_no_takes_no_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _build_parser().parse_args(["serve", "--no-shadow-enabled", "true"])
    assert "--no-shadow-enabled: takes no value" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "meant"),
    [
        (["serve", "--num-blok", "5"], "--num-blocks"),
        (["serve", "--shadow-enable"], "--shadow-enabled"),
        (["admin", "--namespce=a", "stats"], "--namespace"),
    ],
)
def test_an_unknown_option_is_answered_with_the_closest(
    argv: list[str], meant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        _build_parser().parse_args(argv)
    assert f"(did you mean {meant}?)" in capsys.readouterr().err


def test_serve_help_groups_every_flag_and_its_usage_is_short() -> None:
    from app.cli import COMMON_SETTINGS, COMMON_TITLE, SERVE_GROUPS
    from app.settings import Settings

    assert set(SERVE_GROUPS) <= set(Settings.model_fields)
    assert set(COMMON_SETTINGS) <= set(Settings.model_fields)
    serve = _serve()
    grouped = {
        s
        for g in serve._action_groups
        if g.title in (COMMON_TITLE, *SERVE_GROUPS.values())
        for a in g._group_actions
        for s in a.option_strings
    }
    loose = {
        s
        for a in serve._actions
        for s in a.option_strings
        if s.startswith("--") and s not in grouped
    }
    assert loose == {"--help", "--help-all"}
    assert len(serve.format_usage().splitlines()) <= 2
    help_text = serve.format_help()
    assert all(f"\n{title}:\n" in help_text for title in SERVE_GROUPS.values())


def test_serve_help_starts_with_the_common_options() -> None:
    """The handful a newcomer sets come first, before the groups (#43.10), each once."""
    help_text = _serve().format_help()
    titles = [line for line in help_text.splitlines() if line.endswith(":") and line[0] != " "]
    assert titles[:2] == ["options:", "common options:"], titles
    common = help_text.partition("\ncommon options:\n")[2].partition("\n\n\n")[0]
    for flag in ("--config", "--host", "--port", "--admin-port", "--num-blocks", "--block-bytes"):
        assert f"\n  {flag} " in common, flag
        assert help_text.count(f"\n  {flag} ") == 1, flag
    for flag in ("--policy", "--tiers", "--admin-token-file", "--uds"):
        assert f"\n  {flag} " in common, flag


def _serve() -> argparse.ArgumentParser:
    return dict(commands(_build_parser()))["kvoffload serve"]


@pytest.mark.parametrize("columns", ["80", "100", "160"])
def test_serve_help_is_one_line_per_option_within_the_width(
    columns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", columns)
    serve = _serve()
    lines = serve.format_help().splitlines()
    options = [a for a in serve._actions if a.option_strings]
    assert len(options) > 100
    # One line each: as many option lines as options, and no wrapped continuation line.
    option_lines = [line for line in lines if line.startswith("  -")]
    assert len(option_lines) == len(options)
    assert not [line for line in lines if line.startswith("   ")]
    assert all(len(line) <= int(columns) for line in lines), max(lines, key=len)
    for action in options:
        flag = action.option_strings[0]  # -h, --x (a switch's line: --[no-]x)
        assert any(flag.removeprefix("--") in line for line in option_lines), flag


def test_help_all_prints_every_option_s_whole_text(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        _build_parser().parse_args(["serve", "--help-all"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "env KVOFFLOAD_DISK_BYTES" in out
    assert "--shadow-enabled alone: on, --no-shadow-enabled: off" in out
    # The parser used later still prints one line per option.
    assert "env KVOFFLOAD_DISK_BYTES" not in _serve().format_help()
