"""Expert parallelism's token exchange (model/moe/experts.py
ExpertParallelDispatcher over parallel/expert_parallel.py): on each rank,
tokens sent by all-to-all to the ranks holding their experts and back give
the output and token grads of the local dispatcher over every expert, and
each rank's expert grads are the sum of its expert-parallel peers' grads
for those experts; the layout's ep, edp and dp groups are the mesh's."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import pytest
import torch
import torch.distributed as dist

from megaresil.config import ParallelConfig
from megaresil.model.moe.experts import ExpertParallelDispatcher, GroupedExperts, LocalDispatcher
from megaresil.model.moe.routing import Routing
from megaresil.parallel.layout import ParallelLayout
from megaresil.parallel.tensor_parallel import TPGroup
from megaresil.ports import free_port
from tests.harness.dist import join_group, spawn_ranks

WORLD, EXPERTS, TOP_K, HIDDEN, FFN, TOKENS = 4, 8, 2, 16, 24, 12
# (ep, capacity factor): the cases, each run on WORLD ranks (dp = WORLD).
CASES = [(2, None), (4, None), (2, 0.5)]
STACKS = ("gate", "up", "down")


def random_routing(generator: torch.Generator) -> Routing:
    logits = torch.randn(TOKENS, EXPERTS, generator=generator)
    scores = logits.softmax(-1)
    weights, experts = scores.topk(TOP_K, dim=-1)
    return Routing(logits, scores, experts, weights)


def all_experts() -> GroupedExperts:
    experts = GroupedExperts(EXPERTS, HIDDEN, FFN, TPGroup())
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name in STACKS:
            getattr(experts, name).copy_(0.1 * torch.randn(getattr(experts, name).shape,
                                                           generator=generator))
    return experts


def exchange_matches_local(layout: ParallelLayout, capacity: Optional[float]) -> None:
    ep = layout.expert_parallel()
    full, mine = all_experts(), GroupedExperts(EXPERTS, HIDDEN, FFN, TPGroup(), ep)
    held = slice(ep.rank * EXPERTS // ep.size, (ep.rank + 1) * EXPERTS // ep.size)
    with torch.no_grad():
        for name in STACKS:
            getattr(mine, name).copy_(getattr(full, name)[held])
    generator = torch.Generator().manual_seed(100 + layout.rank)  # each rank its own batch
    tokens, routing = torch.randn(TOKENS, HIDDEN, generator=generator), random_routing(generator)
    upstream = torch.randn(TOKENS, HIDDEN, generator=generator)
    local = LocalDispatcher(EXPERTS, TOP_K, capacity)

    reference_in, exchanged_in = tokens.clone().requires_grad_(), tokens.clone().requires_grad_()
    reference = local.run(reference_in, routing, full)
    exchanged = ExpertParallelDispatcher(local, ep).run(exchanged_in, routing, mine)
    (reference * upstream).sum().backward()
    (exchanged * upstream).sum().backward()

    torch.testing.assert_close(exchanged, reference)
    torch.testing.assert_close(exchanged_in.grad, reference_in.grad)
    for name in STACKS:
        summed = getattr(full, name).grad.clone()
        dist.all_reduce(summed, group=ep.group)  # the peers' grads for every expert
        torch.testing.assert_close(getattr(mine, name).grad, summed[held])


def groups_are_the_meshs(layout: ParallelLayout) -> None:
    for axes in (("ep",), ("edp",), ("dp",)):
        ranks = dist.get_process_group_ranks(layout.group(*axes))
        assert ranks == layout.shape.group_of(axes, layout.coords), axes


def _worker(rank: int, port: int, out: str) -> None:
    join_group(rank, WORLD, port)
    try:
        for ep, capacity in CASES:
            layout = ParallelLayout.from_config(ParallelConfig(dp=WORLD, ep=ep),
                                                torch.device("cpu"))
            groups_are_the_meshs(layout)
            exchange_matches_local(layout, capacity)
            (Path(out) / f"ep{ep}-{capacity}.{rank}").touch()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def exchanged(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("expert_parallel")
    spawn_ranks(_worker, (free_port(), str(out)), WORLD)
    return out


@pytest.mark.parametrize("ep,capacity", CASES)
def test_the_all_to_all_exchange_is_the_local_dispatch(exchanged, ep, capacity):
    assert all((exchanged / f"ep{ep}-{capacity}.{rank}").exists() for rank in range(WORLD))
