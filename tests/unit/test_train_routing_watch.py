"""The routers' notes (train/routing_watch.py): a NaN in routing scores is
noted at its layer; router_nan poisons training forward passes only."""
from __future__ import annotations

import torch
import torch.nn as nn

from megaresil.config import MoEConfig
from megaresil.model.moe.routing import Router
from megaresil.parallel.tensor_parallel import TPGroup
from megaresil.train.routing_watch import RoutingWatch


def routers(n: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleList(Router(MoEConfig(num_experts=4, top_k=2), 8, TPGroup())
                                 for _ in range(n))
    for router in model.layers:
        nn.init.normal_(router.weight)
    return model


def test_router_nan_poisons_the_first_router_in_training_and_is_noted_there():
    model, tokens, fired = routers(2), torch.randn(3, 8), []
    watch = RoutingWatch([model], lambda name: name)
    watch.begin_attempt(fired.append)
    first, second = (router(tokens) for router in model.layers)
    assert fired == ["layers.0"] and watch.first_nonfinite() == "layers.0"
    assert first.weights[0, 0].isnan() and first.scores[0, first.experts[0, 0]].isnan()
    assert first.weights[1:].isfinite().all() and second.scores.isfinite().all()
    model.eval()  # an evaluation after the step is not poisoned
    assert model.layers[0](tokens).weights.isfinite().all()
    watch.begin_attempt()  # the next attempt: clean, and nothing noted
    model.train()
    assert model.layers[0](tokens).weights.isfinite().all() and watch.first_nonfinite() is None
