"""The tree's shape (issue 22): imports point one way, the offload reads no environment below its settings,
the config is one package, and no library file passes 500 lines.

Everything here reads the source with `ast`; nothing is imported, so the checks take a fraction of a second
and hold for code paths no other test reaches (an import inside a rarely called function counts too).

How an import becomes an edge of the graph (module -> module it needs, within `runtime` or `launcher`):

- `import a.b.c` and `from a.b.c import x` need `a.b.c`, and every package above it that the importer is
  not itself inside: Python runs `a/b/__init__.py` before `a/b/c.py`, but a module's own packages are
  already being imported when it runs, so a package `__init__` importing its own submodules is normal.
- `from a.b import c` where `c` is a submodule needs `a.b.c`; it also needs `a.b`'s `__init__` when it
  takes any name that is not a submodule, or when the importer is not inside `a.b`. So a submodule taking
  a name from its own package's `__init__` while that `__init__` imports the submodule is a circle.
- Relative imports resolve the same way. Imports under `if TYPE_CHECKING:` never run and do not count;
  imports inside functions do.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINE_LIMIT = 500

# modules the circle check leaves out (none: every circle is gone)
CIRCLE_EXCLUDED: tuple[str, ...] = ()


def _modules(root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package `__init__`) for every .py file under `package`."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        found[".".join(parts)] = (path, is_package)
    return found


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (annotations only: never executed)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                for statement in node.body:
                    skipped.update(id(inner) for inner in ast.walk(statement))
    return skipped


def _imports(node: ast.stmt, base: str) -> list[tuple[str, list[str] | None]]:
    """(module imported, names taken from it or None for `import module`) for one import statement."""
    if isinstance(node, ast.Import):
        return [(alias.name, None) for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            parts = base.split(".")
            parts = parts[: len(parts) - (node.level - 1)]
            module = ".".join([*parts, node.module] if node.module else parts)
        else:
            module = node.module or ""
        return [(module, [alias.name for alias in node.names])]
    return []


def _needs(name: str, path: Path, is_package: bool, modules: dict, root: Path) -> dict[str, tuple[str, int]]:
    """{module of `modules` that module `name` needs: (its file, line of the first import that needs it)}."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = _type_checking_nodes(tree)
    base = name if is_package else name.rpartition(".")[0]
    parts = name.split(".")
    inside = {".".join(parts[:i]) for i in range(1, len(parts))}
    where = path.relative_to(root).as_posix()
    needs: dict[str, tuple[str, int]] = {}
    for node in ast.walk(tree):
        if id(node) in skipped or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        targets = []
        for module, names in _imports(node, base):
            dotted = module.split(".")
            targets += [
                ".".join(dotted[:i]) for i in range(1, len(dotted)) if ".".join(dotted[:i]) not in inside
            ]
            submodules = [f"{module}.{n}" for n in names or () if f"{module}.{n}" in modules]
            takes_init_names = names is None or len(submodules) < len(names)
            if takes_init_names or module not in inside:
                targets.append(module)
            targets += submodules
        for target in targets:
            if target in modules and target != name:
                needs.setdefault(target, (where, node.lineno))
    return needs


def import_graph(package: str, root: Path = ROOT) -> dict[str, dict[str, tuple[str, int]]]:
    """module -> {module it needs: (file, line of the first import that needs it)} within `package`."""
    modules = _modules(root, package)
    return {name: _needs(name, path, is_pkg, modules, root) for name, (path, is_pkg) in modules.items()}


def _strongly_connected(graph: dict[str, dict[str, tuple[str, int]]]) -> list[list[str]]:
    """The groups of modules that reach each other (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return sorted(groups)


def _shortest_circle(graph: dict[str, dict[str, tuple[str, int]]], group: list[str]) -> list[str]:
    """One shortest circle through the group's first module, breadth first: [a, b, ..., a]."""
    start, members = group[0], set(group)
    came_from: dict[str, str | None] = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node]):
                if target == start:
                    path = [node]
                    while (previous := came_from[path[-1]]) is not None:
                        path.append(previous)
                    return [*reversed(path), start]
                if target in members and target not in came_from:
                    came_from[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"{group} reach each other but no circle through {start} was found")


