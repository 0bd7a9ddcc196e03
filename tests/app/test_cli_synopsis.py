"""The documented command line matches the real parser (``app.cli._build_parser``), both ways.

- Every subcommand and every option of each is in its command's section of ``docs/cli.md``,
  the reference generated from the parser (``docs/tools/cli_reference.py``; ``--check`` in
  ``make docs`` and ``tests/test_docs_site.py`` keeps the page current).
- Every option the hand-written pages name (``README.md`` and the pages of ``docs/`` written by
  hand) exists: it is an option of some ``kvoffload`` command, or one of the other programs'
  options listed in ``FOREIGN`` with its program. A flag renamed or removed in the parser, or
  misspelt on a page, fails here.
"""

from __future__ import annotations

import argparse
import re

from app.cli import _build_parser, commands
from tests.docs_blocks import HAND_WRITTEN, ROOT, page_path

OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9](?![\w-])")
#: Options of other programs the pages name, with the program.
FOREIGN = {
    "--check": "docs/tools/cli_reference.py",
    "--strict": "mkdocs build",
    "--no-deps": "pip install",
    "--kv-transfer-config": "vllm serve",
    "--prefix-caching-hash-algo": "vllm serve",
    "--model-path": "sglang.launch_server",
    "--page-size": "sglang.launch_server",
    "--enable-hierarchical-cache": "sglang.launch_server",
    "--hicache-storage-backend": "sglang.launch_server",
    "--hicache-storage-backend-extra-config": "sglang.launch_server",
    "--list-tunables": "ld.so",
    "--no-index": "pip install",
    "--seed": "deploy/tools/cpu_engine.py",
    "--expect": "deploy/tools/cpu_engine.py",
    "--build": "docker compose up",
    "--profile": "docker compose",
    "--rm": "docker compose run",
    "--build-arg": "docker build",
    "--network": "docker run",
    "--from-file": "kubectl create secret",
    "--from-literal": "kubectl create secret",
    "--enable-feature": "prometheus",
    "--unix-socket": "curl",
    "--now": "systemctl disable",
    "--bs": "fio",
    "--direct": "fio",
    "--iodepth": "fio",
    "--ioengine": "fio",
    "--bucket": "aws s3api",
    "--endpoint-url": "aws s3api",
    "--lifecycle-configuration": "aws s3api",
    "--listen-client-urls": "etcd",
    "--advertise-client-urls": "etcd",
    "--enable_ha": "mooncake_master",
    "--enable_http_metadata_server": "mooncake_master",
    "--enable_kv_events": "mooncake_master",
    "--enable_oplog": "mooncake_master",
    "--enable_snapshot": "mooncake_master",
    "--enable_snapshot_restore": "mooncake_master",
    "--etcd_endpoints": "mooncake_master",
    "--http_metadata_server_port": "mooncake_master",
    "--rpc_address": "mooncake_master",
    "--rpc_port": "mooncake_master",
    "--snapshot_object_store_type": "mooncake_master",
}


def options(parser: argparse.ArgumentParser) -> list[list[str]]:
    """The long option strings of each option of ``parser`` (help aside)."""
    return [
        [s for s in action.option_strings if s.startswith("--")]
        for action in parser._actions
        if action.option_strings and not isinstance(action, argparse._HelpAction)
    ]


def reference_sections() -> dict[str, str]:
    """``docs/cli.md`` by command: ``kvoffload admin`` -> the text of its section."""
    text = page_path("cli.md").read_text(encoding="utf-8")
    parts = re.split(r"^## `([^`]+)`\n", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_the_reference_has_every_command_and_option() -> None:
    sections = reference_sections()
    every = commands(_build_parser())
    assert set(sections) == {path for path, _ in every}
    for path, parser in every:
        named = set(OPTION.findall(sections[path]))
        for strings in options(parser):
            assert strings[0] in named, f"{path}: {strings[0]} not in docs/cli.md"


def test_every_option_the_pages_name_exists() -> None:
    parsers = commands(_build_parser())
    known = {
        "--help",
        *(s for _, parser in parsers for strings in options(parser) for s in strings),
    }
    assert not known & set(FOREIGN), "an option listed as another program's is kvoffload's"
    # The benchmarks page names the benchmarks' own options: each must be one of a script's.
    benches = {
        o
        for script in (ROOT / "bench").glob("*.py")
        for o in re.findall(r'"(--[a-z][a-z0-9-]*)"', script.read_text(encoding="utf-8"))
    }
    for page in HAND_WRITTEN:
        named = set(OPTION.findall(page_path(page).read_text(encoding="utf-8")))
        unknown = sorted(
            named - known - set(FOREIGN) - (benches if page == "benchmarks.md" else set())
        )
        assert not unknown, f"{page} names options no kvoffload command has: {unknown}"


def test_every_foreign_option_is_still_named_somewhere() -> None:
    """The list of other programs' options holds only what the pages name."""
    named = {
        o
        for page in HAND_WRITTEN
        for o in OPTION.findall(page_path(page).read_text(encoding="utf-8"))
    }
    assert set(FOREIGN) <= named, sorted(set(FOREIGN) - named)
