"""Whole global tensors in and out of one rank's model slices, for tests that
check a rank against single-process values (and the init benchmark's
"before" side). The runtime never holds a global tensor: it draws its slices
(model/init.py) or loads them from a checkpoint."""
from __future__ import annotations

import torch
import torch.nn as nn

from megaresil.config import ModelConfig
from megaresil.model.init import global_shape
from megaresil.parallel.sharding import spec_of


def local_slice(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's block of a global tensor, padding the vocabulary with zeros
    up to the padded size first."""
    spec = spec_of(param)
    padded_rows = spec.global_shape(param.shape)[0]
    if full.shape[0] < padded_rows:
        full = torch.cat([full, full.new_zeros(padded_rows - full.shape[0], *full.shape[1:])])
    for dim, (start, size) in enumerate(zip(spec.offset(param.shape), param.shape)):
        full = full.narrow(dim, start, size)
    return full


@torch.no_grad()
def assign_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's slice of a global tensor into `param`."""
    param.copy_(local_slice(param, full).to(param.dtype))


def load_full_state(model: nn.Module, cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Load global, layout-free tensors (e.g. from Hugging Face) into `model`:
    every parameter, and the state buffers (expert biases) held by `tensors`."""
    from megaresil.model.moe.balance import named_state_buffers

    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise KeyError(f"no tensor for parameter(s) {missing[:5]}")
    buffers = dict(named_state_buffers([model]))
    unknown = sorted(set(tensors) - set(params) - set(buffers))
    if unknown:
        raise KeyError(f"tensor(s) {unknown[:5]} that the model does not hold")
    with torch.no_grad():
        for key in set(buffers) & set(tensors):
            buffers[key].copy_(tensors[key])
    for key, param in params.items():
        expected = global_shape(key, param, cfg)
        if tensors[key].shape != expected:
            raise ValueError(f"{key}: shape {tuple(tensors[key].shape)} does not match the "
                             f"model's {tuple(expected)}")
        assign_full(param, tensors[key])
