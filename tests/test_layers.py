"""kvprof's packages import only downward, and no modules import each other in a circle.

The layers, lowest first (docs/CONTRACTS.md says which module offers what): the top-level modules (errors,
limits, jsonfile, atomic, cells, classes, recording, results, parallel) -> models -> policy and
profiler -> core -> sim and vllm -> replay -> cli. Two packages on one layer do not import each
other either. The graph is read from the source (every import statement, those inside functions
too: a lazy import is still a dependency), so nothing is imported to check it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvprof

PACKAGE = Path(kvprof.__file__).parent

#: Rank of each layer; a module's layer is its subpackage, or "base" for a top-level module.
RANK = {"base": 0, "models": 1, "policy": 2, "profiler": 2, "core": 3, "sim": 4, "vllm": 4, "replay": 5, "cli": 6}

#: Imports that break the order for a reason, (importer, imported) -> why. None today.
EXCEPTIONS: dict[tuple[str, str], str] = {}


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package under ``root``, by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def import_graph(found: dict[str, Path]) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``: for ``from a import b`` the module ``a.b``
    where there is one, else ``a``; relative imports resolved."""
    graph: dict[str, set[str]] = {}
    for name, path in found.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in found else base for alias in node.names]
            else:
                continue
            edges.update(t for t in targets if t in found and t != name)
    return graph


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANK else "base"


def wrong_way(graph: dict[str, set[str]]) -> list[str]:
    """The imports that go up a layer or across to another package of the same layer."""
    found = []
    for importer, imported in sorted((a, b) for a, targets in graph.items() for b in targets):
        here, there = layer(importer), layer(imported)
        if here != there and RANK[there] >= RANK[here] and (importer, imported) not in EXCEPTIONS:
            found.append(f"{importer} ({here}) imports {imported} ({there})")
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


GRAPH = import_graph(modules())


def test_every_module_is_on_a_layer():
    """A new package must be given its place in ``RANK`` before it may import anything."""
    packages = {init.parent.name for init in PACKAGE.glob("*/__init__.py")}
    assert packages <= set(RANK), sorted(packages - set(RANK))


def test_the_graph_is_read_from_the_source():
    """Imports at the top, inside functions and from a package all count (the checks below are not vacuous)."""
    assert "kvprof.sim.metrics" in GRAPH["kvprof.sim.engine"]  # top of the module
    assert "kvprof.parallel" in GRAPH["kvprof.profiler.shards"]  # inside DiskShards.__init__
    assert "kvprof.results" in GRAPH["kvprof.sim.sweep"]  # from kvprof import results
    assert "kvprof" in GRAPH["kvprof.results"]  # from kvprof import __version__


def test_packages_import_only_downward():
    assert wrong_way(GRAPH) == []


def test_no_modules_import_each_other_in_a_circle():
    assert cycles(GRAPH) == []


def test_the_checks_find_what_they_look_for():
    graph = {"kvprof.profiler.shards": {"kvprof.sim.runner"}, "kvprof.sim.runner": {"kvprof.errors"},
             "kvprof.sim.engine": {"kvprof.sim.timed"}, "kvprof.sim.timed": {"kvprof.sim.workload"},
             "kvprof.sim.workload": {"kvprof.sim.engine"}, "kvprof.vllm.live": {"kvprof.sim.engine"},
             "kvprof.errors": set()}
    assert wrong_way(graph) == ["kvprof.profiler.shards (profiler) imports kvprof.sim.runner (sim)",
                                "kvprof.vllm.live (vllm) imports kvprof.sim.engine (sim)"]
    assert cycles(graph) == [["kvprof.sim.engine", "kvprof.sim.timed", "kvprof.sim.workload"]]
