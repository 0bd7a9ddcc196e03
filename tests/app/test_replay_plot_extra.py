"""`kvoffload replay --plot` without matplotlib names the extra that brings it, before any work."""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

import pytest

from app import replay as replay_cli


def test_plot_without_matplotlib_names_the_plot_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"hash_ids": [1, 2, 3]}) + "\n", encoding="utf-8")
    png = tmp_path / "plot.png"
    # A None entry in sys.modules makes the module unimportable, as if it were not installed.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    parser = argparse.ArgumentParser()
    replay_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["replay", str(trace), "--capacity", "2", "--plot", str(png)])
    out, err = io.StringIO(), io.StringIO()
    assert replay_cli.run(args, out, err) == 2
    assert "pip install 'kvoffload[plot]'" in err.getvalue()
    assert out.getvalue() == "", "the sweep ran although its plot could not be drawn"
    assert not png.exists()
