"""eaglet's imports run one way, with no circle, and no torch where none is needed.

The packages, bottom up (each may import only from packages below it, and from its own):

- ``core``: configuration, files, progress, rates, GPUs (no other eaglet package)
- ``data``: prompts, the template check, the draft vocabulary, the shard format
- ``target``: resolving the target, its checkpoint's tensors, its states and head
- ``model`` and ``engine``, side by side (neither imports the other): the drafter, and vLLM
- ``stages``: generate, extract, train, evaluate, scaling (never a tool; no stage imports
  another, but where ``STAGE_USES`` says why)
- ``tools``: status, plan (and its memory plan), the report page, plots, rehearse, the command line

Every import counts, at the top of a module or inside a function: a function-level import
runs when the function is called and closes a circle just the same (it only hides it from a
module-level import order). Imports under ``if TYPE_CHECKING:`` never run and do not count.
A function-level import of an eaglet module is allowed only where ``LOCAL_IMPORTS`` says why.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO, SRC

PACKAGE = SRC / "eaglet"

# bottom up; a package imports only from packages of a lower rank (and from itself)
RANKS = {"core": 0, "data": 1, "target": 2, "model": 3, "engine": 3, "stages": 4, "tools": 5}

# Circles known and not broken yet, each with what breaks it. The test fails on any other
# circle, and on a listed one that changed or is gone (then remove it here).
KNOWN_CIRCLES: dict[frozenset, str] = {}

# function-level imports of eaglet modules, each with why it is not at the top
LOCAL_IMPORTS: dict[str, str] = {
    "tools.cli": "each subcommand loads its own modules when it runs: `eaglet status` and "
    "`eaglet plan` must not import what `eaglet rehearse` needs (PyTorch)",
    "model.published": "every Snakefile parse reads a starting drafter's settings from it "
    "(train.init_from), which must not load PyTorch; converting one does",
}

# Within ``stages``, each stage (``stages.<name>``, a module or a package) imports no other
# stage: what two stages share sits below them (``target``, ``engine``, ``data``, ``core``) or
# in one of these modules of ``stages`` that is no stage of its own
STAGE_HELPERS = {"scripting"}
# the imports of one stage from another that are the point of the stage, each with why
STAGE_USES = {
    ("scaling", "train"): "the scaling stage trains its drafters with the train stage's loop",
}

# what a person runs to see where a run stands, and what every Snakefile parse imports:
# none of them may load PyTorch (1.6 s of every `eaglet status` and `snakemake -n`)
TORCH_FREE = [
    "eaglet.tools.status",
    "eaglet.tools.plan",
    "eaglet.tools.memory_plan",
    "eaglet.tools.report_page",
    "eaglet.tools.cli",
    "eaglet.core.config",
    "eaglet.core.io",
    "eaglet.core.dtypes",
]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST, modules: set[str], local: bool = False):
    """``(module, line, local)`` for every eaglet module imported anywhere under ``node``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            yield from (hit for stmt in child.orelse for hit in _imports_of(stmt, modules, local))
            continue
        yield from _imports_of(child, modules, local)


def _resolve(name: str, modules: set[str]) -> str | None:
    """The module ``eaglet.<name>`` names: itself, or the package it is in."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports_of(node: ast.AST, modules: set[str], local: bool):
    inner = local or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        if node.module == "eaglet" or node.module.startswith("eaglet."):
            base = node.module.removeprefix("eaglet").lstrip(".")
            for alias in node.names:  # from eaglet.core import rates: the module eaglet.core.rates
                full = f"{base}.{alias.name}" if base else alias.name
                target = full if full in modules else _resolve(base, modules)
                if target:
                    yield target, node.lineno, local
    elif isinstance(node, ast.ImportFrom) and node.level > 0:
        raise AssertionError(f"line {node.lineno}: relative import; eaglet imports absolutely")
    elif isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.startswith("eaglet."):
                target = _resolve(alias.name.removeprefix("eaglet."), modules)
                if target:
                    yield target, node.lineno, local
    yield from _imports(node, modules, inner)


def module_names(package: Path = PACKAGE) -> set[str]:
    """Every module of the package, dotted below it (``stages.train.loop``); a package's
    ``__init__`` is the package's own name."""
    names = set()
    for path in package.rglob("*.py"):
        parts = path.relative_to(package).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if parts:
            names.add(".".join(parts))
    return names


