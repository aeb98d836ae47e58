"""Transformer building blocks shared by every flavour, built from the
tensor-parallel layers; what differs between flavours comes from their spec
(`model/flavours/`).

Shapes in comments: B batch, T sequence (T/tp when sequence parallel), C
hidden, H heads, G kv heads (groups), D head dim; "local" counts are per TP rank.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megaresil.config import ModelConfig, Recompute, RopeScalingType, attention_head_dim
from megaresil.model.context_attention import context_attention
from megaresil.model.flavours import spec_of_model
from megaresil.model.kv_cache import KVCache
from megaresil.model.masks import Documents, causal_mask, sliding_window_mask
from megaresil.model.moe import MoEBlock, MoELossScale, has_experts
from megaresil.parallel.context_parallel import CPGroup
from megaresil.parallel.expert_parallel import EPGroup
from megaresil.parallel.random import LayoutDropout
from megaresil.parallel.sharding import ShardSpec, set_spec
from megaresil.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    mark_replicated,
)


def ffn_size(cfg: ModelConfig) -> int:
    return spec_of_model(cfg).ffn_size(cfg)


def make_norm(cfg: ModelConfig, tp: TPGroup) -> nn.Module:
    norm = spec_of_model(cfg).make_norm(cfg)
    mark_replicated(norm.parameters(), tp)
    return norm


def head_norm(head_dim: int, cfg: ModelConfig, tp: TPGroup) -> nn.Module:
    """An RMSNorm over each head's features. A tp rank holds its own heads,
    so its weight's gradient is that rank's share: summed over tp."""
    norm = nn.RMSNorm(head_dim, eps=cfg.norm_eps)
    set_spec(norm.weight, ShardSpec(grad_sum_axes=("tp",) if tp.active else ()))
    return norm


def sequence_dropout(p: float, site: str, seed: int, tp: TPGroup,
                     cp: CPGroup = CPGroup()) -> LayoutDropout:
    """Dropout on (B, T, C) activations: this rank's context-parallel
    chunks of each sequence, and of those its sequence shard under SP."""
    sp = tp.size if tp.sequence_parallel else 1
    if sp == 1 and not cp.active:
        return LayoutDropout(p, site, seed)
    return LayoutDropout(p, site, seed,
                         full_shape=lambda s: torch.Size((s[0] * sp * cp.size, *s[1:])),
                         local_slice=lambda m: cp.slice_sequence(m, dim=0).chunk(sp)[tp.rank % sp])


def rope_frequencies(head_dim: int, cfg: ModelConfig) -> torch.Tensor:
    """RoPE's inverse frequencies (D/2,), with Llama 3's scaling when the
    config asks for it (computed as transformers does, in float32)."""
    # On the CPU even under a meta-device build: a buffer is computed, not
    # drawn, so model/init.py's materialize only moves it.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** exponents)
    scaling = cfg.rope_scaling
    if scaling.type == RopeScalingType.none:
        return inv_freq
    # Llama 3: long wavelengths (past the pre-training context / low_freq_factor)
    # are stretched by `factor`, short ones (below context / high_freq_factor)
    # kept, and those between interpolated smoothly.
    context = scaling.original_max_seq_len
    wavelen = 2 * math.pi / inv_freq
    long_wave = wavelen > context / scaling.low_freq_factor
    short_wave = wavelen < context / scaling.high_freq_factor
    scaled = torch.where(long_wave, inv_freq / scaling.factor, inv_freq)
    smooth = ((context / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    return torch.where(~short_wave & ~long_wave, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """RoPE in the rotate-half convention (the one Hugging Face Llama uses), so
    q/k projection weights need no permutation when converting.

    The cos/sin tables cover the longest sequence seen so far, built on first
    use: a table of max_seq_len rows (131072 for Llama 3.2) per layer would
    cost far more memory than the sequences trained on need."""

    inv_freq: torch.Tensor  # a buffer

    def __init__(self, head_dim: int, cfg: ModelConfig):
        super().__init__()
        # Not parameters and not checkpoint state: recomputed from the config.
        self.register_buffer("inv_freq", rope_frequencies(head_dim, cfg), persistent=False)
        self.tables: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (cos, sin), (T, D)

    def cos_sin(self, T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # Tables built under generation's inference mode cannot be saved for a backward.
        built_for_inference_only = (self.tables is not None and self.tables[0].is_inference()
                                    and not torch.is_inference_mode_enabled())
        if (self.tables is None or self.tables[0].shape[0] < T or self.tables[0].device != device
                or built_for_inference_only):
            positions = torch.arange(T, dtype=torch.float32, device=device)
            angles = torch.outer(positions, self.inv_freq.to(device))  # (T, D/2)
            angles = torch.cat([angles, angles], dim=-1)  # (T, D)
            self.tables = (angles.cos(), angles.sin())
        cos, sin = self.tables
        return cos[:T], sin[:T]

    def forward(self, x: torch.Tensor, positions: Optional[torch.Tensor] = None,
                length: Optional[int] = None) -> torch.Tensor:  # x: (B, heads, T, D)
        """`positions` (B or 1, T): each token's place in its document or in
        the whole sequence of `length` tokens (None: 0..T-1)."""
        cos, sin = self.cos_sin(length or x.shape[-2], x.device)
        if positions is not None:  # (B, 1, T, D), broadcast over the heads
            cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


def split_heads(qkv: torch.Tensor, heads: int, kv_heads: int,
                head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (a, b, heads, D), k and v (a, b, kv heads, D) from the fused projection's
    output (a, b, (heads + 2 kv heads) D), whose features are grouped by kv head
    (see Attention). (a, b) is (B, T) here, (T, B) in TE's sequence-first layout."""
    a, b, _ = qkv.shape
    per_group = heads // kv_heads
    qkv = qkv.view(a, b, kv_heads, per_group + 2, head_dim)
    q = qkv[:, :, :, :per_group].reshape(a, b, heads, head_dim)
    return q, qkv[:, :, :, per_group], qkv[:, :, :, per_group + 1]


