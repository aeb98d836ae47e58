"""Model FLOPs of a training step: the one formula behind `tflops` and `mfu`.

    FLOPs per step = tokens * (6 * N + 12 * L * T * A)

tokens = the step's global batch (a batch ramp's smaller) * seq_len; N the
parameters of matrix multiplies, counted as Megatron and nanoGPT do: every
block's attention (fused QKV, grouped kv heads, output projection) and MLP
weights (the flavour's `mlp_matrices`; with experts, those a token uses),
plus the output head over the padded vocabulary (with tied embeddings the
embedding matrix, counted once); lookups, norms and biases are left out.
6 = 2 FLOPs per multiply-add, forward plus twice that backward. Attention's
score and value products: 2 * 2 * T * A per token per layer forward (A =
num_heads * head_dim, the queries' width; T the sliding window where shorter),
times 3 with backward (no causal halving, as Megatron's and nanoGPT's). Model
FLOPs: recomputed activations are not counted, so recomputing leaves MFU be.
"""
from __future__ import annotations

from megaresil.config import ModelConfig, RecipeConfig, attention_head_dim
from megaresil.model.flavours import spec_of_model
from megaresil.model.gpt import padded_vocab_size
from megaresil.model.layers import ffn_size
from megaresil.model.moe import has_experts


def feed_forward_parameters(cfg: ModelConfig, layer: int) -> int:
    """Layer `layer`'s feed-forward weights one token multiplies by: the
    flavour's MLP, or, with experts, the active parameters (as DeepSeek-V3's
    and Megatron's MoE MFU): top_k routed experts, the shared expert and the
    router, not the experts the token skips."""
    c, matrices, moe = cfg.hidden_size, spec_of_model(cfg).mlp_matrices, cfg.moe
    if not has_experts(moe, layer):
        return matrices * c * ffn_size(cfg)
    routed = moe.top_k * matrices * c * (moe.expert_ffn_hidden_size or ffn_size(cfg))
    return routed + matrices * c * moe.shared_expert_hidden_size + moe.num_experts * c


def matmul_parameters(cfg: ModelConfig, tp: int = 1) -> int:
    """N: weights of the matrix multiplies of one forward pass (see above)."""
    c, heads = cfg.hidden_size, cfg.num_heads
    head_dim, kv_heads = attention_head_dim(cfg), cfg.num_kv_heads or heads
    attention = c * (heads + 2 * kv_heads) * head_dim + heads * head_dim * c
    mlps = sum(feed_forward_parameters(cfg, layer) for layer in range(cfg.num_layers))
    return cfg.num_layers * attention + mlps + c * padded_vocab_size(cfg, tp)


def flops_per_token(cfg: ModelConfig, seq_len: int, tp: int = 1) -> int:
    query_width = cfg.num_heads * attention_head_dim(cfg)
    keys = min(seq_len, cfg.sliding_window or seq_len)
    return 6 * matmul_parameters(cfg, tp) + 12 * cfg.num_layers * keys * query_width


def flops_per_sample(cfg: RecipeConfig) -> int:
    """A training step's FLOPs per sample of its global batch."""
    return cfg.data.seq_len * flops_per_token(cfg.model, cfg.data.seq_len, cfg.parallel.tp)


def achieved_tflops(step_flops: float, seconds: float, devices: int) -> float:
    """Model TFLOP/s per device (per rank), as Megatron's `TFLOP/s/GPU`."""
    return step_flops / seconds / devices / 1e12
