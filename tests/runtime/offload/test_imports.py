"""The offload package's shape, read from its source: imports point one way, one front door builds the
offloaded placement, and ZeRO never reaches into the offload. (That nothing in it reads the environment is
tests/test_layout.py's `test_offload_reads_no_environment`.)

Module-level and function-level imports count alike (an import inside a function still closes a circle
when it runs). No processes, no torch import: the files are parsed (ARCHITECTURE.md, "Offload").
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import REPO

RUNTIME = REPO / "runtime"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(RUNTIME.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module `path` imports (absolute names, `from x import y` as x and x.y), anywhere in it."""
    names: set[str] = set()
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _graph(packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules of `packages` it imports."""
    files = {
        _module_name(p): p for pkg in packages for p in (RUNTIME.parent / pkg.replace(".", "/")).rglob("*.py")
    }
    return {name: {m for m in _imports(path) if m in files and m != name} for name, path in files.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in graph:
        if node not in index:
            visit(node)
    return found


PARTS = [
    "runtime.offload",
    "runtime.offload.auto_ratio",
    "runtime.offload.partial",
    "runtime.offload.host_masters",
    "runtime.offload.step",
    "runtime.offload.machine",
    "runtime.offload.plan",
    "runtime.offload.io",
    "runtime.offload.placement",
]
"""The package's parts in import order (its __init__ docstring): each imports only parts after it."""


def _part(module: str) -> int:
    return max(i for i, part in enumerate(PARTS) if module == part or module.startswith(part + "."))


def test_each_offload_part_imports_only_the_parts_after_it() -> None:
    graph = _graph(("runtime.offload",))
    backwards = sorted(
        (module, dep)
        for module, deps in graph.items()
        for dep in deps
        if _part(dep) < _part(module) or (_part(dep) == _part(module) and PARTS[_part(module)] == dep)
    )
    assert not backwards, backwards


def test_offload_imports_point_one_way_and_zero_never_imports_the_offload() -> None:
    graph = _graph(("runtime.offload", "runtime.zero"))
    offload = {m for m in graph if m.startswith("runtime.offload")}
    assert not [c for c in _circles(graph) if set(c) & offload], _circles(graph)
    # one front door: only the package's __init__ names HostMasters' module
    builders = sorted(m for m, deps in graph.items() if "runtime.offload.host_masters" in deps)
    assert builders == ["runtime.offload"], builders
    # the protocol and the plan's inputs sit at the bottom: they import nothing else from the offload
    for leaf in ("runtime.offload.placement",):
        assert not {d for d in graph[leaf] if d.startswith("runtime.offload")}, (leaf, graph[leaf])
    assert {d for d in graph["runtime.offload.plan"] if d.startswith("runtime.offload")} <= {
        "runtime.offload.io.spans",
    }, graph["runtime.offload.plan"]
    reaching_in = sorted(m for m, deps in graph.items() if m.startswith("runtime.zero") and deps & offload)
    assert not reaching_in, reaching_in
