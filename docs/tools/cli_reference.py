"""Write ``docs/cli.md``, the command line reference, from the real parser
(``app.cli._build_parser``): every command's ``--help``, so the page cannot drift from the
code. ``--check`` exits 1 when the page on disk is not what the parser says (the tests and CI
run it); without it the page is rewritten.

    python docs/tools/cli_reference.py            rewrite docs/cli.md
    python docs/tools/cli_reference.py --check    verify it
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from app.cli import _build_parser, commands, full_help  # noqa: E402

PAGE = ROOT / "docs" / "cli.md"
#: The width the help is rendered at, whatever the terminal: the page is the same everywhere.
WIDTH = "100"


def render() -> str:
    """The page: a section per command with its ``--help``."""
    os.environ["COLUMNS"] = WIDTH  # argparse reads the width from here
    parts = [
        "# Command line reference\n",
        "Every command's `--help`, generated from the parser "
        "(`python docs/tools/cli_reference.py`; CI checks it is current). Every `serve` option "
        "also reads `KVOFFLOAD_<NAME>` and the `--config` file. A size (`--*-bytes`) is bytes, "
        "or a number with a unit, as Kubernetes writes quantities: `K`, `M`, `G`, `T` are "
        "powers of 1000 and `Ki`, `Mi`, `Gi`, `Ti` powers of 1024, a `B` after either is "
        "optional (`100M` is 100000000, `64KiB` is 65536, `200GiB` is 214748364800).\n",
    ]
    for path, parser in commands(_build_parser()):
        parser.prog = path
        # The whole text of every option (``serve --help`` itself prints one line each).
        parts.append(f"## `{path}`\n\n```text\n{full_help(parser).rstrip()}\n```\n")
    return "\n".join(parts)


def main() -> int:
    check = "--check" in sys.argv[1:]
    text = render()
    if check:
        if not PAGE.exists() or PAGE.read_text(encoding="utf-8") != text:
            print(f"out of date: {PAGE.relative_to(ROOT)}; run python docs/tools/cli_reference.py")
            return 1
        return 0
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
