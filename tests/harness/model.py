"""Whole global tensors in and out of one rank's model slices, for tests that
check a rank against single-process values (and the init benchmark's
"before" side). The runtime never holds a global tensor: it draws its slices
(model/init.py) or loads them from a checkpoint."""
from __future__ import annotations

import torch
import torch.nn as nn

from megaresil.config import ModelConfig
from megaresil.model.init import global_shape


def local_slice(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's block of a global tensor, padding the vocabulary with zeros
    up to the padded size first."""
    dim = getattr(param, "tp_dim", None)
    size = getattr(param, "tp_size", 1)
    padded_rows = param.shape[0] * (size if dim == 0 else 1)
    if full.shape[0] < padded_rows:
        full = torch.cat([full, full.new_zeros(padded_rows - full.shape[0], *full.shape[1:])])
    return full if dim is None else full.chunk(size, dim=dim)[param.tp_rank]


@torch.no_grad()
def assign_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's slice of a global tensor into `param`."""
    param.copy_(local_slice(param, full).to(param.dtype))


def load_full_state(model: nn.Module, cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Load global, layout-free tensors (e.g. from Hugging Face) into `model`."""
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise KeyError(f"no tensor for parameter(s) {missing[:5]}")
    for key, param in params.items():
        expected = global_shape(key, param, cfg)
        if tensors[key].shape != expected:
            raise ValueError(f"{key}: shape {tuple(tensors[key].shape)} does not match the "
                             f"model's {tuple(expected)}")
        assign_full(param, tensors[key])
