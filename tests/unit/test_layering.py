"""The package graph, tested whole: each part of pagedgen imports only what its row allows; nothing cycles.

Every import is read from the source with ``ast``: module-level and function-local ones alike (a lazy
import would otherwise hide an upward one), plus ``importlib.import_module("pagedgen....")`` with a literal
name (how the command dispatches to the bench). Imports under ``if TYPE_CHECKING:`` never run and are left
out. A part is a sub-package of ``pagedgen/`` or one of its top-level modules; ``pagedgen`` itself is the
lazy facade (``pagedgen/__init__.py``). A part split into sub-packages by job (``ops``) has a table of its
own for them. docs/architecture.md, "Who imports whom" and "Inside ops", has the tables and why.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "pagedgen"

# part -> the other parts it may import. Keep in step with docs/architecture.md.
ALLOWED: dict[str, frozenset[str]] = {
    name: frozenset(parts)
    for name, parts in {
        "errors": (),
        "argtypes": (),
        "pagedgen": (),
        "spec": (),
        "core": ("errors",),
        "ops": ("core",),
        "models": ("core", "ops", "errors"),
        "executor": ("core", "ops", "models", "errors"),
        "cache": ("core", "errors"),
        "guidance": ("core", "errors"),
        "sampling": ("core", "guidance", "errors"),
        "parallel": ("core", "ops", "models", "executor", "errors"),
        "engine": ("core", "cache", "executor", "parallel", "sampling", "guidance", "errors"),
        "llm": ("engine", "models", "sampling", "guidance", "spec", "errors"),
        "server": ("pagedgen", "engine", "llm", "models", "cache", "sampling", "guidance", "spec", "errors"),
        "cli": ("pagedgen", "argtypes", "engine", "llm", "models", "server", "errors", "bench"),
        "bench": ("argtypes", "core", "ops", "models", "executor", "engine", "spec", "errors"),
    }.items()
}
# A part split into sub-packages by job: sub-package -> the sibling sub-packages it may import (what the
# part's own row allows, e.g. ``core`` for ``ops``, holds for each of them). Keep in step with
# docs/architecture.md, "Inside ops".
SUB_ALLOWED: dict[str, dict[str, frozenset[str]]] = {
    "ops": {
        name: frozenset(subs)
        for name, subs in {
            "kernels": (),
            "matmul": ("kernels",),
            "mixers": ("kernels",),
            "layers": ("kernels", "matmul", "mixers"),
        }.items()
    },
}
# The one way into the bench from outside it: the command hands ``pagedgen bench ...`` over by name.
BENCH_DISPATCH = ("pagedgen.cli", "pagedgen.bench.cli")
# Module cycles that wait for a change elsewhere; each must still exist (a stale entry fails).
PENDING_CYCLES: tuple[frozenset[str], ...] = ()


@dataclass(frozen=True)
class Edge:
    """One import of a pagedgen module by another; ``how`` is "module", "function" or "dispatch"."""

    source: str
    target: str
    how: str


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str:
    """``pagedgen.engine.step`` -> ``engine``; ``pagedgen.llm`` -> ``llm``; ``pagedgen`` -> ``pagedgen``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def sub_part_of(module: str) -> str | None:
    """``pagedgen.ops.matmul.gemm`` -> ``matmul``; ``pagedgen.ops`` (the package itself) -> ``None``."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else None


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, in_function: bool = False) -> Iterator[tuple[ast.AST, bool]]:
    """Every node with whether it sits inside a function, skipping ``if TYPE_CHECKING:`` bodies."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for other in child.orelse:
                yield other, in_function
                yield from _walk(other, in_function)
            continue
        inside = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        yield child, in_function
        yield from _walk(child, inside)


