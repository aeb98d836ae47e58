"""The training state's tensors as layout-free keys and rects.

Every tensor of the state (weights, AdamW moments, distributed-optimizer row
shards) gets a key that does not mention the layout (`model/<name>`,
`optim/<moment>/<name>`, with global layer numbers), its global shape (the
model config's, vocabulary padding cut) and this rank's rect of it (its TP
offset, or its distributed-optimizer rows).

Nothing here knows a trainer or an optimizer class: parameters come as
(key, parameter) pairs and moments through `MomentsOf` (checkpoint/state.py
says who provides them).
"""
from __future__ import annotations

from typing import Callable, Iterable, Mapping, Optional

import torch
import torch.nn as nn

from megaresil.checkpoint.sharded import Rect
from megaresil.config import ModelConfig
from megaresil.model.init import global_shape, vocab_rows
from megaresil.parallel.distributed_optimizer import RowShard
from megaresil.parallel.sharding import spec_of

MOMENTS = ("exp_avg", "exp_avg_sq")
WEIGHTS = "model/"  # the prefix of weight keys; moments are under "optim/<moment>/"


def param_rect(key: str, param: torch.Tensor, data: torch.Tensor,
               cfg: ModelConfig) -> Optional[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]]:
    """(global shape, offset, view of `data`) for a parameter-shaped tensor
    `data` of `param`; None when this rank's block is all vocabulary padding."""
    shape = tuple(global_shape(key, param, cfg))
    offset = spec_of(param).offset(param.shape)
    if vocab_rows(key, cfg):  # padding rows are not state: cut them
        rows = min(param.shape[0], shape[0] - offset[0])
        if rows <= 0:
            return None
        data = data[:rows]
    return shape, offset, data


def skip(param: nn.Parameter, include_copies: bool) -> bool:
    """The last stage's copy of a tied embedding is not separate state: it is
    never saved, but it is loaded (from the same key) to stay in sync."""
    return spec_of(param).pipeline_copy and not include_copies


# Under bf16 with ZeRO-1 (train/precision.shard_main_params), the row shard
# whose fp32 main rows are a parameter's weights on this rank; None elsewhere.
MainRowsOf = Callable[[nn.Parameter], Optional[RowShard]]


def model_rects(named_params: Iterable[tuple[str, nn.Parameter]], cfg: ModelConfig,
                main_rows: Optional[MainRowsOf] = None) -> list[Rect]:
    """The weights as rects: each parameter's own, or the fp32 main rows of
    its distributed-optimizer shard where `main_rows` names one."""
    rects = []
    for key, param in named_params:
        main = main_rows(param) if main_rows is not None else None
        found = (param_rect(key, param, param.data, cfg) if main is None
                 else _moment_block(key, main, main.view, cfg))
        if found is not None:
            rects.append(Rect(f"{WEIGHTS}{key}", *found))
    return rects


# A parameter's AdamW moments by name and the distributed-optimizer row shard
# they cover (None: the whole parameter); None when this rank holds none.
HeldMoments = tuple[Mapping[str, torch.Tensor], Optional[RowShard]]
MomentsOf = Callable[[nn.Parameter], Optional[HeldMoments]]


def moment_rects(key: str, param: nn.Parameter, moments: Mapping[str, torch.Tensor],
                 shard: Optional[RowShard], cfg: ModelConfig) -> list[Rect]:
    """AdamW moments as rects of the parameter's global tensor: the
    parameter's own rect, or under the distributed optimizer the shard's rows."""
    rects = []
    for moment in MOMENTS:
        found = (param_rect(key, param, moments[moment], cfg) if shard is None
                 else _moment_block(key, shard, moments[moment], cfg))
        if found is not None:
            rects.append(Rect(moment_key(moment, key), *found))
    return rects


def moment_key(moment: str, key: str) -> str:
    """The key of a parameter's AdamW moment (`key`: the parameter's)."""
    return f"optim/{moment}/{key}"


def _moment_block(key: str, shard: RowShard, moment: torch.Tensor, cfg: ModelConfig):
    """Rect of a distributed-optimizer moment: the shard's rows of the param's rect."""
    found = param_rect(key, shard.param, shard.param.data, cfg)
    if found is None:
        return None
    shape, offset, valid = found
    stop = min(shard.stop, valid.shape[0])
    if stop <= shard.start:
        return None
    return shape, (offset[0] + shard.start, *offset[1:]), moment[: stop - shard.start]


def buffer_rects(named_buffers: Iterable[tuple[str, torch.Tensor]]) -> list[Rect]:
    """State held outside the parameters (the expert biases): whole on
    every rank that holds it, under `model/` keys like the weights."""
    return [Rect(f"{WEIGHTS}{key}", tuple(t.shape), (0,) * t.dim(), t)
            for key, t in named_buffers]


def state_rects(named_params: Iterable[tuple[str, nn.Parameter]], cfg: ModelConfig,
                moments_of: Optional[MomentsOf], include_copies: bool,
                main_rows: Optional[MainRowsOf] = None,
                named_buffers: Iterable[tuple[str, torch.Tensor]] = ()) -> list[Rect]:
    """Every tensor of one rank's training state: the weights (`main_rows`:
    see `model_rects`) and the state buffers, then the AdamW moments (none
    when `moments_of` is None). The live trainer and the offline converter
    (which plans ranks that do not run) both describe a rank here."""
    params = [(key, p) for key, p in named_params if not skip(p, include_copies)]
    rects = model_rects(params, cfg, main_rows) + buffer_rects(named_buffers)
    if moments_of is None:
        return rects
    for key, param in params:
        held = moments_of(param)
        if held is not None:
            rects += moment_rects(key, param, *held, cfg)
    return rects
