"""The tree draws the architecture: no import cycles, no file over 500 lines, no arrow pointing up.

The import graph is read with `ast` (nothing is imported), so the check also sees imports inside functions
(a lazy import still makes a cycle); only imports under ``if TYPE_CHECKING:`` are left out, because they
never run. ``from pkg import name`` counts as an import of ``pkg.name`` when that is a module, else of
``pkg`` itself. Importing ``a.b.c`` is counted as an edge to ``a.b.c`` only, not to the packages above it
(their ``__init__`` files are leaves or re-export their own children).
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("radixrt", "frontend_lang")
LINE_LIMIT_DIRS = ("radixrt", "frontend_lang", "tests", "benchmarks", "examples")
MAX_LINES = 500

# (importer prefix, forbidden import prefixes): the arrows that must never point up.
FORBIDDEN = {
    "radixrt.kernels": ("radixrt.worker", "radixrt.server", "radixrt.mem_cache"),
    "radixrt.worker": ("radixrt.server",),
}


def module_files(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Every module of the first-party packages: dotted name -> file (a package is its ``__init__.py``)."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of `tree` except the bodies of ``if TYPE_CHECKING:`` (their ``else:`` runs, so it counts)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _resolve(name: str, modules: Mapping[str, Path]) -> str | None:
    """The longest prefix of dotted `name` that is a first-party module, or None for a third-party one."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def imports_of(module: str, path: Path, modules: Mapping[str, Path]) -> set[str]:
    """The first-party modules that `module` imports at run time (module level or inside functions)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name, modules)
                if target is not None:
                    found.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # `from . import x` inside a package's __init__ is relative to the package itself.
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                target = submodule if submodule in modules else _resolve(source, modules)
                if target is not None:
                    found.add(target)
    found.discard(module)
    return found


def import_graph(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, set[str]]:
    """module -> the first-party modules it imports at run time."""
    modules = module_files(root, packages)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """One concrete cycle (``[a, b, ..., a]``) per strongly connected component with more than one module.

    Tarjan's algorithm (iterative) finds the components; a breadth-first search inside each one gives a
    shortest cycle through its smallest member, so the message names real import lines to remove.
    """
    edges = {node: sorted(set(targets) - {node}) for node, targets in graph.items()}
    for targets in list(edges.values()):
        for target in targets:
            edges.setdefault(target, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work: list[tuple[str, int]] = [(start, 0)]
        while work:
            node, child = work.pop()
            if child == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            targets = edges[node]
            if child < len(targets):
                work.append((node, child + 1))
                target = targets[child]
                if target not in index:
                    work.append((target, 0))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return [_cycle_through(component, edges) for component in sorted(components)]


def _cycle_through(component: list[str], edges: Mapping[str, list[str]]) -> list[str]:
    members = set(component)
    start = component[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        next_frontier = []
        for node in frontier:
            for target in edges[node]:
                if target not in members:
                    continue
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if target not in parents:
                    parents[target] = node
                    next_frontier.append(target)
        frontier = next_frontier
    raise AssertionError(f"no cycle through {start} in its component {component}")


# --- the checker itself can fail ------------------------------------------------------------------------


def test_find_cycles_reports_a_synthetic_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"d"}, "d": set()}) == []
    # Two separate cycles, one of them reached only through a chain.
    graph = {"x": {"y"}, "y": {"x"}, "p": {"q"}, "q": {"r"}, "r": {"q"}}
    assert find_cycles(graph) == [["q", "r", "q"], ["x", "y", "x"]]


def test_import_graph_sees_lazy_imports_and_skips_type_checking(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.b import thing\n    return thing\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\nelse:\n    import json\n"
        "from . import a\nthing = 1\n"
    )
    (pkg / "c.py").write_text("from pkg import sub\nfrom pkg.sub import helper\n")
    (pkg / "sub" / "helper.py").write_text("from .. import c\n")
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg.a"] == {"pkg.b"}
    assert graph["pkg.b"] == {"pkg.a"}  # `from . import a` resolves to the submodule; TYPE_CHECKING skipped
    assert graph["pkg.c"] == {"pkg.sub", "pkg.sub.helper"}
    assert graph["pkg.sub.helper"] == {"pkg.c"}
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"], ["pkg.c", "pkg.sub.helper", "pkg.c"]]


# --- the repository ---------------------------------------------------------------------------------------


def test_no_import_cycles() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


@pytest.mark.parametrize("importer", sorted(FORBIDDEN))
def test_nothing_imports_upward(importer: str) -> None:
    graph = import_graph()
    bad = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if module == importer or module.startswith(importer + ".")
        for target in targets
        if any(target == f or target.startswith(f + ".") for f in FORBIDDEN[importer])
    )
    assert not bad, "\n".join(bad)


def test_no_file_over_500_lines() -> None:
    too_long = []
    for folder in LINE_LIMIT_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > MAX_LINES:
                too_long.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not too_long, "\n".join(too_long)


def test_no_top_level_kernels_package() -> None:
    assert not (ROOT / "kernels").exists(), "attention kernels live in radixrt/kernels"
    spec = importlib.util.find_spec("kernels")
    if spec is None:
        return
    # Another distribution may own the name; it just must not come from this repository.
    locations = [spec.origin] if spec.origin else []
    locations += list(spec.submodule_search_locations or [])
    ours = [loc for loc in locations if ROOT == Path(loc).resolve() or ROOT in Path(loc).resolve().parents]
    assert not ours, f"an importable `kernels` package from this repo: {ours}"
