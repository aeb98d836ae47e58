"""The manual as a whole: README's size and code map, every relative link and
anchor resolving, the generated references in step with the code, and the
site building with mkdocs --strict."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.manual import ROOT, docs_site, manual_pages

pytestmark = pytest.mark.docs

import reference_docs  # noqa: E402  (a tool: tests.harness.manual put tools/ on the path)

README_LIMIT_BYTES = 15 * 1024
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
PAGES = manual_pages()


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: markup dropped, lower case, punctuation
    other than - and _ removed, spaces to hyphens."""
    text = re.sub(r"`|\*\*|__|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors_of(page: Path) -> set[str]:
    found, in_fence = set(), False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            in_fence = not in_fence
        elif not in_fence and (m := HEADING.match(line)):
            found.add(github_anchor(m.group(2)))
    return found


def links_of(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return docs_site.LINK.findall(text)  # links and images alike


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_and_anchors_resolve(page):
    broken = []
    for link in links_of(page):
        if "://" in link or link.startswith("mailto:"):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link} (no such file)")
        elif anchor and target.suffix == ".md" and anchor not in anchors_of(target):
            broken.append(f"{link} (no heading with that anchor in {target.name})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


def test_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= README_LIMIT_BYTES, (
        f"README.md is {len(readme.encode())} bytes; at most {README_LIMIT_BYTES}: move detail "
        f"to docs/")
    code_map = readme.split("## Code map", 1)
    assert len(code_map) == 2, "README.md needs a '## Code map' section"
    section = code_map[1].split("\n## ", 1)[0]
    packages = sorted(p.name for p in (ROOT / "megaresil").iterdir()
                      if (p / "__init__.py").exists())
    missing = [p for p in packages if f"megaresil/{p}" not in section]
    assert not missing, f"README's code map does not name these packages: {missing}"


def test_generated_references_match_the_code():
    assert reference_docs.main(["--check"]) == 0, (
        "docs/reference/ is stale: run `python tools/reference_docs.py`")


def test_every_page_is_in_the_site_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [str(p.relative_to(ROOT)) for p in PAGES if str(p.relative_to(ROOT)) not in nav]
    assert not missing, f"pages missing from mkdocs.yml's nav: {missing}"


def test_the_site_builds_strict(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "docs_site.py"),
                             "--out", str(tmp_path / "site")], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, f"mkdocs --strict failed:\n{result.stdout}\n{result.stderr}"
    assert (tmp_path / "site" / "index.html").exists()


MAX_DOCSTRING_LINES = 15


def test_module_docstrings_are_summaries_that_point_at_the_manual():
    """A module says what it is for in a few lines; the explanation lives in
    docs/, where a user finds it and the tests run its examples."""
    import ast

    long = []
    for path in sorted((ROOT / "megaresil").rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if doc and doc.count("\n") + 1 > MAX_DOCSTRING_LINES:
            long.append(f"{path.relative_to(ROOT)} ({doc.count(chr(10)) + 1} lines)")
    assert not long, f"module docstrings over {MAX_DOCSTRING_LINES} lines: {long}"
