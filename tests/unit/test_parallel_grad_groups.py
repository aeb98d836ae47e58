"""Gradient groups without a process group (parallel/grad_groups.py): the
grouping by each parameter's `ShardSpec.replicated_over`, each group's own
grad buffers, the ZeRO-1 rule training and offline planning share, the norm
summed over groups, and the optimizers of several groups stepped as one.
The multi-rank story: tests/multirank/test_parallel_grad_groups.py."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from megaresil.checkpoint.offline.planning import distributed_optimizer
from megaresil.config import OptimizerConfig, load_recipe
from megaresil.parallel.grad_groups import (
    GradGroup,
    GroupedGrads,
    grad_groups,
    shards_over_dp,
    zero1,
)
from megaresil.parallel.layout import ParallelLayout
from megaresil.parallel.sharding import DENSE_REPLICAS, ShardSpec, set_spec
from megaresil.train.optim import (
    AdamState,
    ChainedOptimizer,
    build_optimizer,
    group_parts,
    reduce_grad_norm,
    shards_state,
)
from tests.harness.cli import ROOT

CPU = ParallelLayout(device=torch.device("cpu"))
# DENSE: a dense parameter's (cp is no axis at cp = 1); WIDE: a second set of axes this layout has
DENSE, WIDE = DENSE_REPLICAS, ("dp", "tp")


def spec_params(*axes: tuple[str, ...]) -> list[nn.Parameter]:
    return [set_spec(nn.Parameter(torch.randn(4, 3) if i % 2 else torch.randn(3)),
                     ShardSpec(replicated_over=a)) for i, a in enumerate(axes)]


def test_params_are_grouped_by_their_specs_axes_in_first_appearance_order():
    params = spec_params(WIDE, DENSE, WIDE, DENSE, DENSE)
    targets = [nn.Parameter(p.detach().clone()) for p in params]
    groups = grad_groups(params, targets, CPU)
    assert [g.axes for g in groups] == [WIDE, DENSE]
    assert [g.params for g in groups] == [[params[0], params[2]], [params[1], params[3], params[4]]]
    assert [g.targets for g in groups] == [[targets[0], targets[2]],
                                           [targets[1], targets[3], targets[4]]]
    assert [(g.group, g.size, g.rank) for g in groups] == [(None, 1, 0), (None, 1, 0)]


def test_an_expert_group_averages_over_every_data_rank_and_sums_its_norm_over_ep():
    layout = ParallelLayout.planned(load_recipe(ROOT / "recipes" / "gpt-tiny.yaml", [
        "parallel.tp=1", "parallel.pp=1", "parallel.dp=8", "train.micro_batch_size=2",
        "model.flavour=llama",
        "model.moe.num_experts=4", "parallel.ep=2"]).parallel, rank=3)
    params = spec_params(DENSE, ("edp",))
    dense, experts = grad_groups(params, params, layout)
    assert (dense.size, dense.batches, dense.split_over) == (8, 8, ())
    assert (experts.size, experts.rank, experts.batches, experts.split_over) == (4, 1, 8, ("ep",))


def test_every_parameter_of_todays_models_is_one_group():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    params = [set_spec(p, ShardSpec()) for p in model.parameters()]
    group, = grad_groups(params, params, CPU)
    assert group.axes == DENSE and group.params == params


def test_each_group_buffers_only_its_own_grads():
    torch.manual_seed(0)
    params = spec_params(DENSE, WIDE, DENSE, WIDE)
    groups = grad_groups(params, params, CPU)
    grads = GroupedGrads(groups, [None, None])
    assert [{id(p) for p in b.bucket_of} for b in grads.buffers] == [
        {id(params[0]), id(params[2])}, {id(params[1]), id(params[3])}]
    inputs = torch.randn(3)
    loss = sum((p * p).sum() for p in params) + (params[1] @ inputs).sum()
    expected = torch.autograd.grad(loss, params, retain_graph=True)
    grads.arm()
    loss.backward()
    grads.finish()
    held = grads.held()
    assert [[p for p, _ in group] for group in held] == [[params[0], params[2]],
                                                         [params[1], params[3]]]
    got = {id(p): g for group in held for p, g in group}
    assert all(torch.equal(got[id(p)], e) for p, e in zip(params, expected))
    assert grads.sharded_over() == [(), ()]
    grads.zero()
    assert all(g.abs().sum() == 0 for group in grads.held() for _, g in group)
    grads.close()


@pytest.mark.parametrize("distributed", [False, True])
@pytest.mark.parametrize("dp", [1, 2])
def test_one_zero1_rule_for_training_and_planning(distributed, dp):
    cfg = load_recipe(ROOT / "recipes" / "gpt-tiny.yaml",
                      [f"parallel.dp={dp}", f"optimizer.distributed={str(distributed).lower()}"])
    layout = ParallelLayout.planned(cfg.parallel, 0)
    expected = distributed and dp > 1
    assert zero1(cfg.optimizer, dp) == shards_over_dp(cfg.optimizer, layout) == expected
    assert distributed_optimizer(cfg) == expected


def test_the_norm_of_several_groups_sums_their_squares():
    squares = [torch.tensor(x, dtype=torch.float64) for x in (1.5, 2.25, 0.25)]
    norm, stage_loss = reduce_grad_norm(squares, CPU, sharded_over=[DENSE, (), DENSE],
                                        loss=torch.tensor(2.5))
    assert math.isclose(norm.item(), 2.0, rel_tol=1e-7) and stage_loss.item() == 2.5
    nan, _ = reduce_grad_norm(squares, CPU, loss=torch.tensor(float("nan")))
    assert math.isnan(nan.item())


def adam_steps(optimizer, params: list[nn.Parameter], n: int) -> None:
    for step in range(n):
        for i, p in enumerate(params):
            p.grad = torch.full_like(p, 0.1 * (i + 1) * (step + 1))
        optimizer.step()


def test_several_groups_step_as_one_optimizer_and_share_one_state_view():
    torch.manual_seed(0)
    params = spec_params(DENSE, WIDE, DENSE, WIDE)
    copies = [nn.Parameter(p.detach().clone()) for p in params]
    cfg = OptimizerConfig(lr=1e-2)
    one = build_optimizer([GradGroup.over(DENSE, copies, copies, CPU)], cfg)
    assert isinstance(one, torch.optim.Optimizer) and group_parts(one) == [one]
    chained = build_optimizer(grad_groups(params, params, CPU), cfg)
    assert isinstance(chained, ChainedOptimizer) and len(chained.parts) == 2
    assert not shards_state(chained) and chained.shards == []
    adam_steps(one, copies, 3)
    adam_steps(chained, params, 3)
    assert all(torch.equal(p, c) for p, c in zip(params, copies))
    state = AdamState(chained)
    assert state.step_count() == 3 and not state.sharded
    moments = state.moments()
    for param, copy in zip(params, copies):
        held, shard = moments(param)
        assert shard is None and torch.equal(held["exp_avg"], one.state[copy]["exp_avg"])
    # A lookup of the second part's parameter answers its state, and leaves
    # no entry in the first part's (whose step count would lack it).
    assert torch.equal(chained.state.get(params[1], {})["exp_avg"],
                       one.state[copies[1]]["exp_avg"])
    state.set_step_count(7)
    assert state.step_count() == 7
    assert {id(p) for p in chained.state} == {id(p) for p in params}
