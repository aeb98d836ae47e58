import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The chaos tests' job (test_resilience.py, test_etcd.py): two data-parallel
# ranks, a small batch: ~0.1 s steps, so recovery dominates.
FLOOR_S = 1.0
SMALL = ["recipes/gpt-tiny.yaml", "parallel.tp=1", "parallel.pp=1", "parallel.dp=2",
         "train.steps=8", "logging.tensorboard=false", "train.eval_batches=0",
         f"resilience.watchdog.floor_s={FLOOR_S}", "resilience.watchdog.calibration_steps=2",
         "data.seq_len=64", "train.micro_batch_size=4", "train.global_batch_size=8",
         "logging.straggler_interval=2"]


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


@pytest.fixture
def chaos(capfd, monkeypatch):
    """`megaresil chaos ARGS` run by the CLI's main() in this process, its
    output (and its training processes') captured as a CompletedProcess's.
    The scenario's runs are processes of their own either way; in-process
    saves starting Python, torch and matplotlib (the report) once per scenario."""
    import subprocess

    from megaresil.cli import main

    monkeypatch.chdir(ROOT)  # recipes/... as the CLI tests give them

    def run(*args: str) -> subprocess.CompletedProcess:
        code = main(["chaos", *args])
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess(["megaresil", "chaos", *args], code, out, err)

    return run


@pytest.fixture(scope="session")
def chaos_reference(tmp_path_factory) -> Path:
    """SMALL's fault-free run (a checkpoint every 2 steps), the one every
    chaos test compares against: trained once for the whole session."""
    run_dir = tmp_path_factory.mktemp("chaos-reference")
    megaresil_cli("train", *SMALL, "checkpoint.interval=2", f"run.dir={run_dir}",
                  "logging.progress=false", timeout=300)
    return run_dir