def import_circles(package: str, excluded: tuple[str, ...] = (), root: Path = ROOT) -> list[str]:
    """Each circle among `package`'s modules (those under `excluded` left out), as text naming every
    import on it: "a -> b -> a" followed by where each of those imports is."""
    graph = import_graph(package, root)

    def left_out(module: str) -> bool:
        return any(module == e or module.startswith(e + ".") for e in excluded)

    graph = {
        module: {target: where for target, where in needs.items() if not left_out(target)}
        for module, needs in graph.items()
        if not left_out(module)
    }
    circles = []
    for group in _strongly_connected(graph):
        circle = _shortest_circle(graph, group)
        hops = [
            f"    {graph[a][b][0]}:{graph[a][b][1]} ({a} imports {b})" for a, b in itertools.pairwise(circle)
        ]
        others = f" ({len(group)} modules reach each other: {', '.join(group)})" if len(group) > 2 else ""
        circles.append(" -> ".join(circle) + others + "\n" + "\n".join(hops))
    return circles


def test_runtime_modules_import_one_way() -> None:
    circles = import_circles("runtime", excluded=CIRCLE_EXCLUDED)
    assert not circles, "import circles in runtime/:\n" + "\n".join(circles)


def test_launcher_modules_import_one_way() -> None:
    circles = import_circles("launcher")
    assert not circles, "import circles in launcher/:\n" + "\n".join(circles)


def test_the_circle_check_names_each_import_of_a_circle(tmp_path: Path) -> None:
    """A submodule that takes a name from its package's `__init__`, which imports the submodule, is a
    circle; the same submodule importing a sibling is not."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from pkg.sub.a import A\nVALUE = 1\n")
    (package / "sub" / "a.py").write_text("from . import b\n\n\ndef f():\n    from pkg.sub import VALUE\n")
    (package / "sub" / "b.py").write_text("import os\n")
    assert import_circles("pkg", root=tmp_path) == [
        "pkg.sub -> pkg.sub.a -> pkg.sub\n"
        "    pkg/sub/__init__.py:1 (pkg.sub imports pkg.sub.a)\n"
        "    pkg/sub/a.py:5 (pkg.sub.a imports pkg.sub)"
    ]
    (package / "sub" / "a.py").write_text("from . import b\n")
    assert import_circles("pkg", root=tmp_path) == []


def _reads_environment(node: ast.AST) -> bool:
    """`os.environ` / `os.getenv` (any spelling that names them), or `from os import environ`."""
    names = ("environ", "environb", "getenv")
    if isinstance(node, ast.Attribute):
        return node.attr in names
    if isinstance(node, ast.ImportFrom) and node.module == "os":
        return any(alias.name in names for alias in node.names)
    return False


def test_offload_reads_no_environment() -> None:
    """Offload behaviour is set through `OffloadSettings`, read once with the config (runtime/config/
    offload.py turns the benchmark variables into settings there); nothing in runtime/offload reads the
    environment."""
    reads = []
    for path in sorted((ROOT / "runtime" / "offload").rglob("*.py")):
        where = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text())
        reads += [f"{where}:{node.lineno}" for node in ast.walk(tree) if _reads_environment(node)]
    assert reads == [], "the environment read in runtime/offload: " + ", ".join(reads)


def test_config_is_one_package() -> None:
    assert (ROOT / "runtime" / "config" / "__init__.py").is_file(), "runtime/config/ is not a package"
    strays = sorted(p.name for p in (ROOT / "runtime").glob("config*.py"))
    assert strays == [], f"config modules outside runtime/config/: {strays}"


def test_no_library_file_passes_500_lines() -> None:
    sizes = {
        path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
        for top in ("runtime", "launcher", "compat", "scripts")
        for path in sorted((ROOT / top).rglob("*.py"))
    }
    failing = {path: lines for path, lines in sizes.items() if lines > LINE_LIMIT}
    assert failing == {}, f"library files over {LINE_LIMIT} lines: " + ", ".join(
        f"{path} ({lines} lines)" for path, lines in failing.items()
    )
