"""megaresil run from the repository: its root, the public CLI in a
subprocess, and the small job the chaos tests share."""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The chaos tests' job (e2e/test_resilience.py, e2e/test_launch_etcd.py): two
# data-parallel ranks, a small batch: ~0.1 s steps, so recovery dominates.
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
