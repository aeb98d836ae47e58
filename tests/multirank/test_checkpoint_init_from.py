"""checkpoint.init_from: a new run starts from a checkpoint's weights at any
layout (fresh optimizer, step 0, data from the start), or, with
init_from_optimizer, continues a full checkpoint's run; a run directory
that already has checkpoints resumes from them instead."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.harness.dist import RECIPE, TINY, Case, run_cases, run_reference
from megaresil.checkpoint import format as fmt
from megaresil.cli import main
from megaresil.config import ConfigError, load_recipe
from megaresil.events import read_events, read_metrics
from megaresil.parallel.layout import ParallelLayout
from megaresil.train.loop import Trainer

STEPS = ["train.steps=6"]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A single-process run stopped at step 3 (a full checkpoint), then
    finished: its metrics are the uninterrupted run's."""
    out = tmp_path_factory.mktemp("source")
    run_reference(Case("src", STEPS + ["train.exit_at_step=3"], resume=True), out)
    return out / "src"


def checkpoint_of(run: Path, step: int) -> Path:
    return run / "checkpoints" / fmt.step_dir_name(step)


def losses(run: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(run) if "loss" in m}


def trainer(run: Path, *overrides: str) -> Trainer:
    cfg = load_recipe(RECIPE, TINY + STEPS + list(overrides) + [f"run.dir={run}"])
    return Trainer(cfg, ParallelLayout(device=torch.device("cpu")))


def events_named(run: Path, name: str) -> list[dict]:
    return [e for e in read_events(run) if e["event"] == name]


@pytest.mark.slow
def test_new_runs_from_a_checkpoint_at_another_layout(source, tmp_path):
    """At tp=2 x pp=2: weights only (step 1 onwards, the source's weights:
    the first loss is the single-process run's from the same weights); a
    restart after its own checkpoint resumes from it, not from init_from;
    with init_from_optimizer, the source run's steps 4-6 are reproduced."""
    init = f"checkpoint.init_from={checkpoint_of(source, 3)}"
    layout = ["parallel.tp=2", "parallel.pp=2"]
    run_reference(Case("reference", STEPS + [init]), tmp_path)
    run_cases(4, [Case("weights", STEPS + layout + [init]),
                  Case("restarted", STEPS + layout + [init, "train.exit_at_step=2"], resume=True),
                  Case("continued", STEPS + layout + [init, "checkpoint.init_from_optimizer=true"])],
              tmp_path)
    reference, weights = losses(tmp_path / "reference"), losses(tmp_path / "weights")
    assert sorted(weights) == list(range(1, 7))
    assert all(math.isclose(weights[s], reference[s], rel_tol=1e-5) for s in weights)
    # The source's weights, not a fresh init (whose first loss is the source run's first).
    assert weights[1] != pytest.approx(losses(source)[1], rel=1e-3)
    (started,) = events_named(tmp_path / "weights", "initialized_from")
    assert started["step"] == 0 and not started["optimizer"] and started["source"] == "checkpoint"
    assert started["saved_layout"]["tp"] == 1 and started["layout"]["tp"] == 2

    restarted = tmp_path / "restarted"
    assert len(events_named(restarted, "initialized_from")) == 1  # the first start only
    (loaded,) = events_named(restarted, "checkpoint_loaded")
    assert loaded["path"] == str(checkpoint_of(restarted, 2))
    assert losses(restarted) == weights  # bit-equal to the uninterrupted run at this layout

    continued = losses(tmp_path / "continued")
    assert sorted(continued) == [4, 5, 6]
    assert all(math.isclose(continued[s], losses(source)[s], rel_tol=1e-5) for s in continued)


def test_weights_only_checkpoints_start_runs_and_cannot_continue_one(source, tmp_path):
    weights_only = tmp_path / "weights_only"
    assert main(["convert", str(checkpoint_of(source, 3)), str(weights_only),
                 "--weights-only"]) == 0
    t = trainer(tmp_path / "a", f"checkpoint.init_from={weights_only}")
    assert t.state.step == 0 and t.state.consumed_samples == 0
    (started,) = events_named(tmp_path / "a", "initialized_from")
    assert started["path"] == str(weights_only)
    with pytest.raises(fmt.CheckpointError, match="init_from_optimizer"):
        trainer(tmp_path / "b", f"checkpoint.init_from={weights_only}",
                "checkpoint.init_from_optimizer=true")


def test_another_model_is_refused_naming_what_differs(source, tmp_path):
    init = f"checkpoint.init_from={checkpoint_of(source, 3)}"
    with pytest.raises(fmt.CheckpointError, match="norm_eps=1e-05 .this recipe: 1e-06"):
        trainer(tmp_path / "a", init, "model.norm_eps=1e-6")
    with pytest.raises(fmt.CheckpointError, match="lacks .*layers.4"):
        trainer(tmp_path / "b", init, "model.num_layers=6")
    with pytest.raises(fmt.CheckpointError, match="init_from=.*nowhere"):
        trainer(tmp_path / "c", f"checkpoint.init_from={tmp_path / 'nowhere'}")


def test_init_from_optimizer_needs_init_from():
    with pytest.raises(ConfigError, match="checkpoint.init_from_optimizer"):
        load_recipe(RECIPE, TINY + ["checkpoint.init_from_optimizer=true"])
