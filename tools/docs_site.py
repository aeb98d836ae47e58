"""Build the manual as a site: `make docs` (mkdocs --strict, so a broken link
or anchor fails the build).

The Markdown is written for GitHub, where README.md, docs/ and bench/ link to
one another by relative paths from the repository's root. mkdocs reads one
directory, so this stages the manual's pages at their repository paths under
build/site-src (with the files they link to: images, scripts) and builds that:
the same links then work on GitHub and on the site.

    python tools/docs_site.py [--out DIR]
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", "CHANGELOG.md", "bench/README.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def manual_pages() -> list[Path]:
    return [ROOT / p for p in PAGES] + sorted((ROOT / "docs").rglob("*.md"))


def stage(src_dir: Path) -> None:
    """Copy the pages and every local file they link to into SRC_DIR, keeping
    their paths relative to the repository."""
    if src_dir.exists():
        shutil.rmtree(src_dir)
    for page in manual_pages():
        _copy(page, src_dir)
        for target in LINK.findall(page.read_text()):
            path = target.split("#")[0]
            if not path or "://" in path or path.startswith("mailto:"):
                continue
            linked = (page.parent / path).resolve()
            if linked.is_file() and linked.is_relative_to(ROOT) and linked.suffix != ".md":
                _copy(linked, src_dir)


def _copy(path: Path, src_dir: Path) -> None:
    dest = src_dir / path.relative_to(ROOT)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(path, dest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "build" / "site"), help="where the site goes")
    args = parser.parse_args(argv)
    src_dir = ROOT / "build" / "site-src"
    stage(src_dir)
    return subprocess.call([sys.executable, "-m", "mkdocs", "build", "--strict", "--clean",
                            "-f", str(ROOT / "mkdocs.yml"), "-d", str(Path(args.out).resolve())],
                           cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
