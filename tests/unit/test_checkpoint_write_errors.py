"""A save that cannot write (full disk, file size limit) fails with one line
naming the errno and the file, and leaves the previous checkpoint valid.

The failures are real: a file size limit (RLIMIT_FSIZE, with SIGXFSZ ignored so
that write returns EFBIG) in a child process, and a full 2 MiB tmpfs where this
user may mount one (root)."""
from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.validation import read_manifest, verify_shards
from megaresil.checkpoint.backends import get_backend
from megaresil.checkpoint.manager import Checkpointer
from megaresil.checkpoint.offline.planning import recipe_layout
from megaresil.checkpoint.sharded import Rect
from megaresil.checkpoint.state import RunRecord
from megaresil.config import RecipeConfig, to_dict
from tests.harness.cli import ROOT
from tests.harness.tmpfs import mounted_tmpfs

BACKENDS = ["torch_dist", "zarr"]
ELEMENTS = 300_000  # 1.2 MB of float32: over both limits below
# Where each backend's failing write lands.
FAILED_FILE = {"torch_dist": "dcp/__0_0.distcp", "zarr": "zarr/w"}


class NoEvents:
    def emit(self, event: str, **fields) -> None:
        pass


def checkpointer(root: Path, backend: str) -> Checkpointer:
    return Checkpointer(root, backend, group=None, asynchronous=False, keep=3, events=NoEvents(),
                        device=torch.device("cpu"))


def save(ckpt: Checkpointer, step: int, tensor: torch.Tensor) -> None:
    cfg = RecipeConfig()
    state = RunRecord(step=step, layout=recipe_layout(cfg), recipe=to_dict(cfg),
                     consumed_samples=0, optimizer_steps=step)
    ckpt.save([Rect("w", (ELEMENTS,), (0,), tensor)], state, {})


def assert_previous_checkpoint_valid(root: Path, step: int) -> None:
    """`latest` still names `step`, whose shards all pass their checksums."""
    assert (root / fmt.LATEST).read_text().strip() == fmt.step_dir_name(step)
    directory = root / fmt.step_dir_name(step)
    manifest = read_manifest(directory)
    assert verify_shards(get_backend(manifest["backend"]), directory, manifest,
                         list(fmt.iter_shards(manifest))) is None


def assert_names_the_failure(message: str, code: str, root: Path, backend: str) -> None:
    assert "\n" not in message.strip(), message
    assert code in message, message
    assert str(root / "step_0000002.partial-0" / FAILED_FILE[backend]) in message, message
    assert "checkpoint.dir" in message and "previous checkpoint stays valid" in message, message


# Saves step 1, lowers the file size limit below one checkpoint file, saves step 2.
CHILD = """
import resource, signal, sys
from pathlib import Path
import torch
from megaresil.checkpoint.format import CheckpointError
from tests.unit.test_checkpoint_write_errors import ELEMENTS, checkpointer, save

ckpt = checkpointer(Path(sys.argv[1]), sys.argv[2])
save(ckpt, 1, torch.randn(ELEMENTS))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))
try:
    save(ckpt, 2, torch.randn(ELEMENTS))
except CheckpointError as err:
    print(err)
    sys.exit(3)
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_file_size_limit_is_named_and_previous_checkpoint_stays_valid(tmp_path, backend):
    root = tmp_path / "checkpoints"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run([sys.executable, "-c", CHILD, str(root), backend], env=env,
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 3, child.stdout + child.stderr
    assert_names_the_failure(child.stdout, "EFBIG", root, backend)
    assert_previous_checkpoint_valid(root, 1)


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs: one checkpoint of 1.2 MB fits, a second does not."""
    with mounted_tmpfs(tmp_path / "disk", "2m") as disk:
        yield disk


@pytest.mark.parametrize("backend", BACKENDS)
def test_full_disk_is_named_and_previous_checkpoint_stays_valid(small_disk, backend):
    root = small_disk / "checkpoints"
    ckpt = checkpointer(root, backend)
    save(ckpt, 1, torch.randn(ELEMENTS))
    with pytest.raises(fmt.CheckpointError) as failed:
        save(ckpt, 2, torch.randn(ELEMENTS))
    ckpt.close()
    assert_names_the_failure(str(failed.value), "ENOSPC", root, backend)
    assert f"free space on the filesystem of {root / 'step_0000002.partial-0'}" in str(failed.value)
    assert_previous_checkpoint_valid(root, 1)


def limit_file_size(limit: int):
    def apply() -> None:  # in the child, before exec: inherited by every worker
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.slow
def test_failed_save_stops_the_run_with_the_reason(cli, cli_main, tmp_path):
    """Through the CLI: the first run saves step 2; the same run continued
    under a 4 MB file size limit (the checkpoint file is ~30 MB) fails its
    step-4 save, exits non-zero naming EFBIG and the file, and `ckpt verify`
    still passes step 2."""
    from tests.harness.cli import ROOT

    run = tmp_path / "run"
    args = ["train", "recipes/gpt-tiny.yaml", f"run.dir={run}", "parallel.tp=1", "parallel.pp=1",
            "parallel.dp=1", "train.steps=4", "checkpoint.interval=2", "train.eval_batches=0",
            "logging.progress=false", "logging.tensorboard=false",
            "resilience.max_restarts=0", "resilience.in_process=false"]
    cli(*args, "train.exit_at_step=2")
    continued = subprocess.run([sys.executable, "-m", "megaresil", *args], cwd=ROOT,
                               capture_output=True, text=True, timeout=600,
                               preexec_fn=limit_file_size(4 << 20))
    assert continued.returncode != 0, continued.stdout + continued.stderr
    reason = next((line for line in continued.stderr.splitlines() if "EFBIG" in line), None)
    assert reason is not None, continued.stderr
    # The partial directory is named by the generation that saves it (fencing).
    assert re.search(r"step_0000004\.partial-0-[0-9a-f]{12}/dcp/__0_0\.distcp", reason), reason
    assert "checkpoint.dir" in reason
    assert cli_main("ckpt", "verify", str(run / "checkpoints" / "step_0000002")).returncode == 0
