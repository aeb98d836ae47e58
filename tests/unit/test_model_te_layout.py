"""model.backend=te's layout logic, checked on CPU without TE: its blocks run
on (T, B, C) between a stage's two transposes, and the parameters it marks
sequence-parallel are the local model's. (TE itself: tests/gpu/test_model_te.py.)

At tp=1 the local linears, norms and MLPs act on the last dim only, so a local
model whose blocks are made sequence-first runs on CPU; torch SDPA stands in
for DotProductAttention's kernel, behind DPA's documented contract (sbhd q, k,
v in, (T, B, heads * D) out, causal, GQA). What is tested is ours: the stage's
transposes, the head split, RoPE and GQA in sbhd, and the dropout masks."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from megaresil.config import ModelConfig, Recompute
from megaresil.model import te
from megaresil.model.gpt import GPT
from megaresil.model.init import initialize
from megaresil.parallel.tensor_parallel import TPGroup, seq_shard, swap_batch_and_sequence


def config(flavour: str, **extra) -> ModelConfig:
    if flavour != "gpt2":
        extra.update(flavour=flavour, num_kv_heads=2)
    return ModelConfig(num_layers=2, hidden_size=32, num_heads=4, vocab_size=64, max_seq_len=16,
                       **extra)


def sdpa_sbhd(q, k, v, checkpoint_core_attention=False):
    """DotProductAttention(qkv_format="sbhd", attn_mask_type="causal")'s contract."""
    y = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)),
                                       is_causal=True, enable_gqa=True)  # (B, heads, T, D)
    return y.permute(2, 0, 1, 3).flatten(2)


def sequence_first(model: GPT) -> GPT:
    """A copy of `model` whose blocks run on (T, B, C), with their own linears."""
    model = copy.deepcopy(model)
    for block in model.layers.values():
        te.make_sequence_first(block, block.attn.qkv, block.attn.proj, sdpa_sbhd)
    model.sequence_first = True
    return model


def test_a_sequence_shard_transposes_to_te_dim0_shard():
    x = torch.randn(2, 8, 3)  # (B, T, C)
    for rank in range(2):
        tp = TPGroup(None, 2, rank, sequence_parallel=True)
        torch.testing.assert_close(swap_batch_and_sequence(seq_shard(x, tp)),
                                   swap_batch_and_sequence(x).chunk(2, dim=0)[rank], rtol=0, atol=0)


@pytest.mark.parametrize("flavour,recompute", [("gpt2", Recompute.none), ("llama", Recompute.full),
                                               ("qwen2", Recompute.none),
                                               ("qwen3", Recompute.none)])
def test_sequence_first_blocks_give_the_local_loss_and_grads(flavour, recompute):
    """Dropout on (its masks must be the local ones); Llama with GQA and RoPE,
    under full recomputation (the stored group inputs are sequence-first);
    Qwen2's q/k/v biases; Qwen3's q/k norms, in (T, B, heads, D) too."""
    cfg = config(flavour, dropout=0.1, recompute=recompute)
    local = GPT(cfg)
    initialize(local, cfg, seed=0)
    other = sequence_first(local)
    tokens, targets = torch.randint(64, (2, 16)), torch.randint(64, (2, 16))
    samples = torch.tensor([5, 9])
    losses = [model(tokens, targets, samples) for model in (local, other)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
    grads = dict(other.named_parameters())
    for name, param in local.named_parameters():
        torch.testing.assert_close(grads[name].grad, param.grad, rtol=1e-5, atol=1e-6)


# Parameters that see only this rank's sequence shard, as TE's modules name them.
SEQUENCE_PARALLEL = {"gpt2": ("attn.qkv.layer_norm_weight", "attn.qkv.layer_norm_bias",
                              "attn.proj.bias", "mlp.fused.layer_norm_weight",
                              "mlp.fused.layer_norm_bias", "mlp.fused.fc2_bias"),
                     "llama": ("attn.qkv.layer_norm_weight", "mlp.gate_up.layer_norm_weight")}
OUTSIDE_BLOCKS = {"gpt2": {"embed.positions.weight", "norm.weight", "norm.bias"},
                  "llama": {"norm.weight"}}


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_te_marks_norms_and_row_biases_sequence_parallel(flavour):
    cfg = config(flavour)
    with torch.device("meta"):
        sp = GPT(cfg, tp=TPGroup(None, 2, 0, sequence_parallel=True))
        plain = GPT(cfg, tp=TPGroup(None, 2, 0))
    want = {f"layers.{i}.{name}" for i in range(cfg.num_layers)
            for name in SEQUENCE_PARALLEL[flavour]}
    assert te.sequence_parallel_names(sp, flavour) == want | OUTSIDE_BLOCKS[flavour]
    assert te.sequence_parallel_names(plain, flavour) == set()
