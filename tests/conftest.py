import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def megaresil_cli(*args: str, timeout: float = 600, check: bool = True):
    """Run the public CLI as a user would, from the repository root."""
    import subprocess

    result = subprocess.run([sys.executable, "-m", "megaresil", *args], cwd=ROOT,
                            capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if check and result.returncode != 0:
        raise AssertionError(f"megaresil {' '.join(args)} exited {result.returncode}:\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


@pytest.fixture
def cli():
    return megaresil_cli