def _path(package: Path, module: str) -> Path:
    path = package.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def import_graph(package: Path = PACKAGE, local: bool = False) -> dict[str, dict[str, int]]:
    """``module -> {imported module: line of its first import}`` over the package's modules
    (``local``: the function-level imports only)."""
    modules = module_names(package)
    graph: dict[str, dict[str, int]] = {}
    for name in sorted(modules):
        path = _path(package, name)
        tree = ast.parse(path.read_text(), filename=str(path))
        edges: dict[str, int] = {}
        for imported, line, inside in _imports(tree, modules):
            if imported != name and not name.startswith(imported + ".") and inside >= local:
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
    """A readable circle through ``group``: ``a:12 -> b:40 -> a``, each hop with the line
    of its import, found by a breadth-first walk back to the start."""
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
                    hops = [f"{m}:{graph[m][n]}" for m, n in zip(path, path[1:] + [start])]
                    return " -> ".join(hops + [start])
                if imported not in came_from:
                    came_from[imported] = module
                    following.append(imported)
        frontier = following
    raise AssertionError(f"no circle through {group}")


def wrong_way(graph: dict[str, dict[str, int]]) -> list[str]:
    """Every import of a package from one not above it: ``module:line -> module``."""
    found = []
    for module, edges in graph.items():
        mine = module.split(".")[0]
        for imported, line in edges.items():
            theirs = imported.split(".")[0]
            if theirs == mine:
                continue
            if theirs not in RANKS or mine not in RANKS or RANKS[theirs] >= RANKS[mine]:
                found.append(f"{module}:{line} -> {imported}")
    return sorted(found)


def test_no_import_circle_among_eaglet_modules():
    graph = import_graph()
    found = circles(graph)
    new = [g for g in found if frozenset(g) not in KNOWN_CIRCLES]
    assert not new, (
        "import circle(s) among eaglet's modules (line numbers are the imports):\n"
        + "\n".join(one_circle(graph, g) for g in new)
        + "\nMove what both sides need into a module below them both."
    )
    gone = [sorted(k) for k in KNOWN_CIRCLES if sorted(k) not in found]
    assert not gone, f"the known circle(s) {gone} are gone: remove them from KNOWN_CIRCLES"


def test_every_module_sits_in_a_package_of_the_layering():
    """A module outside the packages would have no place in the direction."""
    loose = sorted(m for m in module_names() if m.split(".")[0] not in RANKS)
    assert not loose, f"modules in no package of {sorted(RANKS)}: {loose}"


def test_imports_run_one_way_through_the_packages():
    bad = wrong_way(import_graph())
    assert not bad, (
        "imports from a package at or above the importer's (bottom up: "
        f"{', '.join(RANKS)}; model and engine side by side):\n"
        + "\n".join(bad)
        + "\nMove what the lower package needs down, into it or below it."
    )


def across_stages(graph: dict[str, dict[str, int]]) -> list[str]:
    """Every import of one stage by another (``module:line -> module``) that neither
    :data:`STAGE_HELPERS` nor :data:`STAGE_USES` allows."""
    found = []
    for module, edges in graph.items():
        parts = module.split(".")
        if parts[0] != "stages" or len(parts) < 2:
            continue
        for imported, line in edges.items():
            theirs = imported.split(".")
            if theirs[0] != "stages" or len(theirs) < 2 or theirs[1] == parts[1]:
                continue
            if theirs[1] in STAGE_HELPERS or (parts[1], theirs[1]) in STAGE_USES:
                continue
            found.append(f"{module}:{line} -> {imported}")
    return sorted(found)


def test_no_stage_imports_another_stage():
    """What a stage shares with another (the capture that generation, the vllm extraction
    backend and training's stream mode all use) lives below ``stages``: no stage reaches into
    another's modules for it."""
    graph = import_graph()
    bad = across_stages(graph)
    assert not bad, (
        "a stage imports another stage's modules (move what both need below "
        "``stages``, or name the use in STAGE_USES):\n" + "\n".join(bad)
    )
    made = {
        (m.split(".")[1], i.split(".")[1])
        for m, edges in graph.items()
        for i in edges
        if m.startswith("stages.") and i.startswith("stages.")
    }
    unused = sorted(f"{a} -> {b}" for a, b in STAGE_USES if (a, b) not in made)
    assert not unused, f"STAGE_USES names uses no module makes: {unused}"


def test_no_function_level_import_of_an_eaglet_module_without_its_reason():
    graph = import_graph(local=True)
    hidden = sorted(
        f"{m}:{line} -> {i}"
        for m, edges in graph.items()
        if m not in LOCAL_IMPORTS
        for i, line in edges.items()
    )
    assert not hidden, (
        "function-level imports of eaglet modules (import at the top; where a "
        "reason keeps one inside, name it in LOCAL_IMPORTS):\n" + "\n".join(hidden)
    )
    stale = sorted(m for m in LOCAL_IMPORTS if not graph.get(m))
    assert not stale, f"LOCAL_IMPORTS names modules with no local import: {stale}"


