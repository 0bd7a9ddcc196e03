"""The import graph of ``app/``, ``manager/``, ``transfer/`` and the engine side
(``client/kvoffload_client``): no circle, no private name imported across modules, the app's rooms
import only downward, and the engine side imports nothing of the server. Outside the packages,
``bench/`` and ``tests/`` share their helpers through ``testsupport/``: the benchmarks import
nothing of the tests, test support imports neither, and only a test of a benchmark's own code
(``tests/test_bench_*.py``) imports ``bench``.

Every import statement counts, wherever it is (module level, inside a function, under
``TYPE_CHECKING``): a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Each package and the directory its import path starts from.
PACKAGES = {"app": ROOT, "manager": ROOT, "transfer": ROOT, "kvoffload_client": ROOT / "client"}

# The app's rooms, lowest first. A module may import app modules of its own rank or lower.
# A new module directly under app/ (or a new package there) must be named here (the test names
# it otherwise); a module deeper takes its package's room.
APP_RANKS: dict[str, int] = {
    "app": 0,  # the package root: a docstring and the version lookup
    "app.settings": 0,
    "app.pool_share": 0,
    "app.descriptors": 0,
    "app.telemetry": 1,
    "app.core": 2,
    "app.http": 3,
    "app.server": 4,
    "app.replay": 4,
    "app.cli": 5,
}
# Imported inside an inference engine's process, installed without the server: nothing of the
# server may come with it.
ENGINE_SIDE = "kvoffload_client"
SERVER_PACKAGES = ("app", "manager", "transfer", "torch")
SERVER_LIBRARIES = ("fastapi", "starlette", "uvicorn", "pydantic_settings", "prometheus_client")
# The service core speaks no HTTP: it raises domain errors, the edge maps them.
HTTP_LIBRARIES = ("fastapi", "starlette", "uvicorn", "httpx")


def module_name(path: Path, base: Path = ROOT) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, base in PACKAGES.items():
        for path in sorted((base / package).rglob("*.py")):
            found[module_name(path, base)] = path
    return found


MODULES = project_modules()


def imports(name: str, path: Path) -> Iterator[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import in the file."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [a.name for a in node.names]
            # ``from pkg import submodule`` depends on the submodule itself.
            submodules = [n for n in names if f"{base}.{n}" in MODULES]
            for sub in submodules:
                yield f"{base}.{sub}", []
            rest = [n for n in names if n not in submodules]
            if rest or not submodules:
                yield base, rest


def project_target(imported: str) -> str | None:
    """The project module an import refers to (a parent package for a missing leaf)."""
    while imported:
        if imported in MODULES:
            return imported
        imported = imported.rpartition(".")[0]
    return None


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for imported, _ in imports(name, path):
            target = project_target(imported)
            if target is not None and target != name:
                edges[name].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def room(module: str) -> str:
    best = max((r for r in APP_RANKS if module == r or module.startswith(r + ".")), key=len)
    return best


def test_the_scan_sees_the_packages() -> None:
    assert {"app.core.service", "manager.core", "transfer.worker"} <= MODULES.keys()
    assert {"kvoffload_client.client", "kvoffload_client.vllm.tier"} <= MODULES.keys()


def test_no_import_circle() -> None:
    assert cycles(graph()) == []


def test_cycle_finder_finds_one() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def private_imports(name: str, path: Path) -> Iterator[str]:
    """Private names (and private modules) ``name`` imports from other project modules."""
    for imported, names in imports(name, path):
        if project_target(imported) in (None, name):
            continue
        parts = [p for p in imported.split(".") if p.startswith("_") and not p.endswith("__")]
        parts += [n for n in names if n.startswith("_") and not n.startswith("__")]
        yield from (f"{name} imports {p} from {imported}" for p in parts)


def test_no_private_name_is_imported_from_another_module() -> None:
    assert [o for name, path in MODULES.items() for o in private_imports(name, path)] == []


def test_private_finder_finds_a_name_and_a_module(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text("from transfer.worker import _Held\nfrom transfer._hidden import x\n")
    assert list(private_imports("manager.planted", planted)) == [
        "manager.planted imports _Held from transfer.worker",
        "manager.planted imports _hidden from transfer._hidden",
    ]


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.split(".")[0] == "app"))
def test_app_imports_only_downward(name: str) -> None:
    rank = APP_RANKS[room(name)]
    upward = [
        target
        for imported, _ in imports(name, MODULES[name])
        if (target := project_target(imported)) is not None
        and target.split(".")[0] == "app"
        and APP_RANKS[room(target)] > rank
    ]
    assert upward == [], f"{name} (room {room(name)}) imports upward: {upward}"


def roomless(modules: list[str]) -> list[str]:
    """The app modules whose room is not named in ``APP_RANKS``: a module directly under
    ``app/`` or a package there must be named itself (every name starts with ``app``, so the
    root's rank would otherwise take any module in silently); one deeper takes its package's."""
    return [n for n in modules if n != "app" and ".".join(n.split(".")[:2]) not in APP_RANKS]


def test_every_app_module_has_a_room() -> None:
    assert roomless([n for n in MODULES if n.split(".")[0] == "app"]) == []


def test_the_room_check_names_a_new_module_directly_under_app() -> None:
    assert roomless(["app.server", "app.core.service", "app.brand_new", "app.newpkg.mod"]) == [
        "app.brand_new",
        "app.newpkg.mod",
    ]


def test_the_architecture_page_names_every_module() -> None:
    # The page's room lists are where a newcomer looks first: a module it does not name is one
    # they will not find there. File names only (the page lists them per package).
    page = (ROOT / "docs" / "architecture.md").read_text()
    shared = sorted((ROOT / "testsupport").rglob("*.py"))
    unnamed = sorted(
        str(path.relative_to(ROOT))
        for path in [*MODULES.values(), *shared]
        if path.name != "__init__.py"
        and f"`{path.name}`" not in page
        and f"`{path.parent.name}/{path.name}`" not in page
    )
    assert unnamed == [], "docs/architecture.md names none of these modules"


def server_imports(name: str, path: Path) -> list[str]:
    """What ``name`` imports of the server: its packages, its libraries, torch."""
    return [
        imported
        for imported, _ in imports(name, path)
        if imported.split(".")[0] in (*SERVER_LIBRARIES, *SERVER_PACKAGES)
    ]


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.split(".")[0] == ENGINE_SIDE))
def test_engine_side_modules_import_no_server_code(name: str) -> None:
    assert server_imports(name, MODULES[name]) == []


def test_the_server_check_finds_an_import_of_the_server(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text("import fastapi\nfrom app.settings import Settings\nimport httpx\n")
    found = server_imports("kvoffload_client.planted", planted)
    assert found == ["fastapi", "app.settings"]


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("app.core")))
def test_the_core_speaks_no_http(name: str) -> None:
    for imported, _ in imports(name, MODULES[name]):
        assert imported.split(".")[0] not in HTTP_LIBRARIES, f"{name} imports {imported}"
        assert not imported.startswith("app.http"), f"{name} imports {imported}"


# Outside the packages: what the benchmarks, the test support and the tests may not import.
SHARED_SIDES = {"bench": ("tests",), "testsupport": ("bench", "tests"), "tests": ("bench",)}


def side_imports(side: str, name: str, path: Path) -> list[str]:
    """What module ``name`` (at ``path``) on ``side`` (``bench``, ``testsupport`` or ``tests``)
    imports of a side it may not: a test imports ``bench`` only where it tests a benchmark's own
    code, in a ``tests/test_bench_*.py`` file."""
    banned = SHARED_SIDES[side]
    if name.startswith("tests.test_bench_") and name.count(".") == 1:
        banned = ()
    return [i for i, _ in imports(name, path) if i.split(".")[0] in banned]


@pytest.mark.parametrize("side", sorted(SHARED_SIDES))
def test_bench_and_tests_share_only_testsupport(side: str) -> None:
    found = {
        str(path.relative_to(ROOT)): names
        for path in sorted((ROOT / side).rglob("*.py"))
        if (names := side_imports(side, module_name(path), path))
    }
    assert found == {}, f"move what both use into testsupport/: {found}"


def test_the_side_check_finds_bench_and_tests_importing_each_other(tmp_path: Path) -> None:
    planted = {
        "bench.b": "from tests.e2e.server import ServerProcess\nimport testsupport.server\n",
        "tests.test_x": "from bench.harness import TRACE\nimport tests.api\n",
        "tests.test_bench_x": "from bench.harness import TRACE\n",
        "tests.load.test_bench_y": "from bench import harness\n",
        "testsupport.t": "import bench.control\nfrom tests.vllm import conftest\n",
    }
    found = {}
    for name, text in planted.items():
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        found[name] = side_imports(name.split(".")[0], name, path)
    assert found == {
        "bench.b": ["tests.e2e.server"],
        "tests.test_x": ["bench.harness"],
        "tests.test_bench_x": [],
        "tests.load.test_bench_y": ["bench"],
        "testsupport.t": ["bench.control", "tests.vllm"],
    }
