"""The feed-forward blocks the flavours choose from, built from the
tensor-parallel layers (`model/flavours/` says which a family uses)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from megaresil.config import ModelConfig
from megaresil.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    enter_tp_region,
)


class GeluMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, *, ffn: int):
        super().__init__()
        self.fc = ColumnParallelLinear(cfg.hidden_size, ffn, tp, bias=True)
        self.proj = RowParallelLinear(ffn, cfg.hidden_size, tp, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2's "gelu_new" is the tanh approximation.
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class SwiGLUMLP(nn.Module):
    """Gate and up projections kept as two weights (not one fused) so each
    shards on its own rows under tensor parallelism."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, *, ffn: int):
        super().__init__()
        self.tp = tp
        # gate and up share one entry into the TP region (one all-gather under SP).
        self.gate = ColumnParallelLinear(cfg.hidden_size, ffn, tp, bias=False, enter_region=False)
        self.up = ColumnParallelLinear(cfg.hidden_size, ffn, tp, bias=False, enter_region=False)
        self.down = RowParallelLinear(ffn, cfg.hidden_size, tp, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = enter_tp_region(x, self.tp)
        return self.down(F.silu(self.gate(x)) * self.up(x))