def _write(root: Path, module: str, text: str) -> None:
    path = root.joinpath(*module.split(".")).with_suffix(".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    for parent in path.relative_to(root).parents:
        (root / parent / "__init__.py").touch()
    path.write_text(text)


def test_the_checks_find_a_circle_a_wrong_way_import_and_a_hidden_one(tmp_path):
    """The finders themselves: a circle closed inside a function counts, one under
    TYPE_CHECKING does not; a lower package importing a higher one, or one of its siblings,
    is named with its line; so is a function-level import."""
    _write(tmp_path, "core.a", "from eaglet.core.b import x\n")
    _write(tmp_path, "core.b", "import os\n\n\ndef f():\n    from eaglet.core import a\n")
    _write(
        tmp_path,
        "data.c",
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from eaglet.tools.d import y\n"
        "from eaglet.core.b import x\n",
    )
    _write(tmp_path, "tools.d", "from eaglet.core import a\n")
    _write(tmp_path, "stages.e", "import os\nfrom eaglet.tools.d import z\n")
    _write(tmp_path, "model.f", "from eaglet.engine.g import w\n")
    _write(tmp_path, "engine.g", "")
    _write(
        tmp_path,
        "stages.train.h",
        "from eaglet.stages.extract.vllm import v\nfrom eaglet.stages.scripting import u\n",
    )
    _write(tmp_path, "stages.extract.vllm", "")
    _write(tmp_path, "stages.scripting", "")
    graph = import_graph(tmp_path)
    assert graph["core.a"] == {"core.b": 1} and graph["core.b"] == {"core.a": 5}
    assert graph["data.c"] == {"core.b": 4}
    assert circles(graph) == [["core.a", "core.b"]]
    assert one_circle(graph, ["core.a", "core.b"]) == "core.a:1 -> core.b:5 -> core.a"
    assert wrong_way(graph) == ["model.f:1 -> engine.g", "stages.e:2 -> tools.d"]
    assert across_stages(graph) == ["stages.train.h:1 -> stages.extract.vllm"]
    assert import_graph(tmp_path, local=True)["core.b"] == {"core.a": 5}
    assert import_graph(tmp_path, local=True)["core.a"] == {}


def _without_torch(tmp_path: Path) -> dict[str, str]:
    """An environment whose Python cannot import torch (a ``sitecustomize`` finder that
    refuses it), with this checkout's package first on the path."""
    blocker = tmp_path / "no_torch" / "sitecustomize.py"
    blocker.parent.mkdir()
    blocker.write_text(
        "import sys\n"
        "class _NoTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch is blocked in this test')\n"
        "sys.meta_path.insert(0, _NoTorch())\n"
    )
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(blocker.parent), str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")]
        ),
    }


@pytest.mark.subprocess
def test_status_plan_the_report_and_the_snakefile_parse_never_import_torch(tmp_path):
    """Run with torch made unimportable: the modules a person or every Snakefile parse
    loads must import, and the Snakefile must parse (``snakemake -n`` on a config)."""
    env = _without_torch(tmp_path)
    code = (
        "import importlib, sys\n"
        f"for name in {TORCH_FREE!r}:\n"
        "    importlib.import_module(name)\n"
        "assert 'torch' not in sys.modules\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "-n",
            "--cores",
            "1",
            "--config",
            f"results_dir={tmp_path / 'results'}",
        ],
        env=env,
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "torch is blocked" not in done.stdout + done.stderr


@pytest.mark.subprocess
def test_the_blocker_itself_stops_torch(tmp_path):
    """The torch-free check would pass vacuously if the blocker let torch through."""
    env = _without_torch(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", "import eaglet.model.drafter"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0 and "torch is blocked" in done.stderr


def test_every_module_opens_with_a_docstring_that_says_what_it_holds():
    """A module's first lines say what it is for: no placeholder (``TODO``, a word or two)."""
    thin = []
    for module in sorted(module_names()):
        doc = ast.get_docstring(ast.parse(_path(PACKAGE, module).read_text())) or ""
        if len(doc.split()) < 4 or doc.strip().upper().startswith("TODO"):
            thin.append(f"{module}: {doc!r}")
    assert not thin, "modules without a docstring that says what they hold:\n" + "\n".join(thin)


MAX_MODULE_LINES = 800


def test_no_module_is_longer_than_800_lines():
    """A module past 800 lines holds more than one thing: split it by what its parts do (a
    formatter run and later changes pushed four past it unnoticed until this test)."""
    long = {
        module: n
        for module in sorted(module_names())
        if (n := len(_path(PACKAGE, module).read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