class Attention(nn.Module):
    """Causal self-attention with one fused, column-parallel QKV projection.

    The fused weight's rows are grouped by kv head, Megatron style: for each kv
    group g, the rows of its H/G query heads, then k_g, then v_g. Cutting the
    rows into tp equal blocks hands each rank whole groups, so the config
    requires tp to divide num_kv_heads.
    """

    def __init__(self, cfg: ModelConfig, tp: TPGroup, *, site: str, seed: int,
                 cp: CPGroup = CPGroup()):
        super().__init__()
        self.cp, self.site = cp, site  # site: this layer's key in a KVCache
        self.head_dim = attention_head_dim(cfg)
        kv_heads = cfg.num_kv_heads or cfg.num_heads
        self.local_heads, self.local_kv_heads = cfg.num_heads // tp.size, kv_heads // tp.size
        spec = spec_of_model(cfg)
        bias = spec.linear_biases
        qkv_rows = (cfg.num_heads + 2 * kv_heads) * self.head_dim
        self.qkv = ColumnParallelLinear(cfg.hidden_size, qkv_rows, tp,
                                        bias=bias or spec.qkv_bias)
        self.proj = RowParallelLinear(cfg.num_heads * self.head_dim, cfg.hidden_size, tp, bias=bias)
        self.rope = RotaryEmbedding(self.head_dim, cfg) if spec.traits.rope else None
        self.q_norm = head_norm(self.head_dim, cfg, tp) if spec.qk_norm else None
        self.k_norm = head_norm(self.head_dim, cfg, tp) if spec.qk_norm else None
        # Attention-probability dropout drawn over all heads, sliced to ours.
        self.prob_dropout = LayoutDropout(
            cfg.attention_dropout, site + ".attn_probs", seed,
            full_shape=lambda s: torch.Size((s[0] * tp.size, *s[1:])),
            local_slice=lambda m: m.chunk(tp.size, dim=0)[tp.rank])
        self.recompute_core = cfg.recompute == Recompute.selective
        self.window = cfg.sliding_window

    def split_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = split_heads(self.qkv(x), self.local_heads, self.local_kv_heads, self.head_dim)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, D)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             samples: Optional[torch.Tensor], documents: Optional[Documents]) -> torch.Tensor:
        if self.cp.active:  # config/context.py refuses its dropout
            separate = documents is not None and documents.blocks is not None
            return context_attention(q, k, v, self.cp, self.window, 1 / math.sqrt(self.head_dim),
                                     documents.ids if separate and documents else None)
        if self.training and self.prob_dropout.p > 0:
            return self.core_with_dropout(q, k, v, samples, documents)
        if documents is None or documents.blocks is None:
            return self.attend(q, k, v, sliding_window_mask(q.shape[-2], self.window, q.device))
        # Block-diagonal: each row's documents attend apart, alone or in runs
        # of short ones under a mask that keeps them apart (model/masks.py).
        rows = []
        for blocks in documents.rows():
            parts = []
            for b in blocks:
                span = (slice(b.row, b.row + 1), slice(None), slice(b.start, b.end))
                parts.append(self.attend(q[span], k[span], v[span],
                                         documents.block_mask(b, self.window)))
            rows.append(torch.cat(parts, dim=2))
        return torch.cat(rows, dim=0)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: Optional[torch.Tensor], causal: bool = True) -> torch.Tensor:
        """SDPA under `mask` (True where seen); where it is None, causal, or
        every key seen when not `causal`."""
        gqa = self.local_heads != self.local_kv_heads
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                              is_causal=causal and mask is None, enable_gqa=gqa)

    def core_with_dropout(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          samples: Optional[torch.Tensor],
                          documents: Optional[Documents]) -> torch.Tensor:
        """SDPA draws its dropout from the global RNG; a layout-independent
        mask needs the probabilities in hand, so the (B, H, T, T) scores are."""
        if self.local_heads != self.local_kv_heads:
            repeat = self.local_heads // self.local_kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        T = q.shape[-2]
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, H, T, T)
        if documents is not None and documents.blocks is not None:
            seen = documents.dense_mask(self.window)  # (B, 1, T, T)
        else:
            seen = causal_mask(T, self.window, q.device)  # (T, T)
        probs = scores.masked_fill(~seen, float("-inf")).softmax(dim=-1)
        return self.prob_dropout(probs, samples) @ v

    def forward(self, x: torch.Tensor, samples: Optional[torch.Tensor],
                documents: Optional[Documents] = None,
                cache: Optional[KVCache] = None) -> torch.Tensor:
        """`cache`: x is the next tokens of a generation, which see the
        cache's keys and values too (and add theirs)."""
        q, k, v = self.split_qkv(x)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            positions, length = self.rope_places(q, documents, cache)
            q, k = self.rope(q, positions, length), self.rope(k, positions, length)
        if cache is not None:
            k, v = cache.extend(self.site, k, v)
            y = self.attend(q, k, v, cache.mask(q.shape[-2], self.window), causal=False)
        elif self.recompute_core and self.training:
            y = checkpoint(self.core, q, k, v, samples, documents, use_reentrant=False)
        else:
            y = self.core(q, k, v, samples, documents)  # (B, local H, T, D)
        B, _, T, _ = y.shape
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))

    def rope_places(self, q: torch.Tensor, documents: Optional[Documents],
                    cache: Optional[KVCache]) -> tuple[Optional[torch.Tensor], int]:
        """(positions (B or 1, T) or None for 0..T-1, the rows of RoPE's table they read)."""
        if cache is not None:  # a table for the whole cache, built once
            return cache.positions(q.shape[-2]), cache.capacity
        positions = None if documents is None else documents.positions
        if positions is None and self.cp.active:
            positions = self.cp.positions(q.shape[-2], q.device).unsqueeze(0)
        return positions, q.shape[-2] * self.cp.size


