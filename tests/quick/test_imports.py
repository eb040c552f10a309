"""The package's imports point one way (entry points -> trainer -> components -> config -> errors): no circle,
a leaf at the bottom, nothing reaching up to `python -m train`. Read from the source with ast (no import runs),
the imports inside functions included: a lazy import closes a circle as surely as one at the top."""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

from tests.conftest import ROOT

LEAF = "train.errors"  # the error types and constants every layer shares


def _module_names() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / "train").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """Every train module `name` imports, anywhere in the file, with the line of its first import. Importing
    train.a.b runs train.a's __init__ too, so a package counts unless it holds `name` (already imported)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importer's package, one level up per dot after the first
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [base, *(f"{base}.{a.name}" for a in node.names)]  # `from train import config`
        else:
            continue
        for target in targets:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                mod = ".".join(parts[:i])
                if mod in modules and mod != name and not name.startswith(mod + "."):
                    found.setdefault(mod, node.lineno)
    return found


@functools.cache
def _graph() -> tuple[dict[str, dict[str, int]], dict[str, Path]]:
    modules = _module_names()
    return {name: _imports(name, path, modules) for name, path in modules.items()}, modules


def _circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _path_through(component: list[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """A shortest closed path from the component's first module back to itself (breadth first)."""
    start, members = component[0], set(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w in members and w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        if start in came_from:
            break
        frontier = nxt
    path = [start]
    while True:
        path.append(came_from[path[-1]])
        if path[-1] == start:
            return path[::-1]


def _describe(component: list[str], graph: dict[str, dict[str, int]], modules: dict[str, Path]) -> str:
    """The circle's modules, then every import between them (file:line), a shortest closed path first."""
    path = _path_through(component, graph)
    edges = [*zip(path, path[1:], strict=False)]
    edges += sorted((a, b) for a in component for b in graph[a] if b in component and (a, b) not in edges)
    return f"{len(component)} modules: {', '.join(component)}\n    " + "\n    ".join(
        f"{a} -> {b}  ({modules[a].relative_to(ROOT)}:{graph[a][b]})" for a, b in edges)


def test_the_imports_of_train_form_no_circle():
    graph, modules = _graph()
    circles = _circles(graph)
    assert not circles, "import circles in train/ (move what both sides need down a layer):\n  " + "\n\n  ".join(
        _describe(c, graph, modules) for c in circles)


def test_the_leaf_imports_nothing_of_train_and_only_the_standard_library():
    graph, modules = _graph()
    assert not graph[LEAF], f"{LEAF} must import nothing of train: it imports {sorted(graph[LEAF])}"
    tree = ast.parse(modules[LEAF].read_text())
    outside = {(a.name if isinstance(n, ast.Import) else n.module or "").split(".")[0]
               for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names}
    assert outside <= set(sys.stdlib_module_names) | {"__future__"}, (
        f"{LEAF} must import only the standard library (python -m train.launch imports it before torch): "
        f"it imports {sorted(outside - set(sys.stdlib_module_names))}")


def test_no_module_imports_the_entry_point_python_m_train():
    graph, modules = _graph()
    assert not [m for m in graph if "train.__main__" in graph[m]], (
        "modules import train/__main__.py (move what they need below it): "
        + ", ".join(f"{modules[m].relative_to(ROOT)}:{graph[m]['train.__main__']}"
                    for m in graph if "train.__main__" in graph[m]))


ENTRY_POINTS = ("train.__main__", "train.prepare", "train.export", "train.report", "train.doctor", "train.submit",
                "train.launch", "train.checkpoint.__main__")
# What every layer may import: the config, the task interface with the Hugging Face format it names and the loader
# of a task's class (the config loads it), the errors.
BOTTOM = ("train.config", "train.task", "train.hf_format", "train.task_loader", "train.errors")


def _layer(module: str) -> int:
    """0 the bottom, 1 a component (the folders and optim.py), 2 the trainer, 3 an entry point."""
    if module in BOTTOM:
        return 0
    if module == "train.trainer":
        return 2
    if any(module == e or module.startswith(e + ".") for e in ENTRY_POINTS) or module == "train":
        return 3
    return 1


def test_imports_point_down_entry_points_then_the_trainer_then_components_then_config():
    """No component reaches up to the trainer or an entry point, and config, task and errors import none of
    them: a reader goes down the layers, never up (a package's __init__ is its folder's docstring)."""
    graph, modules = _graph()
    up = [f"{modules[a].relative_to(ROOT)}:{line} imports {b}" for a in graph for b, line in graph[a].items()
          if _layer(b) > _layer(a)]
    assert not up, "imports that point up a layer (move what both need down):\n  " + "\n  ".join(up)
