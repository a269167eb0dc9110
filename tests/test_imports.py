"""No import circle among eaglet's modules.

The layering the library keeps, bottom up: the base (config, files, progress, rates, the
target's files), the engine (the server, its HTTP client, the capture arguments and
connector), the stages (data, hidden states, drafter, evaluation), and on top the entries
(the CLI, status, plan). A module imports only from below it, so no two modules import each
other, directly or around a longer circle.

Every import counts, at the top of a module or inside a function: a function-level import
runs when the function is called and closes a circle just the same (it only hides it from a
module-level import order). Imports under ``if TYPE_CHECKING:`` never run and do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "eaglet"

# Circles known and not broken yet, each with what breaks it. The test fails on any other
# circle, and on a listed one that changed or is gone (then remove it here).
KNOWN_CIRCLES: dict[frozenset, str] = {}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST, modules: set[str]):
    """The eaglet modules imported anywhere under ``node``, with the line of each import."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            yield from (hit for stmt in child.orelse for hit in _imports_of(stmt, modules))
            continue
        yield from _imports_of(child, modules)


def _imports_of(node: ast.AST, modules: set[str]):
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        parts = node.module.split(".")
        if parts[0] == "eaglet" and len(parts) > 1:
            yield parts[1], node.lineno
        elif node.module == "eaglet":  # from eaglet import rates, shards
            yield from ((a.name, node.lineno) for a in node.names if a.name in modules)
    elif isinstance(node, ast.ImportFrom) and node.level > 0:
        raise AssertionError(f"line {node.lineno}: relative import; eaglet imports absolutely")
    elif isinstance(node, ast.Import):
        for alias in node.names:
            parts = alias.name.split(".")
            if parts[0] == "eaglet" and len(parts) > 1:
                yield parts[1], node.lineno
    yield from _imports(node, modules)


def import_graph(package: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """``module -> {imported module: line of its first import}`` over the package's modules."""
    modules = {p.stem for p in package.glob("*.py")} - {"__init__"}
    graph: dict[str, dict[str, int]] = {}
    for name in sorted(modules):
        tree = ast.parse((package / f"{name}.py").read_text(), filename=f"{name}.py")
        edges: dict[str, int] = {}
        for imported, line in _imports(tree, modules):
            if imported in modules and imported != name:
                edges.setdefault(imported, line)
        graph[name] = edges
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm): every
    module of a group reaches every other by imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph[module]:
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return groups


def one_circle(graph: dict[str, dict[str, int]], group: list[str]) -> str:
    """A readable circle through ``group``: ``a.py:12 -> b.py:40 -> a.py``, each hop with the
    line of its import, found by a breadth-first walk back to the start."""
    start = group[0]
    members = set(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for imported in sorted(graph[module]):
                if imported not in members:
                    continue
                if imported == start:
                    path = [module]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    path.reverse()
                    hops = [f"{m}.py:{graph[m][n]}" for m, n in zip(path, path[1:] + [start])]
                    return " -> ".join(hops + [f"{start}.py"])
                if imported not in came_from:
                    came_from[imported] = module
                    following.append(imported)
        frontier = following
    raise AssertionError(f"no circle through {group}")


def test_no_import_circle_among_eaglet_modules():
    graph = import_graph()
    found = circles(graph)
    new = [g for g in found if frozenset(g) not in KNOWN_CIRCLES]
    assert not new, "import circle(s) among eaglet's modules (line numbers are the imports):\n" \
        + "\n".join(one_circle(graph, g) for g in new) \
        + "\nMove what both sides need into a module below them both."
    gone = [sorted(k) for k in KNOWN_CIRCLES if sorted(k) not in found]
    assert not gone, f"the known circle(s) {gone} are gone: remove them from KNOWN_CIRCLES"


def test_the_engine_client_and_capture_arguments_sit_below_the_stages():
    """Generation and extraction both use the engine's HTTP client and the capture
    arguments; neither imports a stage, so both stages can import them."""
    graph = import_graph()
    for module in ("engine_client", "hidden_capture", "server", "hidden_connector"):
        assert set(graph[module]) <= {"io", "progress", "rates", "config", "server"}, \
            f"{module} imports {sorted(graph[module])}"
    assert "generate" not in graph["extract_vllm"] and "extract" not in graph["extract_vllm"]
    assert not {"extract", "extract_vllm", "generate"} & set(graph["extract_common"])


def test_a_circle_through_a_function_level_import_is_found_and_named(tmp_path):
    """The finder itself: a circle closed inside a function counts, one under
    TYPE_CHECKING does not, and the message names each hop with its line."""
    (tmp_path / "a.py").write_text("from eaglet.b import x\n")
    (tmp_path / "b.py").write_text("import os\n\n\ndef f():\n    from eaglet import a\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\n"
                                   "if TYPE_CHECKING:\n    from eaglet.a import y\n"
                                   "from eaglet.b import x\n")
    graph = import_graph(tmp_path)
    assert graph == {"a": {"b": 1}, "b": {"a": 5}, "c": {"b": 4}}
    assert circles(graph) == [["a", "b"]]
    assert one_circle(graph, ["a", "b"]) == "a.py:1 -> b.py:5 -> a.py"
