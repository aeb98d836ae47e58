"""Optimizer state through one protocol (`train.optim.AdamState`), whichever
AdamW implementation steps: torch's counts steps per parameter, apex's
FusedAdam per param group. A stand-in for FusedAdam (which needs CUDA)
counts its steps the way FusedAdam does."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.harness.dist import Case, run_cases
from megaresil.checkpoint.validation import read_manifest
from megaresil.parallel.distributed_optimizer import DistributedOptimizer
from megaresil.train import optim
from megaresil.events import read_metrics
from megaresil.train.optim import AdamState


class GroupStepAdamW(torch.optim.Optimizer):
    """AdamW that keeps its step count in each param group (`group["step"]`)
    and only the moments per parameter, as apex's FusedAdam does."""

    def __init__(self, params, lr, betas, eps, adam_w_mode=True, weight_decay=0.0):
        assert adam_w_mode
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            step, (beta1, beta2), lr = group["step"], group["betas"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                p.mul_(1 - lr * group["weight_decay"])
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2 ** step)).add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1 ** step))


@pytest.fixture
def group_step_adamw(monkeypatch):
    """Trainers in this process build GroupStepAdamW where they would build
    apex's FusedAdam."""
    monkeypatch.setattr(optim, "fused_adam_class", lambda: GroupStepAdamW)


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def test_resume_under_a_group_step_optimizer_is_bit_identical(tmp_path, group_step_adamw):
    """Saved at step 4 and resumed, the run continues exactly as the
    uninterrupted one: the step count (hence bias correction) comes back."""
    run_cases(1, [Case("straight"), Case("resumed", ["train.exit_at_step=4"], resume=True)],
              tmp_path)
    manifest = read_manifest(tmp_path / "resumed" / "checkpoints" / "step_0000004")
    assert manifest["optimizer"]["adam_step"] == 4
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert sorted(resumed) == list(range(1, 11))
    assert [resumed[s] for s in range(5, 11)] == [straight[s] for s in range(5, 11)]


def two_params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(6, 3)), torch.nn.Parameter(torch.randn(3))]


def take_steps(optimizer, params, n: int) -> None:
    for _ in range(n):
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()


@pytest.mark.parametrize("cls", [GroupStepAdamW, torch.optim.AdamW])
def test_step_count_is_read_and_set_where_the_optimizer_keeps_it(cls, group_step_adamw):
    params = two_params()
    optimizer = cls(params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    state = AdamState(optimizer)
    assert state.step_count() == 0
    take_steps(optimizer, params, 3)
    assert state.step_count() == 3
    fresh_params = two_params()
    fresh = AdamState(cls(fresh_params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8))
    fresh.moments()  # what a load does first: zero state to load into
    fresh.set_step_count(3)
    take_steps(fresh.inner, fresh_params, 1)
    assert fresh.step_count() == 4


def test_distributed_optimizer_moments_are_row_shards():
    """Under ZeRO-1 each parameter's moments are this rank's rows of them;
    a rank that owns no rows of a parameter holds none."""
    params = [torch.nn.Parameter(torch.randn(5, 2)), torch.nn.Parameter(torch.randn(1))]
    wrapped = DistributedOptimizer([{"params": params}], torch.optim.AdamW, {"lr": 1e-3},
                                   group=None, dp=2, dp_rank=1)
    moments = AdamState(wrapped).moments()
    held, shard = moments(params[0])
    assert (shard.start, shard.stop) == (3, 5) and held["exp_avg"].shape == (2, 2)
    assert moments(params[1]) is None


def test_unknown_optimizer_is_refused():
    params = two_params()
    with pytest.raises(TypeError, match="SGD"):
        AdamState(torch.optim.SGD(params, lr=0.1))
