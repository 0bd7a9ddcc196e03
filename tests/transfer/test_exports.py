"""The public face of ``transfer`` and what it may know of ``manager``.

Circles and private names across modules are held for every package by ``tests/test_layering.py``.
"""

from __future__ import annotations

import ast
import types
from collections.abc import Iterator
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


def imports(source: str) -> Iterator[str]:
    """Every module imported by a module of ``transfer`` (relative imports resolved)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                module = f"transfer.{module}" if module else "transfer"
            yield module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name


def sources() -> dict[str, str]:
    """Module name -> source, for every module of ``transfer``."""
    return {
        "transfer" if p.stem == "__init__" else f"transfer.{p.stem}": p.read_text()
        for p in sorted(PACKAGE.glob("*.py"))
    }


def test_transfer_knows_only_the_spec_and_errors_of_manager() -> None:
    allowed = {"manager.spec", "manager.errors"}
    for importer, source in sources().items():
        for module in imports(source):
            if module == "app" or module.startswith("app."):
                raise AssertionError(f"{importer} imports {module}")
            if (module == "manager" or module.startswith("manager.")) and module not in allowed:
                raise AssertionError(f"{importer} imports {module}")
