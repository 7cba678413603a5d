"""The layout of services/: dependencies point one way, and every module stays small enough to read.

The import graph is computed from the source with `ast`, not by importing: every `import` and
`from ... import` anywhere in a module counts (module level and inside functions), since a lazy import
is still a dependency, and a cycle hidden inside a function is still a cycle. Imports under
`if TYPE_CHECKING:` are left out: they never run, so they order no loading, and they are how a module
names a type for its annotations without depending on the module that defines it.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVICES = REPO / "services"
MAX_LINES = 500
GENERATED = SERVICES / "core" / "pb"
LOCAL_LOOP = "services.local"
# The only module allowed to import the single-process loop: the CLI entry that runs it.
LOCAL_LOOP_CALLERS = {"services.cli"}


def _module_name(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(SERVICES.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node but those only a type checker sees (the body of `if TYPE_CHECKING:`)."""
    out: list[ast.AST] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The services modules `name` imports: `import a.b` names a.b; `from a import b` names a.b when
    b is a module, else a; relative imports are resolved against the importing package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    # `import services.x.y` where services.x.y is a package's attribute, not a module: keep the module.
    resolved = set()
    for target in found:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            resolved.add(target)
    return resolved


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path, known) for name, path in mods.items()}


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm; components of more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _shortest_cycle(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """A shortest cycle through the first module of a strongly connected component."""
    start, members = comp[0], set(comp)
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v] & members):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if w not in parent:
                parent[w] = v
                queue.append(w)
    raise AssertionError(f"{comp} is not strongly connected")


def test_services_have_no_import_cycle() -> None:
    graph = import_graph()
    cycles = [f"{' -> '.join(_shortest_cycle(graph, comp))} (cycles join {', '.join(comp)})"
              for comp in _strongly_connected(graph)]
    assert not cycles, "import cycles in services/:\n  " + "\n  ".join(cycles)


def test_only_the_cli_imports_the_single_process_loop() -> None:
    graph = import_graph()
    assert LOCAL_LOOP in graph, f"{LOCAL_LOOP} moved: update this test"
    importers = sorted(m for m, deps in graph.items() if LOCAL_LOOP in deps and m not in LOCAL_LOOP_CALLERS)
    assert not importers, f"{', '.join(importers)} import {LOCAL_LOOP}; the services must not depend on the local loop"


def test_no_module_in_services_is_over_500_lines() -> None:
    sizes = {
        str(p.relative_to(REPO)): len(p.read_text().splitlines())
        for p in sorted(SERVICES.rglob("*.py"))
        if not p.is_relative_to(GENERATED)
    }
    big = {p: n for p, n in sizes.items() if n > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: " + ", ".join(f"{p} ({n})" for p, n in sorted(big.items()))


# -- the checker itself: a graph it reads wrong would pass any layout -----------------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)


def test_the_checker_sees_lazy_submodule_and_relative_imports(tmp_path: Path) -> None:
    _write(tmp_path, {
        "services/__init__.py": "",
        "services/pkg/__init__.py": "",
        "services/pkg/a.py": "def f():\n    from services.pkg import b\n",
        "services/pkg/b.py": "from .c import thing\n",
        "services/pkg/c.py": "import services.pkg.a\nthing = 1\n",
        "services/pkg/d.py": "from services.pkg.c import thing\n",
        "services/pkg/e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from services.pkg import d\n"
                             "else:\n    import services.pkg.b\n",
    })
    mods = {_module_name(p, tmp_path): p for p in sorted((tmp_path / "services").rglob("*.py"))}
    known = set(mods)
    graph = {n: _imports(n, p, known) for n, p in mods.items()}
    assert graph["services.pkg.a"] == {"services.pkg.b"}
    assert graph["services.pkg.b"] == {"services.pkg.c"}
    assert graph["services.pkg.d"] == {"services.pkg.c"}
    assert graph["services.pkg.e"] == {"services.pkg.b"}  # the type-checking-only import is no edge
    comps = _strongly_connected(graph)
    assert comps == [["services.pkg.a", "services.pkg.b", "services.pkg.c"]]
    assert _shortest_cycle(graph, comps[0]) == ["services.pkg.a", "services.pkg.b", "services.pkg.c",
                                                "services.pkg.a"]

