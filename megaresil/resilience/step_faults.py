"""The faults that act on a step's numbers (kinds nan, spike, bitflip,
router_nan): what one attempt of a step gets, applied where the trainer
hands over its loss, gradients and parameters (Trainer.optimizer_step), or
its routers' scores (train/routing_watch.py)."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from megaresil.config import FaultKind, FaultSpec, FlipTarget

Named = Sequence[tuple[str, torch.Tensor]]
# Bit patterns of each float width, read and written as integers of the same width.
INT_VIEWS = {4: torch.int32, 2: torch.int16, 8: torch.int64}


@dataclass
class StepFaults:
    """The faults due in one attempt of a step. `fired(fault, **details)`
    records one as injected (the injector's `fault_injected` event)."""
    due: list[FaultSpec] = field(default_factory=list)
    fired: Callable[..., None] = lambda fault, **details: None

    def of(self, kind: FaultKind, target: FlipTarget | None = None) -> list[FaultSpec]:
        return [f for f in self.due if f.kind == kind
                and (target is None or f.flip_target == target)]

    def before_update(self, counted_grads: list[torch.Tensor], own_grads: Named) -> None:
        """NaN into a grad the norm counts, bits flipped in the grads this
        rank steps on."""
        if self.of(FaultKind.nan):
            poison_with_nan(counted_grads)
        for fault in self.of(FaultKind.bitflip, FlipTarget.grad):
            self.fired(fault, **flip_bit(own_grads, fault.flip_seed, fault.bit))

    def routing_poison(self) -> Optional[Callable[[str], None]]:
        """With a router_nan fault due: what records it as injected in a
        layer (the caller poisons that layer's routing scores)."""
        due = self.of(FaultKind.router_nan)
        if not due:
            return None

        def fired_in(layer: str) -> None:
            for fault in due:
                self.fired(fault, layer=layer)
        return fired_in

    def loss_factor(self) -> float:
        """What this rank's spike faults multiply its replica's loss by, as the
        checks see it (1: none). The factor, not a scaled local loss, because
        only one rank of a replica contributes the loss (TP rank 0 of the last
        stage): a spike on any other rank would otherwise change nothing."""
        return math.prod(f.loss_scale for f in self.of(FaultKind.spike))

    def after_update(self, params: Named) -> None:
        """Bits flipped in this rank's parameters, once the update is applied."""
        for fault in self.of(FaultKind.bitflip, FlipTarget.param):
            self.fired(fault, **flip_bit(params, fault.flip_seed, fault.bit))


def poison_with_nan(grads: list[torch.Tensor]) -> None:
    """A NaN into the first element of the first non-empty grad."""
    first = next((g for g in grads if g is not None and g.numel() > 0), None)
    if first is not None:
        first.view(-1)[0] = float("nan")


def flip_bit(named: Named, seed: int, bit: int | None = None) -> dict:
    """Flip one bit of one element, chosen by `seed` uniformly over every
    element of `named` (the same choice on every data-parallel replica,
    which holds the same tensors); `bit` None: chosen by seed too. Returns
    what was flipped, for the event."""
    tensors = [(name, t) for name, t in named if t is not None and t.numel() > 0]
    rng = random.Random(seed)
    index = rng.randrange(sum(t.numel() for _, t in tensors))
    for name, tensor in tensors:
        if index < tensor.numel():
            break
        index -= tensor.numel()
    width = tensor.element_size() * 8
    bit = rng.randrange(width) if bit is None else bit % width
    bits = tensor.detach().view(-1).view(INT_VIEWS[tensor.element_size()])
    before = tensor.detach().view(-1)[index].item()
    unsigned = (int(bits[index]) & ((1 << width) - 1)) ^ (1 << bit)
    bits[index] = unsigned - (1 << width) if unsigned >= 1 << (width - 1) else unsigned
    return {"tensor": name, "index": index, "bit": bit, "before": before,
            "after": tensor.detach().view(-1)[index].item()}
