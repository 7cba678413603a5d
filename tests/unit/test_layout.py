"""The layout of services/: dependencies point one way, and every module stays small enough to read.

The import graph is computed from the source with `ast`, not by importing: every `import` and
`from ... import` anywhere in a module counts (module level and inside functions), since a lazy import
is still a dependency, and a cycle hidden inside a function is still a cycle. Imports under
`if TYPE_CHECKING:` are left out: they never run, so they order no loading, and they are how a module
names a type for its annotations without depending on the module that defines it.
"""

from __future__ import annotations

import ast
import importlib.util
import re
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


def _imports(name: str, path: Path, known: set[str], typing_too: bool = False) -> set[str]:
    """The services modules `name` imports: `import a.b` names a.b; `from a import b` names a.b when
    b is a module, else a; relative imports are resolved against the importing package. With
    `typing_too`, imports only a type checker sees count as well."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in (ast.walk(tree) if typing_too else _runtime_nodes(tree)):
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


def import_graph(typing_too: bool = False) -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path, known, typing_too) for name, path in mods.items()}


MAY_IMPORT = re.compile(r"^May import:(.*?)(?:\n\s*\n|\Z)", re.S | re.M)


def declared_rules(mods: dict[str, Path]) -> dict[str, list[str]]:
    """Package -> what its modules may import besides their own package, from the package
    docstring's `May import:` paragraph (the one place the rule is written)."""
    rules: dict[str, list[str]] = {}
    for name, path in mods.items():
        if path.name != "__init__.py":
            continue
        m = MAY_IMPORT.search(ast.get_docstring(ast.parse(path.read_text())) or "")
        if m:
            rules[name] = [x for x in re.split(r"[\s,]+", m.group(1)) if x]
    return rules


def _governing(name: str, rules: dict[str, list[str]]) -> str | None:
    """The nearest package around `name` (itself, for a package) that declares its imports."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in rules:
            return ".".join(parts[:i])
    return None


def direction_violations(graph: dict[str, set[str]], rules: dict[str, list[str]]) -> list[str]:
    """A module may import the modules its own package governs and what that package's rule names
    (a name covers the module or package and everything under it)."""
    out = []
    for name, deps in sorted(graph.items()):
        gov = _governing(name, rules)
        if gov is None:
            continue
        for dep in sorted(deps):
            if _governing(dep, rules) == gov:
                continue
            if not any(dep == a or dep.startswith(a + ".") for a in rules[gov]):
                out.append(f"{name} imports {dep} ({gov} may import {', '.join(rules[gov])})")
    return out


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


# The packages whose docstrings must state what they may import: the layers and their sub-packages.
DECLARED = {"services.core", "services.rl", "services.models", "services.tasks", "services.workers",
            *(f"services.core.{p}" for p in ("config", "observability", "transport", "journal", "host", "serving")),
            *(f"services.models.{p}" for p in ("io", "weights", "nets", "engines", "roles", "checkpoints"))}


def test_every_layer_and_sub_package_says_what_it_may_import() -> None:
    rules = declared_rules(_modules())
    assert not DECLARED - set(rules), f"packages without a `May import:` paragraph: {sorted(DECLARED - set(rules))}"
    unknown = [f"{pkg}: {a}" for pkg, allowed in rules.items() for a in allowed if a not in _modules()]
    assert not unknown, f"`May import:` names what does not exist: {unknown}"


def test_imports_point_only_where_each_package_says_even_for_types() -> None:
    """Type-only imports count too: a helper that names a higher module's class for its annotations
    still ties its meaning to that module."""
    bad = direction_violations(import_graph(typing_too=True), declared_rules(_modules()))
    assert not bad, "imports against the layering:\n  " + "\n  ".join(bad)


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



def test_the_direction_checker_reads_the_docstring_rules_and_flags_an_upward_import(tmp_path: Path) -> None:
    _write(tmp_path, {
        "services/__init__.py": "",
        "services/low/__init__.py": '"""Low.\n\nMay import: services.low\n"""\n',
        "services/low/a.py": "from services.high import b\n",
        "services/low/c.py": "from services.low import a\n",
        "services/high/__init__.py": '"""High.\n\nMay import:\nservices.low,\nservices.mid\n\nMore prose.\n"""\n',
        "services/high/b.py": "from services.low import c\nfrom services import top\n",
        "services/mid.py": "",
        "services/top.py": "from services.high import b\n",
    })
    mods = {_module_name(p, tmp_path): p for p in sorted((tmp_path / "services").rglob("*.py"))}
    rules = declared_rules(mods)
    assert rules == {"services.low": ["services.low"], "services.high": ["services.low", "services.mid"]}
    graph = {n: _imports(n, p, set(mods)) for n, p in mods.items()}
    assert direction_violations(graph, rules) == [
        "services.high.b imports services.top (services.high may import services.low, services.mid)",
        "services.low.a imports services.high.b (services.low may import services.low)",
    ]


def test_the_layout_section_of_the_architecture_doc_lists_every_module_as_the_tree_has_it() -> None:
    spec = importlib.util.spec_from_file_location("gen_layout", REPO / "scripts" / "gen_layout.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    doc = (REPO / "docs" / "architecture.md").read_text()
    assert gen.rewritten(doc) == doc, "docs/architecture.md's layout drifted: run `python scripts/gen_layout.py`"
    for path in sorted(SERVICES.rglob("*.py")):
        if path.is_relative_to(GENERATED) or path.name in ("__init__.py", "__main__.py"):
            continue
        assert f"| `{path.name}` |" in doc and f"#### `{path.parent.relative_to(REPO).as_posix()}/`" in doc, path


def test_no_module_but_the_controllers_server_names_the_controller_class() -> None:
    """The controller's helpers take the narrow protocols of services/controller/state.py (or the
    objects they use): a helper that imports `Controller`, even for a type, depends on all of it."""
    importers = []
    for path in sorted([*SERVICES.rglob("*.py"), *(REPO / "tests").rglob("*.py"), *(REPO / "bench").rglob("*.py")]):
        if path == SERVICES / "controller" / "server.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and any(a.name == "Controller" for a in node.names):
                importers.append(str(path.relative_to(REPO)))
    assert not importers, f"modules importing Controller: {importers}"
