"""The public face of ``transfer`` and its dependency rule."""

from __future__ import annotations

import ast
import types
from pathlib import Path

import transfer

PACKAGE = Path(transfer.__file__).parent


def test_exported_names_are_exactly_all() -> None:
    public = {
        name
        for name in dir(transfer)
        if not name.startswith("_")
        and name != "annotations"
        and not isinstance(getattr(transfer, name), types.ModuleType)
    }
    assert public == set(transfer.__all__)


def test_transfer_knows_only_the_spec_and_errors_of_manager() -> None:
    allowed = {"manager.spec", "manager.errors"}
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name == "app" or name.startswith("app."):
                    raise AssertionError(f"{path.name} imports {name}")
                if (name == "manager" or name.startswith("manager.")) and name not in allowed:
                    raise AssertionError(f"{path.name} imports {name}")
