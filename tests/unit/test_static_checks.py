"""The static checks `make check` runs (settings in pyproject.toml): ruff and
mypy pass over megaresil/, and mypy skips no module of it: none carries
`# mypy: ignore-errors` (docs/contributing.md, "Static checks")."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.harness.cli import ROOT

MARKER = "# mypy: ignore-errors"


def unchecked_modules() -> list[str]:
    """The modules of megaresil/ that carry the marker line."""
    return sorted(str(path.relative_to(ROOT)) for path in (ROOT / "megaresil").rglob("*.py")
                  if MARKER in path.read_text().splitlines())


def test_mypy_skips_no_module():
    unchecked = unchecked_modules()
    assert not unchecked, (f"{len(unchecked)} modules carry {MARKER!r}: make them pass mypy "
                           "instead:\n  " + "\n  ".join(unchecked))


def run_checker(module: str, *args: str) -> subprocess.CompletedProcess:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed: `pip install -e '.[test]'` installs it")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT,
                          capture_output=True, text=True)


def test_ruff_passes():
    done = run_checker("ruff", "check", "megaresil")
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_passes():
    done = run_checker("mypy")
    assert done.returncode == 0, done.stdout + done.stderr
