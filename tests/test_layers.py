"""The packages are layers and imports run downward:

    gateway (HTTP, the router, the CLI) -> engine -> lora | grammar | sessions -> kernels

Checked from the source (every import, lazy ones too; once without and once with those under
`TYPE_CHECKING`), so an arrow back up or a circle fails here whichever module happens to be
imported first; then every module is imported in one fresh interpreter. Last, no file or class
outgrows its room.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYER = {"gateway": 0, "engine": 1, "lora": 2, "grammar": 2, "sessions": 2, "kernels": 3}


def _modules() -> dict[str, Path]:
    mods = {}
    for package in LAYER:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def _type_only(tree: ast.Module) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:`."""
    nodes: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            nodes.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return nodes


def _imports(name: str, path: Path, mods: dict[str, Path], typed: bool = False) -> set[str]:
    """The project modules `name` imports (a `from pkg import mod` counts as `pkg.mod`);
    with `typed`, those under `TYPE_CHECKING` too."""
    tree = ast.parse(path.read_text())
    skip = set() if typed else _type_only(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in mods and t != name)
    return found


def _graph(typed: bool = False) -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods, typed) for name, path in mods.items()}


@pytest.mark.parametrize("typed", [False, True], ids=["imports", "type-level too"])
def test_imports_run_down_the_layers(typed: bool) -> None:
    """No import runs up or sideways, nor a type-only one: a layer that needs a shape from
    above declares what it needs (lora/shape.py's `BaseShape`)."""
    wrong = []
    for name, targets in _graph(typed).items():
        layer, package = LAYER[name.split(".")[0]], name.split(".")[0]
        for target in sorted(targets):
            other = target.split(".")[0]
            if LAYER[other] < layer or (LAYER[other] == layer and other != package):
                wrong.append(f"{name} -> {target}")
    assert not wrong, "imports that run up or sideways:\n" + "\n".join(wrong)


@pytest.mark.parametrize("typed", [False, True], ids=["imports", "type-level too"])
def test_no_import_circles(typed: bool) -> None:
    """No circle among the imports, nor once type-only imports are counted: a type-level
    circle is a design circle (two modules that each need the other's shapes)."""
    graph = _graph(typed)
    circles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_every_module_imports_in_a_fresh_interpreter() -> None:
    names = sorted(_modules())
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    subprocess.run([sys.executable, "-c", code, *names], cwd=ROOT, check=True, timeout=300)


def test_the_gateway_side_of_the_seam_imports_no_torch() -> None:
    """The HTTP process's request path (schemas, planning, the engine's message types) loads
    without torch; only the engine thread needs it."""
    code = ("import sys, gateway.app, gateway.router.app, engine.messages\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=300)


MAX_FILE_LINES = 500
MAX_CLASS_METHODS = 25


def test_no_file_or_class_outgrows_its_room() -> None:
    """A file over 500 lines or a class over 25 methods (properties and private helpers
    count) holds more than one idea: split it by what its parts do."""
    big = []
    for name, path in _modules().items():
        source = path.read_text()
        if source.count("\n") > MAX_FILE_LINES:
            big.append(f"{name}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(b, ast.FunctionDef | ast.AsyncFunctionDef)
                              for b in node.body)
                if methods > MAX_CLASS_METHODS:
                    big.append(f"{name}.{node.name}: {methods} methods")
    assert not big, "over the limits:\n" + "\n".join(big)
