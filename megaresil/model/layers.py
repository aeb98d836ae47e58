"""Transformer building blocks shared by the GPT-2 and Llama flavours.

Shapes in comments: B batch, T sequence, C hidden, H heads, G kv heads (groups),
D head dim.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megaresil.config import Flavour, ModelConfig, Recompute


def ffn_size(cfg: ModelConfig) -> int:
    if cfg.ffn_hidden_size:
        return cfg.ffn_hidden_size
    if cfg.flavour == Flavour.gpt2:
        return 4 * cfg.hidden_size
    # Llama's rule: 2/3 of 4h, rounded up to a multiple of 64.
    return 64 * math.ceil(int(8 * cfg.hidden_size / 3) / 64)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.flavour == Flavour.gpt2:
        return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
    return nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)


class RotaryEmbedding(nn.Module):
    """RoPE in the rotate-half convention (the one Hugging Face Llama uses), so
    q/k projection weights need no permutation when converting."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)  # (T, D/2)
        angles = torch.cat([angles, angles], dim=-1)  # (T, D)
        # Not parameters and not checkpoint state: recomputed from the config.
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, heads, T, D)
        T = x.shape[-2]
        cos, sin = self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class Attention(nn.Module):
    """Causal self-attention with one fused QKV projection.

    The fused weight's rows are grouped by kv head, Megatron style: for each kv
    group g, the rows of its H/G query heads, then k_g, then v_g. Splitting the
    rows into equal contiguous blocks therefore splits whole groups, which is
    what tensor parallelism needs.
    """

    def __init__(self, cfg: ModelConfig, *, num_heads: int, num_kv_heads: int):
        super().__init__()
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        bias = cfg.flavour == Flavour.gpt2
        qkv_rows = (num_heads + 2 * num_kv_heads) * self.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, qkv_rows, bias=bias)
        self.proj = nn.Linear(num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.rope = (RotaryEmbedding(self.head_dim, cfg.max_seq_len, cfg.rope_theta)
                     if cfg.flavour == Flavour.llama else None)
        self.attention_dropout = cfg.attention_dropout
        self.recompute_core = cfg.recompute == Recompute.selective

    def split_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, _ = x.shape
        per_group = self.num_heads // self.num_kv_heads
        qkv = self.qkv(x).view(B, T, self.num_kv_heads, per_group + 2, self.head_dim)
        q = qkv[:, :, :, :per_group].reshape(B, T, self.num_heads, self.head_dim)
        k, v = qkv[:, :, :, per_group], qkv[:, :, :, per_group + 1]  # (B, T, G, D)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, D)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dropout = self.attention_dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True,
                                              enable_gqa=self.num_heads != self.num_kv_heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        q, k, v = self.split_qkv(x)
        if self.rope is not None:
            q, k = self.rope(q), self.rope(k)
        if self.recompute_core and self.training:
            y = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            y = self.core(q, k, v)  # (B, H, T, D)
        B, _, T, _ = y.shape
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class GeluMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, *, ffn: int):
        super().__init__()
        self.fc = nn.Linear(cfg.hidden_size, ffn)
        self.proj = nn.Linear(ffn, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2's "gelu_new" is the tanh approximation.
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class SwiGLUMLP(nn.Module):
    """Gate and up projections kept as two weights (not one fused) so each
    shards on its own rows under tensor parallelism."""

    def __init__(self, cfg: ModelConfig, *, ffn: int):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, ffn, bias=False)
        self.up = nn.Linear(cfg.hidden_size, ffn, bias=False)
        self.down = nn.Linear(ffn, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1 = make_norm(cfg)
        self.attn = Attention(cfg, num_heads=cfg.num_heads,
                              num_kv_heads=cfg.num_kv_heads or cfg.num_heads)
        self.norm2 = make_norm(cfg)
        mlp_cls = GeluMLP if cfg.flavour == Flavour.gpt2 else SwiGLUMLP
        self.mlp = mlp_cls(cfg, ffn=ffn_size(cfg))
        self.dropout = nn.Dropout(cfg.dropout)
        self.recompute_all = cfg.recompute == Recompute.full

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.norm1(x)))
        return x + self.dropout(self.mlp(self.norm2(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute_all and self.training:
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)
