"""The public face of ``transfer`` and its dependency rules.

Imports are read with ``ast``, wherever they sit in a module (top level, inside a function, under
``TYPE_CHECKING``): a lazy import still ties two modules together.
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


def imports(source: str) -> Iterator[tuple[str, tuple[str, ...]]]:
    """``(module, names)`` for every import in a module of ``transfer``; ``names`` is empty for
    ``import module``. Relative imports are resolved against the package."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                module = f"transfer.{module}" if module else "transfer"
            yield module, tuple(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ()


def sources() -> dict[str, str]:
    """Module name -> source, for every module of ``transfer``."""
    return {
        "transfer" if p.stem == "__init__" else f"transfer.{p.stem}": p.read_text()
        for p in sorted(PACKAGE.glob("*.py"))
    }


def private_imports(modules: dict[str, str]) -> list[str]:
    """``"importer: name from module"`` for each private name (or private module) imported."""
    found = []
    for importer, source in modules.items():
        for module, names in imports(source):
            if module == "__future__":
                continue
            private = [p for p in module.split(".") if p.startswith("_") and not p.endswith("__")]
            private += [n for n in names if n.startswith("_")]
            found += [f"{importer}: {name} from {module}" for name in private]
    return found


def import_graph(modules: dict[str, str]) -> dict[str, set[str]]:
    """Which of ``modules`` each one imports. ``from transfer import x`` imports the package and,
    when ``x`` is a submodule, that submodule. Importing ``transfer.x`` runs the package's
    ``__init__`` first, but Python allows that one loop, so it is no edge here."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for importer, source in modules.items():
        for module, names in imports(source):
            targets = {module} | {f"{module}.{n}" for n in names}
            graph[importer] |= {t for t in targets if t in modules and t != importer}
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as ``[a, b, ..., a]``, or None when the graph has none."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once explored
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (circle := visit(nxt)) is not None:
                return circle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (circle := visit(node)) is not None:
            return circle
    return None


def test_transfer_knows_only_the_spec_and_errors_of_manager() -> None:
    allowed = {"manager.spec", "manager.errors"}
    for importer, source in sources().items():
        for module, _names in imports(source):
            if module == "app" or module.startswith("app."):
                raise AssertionError(f"{importer} imports {module}")
            if (module == "manager" or module.startswith("manager.")) and module not in allowed:
                raise AssertionError(f"{importer} imports {module}")


def test_no_module_imports_a_private_name() -> None:
    assert private_imports(sources()) == []


def test_no_import_circle_between_modules() -> None:
    assert find_circle(import_graph(sources())) is None


def test_the_checks_catch_a_lazy_circle_and_a_private_import() -> None:
    planted = {
        "transfer": "from transfer.c import C\n",
        "transfer.a": "def make():\n    from transfer import b\n    return b.B()\n",
        "transfer.b": "from transfer.a import _Helper as A\nfrom ._c import x\n",
        "transfer.c": "import os\n",
    }
    assert find_circle(import_graph(planted)) == ["transfer.a", "transfer.b", "transfer.a"]
    assert private_imports(planted) == [
        "transfer.b: _Helper from transfer.a",
        "transfer.b: _c from transfer._c",
    ]
    del planted["transfer.b"]
    assert find_circle(import_graph(planted)) is None
