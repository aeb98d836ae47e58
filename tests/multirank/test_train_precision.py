"""train.precision=bf16 (Megatron style) on CPU: bf16 model, fp32 main state.

bf16 follows fp32's loss trajectory within bf16's rounding, resumes bit-exactly,
and its checkpoints hold the fp32 main weights, so an fp32 run resumes from them.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.harness.dist import Case, recipe_for, train_case
from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.validation import read_manifest
from megaresil.events import read_metrics
from megaresil.parallel.layout import ParallelLayout
from megaresil.train.loop import Trainer

CPU = ParallelLayout(device=torch.device("cpu"))
BF16 = ["train.precision=bf16"]


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


def run(tmp_path: Path, name: str, overrides: list[str], **case) -> Trainer:
    return train_case(Case(name, overrides, **case), tmp_path / name, CPU)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """bf16 and fp32 straight through, and bf16 stopped at step 5 and resumed."""
    out = tmp_path_factory.mktemp("precision")
    trainers = {"bf16": run(out, "bf16", BF16), "fp32": run(out, "fp32", ["train.precision=fp32"])}
    run(out, "resumed", BF16 + ["train.exit_at_step=5"], resume=True)
    return out, trainers


def test_bf16_tracks_fp32_within_bf16_rounding(runs):
    out, trainers = runs
    assert all(p.dtype == torch.bfloat16 for p in trainers["bf16"].params)
    assert all(p.dtype == torch.float32 for p in trainers["bf16"].opt_params)
    fp32, bf16 = losses(out / "fp32"), losses(out / "bf16")
    assert len(bf16) == len(fp32) == 10
    drift = [abs(b - f) / f for b, f in zip(bf16, fp32)]
    assert max(drift) < 2e-3, drift  # bf16 keeps ~3 significant digits
    assert fp32 != bf16  # it really computed in bf16
    assert bf16[-1] < bf16[0] - 0.15


def test_bf16_resume_is_bit_exact(runs):
    out, _ = runs
    assert losses(out / "resumed") == losses(out / "bf16")


def test_bf16_checkpoint_holds_fp32_main_state_and_resumes_in_fp32(tmp_path):
    bf16 = run(tmp_path, "run", BF16 + ["train.exit_at_step=5"])
    manifest = read_manifest(fmt.committed_checkpoints(tmp_path / "run" / "checkpoints")[0])
    dtypes = {key: t["dtype"] for key, t in manifest["tensors"].items()}
    assert set(dtypes.values()) == {"float32"}, dtypes

    fp32 = Trainer(recipe_for(Case("run", ["train.precision=fp32"]), tmp_path / "run"), CPU)
    assert fp32.state.step == 5 and fp32.main is None
    resumed = dict(fp32.named_state_parameters())
    for key, main in bf16.named_state_parameters():
        # The fp32 main weights, not their bf16 rounding.
        torch.testing.assert_close(resumed[key], main, rtol=0, atol=0)
    fp32.run()
    fp32.close()
    assert len(losses(tmp_path / "run")) == 10
