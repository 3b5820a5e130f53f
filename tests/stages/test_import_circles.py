"""No module of fsdpfast imports, directly or through others, a module that imports it back.

The layers themselves are checked by the import contract (pyproject.toml, `lint-imports` in CI);
this counts circles between single modules, function-level imports included, which a layer
contract between packages does not see."""

from __future__ import annotations

import ast
from pathlib import Path

import fsdpfast

PACKAGE = Path(fsdpfast.__file__).parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ["fsdpfast", *path.relative_to(PACKAGE).with_suffix("").parts]
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            stem = ".".join(base + ([node.module] if node.module else []))
            submodules = [f"{stem}.{alias.name}" for alias in node.names if f"{stem}.{alias.name}" in known]
            targets = submodules or [stem]  # `from . import plan` imports the module, not the face
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return circles


def test_no_module_imports_one_that_imports_it_back():
    modules = _modules()
    # a package's face re-exports its modules; the circles that matter are between modules
    graph = {name: _imports(name, path, set(modules)) - {"fsdpfast"} for name, path in modules.items()}
    assert _circles(graph) == []


def test_the_count_sees_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
