"""Gradient groups over data parallelism (parallel/grad_groups.py): today's
parameters split into two groups over the same data-parallel group train
as one group does: the same reduced grads, bit for bit, the same norm to
fp64 rounding, and the same weights after the update, with an all-reduce
and with ZeRO-1."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import megaresil.train.build as build
from megaresil.parallel.grad_groups import GradGroup
from megaresil.parallel.layout import ParallelLayout
from megaresil.ports import free_port
from megaresil.train.loop import Trainer
from tests.harness.dist import Case, join_group, recipe_for, spawn_ranks

WORLD = 2
REDUCTIONS = {"all_reduce": ["parallel.dp=2"],
              "zero1": ["parallel.dp=2", "optimizer.distributed=true"]}


def two_groups(params, targets, layout) -> list[GradGroup]:
    """Every other parameter in a second group, both over ("dp",)."""
    return [GradGroup.over(("dp",), params[first::2], targets[first::2], layout)
            for first in (0, 1)]


def one_step(name: str, overrides: list[str], out: Path) -> dict:
    """Train one step; the grads the optimizer stepped on (by key), the norm
    and the updated weights."""
    cfg = recipe_for(Case(name, overrides), out / name)
    trainer = Trainer(cfg, ParallelLayout.from_config(cfg.parallel, torch.device("cpu")))
    keys = {id(p): key for key, p in trainer.named_parameters()}
    keys.update({id(p): key for key, p in trainer.named_state_parameters()})
    grads, sync_grads = {}, trainer.sync_grads

    def recording_sync():
        held = sync_grads()
        grads.update({keys[id(p)]: g.clone() for group in held for p, g in group})
        return held

    trainer.sync_grads = recording_sync
    loss = trainer.forward_backward(trainer.batches(trainer.train_data, 0))
    result = trainer.optimizer_step(1, loss)
    trainer.close()
    return {"groups": len(trainer.grads.buffers), "grads": grads, "norm": result.norm,
            "weights": {key: p.detach().clone() for key, p in trainer.named_parameters()}}


def _worker(rank: int, port: int, out: str) -> None:
    join_group(rank, WORLD, port)
    try:
        by_spec = build.grad_groups
        for reduction, overrides in REDUCTIONS.items():
            for split, groups in (("one", by_spec), ("two", two_groups)):
                build.grad_groups = groups
                name = f"{reduction}_{split}"
                torch.save(one_step(name, overrides, Path(out)), Path(out) / f"{name}.{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def steps(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("grad_groups")
    spawn_ranks(_worker, (free_port(), str(out)), WORLD)
    return out


@pytest.mark.parametrize("reduction", list(REDUCTIONS))
@pytest.mark.parametrize("rank", range(WORLD))
def test_two_groups_over_dp_step_as_one(steps, reduction, rank):
    one = torch.load(steps / f"{reduction}_one.{rank}.pt")
    two = torch.load(steps / f"{reduction}_two.{rank}.pt")
    assert (one["groups"], two["groups"]) == (1, 2)
    assert one["grads"].keys() == two["grads"].keys()
    for key, grad in one["grads"].items():
        assert torch.equal(grad, two["grads"][key]), key
    assert torch.allclose(one["norm"], two["norm"], rtol=1e-6, atol=0)
    for key, weight in one["weights"].items():
        assert torch.equal(weight, two["weights"][key]), key
