"""Megatron's optimizer state in (checkpoint/megatron/optimizer_state.py):
Megatron-Core trains llama two steps with its distributed optimizer and
saves (the session's `mcore_checkpoints`, the `*-fully_reshardable` and
`*-dp_reshardable` saves). In model space (fully_reshardable) the import is a
full checkpoint whose AdamW moments are Mcore's own, element for element,
at tp=1 and tp=2; in its data-parallel buffers (dp_reshardable) the import
is weights only and says why, with the fix."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.megatron.reading import import_from_megatron
from megaresil.checkpoint.offline.convert import Target
from megaresil.checkpoint.offline.diff import diff_checkpoints, full_tensors
from megaresil.checkpoint.sources import CheckpointSource
from megaresil.config import load_recipe
from megaresil.events import read_events
from megaresil.parallel.layout import ParallelLayout
from megaresil.train.loop import Trainer
from tests.harness.hf import megaresil_model
from tests.harness.mcore import (
    FLAVOURS,
    ITERATION,
    RECIPE,
    TINY,
    TRAINED_STEPS,
    Saved,
    fixed_tokens,
)

TP1 = Target(tp=1, pp=1, dp=1)
IN_MODEL_SPACE = ["llama-tp1-pp1-fully_reshardable", "llama-tp2-pp1-fully_reshardable"]


def tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    source = CheckpointSource(checkpoint)
    return dict(full_tensors(source, sorted(source.tensors)))


def continuing(init_from: Path, run: Path) -> Trainer:
    """A one-rank run of the saves' model that takes `init_from`'s optimizer
    state and trains one step past Megatron's iteration."""
    cfg = load_recipe(RECIPE, TINY + FLAVOURS["llama"] + [
        f"checkpoint.init_from={init_from}", "checkpoint.init_from_optimizer=true",
        f"run.dir={run}", f"train.steps={ITERATION + 1}", "parallel.tp=1", "parallel.pp=1",
        "parallel.dp=1", "train.micro_batch_size=2", "train.global_batch_size=2",
        "train.eval_batches=0", "checkpoint.interval=0", "logging.progress=false",
        "logging.tensorboard=false"])
    return Trainer(cfg, ParallelLayout(device=torch.device("cpu")))


@pytest.mark.parametrize("name", IN_MODEL_SPACE)
def test_the_moments_are_where_megatron_core_puts_them(mcore_checkpoints, name, tmp_path):
    """The harness also saved, as a model's weights, each parameter's
    moment as Mcore's optimizer itself pairs them: imported as weights, they
    are the full import's moments bit for bit."""
    save = mcore_checkpoints[name]
    full = import_from_megatron(save, tmp_path / "full", TP1)
    manifest = json.loads((full / fmt.MANIFEST).read_text())
    assert (manifest["step"], manifest["optimizer"]["adam_step"]) == (ITERATION, TRAINED_STEPS)
    assert "weights_only" not in manifest
    ours = tensors(full)
    for moment in ("exp_avg", "exp_avg_sq"):
        theirs = tensors(import_from_megatron(save / moment, tmp_path / moment, TP1))
        assert len(theirs) == 17
        for key, tensor in theirs.items():
            assert torch.equal(ours[f"optim/{moment}/{key.removeprefix('model/')}"], tensor), key


def test_the_fp32_main_weights_are_the_weights(mcore_checkpoints, tmp_path):
    """The weights come from the optimizer's fp32 main copies: Mcore's
    logits after its two steps, and (fp32 training) the model's own weights."""
    save = mcore_checkpoints["llama-tp2-pp1-fully_reshardable"]
    full = import_from_megatron(save, tmp_path / "full", Target(tp=1, pp=1, dp=1))
    cfg = Saved("llama").recipe()
    with torch.no_grad():
        ours = megaresil_model(full).logits(fixed_tokens(cfg))[..., :cfg.model.vocab_size]
    theirs = torch.load(save / "logits.pt")[..., :cfg.model.vocab_size]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    weights = import_from_megatron(save, tmp_path / "weights",
                                   Target(tp=1, pp=1, dp=1, weights_only=True))
    assert json.loads((weights / fmt.MANIFEST).read_text())["weights_only"]
    report = diff_checkpoints(full, weights)
    assert report.only_in_a and not report.only_in_b and all(k.identical for k in report.keys)


def test_a_run_continues_from_the_import(mcore_checkpoints, tmp_path, capfd):
    save = mcore_checkpoints["llama-tp1-pp1-fully_reshardable"]
    full = import_from_megatron(save, tmp_path / "full", Target(tp=1, pp=1, dp=1))
    assert "optimizer state carried (fully_reshardable)" in capfd.readouterr().err
    run = tmp_path / "run"
    trainer = continuing(full, run)
    assert trainer.state.step == ITERATION
    trainer.run()
    (started,) = [e for e in read_events(run) if e["event"] == "initialized_from"]
    assert started["optimizer"] and started["step"] == ITERATION
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "loss" in s] == [ITERATION + 1]


def test_state_megaresil_cannot_read_is_left_out_in_one_line(mcore_checkpoints, tmp_path, capfd,
                                                            cli_main):
    save = mcore_checkpoints["llama-tp1-pp1-dp_reshardable"]
    weights = import_from_megatron(save, tmp_path / "weights", TP1)
    assert json.loads((weights / fmt.MANIFEST).read_text())["weights_only"]
    note = [line for line in capfd.readouterr().err.splitlines() if "weights only" in line]
    assert note == ["megaresil: weights only: optimizer state not carried: Megatron saved it as "
                    "dp_reshardable (the data-parallel buffers of the layout that saved it, not "
                    "model space); save with --dist-ckpt-optim-fully-reshardable to carry it"]
    out = cli_main("ckpt", "inspect", str(mcore_checkpoints[IN_MODEL_SPACE[0]])).stdout
    assert "optimizer state carried (fully_reshardable): AdamW's moments" in out


def test_a_run_takes_megatrons_optimizer_state_from_an_import_only(mcore_checkpoints, tmp_path):
    save = mcore_checkpoints["llama-tp1-pp1-fully_reshardable"]
    with pytest.raises(fmt.CheckpointError, match=r"Fix: convert it first \(megaresil convert "
                                                  r"--from-megatron .* DST\) and start from DST"):
        continuing(save, tmp_path)
