"""The import rules (docs/architecture.md, "The parts and the import rules"),
read from the source: every import in every module of the package (module
level, inside functions, under TYPE_CHECKING, relative ones resolved), drawn
as a graph between modules and between the package's parts; and the size a
module may grow to.

A part is a subpackage (`parallel`, `model`, ...) or a top-level module
(`config`, `launch`, ...). The rules say which way knowledge flows, so the
next features land on parts that know only what they must. No two modules
import each other, even only for types: a type-only import is entanglement
too (neither can be read, moved or tested without the other)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.harness.cli import ROOT

PACKAGE = "megaresil"
PACKAGE_DIR = ROOT / PACKAGE

# importing part -> parts it must not import
FORBIDDEN = {
    "parallel": {"model", "train", "checkpoint", "resilience"},
    "model": {"train", "checkpoint"},
    "checkpoint": {"train", "resilience"},
    "resilience": {"train"},
    # Seeing a run reads its records and recipe; it drives nothing.
    "observe": {"train", "resilience", "checkpoint", "data"},
    # Files to samples: the recipe only; what trains on the samples is above it.
    "data": {"model", "train", "checkpoint", "resilience", "observe"},
    # Planning is arithmetic over a run's records (events) and a failure
    # profile: it may be asked by the runtime (train's save schedule), never
    # the other way round, so it knows no runtime part.
    "plan": {"model", "parallel", "data", "train", "checkpoint", "resilience"},
}
# Leaves: top-level modules any part may import, which import nothing of the
# package (the errors' base, the worker's parsed environment, the clock).
LEAVES = {"clock", "errors", "worker_env"}
# The wiring: the only parts that know every other part, so nothing else knows them.
WIRING = {"launch", "cli", "__main__"}
# Drills (chaos, soak, the fault-injection CLI) run the runtime from outside,
# as a test harness does: the runtime keeps only its injection hooks and never
# knows the drills; only the wiring starts them.
DRILLS = "drills"
# A module longer than this says why in a comment in its first lines.
MAX_LINES = 450
WHY_LONG_LINES = 5


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules `module` imports, anywhere in its body. `from X import Y`
    counts as importing X.Y when that is a module of `known`, else X."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = resolve_from(node, module, is_package)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return found


def resolve_from(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a `from ... import` reads from."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    anchor = package[: len(package) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def part_of(module: str) -> str | None:
    """`megaresil.train.loop` -> `train`; None outside the package (and for
    the package's own `__init__`, which holds only the version)."""
    parts = module.split(".")
    return parts[1] if parts[0] == PACKAGE and len(parts) > 1 else None


def import_edges() -> list[tuple[str, str]]:
    """(importing module, imported module) for every import inside the package."""
    files = sorted(PACKAGE_DIR.rglob("*.py"))
    known = {module_name(f, PACKAGE_DIR) for f in files}
    edges = []
    for path in files:
        module = module_name(path, PACKAGE_DIR)
        imports = imported_modules(path.read_text(), module, path.name == "__init__.py", known)
        edges += [(module, imported) for imported in sorted(imports)
                  if part_of(imported) is not None]
    return edges


EDGES = import_edges()


def cross_part_edges() -> list[tuple[str, str, str, str]]:
    """(importer part, imported part, importing module, imported module)."""
    return [(part_of(src), part_of(dst), src, dst) for src, dst in EDGES
            if part_of(src) is not None and part_of(src) != part_of(dst)]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def module_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for src, dst in EDGES:
        if src != dst:
            graph.setdefault(src, set()).add(dst)
    return graph


def describe(edges) -> str:
    return "\n".join(f"  {src} imports {dst}" for src, dst in edges)


def test_the_walker_sees_function_level_and_relative_imports():
    source = ("from . import sibling\n"
              "def f():\n"
              "    from ..train.loop import Trainer\n"
              "    import megaresil.model.gpt\n")
    known = {"megaresil.checkpoint.sibling"}
    assert imported_modules(source, "megaresil.checkpoint.planning", False, known) == {
        "megaresil.checkpoint.sibling", "megaresil.train.loop", "megaresil.model.gpt"}
    assert imported_modules("from .sharded import Rect\n", "megaresil.checkpoint", True,
                            known) == {"megaresil.checkpoint.sharded"}


def test_the_walker_sees_type_only_imports_and_their_cycles():
    """An import under `if TYPE_CHECKING:` is an edge like any other, so a
    pair of modules that import each other only for types is a cycle."""
    source = ("from typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n"
              "    from .manager import SaveReport\n")
    known = {"megaresil.checkpoint.manager", "megaresil.checkpoint.local_tier"}
    imports = imported_modules(source, "megaresil.checkpoint.local_tier", False, known)
    assert imports == {"typing", "megaresil.checkpoint.manager"}
    graph = {"megaresil.checkpoint.local_tier": {"megaresil.checkpoint.manager"},
             "megaresil.checkpoint.manager": {"megaresil.checkpoint.local_tier"}}
    assert cycles(graph) == [["megaresil.checkpoint.local_tier", "megaresil.checkpoint.manager"]]


def test_the_walker_sees_the_package():
    parts = {(a, b) for a, b, _, _ in cross_part_edges()}
    # Ties every layout of the tree has: a walk that finds none is blind, not clean.
    assert ("train", "parallel") in parts and ("model", "parallel") in parts, parts


def test_no_cycle_between_parts():
    graph: dict[str, set[str]] = {}
    for src, dst, _, _ in cross_part_edges():
        graph.setdefault(src, set()).add(dst)
    problems = []
    for component in cycles(graph):
        members = set(component)
        ties = [(s, d) for a, b, s, d in cross_part_edges() if a in members and b in members]
        problems.append(f"cycle between {', '.join(component)}:\n{describe(ties)}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("importer", sorted(FORBIDDEN))
def test_part_imports_nothing_it_must_not_know(importer):
    forbidden = FORBIDDEN[importer]
    bad = [(s, d) for a, b, s, d in cross_part_edges() if a == importer and b in forbidden]
    assert not bad, (f"{PACKAGE}/{importer}/ must import nothing from "
                     f"{', '.join(sorted(forbidden))}:\n{describe(bad)}")


@pytest.mark.parametrize("leaf", sorted(LEAVES))
def test_a_leaf_imports_nothing_of_the_package(leaf):
    bad = [(s, d) for a, b, s, d in cross_part_edges() if a == leaf and b is not None]
    assert not bad, f"{PACKAGE}/{leaf}.py must import nothing of {PACKAGE}:\n{describe(bad)}"


def test_config_imports_only_the_errors_base():
    bad = [(s, d) for a, b, s, d in cross_part_edges()
           if a == "config" and b is not None and b != "errors"]
    assert not bad, f"{PACKAGE}/config/ imports only {PACKAGE}.errors:\n{describe(bad)}"


def test_only_the_wiring_imports_the_wiring():
    bad = [(s, d) for a, b, s, d in cross_part_edges() if b in WIRING and a not in WIRING]
    assert not bad, (f"only {', '.join(sorted(WIRING))} may import the wiring "
                     f"(it knows every part):\n{describe(bad)}")


def test_no_cycle_between_modules():
    """Module by module, not only part by part: two modules of one part that
    import each other (at module level, in a function or for types only)."""
    problems = []
    for component in cycles(module_graph()):
        members = set(component)
        ties = [(s, d) for s, d in EDGES if s in members and d in members and s != d]
        problems.append(f"cycle between {', '.join(component)}:\n{describe(ties)}")
    assert not problems, "\n".join(problems)


def test_only_the_wiring_imports_the_drills():
    """No runtime part (parallel, model, data, train, checkpoint, resilience,
    observe, plan) nor any other top-level module knows the drills."""
    bad = [(s, d) for a, b, s, d in cross_part_edges()
           if b == DRILLS and a not in WIRING]
    assert not bad, (f"only {', '.join(sorted(WIRING))} may import {PACKAGE}/{DRILLS}/ "
                     f"(the runtime keeps only the injection hooks):\n{describe(bad)}")


def says_why_it_is_long(head: list[str]) -> bool:
    """A comment among the first lines that speaks of the length, e.g.
    `# 520 lines: one table per recipe section, read top to bottom.`"""
    return any(re.search(r"#.*\b(lines?|long)\b", line, re.IGNORECASE) for line in head)


def test_every_module_is_short_or_says_why():
    too_long = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        lines = path.read_text().splitlines()
        if len(lines) > MAX_LINES and not says_why_it_is_long(lines[:WHY_LONG_LINES]):
            too_long.append(f"  {path.relative_to(PACKAGE_DIR.parent)}: {len(lines)} lines")
    assert not too_long, (f"over {MAX_LINES} lines, with no comment in the first "
                          f"{WHY_LONG_LINES} lines saying why:\n" + "\n".join(too_long))
