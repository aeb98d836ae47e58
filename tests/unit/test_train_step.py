"""train/step.py on one rank: forward and backward give the mean loss over
the micro-batches that the eval forward gives, the synced grads are the ones
the optimizer steps on, and the step's figures are their norm and that loss."""
import math

import torch

from megaresil.config import load_recipe
from megaresil.parallel.layout import ParallelLayout
from megaresil.train import step
from megaresil.train.loop import Trainer
from tests.harness.dist import RECIPE, TINY

CPU = ParallelLayout(device=torch.device("cpu"))


def test_a_steps_figures_are_its_mean_loss_and_grad_norm(tmp_path):
    cfg = load_recipe(RECIPE, TINY + ["train.precision=fp32", f"run.dir={tmp_path}"])
    trainer = Trainer(cfg, CPU)
    batches = trainer.batches(trainer.train_data, 0)
    with torch.no_grad():
        expected = step.forward_eval(trainer.parts, batches)
    loss = step.forward_backward(trainer.parts, batches, CPU.device)
    assert torch.allclose(loss, expected, rtol=1e-6)

    held = step.sync_grads(trainer.grads, CPU)
    stepped = [p for group in held for p, _ in group]
    assert stepped == trainer.opt_params
    result = step.step_figures(held, trainer.grads, CPU, loss)
    squares = sum(float(g.double().pow(2).sum()) for group in held for _, g in group)
    assert math.isclose(result.grad_norm, math.sqrt(squares), rel_tol=1e-5)
    assert result.loss == loss.item() and not result.applied

    step.zero_grads(trainer.parts)
    assert all(not g.any() for group in trainer.grads.held() for _, g in group)
    trainer.close()