def imported_modules(path: Path, known: set[str]) -> set[tuple[str, str]]:
    """(pagedgen module, how) pairs ``path`` imports; ``from a import b`` is ``a.b`` when that is a module."""
    found: set[tuple[str, str]] = set()
    for node, in_function in _walk(ast.parse(path.read_text(), filename=str(path))):
        how = "function" if in_function else "module"
        if isinstance(node, ast.Import):
            found |= {(alias.name, how) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add((name if name in known else str(node.module), how))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add((node.args[0].value, "dispatch"))
    return {(name, how) for name, how in found if name.split(".")[0] == "pagedgen"}


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def import_graph(root: Path = PACKAGE) -> list[Edge]:
    files = modules(root)
    known = set(files)
    edges = []
    for source, path in files.items():
        for target, how in sorted(imported_modules(path, known)):
            assert target in known, f"{source} imports {target}, which is no module of pagedgen"
            if target != source:
                edges.append(Edge(source, target, how))
    return edges


def cycles(edges: list[Edge]) -> list[list[str]]:
    """One shortest cycle per strongly connected group of nodes (Tarjan), each as a path back to its start."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.target)
        graph.setdefault(edge.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = set()
            while node not in group:
                group.add(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_shortest_cycle(graph, group) for group in groups]


def _shortest_cycle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & group):
                if target == start:
                    return paths[node] + [start]
                if target not in paths:
                    paths[target] = paths[node] + [target]
                    following.append(target)
        frontier = following
    raise AssertionError(f"{sorted(group)} is no cycle")


GRAPH = import_graph()


def test_every_part_of_the_package_has_a_row():
    assert {part_of(module) for module in modules()} == set(ALLOWED)


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_a_part_imports_only_what_its_row_allows(part):
    refused = sorted(
        f"{edge.source} -> {edge.target}"
        for edge in GRAPH
        if part_of(edge.source) == part and part_of(edge.target) not in ALLOWED[part] | {part}
    )
    assert refused == []


def test_the_allowed_table_has_no_cycle():
    edges = [Edge(part, other, "module") for part, others in ALLOWED.items() for other in others]
    assert cycles(edges) == []


def test_no_two_parts_import_each_other_round_a_cycle():
    edges = [
        Edge(part_of(e.source), part_of(e.target), e.how)
        for e in GRAPH
        if part_of(e.source) != part_of(e.target)
    ]
    assert cycles(edges) == []


def test_no_module_cycle():
    found = [cycle for cycle in cycles(GRAPH) if frozenset(cycle) not in PENDING_CYCLES]
    assert [" -> ".join(cycle) for cycle in found] == []


def test_each_pending_cycle_still_exists():
    assert {frozenset(cycle) for cycle in cycles(GRAPH)} >= set(PENDING_CYCLES)


def test_every_module_of_a_split_part_sits_in_a_sub_package_with_a_row():
    for part, rows in SUB_ALLOWED.items():
        outside = sorted(
            module
            for module in modules()
            if part_of(module) == part and module != f"pagedgen.{part}" and sub_part_of(module) not in rows
        )
        assert outside == [], part
        assert {sub_part_of(module) for module in modules() if part_of(module) == part} - {None} == set(rows)


@pytest.mark.parametrize(
    ("part", "sub"), [(part, sub) for part, rows in sorted(SUB_ALLOWED.items()) for sub in sorted(rows)]
)
def test_a_sub_package_imports_only_what_its_row_allows(part, sub):
    allowed = SUB_ALLOWED[part][sub] | {sub}
    refused = sorted(
        f"{edge.source} -> {edge.target}"
        for edge in GRAPH
        if part_of(edge.source) == part == part_of(edge.target)
        and sub_part_of(edge.source) == sub
        and sub_part_of(edge.target) not in allowed
    )
    assert refused == []


@pytest.mark.parametrize("part", sorted(SUB_ALLOWED))
def test_the_sub_packages_have_no_cycle_in_their_table_or_as_imported(part):
    table = [Edge(sub, other, "module") for sub, others in SUB_ALLOWED[part].items() for other in others]
    imported = [
        Edge(str(sub_part_of(e.source)), str(sub_part_of(e.target)), e.how)
        for e in GRAPH
        if part_of(e.source) == part == part_of(e.target) and sub_part_of(e.source) != sub_part_of(e.target)
    ]
    assert cycles(table) == []
    assert cycles(imported) == []


def test_the_bench_is_a_leaf():
    """Nothing outside pagedgen/bench imports it, but the command's one dispatch by name."""
    into_bench = {
        (edge.source, edge.target, edge.how)
        for edge in GRAPH
        if part_of(edge.target) == "bench" and part_of(edge.source) != "bench"
    }
    assert into_bench == {(*BENCH_DISPATCH, "dispatch")}
    assert [part for part, others in ALLOWED.items() if "bench" in others] == ["cli"]


def test_the_import_reader_sees_lazy_dispatched_and_package_imports(tmp_path):
    root = tmp_path / "pagedgen"
    (root / "ops").mkdir(parents=True)
    for name in ("__init__.py", "ops/__init__.py", "ops/gemm.py", "models.py", "executor.py", "bench.py"):
        (root / name).write_text("")
    (root / "mod.py").write_text(
        "import os\nimport importlib\nfrom typing import TYPE_CHECKING\nimport pagedgen.ops.gemm\n"
        "from pagedgen import models\nfrom pagedgen.ops import gemm, Thing\n"
        "if TYPE_CHECKING:\n    from pagedgen import bench\n"
        "def f():\n    from pagedgen.executor import pack_step\n"
        "    importlib.import_module('pagedgen.bench')\n"
    )
    edges = {(e.target, e.how) for e in import_graph(root) if e.source == "pagedgen.mod"}
    assert edges == {
        ("pagedgen.ops.gemm", "module"),
        ("pagedgen.models", "module"),
        ("pagedgen.ops", "module"),
        ("pagedgen.executor", "function"),
        ("pagedgen.bench", "dispatch"),
    }


def test_a_cycle_is_named_as_its_path():
    edges = [
        Edge("a", "b", "module"),
        Edge("b", "c", "function"),
        Edge("c", "a", "module"),
        Edge("c", "d", "module"),
    ]
    assert cycles(edges) == [["a", "b", "c", "a"]]
    assert cycles(edges[:2]) == []


TESTS = PACKAGE.parent / "tests"


def test_the_test_import_reader_sees_package_and_lazy_imports(tmp_path):
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    source = tmp_path / "tests" / "unit" / "test_a.py"
    source.write_text(
        "from tests import helpers\nfrom tests.helpers.drafts import run_with\n"
        "def f():\n    from tests.unit.test_b import thing\n"
    )
    assert imports_of_test_code(source) == {"tests.helpers", "tests.helpers.drafts", "tests.unit.test_b"}


def imports_of_test_code(path: Path) -> set[str]:
    """The ``tests.*`` modules a file imports, function-local ones too (``from tests import x``: ``x``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            if node.module == "tests":
                found |= {f"tests.{alias.name}" for alias in node.names}
            else:
                found.add(str(node.module))
    return {name for name in found if name.split(".")[0] == "tests"}


def test_no_test_module_is_imported_by_another():
    """Shared test code lives in helper modules (``tests/helpers/``, a layer's ``*_cases.py`` and the like)
    or is a fixture of a ``conftest.py``; a ``test_*.py`` or ``conftest.py`` is never imported."""
    imported = {
        f"{path.relative_to(TESTS.parent)}: {name}"
        for path in sorted(TESTS.rglob("*.py"))
        for name in imports_of_test_code(path)
        if name.split(".")[-1].startswith("test_") or name.split(".")[-1] == "conftest"
    }
    assert sorted(imported) == []