def make_mlp(cfg: ModelConfig, tp: TPGroup, index: int, moe_scale: MoELossScale,
             ep: EPGroup, cp: CPGroup) -> nn.Module:
    """Layer `index`'s feed-forward block: experts where model.moe puts them,
    else the flavour's MLP."""
    if has_experts(cfg.moe, index):
        return MoEBlock(cfg, tp, moe_scale, ffn=ffn_size(cfg), ep=ep, cp=cp)
    return spec_of_model(cfg).make_mlp(cfg, tp, index)


class Block(nn.Module):
    """Pre-norm transformer block; `index` is the global layer number."""

    # The TE backend swaps these for sequence-first modules of the same call
    # (model/te.py make_sequence_first).
    attn: nn.Module
    attn_dropout: nn.Module
    mlp_dropout: nn.Module

    def __init__(self, cfg: ModelConfig, tp: TPGroup, *, index: int, seed: int,
                 moe_scale: MoELossScale, ep: EPGroup = EPGroup(), cp: CPGroup = CPGroup()):
        super().__init__()
        site = f"layers.{index}"
        self.norm1 = make_norm(cfg, tp)
        self.attn = Attention(cfg, tp, site=site, seed=seed, cp=cp)
        self.norm2 = make_norm(cfg, tp)
        self.mlp = make_mlp(cfg, tp, index, moe_scale, ep, cp)
        self.attn_dropout = sequence_dropout(cfg.dropout, site + ".attn_out", seed, tp, cp)
        self.mlp_dropout = sequence_dropout(cfg.dropout, site + ".mlp_out", seed, tp, cp)

    def forward(self, x: torch.Tensor, samples: Optional[torch.Tensor] = None,
                documents: Optional[Documents] = None,
                cache: Optional[KVCache] = None) -> torch.Tensor:
        # Full recomputation wraps whole groups of blocks (model/activations.py).
        # Generation's cache is the local layers' alone (inference.py builds those).
        h = self.norm1(x)
        attn = (self.attn(h, samples, documents) if cache is None else
                self.attn(h, samples, documents, cache))
        x = x + self.attn_dropout(attn, samples)
        return x + self.mlp_dropout(self.mlp(self.norm2(x)), samples)
