"""The code's references into the repository resolve: every `docs/PAGE.md`
named in megaresil/'s strings (docstrings, help texts) and comments exists,
every section quoted after it (`docs/x.md ("A", "B")` or `docs/x.md, "A"`)
is a heading of that page, and every `#anchor` one of its anchors; every
repository path a docstring or comment names exists; and nothing cites a
file outside the repository (`design.md`)."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from tests.docs.test_manual_pages import HEADING, anchors_of, github_anchor
from tests.harness.manual import ROOT

pytestmark = pytest.mark.docs

PACKAGE = ROOT / "megaresil"
MODULES = sorted(PACKAGE.rglob("*.py"))
PAGE = re.compile(r"\bdocs/([\w./-]+\.md)(?:#([\w-]+))?")
# The quoted sections right after a page: ("A", "B") or , "A" and "B".
QUOTED_LIST = re.compile(r'\s*\(((?:\s*"[^"]+"\s*,?)+)\)')
QUOTED_RUN = re.compile(r'\s*,\s*("[^"]+"(?:\s*(?:,|and)\s*"[^"]+")*)')
QUOTED = re.compile(r'"([^"]+)"')
TOP_DIRS = ("megaresil", "tests", "tools", "bench", "docs", "configs", "recipes")
PARTS = tuple(sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()))
# A path from the repository root, or a module named from inside the package
# (`train/handover.py`); a `{` or `*` makes it a pattern, not a path.
REPO_PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(TOP_DIRS)})/[\w./-]*[\w/])(?![\w{{*])")
PART_MODULE = re.compile(rf"(?<![\w./-])((?:{'|'.join(PARTS)})/[\w/]*\w\.py)\b")


def docstrings_and_comments(tree: ast.Module, source: str) -> list[str]:
    """The docstrings, and the comments with a run of comment lines joined."""
    owners = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    texts = [doc for node in ast.walk(tree) if isinstance(node, owners)
             if (doc := ast.get_docstring(node, clean=False))]
    last_line = -2
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            text = token.string.lstrip("#").strip()
            if token.start[0] == last_line + 1:
                texts[-1] += " " + text
            else:
                texts.append(text)
            last_line = token.start[0]
    return texts


def other_strings(tree: ast.Module) -> list[str]:
    """Every string constant (help texts, messages; implicit concatenations
    joined): they may cite a page too. Store keys and the like look like
    paths, so only docstrings and comments are read for paths."""
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def headings_of(page: Path) -> set[str]:
    found, in_fence = set(), False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            in_fence = not in_fence
        elif not in_fence and (m := HEADING.match(line)):
            found.add(m.group(2))
    return found


def quoted_sections(after: str) -> list[str]:
    match = QUOTED_LIST.match(after) or QUOTED_RUN.match(after)
    return [" ".join(s.split()) for s in QUOTED.findall(match.group(1))] if match else []


def page_problems(text: str) -> list[str]:
    problems = []
    for match in PAGE.finditer(text):
        page, anchor = ROOT / "docs" / match.group(1), match.group(2)
        name = f"docs/{match.group(1)}"
        if not page.exists():
            problems.append(f"{name}: no such page")
            continue
        if anchor and anchor not in anchors_of(page):
            problems.append(f"{name}#{anchor}: no heading with that anchor")
        headings = headings_of(page)
        problems += [f'{name} ("{section}"): no such heading' for section in
                     quoted_sections(text[match.end():]) if section not in headings]
    return problems


def path_problems(text: str) -> list[str]:
    named = [m.group(1) for m in REPO_PATH.finditer(text)]
    named += [f"megaresil/{m.group(1)}" for m in PART_MODULE.finditer(text)]
    return [f"{path}: no such file or directory" for path in named
            if not (ROOT / path.split("#")[0].rstrip("/.")).exists()]


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(ROOT)) for p in MODULES])
def test_references_resolve(path):
    source = path.read_text()
    tree = ast.parse(source)
    prose = docstrings_and_comments(tree, source)
    problems = [p for text in prose for p in path_problems(text)]
    for text in prose + other_strings(tree):
        problems += page_problems(text)
        if "design.md" in text:
            problems.append("cites design.md, a file outside the repository: cite "
                            'docs/architecture.md ("Section")')
    assert not problems, f"{path.relative_to(ROOT)}: {sorted(set(problems))}"


def test_the_checks_see_a_broken_reference():
    """The parsing itself: a wrong section, a missing page, a missing path and
    a design.md citation are each caught, and the forms in use are read."""
    assert quoted_sections(' ("A", "B") says') == ["A", "B"]
    assert quoted_sections(', "Splits" and "How it works".') == ["Splits", "How it works"]
    assert quoted_sections(" has more") == []
    assert quoted_sections(' ("One thread, one\n    process group")') == [
        "One thread, one process group"]
    assert page_problems('docs/fault-tolerance.md ("What happens")')
    assert not page_problems('docs/fault-tolerance.md ("What is detected and what happens")')
    assert page_problems("docs/no-such-page.md")
    assert page_problems("docs/clusters.md#no-such-anchor")
    assert not page_problems("docs/clusters.md#health-checks")
    assert path_problems("see megaresil/no_such_module.py") and path_problems("train/nope.py")
    assert not path_problems("train/handover.py and tests/unit/test_import_rules.py")
    assert github_anchor("Health checks") == "health-checks"
