"""The routing scores under the numerical checks: a forward hook on each
layer's router notes, on the device and without a sync, whether its scores
held a NaN or an infinity in the attempt of a step at hand; the numerics
guard (train/numerics.py) reads the notes only on a non-finite step, to name
the layer where it began. The non-finite step itself is caught by the loss: a NaN score is
always chosen (top-k orders NaN above every number), so its combine weight is
NaN and so is the token's output. The hook also injects the fault kind
router_nan. docs/numerics.md."""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable, Iterable, Optional

import torch
import torch.nn as nn

from megaresil.model.moe.routing import Router, Routing

KeyMap = Callable[[str], str]


class RoutingWatch:
    """The routers of a rank's chunks, by layout-free name (the router
    weight's checkpoint key, less `.weight`)."""

    def __init__(self, chunks: Iterable[nn.Module], checkpoint_key: KeyMap):
        self.layers: list[str] = []
        self.nonfinite: dict[str, torch.Tensor] = {}  # this attempt's notes, by layer
        self.poisoned: Optional[str] = None  # the layer router_nan poisons in this attempt
        for chunk in chunks:
            for name, module in chunk.named_modules():
                if isinstance(module, Router):
                    layer = checkpoint_key(f"{name}.weight").removesuffix(".weight")
                    self.layers.append(layer)
                    module.register_forward_hook(partial(self.after_routing, layer))

    def begin_attempt(self, poison: Callable[[str], None] | None = None) -> None:
        """Forget the last attempt's notes; with `poison`, router_nan's NaN
        goes into this rank's first router in every forward pass of this
        attempt (`poison(layer)` says where, once)."""
        self.nonfinite.clear()
        self.poisoned = self.layers[0] if poison is not None and self.layers else None
        if poison is not None and self.poisoned is not None:
            poison(self.poisoned)

    def after_routing(self, layer: str, module: nn.Module, inputs: tuple,
                      routing: Routing) -> Routing:
        if layer == self.poisoned and module.training:  # an evaluation after it is clean
            routing = with_nan_score(routing)
        bad = ~torch.isfinite(routing.scores).all()
        seen = self.nonfinite.get(layer)
        self.nonfinite[layer] = bad if seen is None else seen | bad
        return routing

    def first_nonfinite(self) -> Optional[str]:
        """The first layer, in forward order, whose scores were non-finite
        in this attempt: where it began, the layers after it taking its NaN
        along through the tokens (a sync: the non-finite path only)."""
        return next((layer for layer, bad in self.nonfinite.items() if bool(bad)), None)


def with_nan_score(routing: Routing) -> Routing:
    """`routing` as if token 0's score for its first choice were NaN: top-k
    keeps choosing it, with a NaN weight."""
    scores, weights = routing.scores.clone(), routing.weights.clone()
    scores[0, routing.experts[0, 0]] = float("nan")
    weights[0, 0] = float("nan")
    return dataclasses.replace(routing, scores=scores, weights=weights)
