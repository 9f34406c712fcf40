"""No import circles in the Python code: the package (python/vkv), the lab and the benchmarks;
and imports go one way between them: benchmarks -> lab -> vkv. Every import counts, those
inside functions too (a lazy import hides a circle, it does not break it); an import of a
package counts as one of its __init__.py."""

import ast
import pathlib
from typing import Dict, List, Optional, Set

ROOT = pathlib.Path(__file__).resolve().parents[2]
TREES = {"vkv": ROOT / "python" / "vkv", "lab": ROOT / "lab", "benchmarks": ROOT / "benchmarks"}


def modules() -> Dict[str, pathlib.Path]:
    """Every module of the trees by its dotted name (a package by its own name); a compiled
    module (vkv._C) by its stub."""
    found = {}
    for top, folder in TREES.items():
        for path in sorted(folder.rglob("*.py*"), key=lambda p: p.suffix != ".py"):
            if path.suffix not in (".py", ".pyi") or path.with_suffix(".py").exists() and path.suffix == ".pyi":
                continue
            parts = [top, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found.setdefault(".".join(parts), path)
    return found


def imported(name: str, node: ast.AST, known: Dict[str, pathlib.Path], is_package: bool) -> Set[str]:
    """The modules of the trees an import statement of module ``name`` names."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:
        package = name.split(".") if is_package else name.split(".")[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    names = {base}
    for alias in node.names:
        if f"{base}.{alias.name}" in known:  # from package import module
            names.add(f"{base}.{alias.name}")
    if all(f"{base}.{alias.name}" in known for alias in node.names):
        names.discard(base)  # only submodules named: the package's __init__ ran, but imports none of them here
    return names


def graph() -> Dict[str, Set[str]]:
    known = modules()
    edges: Dict[str, Set[str]] = {}
    for name, path in known.items():
        targets: Set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in imported(name, node, known, path.name == "__init__.py"):
                    while target and target not in known:  # a name inside a module, or another package
                        target = target.rpartition(".")[0]
                    if target and target != name:
                        targets.add(target)
        edges[name] = targets
    return edges


def find_cycle(edges: Dict[str, Set[str]]) -> Optional[List[str]]:
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(node: str) -> Optional[List[str]]:
        state[node] = 1
        path.append(node)
        for target in sorted(edges[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_trees_are_read():
    edges = graph()
    assert {"vkv", "vkv.paged", "lab.stores.catalog", "benchmarks.common"} <= set(edges)
    assert "lab.stores.kv_stores" in edges["lab.stores.flashinfer"]


def test_no_module_imports_itself_through_others():
    cycle = find_cycle(graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_package_imports_neither_the_lab_nor_the_benchmarks():
    upward = [(name, target) for name, targets in graph().items() for target in targets
              if (name.startswith("vkv") and not target.startswith("vkv"))
              or (name.startswith("lab") and target.startswith("benchmarks"))]
    assert upward == []


def test_a_circle_is_found_where_there_is_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
