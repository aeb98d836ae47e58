"""Name and layout mapping between megaresil and Hugging Face `transformers`
state dicts (GPT2LMHeadModel, LlamaForCausalLM).

Works on full (unsharded, unpadded-vocab) tensors; the resharding path takes
it from there.
"""
from __future__ import annotations

import torch

from megaresil.config import Flavour, ModelConfig
from megaresil.model.gpt import ties_embeddings


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int,
             num_kv_heads: int) -> torch.Tensor:
    """Stack separate q/k/v rows into megaresil's kv-group-major fused layout."""
    groups = num_kv_heads
    q = q.reshape(groups, num_heads // groups, -1, *q.shape[1:])  # (G, H/G, D, ...)
    k = k.reshape(groups, 1, -1, *k.shape[1:])
    v = v.reshape(groups, 1, -1, *v.shape[1:])
    return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[3:])


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int):
    groups, per_group = num_kv_heads, num_heads // num_kv_heads
    grouped = qkv.reshape(groups, per_group + 2, -1, *qkv.shape[1:])  # (G, H/G+2, D, ...)
    q = grouped[:, :per_group].reshape(-1, *qkv.shape[1:])
    k = grouped[:, per_group].reshape(-1, *qkv.shape[1:])
    v = grouped[:, per_group + 1].reshape(-1, *qkv.shape[1:])
    return q, k, v


def _gpt2_layer_from_hf(sd: dict, i: int, cfg: ModelConfig) -> dict:
    h = f"transformer.h.{i}."
    heads = cfg.num_heads
    out = {}
    # GPT-2's Conv1D stores (in, out): transpose to nn.Linear's (out, in).
    qkv_w = sd[h + "attn.c_attn.weight"].t()
    out[f"layers.{i}.attn.qkv.weight"] = fuse_qkv(*qkv_w.chunk(3, dim=0), heads, heads)
    out[f"layers.{i}.attn.qkv.bias"] = fuse_qkv(*sd[h + "attn.c_attn.bias"].chunk(3), heads, heads)
    for ours, theirs in (("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"),
                         ("mlp.proj", "mlp.c_proj")):
        out[f"layers.{i}.{ours}.weight"] = sd[h + theirs + ".weight"].t()
        out[f"layers.{i}.{ours}.bias"] = sd[h + theirs + ".bias"]
    for ours, theirs in (("norm1", "ln_1"), ("norm2", "ln_2")):
        out[f"layers.{i}.{ours}.weight"] = sd[h + theirs + ".weight"]
        out[f"layers.{i}.{ours}.bias"] = sd[h + theirs + ".bias"]
    return out


def _llama_layer_from_hf(sd: dict, i: int, cfg: ModelConfig) -> dict:
    h = f"model.layers.{i}."
    a = h + "self_attn."
    kv = cfg.num_kv_heads or cfg.num_heads
    return {
        f"layers.{i}.norm1.weight": sd[h + "input_layernorm.weight"],
        f"layers.{i}.attn.qkv.weight": fuse_qkv(sd[a + "q_proj.weight"], sd[a + "k_proj.weight"],
                                                sd[a + "v_proj.weight"], cfg.num_heads, kv),
        f"layers.{i}.attn.proj.weight": sd[a + "o_proj.weight"],
        f"layers.{i}.norm2.weight": sd[h + "post_attention_layernorm.weight"],
        f"layers.{i}.mlp.gate.weight": sd[h + "mlp.gate_proj.weight"],
        f"layers.{i}.mlp.up.weight": sd[h + "mlp.up_proj.weight"],
        f"layers.{i}.mlp.down.weight": sd[h + "mlp.down_proj.weight"],
    }


def from_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A transformers state dict → megaresil's full, layout-free state dict."""
    if cfg.flavour == Flavour.gpt2:
        out = {"embed.tokens.weight": sd["transformer.wte.weight"],
               "embed.positions.weight": sd["transformer.wpe.weight"],
               "norm.weight": sd["transformer.ln_f.weight"],
               "norm.bias": sd["transformer.ln_f.bias"]}
        layer_fn = _gpt2_layer_from_hf
    else:
        out = {"embed.tokens.weight": sd["model.embed_tokens.weight"],
               "norm.weight": sd["model.norm.weight"]}
        layer_fn = _llama_layer_from_hf
    if not ties_embeddings(cfg):
        out["head.weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_layers):
        out.update(layer_fn(sd, i, cfg))
    return out
