"""User journeys: the installed `megaresil` command, run as a user runs it,
from a fresh directory outside the repository (`pytest -m journey`)."""
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# The console script pip installed beside this interpreter: what a user types.
MEGARESIL = shutil.which("megaresil", path=str(Path(sys.executable).parent)) or "megaresil"


def user_env(**extra: str) -> dict[str, str]:
    """The user's environment, without the repository on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def megaresil(*args: str, cwd: Path, timeout: float = 600, check: bool = True,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`megaresil ARGS` in cwd; raises with its output unless check=False."""
    result = subprocess.run([MEGARESIL, *args], cwd=cwd, capture_output=True, text=True,
                            timeout=timeout, env=env or user_env())
    if check and result.returncode != 0:
        raise AssertionError(f"megaresil {' '.join(args)} exited {result.returncode}:\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def start(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`megaresil ARGS` started in its own process group, as a terminal's
    foreground job: interrupt(proc) then sends what Ctrl-C sends."""
    return subprocess.Popen([MEGARESIL, *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env or user_env(),
                            start_new_session=True)


def interrupt(proc: subprocess.Popen) -> None:
    """Ctrl-C: SIGINT to the whole foreground process group."""
    os.killpg(proc.pid, signal.SIGINT)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A fresh working directory outside the repository."""
    d = tmp_path / "user"
    d.mkdir()
    return d


def with_demo_corpus(cache_dir: Path, corpus: Path) -> Path:
    """cache_dir holding a copy of the prepared demo corpus, as a user's
    earlier run would have left it (a copy: runs may add to a cache)."""
    shutil.copytree(corpus, cache_dir, dirs_exist_ok=True)
    return cache_dir
