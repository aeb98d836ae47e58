"""Layout-free, reproducible parameter initialisation, drawn shard by shard.

A parameter's global tensor is a pure function of (seed, parameter key): its
units (indices along the dim tensor parallelism cuts, dim 0 when it is not
cut) are taken in fixed blocks of UNITS_PER_DRAW, and each block is drawn from
its own generator seeded by (seed, key, block). A rank therefore draws only
the blocks its slice touches, straight into the parameter wherever it lives
(a model built on the meta device is materialised here), and gets exactly the
values a single process holds for that slice. That keeps every layout
reproducing the single-process run without any rank ever holding a global
tensor, and without drawing one either (init time is O(local), not O(model)).
Values do not depend on what else the model holds.
"""
from __future__ import annotations

import math
import zlib
from typing import Optional, TypeVar

import torch
import torch.nn as nn

from megaresil.config import ModelConfig
from megaresil.parallel.sharding import ShardSpec, carry_spec, spec_of

ModuleT = TypeVar("ModuleT", bound=nn.Module)

# Output projections of each residual branch get the GPT-2 scaled init.
RESIDUAL_OUTPUTS = ("attn.proj.weight", "mlp.proj.weight", "mlp.down.weight",
                    "mlp.experts.down", "mlp.shared.down.weight")

# Torch's CPU generator keeps only the low 32 bits of a seed, so every block
# seed is one draw from 2^32: blocks of 256 units keep a 70B model near 35k
# seeds (about 0.15 expected pairs of blocks sharing one), while a rank draws at
# most two partial blocks beyond its own slice per parameter.
UNITS_PER_DRAW = 256


def key_seed(seed: int, key: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63)


def block_seed(seed: int, key: str, block: int) -> int:
    return (key_seed(seed, key) * 0x9E3779B1 + block * 0x85EBCA77) % (2**63)


def init_std(key: str, cfg: ModelConfig) -> float:
    if key.endswith(RESIDUAL_OUTPUTS):
        return cfg.init_std / math.sqrt(2 * cfg.num_layers)
    return cfg.init_std


def vocab_rows(key: str, cfg: ModelConfig) -> bool:
    return key in ("embed.tokens.weight", "head.weight")


def global_shape(key: str, param: torch.Tensor, cfg: ModelConfig) -> torch.Size:
    """The layout-free shape: unsharded, and with the real (unpadded) vocabulary."""
    shape = list(spec_of(param).global_shape(param.shape))
    if vocab_rows(key, cfg):
        shape[0] = cfg.vocab_size
    return torch.Size(shape)


def unit_dim(param: torch.Tensor) -> int:
    """The dim whose indices are drawn block by block: the first one cut."""
    return spec_of(param).unit_dim


def local_units(param: torch.Tensor, spec: Optional[ShardSpec] = None) -> range:
    """The global indices along `unit_dim` this rank's slice covers (past the
    real vocabulary for padded vocab rows)."""
    spec = spec or spec_of(param)
    dim = spec.unit_dim
    start = spec.offset(param.shape)[dim]
    return range(start, start + param.shape[dim])


def _local_block(values: torch.Tensor, dim: int, param: torch.Tensor,
                 spec: ShardSpec) -> torch.Tensor:
    """A unit-major block of the global tensor, cut to this rank's slice along
    every dim but the unit dim (whole along dims nothing cuts)."""
    offset = spec.offset(param.shape)
    others = [d for d in range(param.ndim) if d != dim]
    for axis, d in enumerate(others, start=1):
        values = values.narrow(axis, offset[d], param.shape[d])
    return values


@torch.no_grad()
def draw_normal(param: torch.Tensor, key: str, cfg: ModelConfig, seed: int) -> None:
    """Fill `param` with its slice of the global N(0, std) tensor for `key`,
    one block at a time (host memory: one block); units past the real
    vocabulary are zero. A stack of experts draws each expert as a tensor of
    its own, keyed `key.<expert>`: its values do not depend on how many
    experts a rank holds, and no block spans experts."""
    spec, std = spec_of(param), init_std(key, cfg)
    if not spec.stacks_experts:
        _draw_blocks(param, spec, key, global_shape(key, param, cfg), std, seed)
        return
    inner = spec.per_expert()
    for expert, values in zip(local_units(param, spec), param):
        _draw_blocks(values, inner, f"{key}.{expert}", inner.global_shape(values.shape), std,
                     seed)


def _draw_blocks(param: torch.Tensor, spec: ShardSpec, key: str, shape: torch.Size, std: float,
                 seed: int) -> None:
    dim = spec.unit_dim
    units, unit_shape = shape[dim], shape[:dim] + shape[dim + 1:]
    target = param.movedim(dim, 0)  # a view: unit-major
    mine = local_units(param, spec)
    target[max(units, mine.start) - mine.start:].zero_()
    generator = torch.Generator()
    stop = min(mine.stop, units)
    blocks = (range(mine.start // UNITS_PER_DRAW, -(-stop // UNITS_PER_DRAW))
              if stop > mine.start else range(0))  # all padding: nothing to draw
    for block in blocks:
        lo, hi = block * UNITS_PER_DRAW, min((block + 1) * UNITS_PER_DRAW, units)
        generator.manual_seed(block_seed(seed, key, block))
        values = torch.empty(hi - lo, *unit_shape).normal_(generator=generator).mul_(std)
        values = _local_block(values, dim, param, spec)
        first, last = max(lo, mine.start), min(hi, stop)
        target[first - mine.start:last - mine.start].copy_(values[first - lo:last - lo])


@torch.no_grad()
def initialize_parameter(param: torch.Tensor, key: str, cfg: ModelConfig, seed: int) -> None:
    if key.endswith("bias"):
        param.zero_()
    elif "norm" in key:
        param.fill_(1.0)
    else:
        draw_normal(param, key, cfg, seed)


def initialize(model: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Fill every parameter of `model` (in place, on its device) from its key."""
    for key, param in model.named_parameters():
        initialize_parameter(param, key, cfg, seed)


def materialize(model: ModuleT, cfg: ModelConfig, seed: int, device: torch.device,
                draw: bool = True) -> ModuleT:
    """Give a model built under `torch.device("meta")` storage on `device` for
    this rank's slices only, and initialise them there (with `draw`; without,
    they stay uninitialised, for a load to fill).

    Parameters are replaced by new ones that keep their `ShardSpec`;
    buffers are built for real even under a meta build (they are small and
    computed, not drawn), so they only move."""
    for key, param in list(model.named_parameters()):
        owner_name, _, name = key.rpartition(".")
        owner = model.get_submodule(owner_name)
        real = nn.Parameter(torch.empty_like(param, device=device),
                            requires_grad=param.requires_grad)
        carry_spec(param, real)
        setattr(owner, name, real)
        if draw:
            initialize_parameter(real, key, cfg, seed)
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_meta:
                raise ValueError(f"buffer {name} of {type(module).__name__} was built on the meta "
                                 "device and cannot be materialised; build it on the CPU in its "
                                 "module's __init__ (see RotaryEmbedding)")
            setattr(module, name, buffer.to(device))
    return model
