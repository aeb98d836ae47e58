"""Numeric precision of training: fp32, bf16 Megatron style, or bf16 autocast.

- `fp32`: parameters, activations and grads in fp32 (exact layout equivalence).
- `bf16` (Megatron's mixed precision): the model's parameters and activations
  are bf16; the optimizer steps fp32 *main* copies of them, whose fp32 grads
  accumulate the micro-batches' bf16 grads (data_parallel.GradBuffers), and
  copies the result back to bf16 after each step. Softmax/cross-entropy run in
  fp32. Checkpoints hold the fp32 main weights and moments, so a bf16 run
  resumes under fp32 and vice versa.
- `amp`: fp32 parameters under bf16 autocast (the previous `bf16`).
- `auto`: fp32 on CPU, bf16 on CUDA.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from megaresil.config import Precision

# Attributes the parallel code reads off a parameter (tp_dim, sequence_parallel,
# tied_across_pipeline, ...) live in its __dict__: a main copy carries them all.


def resolve(precision: Precision, device: torch.device) -> Precision:
    if precision != Precision.auto:
        return precision
    return Precision.bf16 if device.type == "cuda" else Precision.fp32


def autocast_for(precision: Precision, device: torch.device):
    """(autocast context, dtype of the logits the model produces)."""
    if precision == Precision.amp:
        return torch.autocast(device.type, dtype=torch.bfloat16), torch.bfloat16
    if precision == Precision.bf16:
        return contextlib.nullcontext(), torch.bfloat16
    return contextlib.nullcontext(), torch.float32


def main_copy(param: nn.Parameter) -> nn.Parameter:
    """An fp32 Parameter with `param`'s values and marks."""
    main = nn.Parameter(param.detach().to(torch.float32, copy=True))
    main.__dict__.update({k: v for k, v in vars(param).items() if not k.startswith("_")})
    return main


class MainParams:
    """fp32 main copies of a model's parameters, which are cast to bf16 here."""

    def __init__(self, params: list[nn.Parameter]):
        self.model = params
        self.main = [main_copy(p) for p in params]
        for param in params:
            param.data = param.data.to(torch.bfloat16)

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """After an optimizer step or a checkpoint load: bf16 model := fp32 main."""
        for param, main in zip(self.model, self.main):
            param.copy_(main)


def optimizer_params(params: list[nn.Parameter], main: MainParams | None) -> list[nn.Parameter]:
    """What the optimizer steps and the checkpoint holds: the fp32 main copies
    under bf16, else the parameters themselves."""
    return main.main if main is not None else params
