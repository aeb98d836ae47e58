"""Layout-free, reproducible parameter initialisation.

Every parameter's full (global) tensor is drawn from a generator seeded by
(seed, parameter key), then this rank keeps its slice. A parameter therefore
gets the same values whatever the tp/pp/dp layout and whatever else the model
holds, which is what lets every layout reproduce the single-process run.
"""
from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn

from megaresil.config import ModelConfig

# Output projections of each residual branch get the GPT-2 scaled init.
RESIDUAL_OUTPUTS = ("attn.proj.weight", "mlp.proj.weight", "mlp.down.weight")


def key_seed(seed: int, key: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63)


def full_init(key: str, shape: torch.Size, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The global tensor for `key` (unpadded shape for the vocab tensors)."""
    if key.endswith("bias"):
        return torch.zeros(shape)
    if "norm" in key:
        return torch.ones(shape)
    std = cfg.init_std
    if key.endswith(RESIDUAL_OUTPUTS):
        std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    generator = torch.Generator().manual_seed(key_seed(seed, key))
    return torch.randn(shape, generator=generator) * std


def vocab_rows(key: str, cfg: ModelConfig) -> bool:
    return key in ("embed.tokens.weight", "head.weight")


def global_shape(key: str, param: torch.Tensor, cfg: ModelConfig) -> torch.Size:
    """The layout-free shape: unsharded, and with the real (unpadded) vocabulary."""
    shape = list(param.shape)
    dim = getattr(param, "tp_dim", None)
    if dim is not None:
        shape[dim] *= param.tp_size
    if vocab_rows(key, cfg):
        shape[0] = cfg.vocab_size
    return torch.Size(shape)


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


def initialize(model: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Fill every parameter of `model` from its key."""
    for key, param in model.named_parameters():
        assign_full(param, full_init(key, global_shape(key, param, cfg), cfg, seed))


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
