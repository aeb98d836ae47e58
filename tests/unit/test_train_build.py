"""train/build.py: one rank's parts, built in one place, the same run after run;
the Trainer's fields are its parts'."""
import torch

from megaresil.config import load_recipe
from megaresil.events import EventLog
from megaresil.parallel.layout import ParallelLayout
from megaresil.resilience.supervision import Supervision
from megaresil.train.build import build_parts, named_parameters, named_state_parameters
from megaresil.train.loop import Trainer
from tests.harness.dist import RECIPE, TINY

CPU = ParallelLayout(device=torch.device("cpu"))


def parts_in(run_dir, *overrides):
    cfg = load_recipe(RECIPE, TINY + list(overrides) + [f"run.dir={run_dir}"])
    return build_parts(cfg, CPU, Supervision(), EventLog(run_dir, 0))


def test_two_builds_draw_the_same_model(tmp_path):
    one, two = parts_in(tmp_path / "one"), parts_in(tmp_path / "two")
    first = list(named_parameters(one.chunks, one.checkpoint_key))
    second = list(named_parameters(two.chunks, two.checkpoint_key))
    assert [k for k, _ in first] == [k for k, _ in second]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(first, second))
    one.checkpointing.close()
    two.checkpointing.close()


def test_fp32_parts_step_the_parameters_themselves(tmp_path):
    parts = parts_in(tmp_path, "train.precision=fp32")
    assert parts.main is None and parts.pipeline is None and not parts.sharded_optimizer
    assert parts.opt_params == parts.params
    held = dict(named_state_parameters(parts.chunks, parts.checkpoint_key, parts.opt_params))
    model = dict(named_parameters(parts.chunks, parts.checkpoint_key))
    assert all(held[key] is model[key] for key in held)
    assert list(parts.checkpoint_state.named_parameters()) == list(held.items())
    parts.checkpointing.close()


def test_the_trainers_fields_are_its_parts(tmp_path):
    cfg = load_recipe(RECIPE, TINY + [f"run.dir={tmp_path}"])
    trainer = Trainer(cfg, CPU)
    parts = trainer.parts
    for name in ("train_data", "chunks", "model", "params", "main", "opt_params", "optimizer",
                 "pipeline", "grads", "state", "checkpoint_state", "checkpointing"):
        assert getattr(trainer, name) is getattr(parts, name), name
    assert trainer.sharded_optimizer == parts.sharded_optimizer
    trainer.close()
