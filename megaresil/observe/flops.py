"""Model FLOPs of a training step: the one formula behind `tflops` and `mfu`.

    FLOPs per step = tokens * (6 * N + 12 * L * T * C)

tokens = global_batch_size * seq_len per optimizer step; N the parameters
that take part in matrix multiplies, counted as Megatron and nanoGPT do: every
block's attention (fused QKV, with grouped kv heads, and the output
projection) and MLP weights (the flavour's `mlp_matrices`), plus the output
head over the padded vocabulary (with tied embeddings that is the embedding
matrix, counted once); embeddings looked up, norms and biases are left out.
6 = 2 FLOPs per multiply-add, forward plus twice that backward. The attention
term is the score and value products, 2 * 2 * T * C per token per layer
forward, times 3 with backward (no causal halving, as Megatron's and
nanoGPT's formulas). Recomputed activations are not counted: these are model
FLOPs, so MFU does not rise by recomputing.
"""
from __future__ import annotations

from megaresil.config import ModelConfig, RecipeConfig
from megaresil.model.flavours import spec_of_model
from megaresil.model.gpt import padded_vocab_size
from megaresil.model.layers import ffn_size


def matmul_parameters(cfg: ModelConfig, tp: int = 1) -> int:
    """N: weights of the matrix multiplies of one forward pass (see above)."""
    c, heads = cfg.hidden_size, cfg.num_heads
    head_dim, kv_heads = c // heads, cfg.num_kv_heads or heads
    attention = c * (heads + 2 * kv_heads) * head_dim + c * c
    mlp = spec_of_model(cfg).mlp_matrices * c * ffn_size(cfg)
    return cfg.num_layers * (attention + mlp) + c * padded_vocab_size(cfg, tp)


def flops_per_token(cfg: ModelConfig, seq_len: int, tp: int = 1) -> int:
    return 6 * matmul_parameters(cfg, tp) + 12 * cfg.num_layers * seq_len * cfg.hidden_size


def flops_per_step(cfg: RecipeConfig) -> int:
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    return tokens * flops_per_token(cfg.model, cfg.data.seq_len, cfg.parallel.tp)


def achieved_tflops(step_flops: float, seconds: float, devices: int) -> float:
    """Model TFLOP/s per device (per rank), as Megatron's `TFLOP/s/GPU`."""
    return step_flops / seconds / devices / 1e12
