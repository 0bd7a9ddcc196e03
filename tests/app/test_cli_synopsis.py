"""README.md's "Command line" synopsis matches the real parser (``app.cli._build_parser``):
every subcommand and every option of each appears in its command's part of the synopsis, and
the synopsis names no option the command lacks, so neither can drift from the other."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from app.cli import _build_parser

README = Path(__file__).resolve().parents[2] / "README.md"
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def synopsis() -> str:
    """The first fenced block of the README's "Command line" section."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("\n## Command line\n") :]
    match = re.search(r"```\n(.*?)```", section, re.S)
    assert match is not None
    return match.group(1)


def parts() -> dict[str, str]:
    """The synopsis by command: ``serve`` -> its lines (from ``kvoffload serve`` to the next
    ``kvoffload ...`` line); ``""`` -> the lines naming no command (``kvoffload --version``)."""
    out: dict[str, str] = {}
    current = ""
    for line in synopsis().splitlines():
        words = line.split()
        if words[:1] == ["kvoffload"]:
            current = words[1] if not words[1].startswith("-") else ""
        out[current] = out.get(current, "") + line + "\n"
    return out


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands of ``parser`` by name."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def options(parser: argparse.ArgumentParser) -> list[list[str]]:
    """The long option strings of each option of ``parser`` (help aside)."""
    return [
        [s for s in action.option_strings if s.startswith("--")]
        for action in parser._actions
        if action.option_strings and not isinstance(action, argparse._HelpAction)
    ]


def tree(
    parser: argparse.ArgumentParser, path: str = ""
) -> list[tuple[str, argparse.ArgumentParser]]:
    """``parser`` and every subcommand below it, each with its path (``policy set``)."""
    found = [(path, parser)]
    for name, sub in subcommands(parser).items():
        found += tree(sub, f"{path} {name}".strip())
    return found


def test_the_synopsis_has_a_part_per_command_and_the_version() -> None:
    commands = subcommands(_build_parser())
    assert set(parts()) == {"", *commands}
    assert "kvoffload --version" in parts()[""]


def test_every_subcommand_and_option_of_the_parser_is_in_the_synopsis() -> None:
    top = _build_parser()
    text = parts()
    for name, command in subcommands(top).items():
        for path, parser in tree(command):
            where = f"kvoffload {name} {path}".strip()
            if path:
                words = rf"(?<![\w-]){re.escape(path)}(?![\w-])"
                assert re.search(words, text[name]), f"{where}: not in the README synopsis"
            for strings in options(parser):
                # The first long spelling is the one documented (aliases may stay unlisted).
                assert strings[0] in OPTION.findall(text[name]), (
                    f"{where}: {strings[0]} not in the README synopsis"
                )
    for strings in options(top):
        assert strings[0] in OPTION.findall(text[""])


def test_the_synopsis_names_no_option_the_command_lacks() -> None:
    top = _build_parser()
    commands = {"": top, **subcommands(top)}
    for name, part in parts().items():
        known = {
            s
            for _, parser in (tree(commands[name]) if name else [("", top)])
            for strings in options(parser)
            for s in strings
        }
        unknown = sorted(set(OPTION.findall(part)) - known)
        assert not unknown, f"kvoffload {name}: the synopsis names {unknown}"
