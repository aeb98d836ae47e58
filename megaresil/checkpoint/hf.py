"""Name, layout and config mapping between megaresil and Hugging Face
`transformers` (GPT2LMHeadModel, LlamaForCausalLM), both ways.

Works on full (unsharded, unpadded-vocab) tensors; the resharding path takes
it from there.
"""
from __future__ import annotations

import torch

from megaresil.checkpoint.format import CheckpointError
from megaresil.config import Flavour, ModelConfig
from megaresil.model.gpt import ties_embeddings
from megaresil.model.layers import ffn_size


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


def _gpt2_layer_to_hf(ours: dict, i: int, cfg: ModelConfig) -> dict:
    h, o = f"transformer.h.{i}.", f"layers.{i}."
    heads = cfg.num_heads
    qkv_weight = torch.cat(split_qkv(ours[o + "attn.qkv.weight"], heads, heads))
    out = {h + "attn.c_attn.weight": qkv_weight.t(),  # Conv1D is (in, out)
           h + "attn.c_attn.bias": torch.cat(split_qkv(ours[o + "attn.qkv.bias"], heads, heads))}
    for ours_name, theirs in (("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"),
                              ("mlp.proj", "mlp.c_proj")):
        out[h + theirs + ".weight"] = ours[o + ours_name + ".weight"].t()
        out[h + theirs + ".bias"] = ours[o + ours_name + ".bias"]
    for ours_name, theirs in (("norm1", "ln_1"), ("norm2", "ln_2")):
        out[h + theirs + ".weight"] = ours[o + ours_name + ".weight"]
        out[h + theirs + ".bias"] = ours[o + ours_name + ".bias"]
    return out


def _llama_layer_to_hf(ours: dict, i: int, cfg: ModelConfig) -> dict:
    h, o = f"model.layers.{i}.", f"layers.{i}."
    kv_heads = cfg.num_kv_heads or cfg.num_heads
    q, k, v = split_qkv(ours[o + "attn.qkv.weight"], cfg.num_heads, kv_heads)
    return {
        h + "input_layernorm.weight": ours[o + "norm1.weight"],
        h + "self_attn.q_proj.weight": q,
        h + "self_attn.k_proj.weight": k,
        h + "self_attn.v_proj.weight": v,
        h + "self_attn.o_proj.weight": ours[o + "attn.proj.weight"],
        h + "post_attention_layernorm.weight": ours[o + "norm2.weight"],
        h + "mlp.gate_proj.weight": ours[o + "mlp.gate.weight"],
        h + "mlp.up_proj.weight": ours[o + "mlp.up.weight"],
        h + "mlp.down_proj.weight": ours[o + "mlp.down.weight"],
    }


def to_hf(ours: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """megaresil's full, layout-free state dict → a transformers state dict
    (contiguous tensors, as safetensors stores them). A tied head is not
    stored: transformers ties it on load."""
    if cfg.flavour == Flavour.gpt2:
        out = {"transformer.wte.weight": ours["embed.tokens.weight"],
               "transformer.wpe.weight": ours["embed.positions.weight"],
               "transformer.ln_f.weight": ours["norm.weight"],
               "transformer.ln_f.bias": ours["norm.bias"]}
        layer_fn = _gpt2_layer_to_hf
    else:
        out = {"model.embed_tokens.weight": ours["embed.tokens.weight"],
               "model.norm.weight": ours["norm.weight"]}
        layer_fn = _llama_layer_to_hf
    if not ties_embeddings(cfg):
        out["lm_head.weight"] = ours["head.weight"]
    for i in range(cfg.num_layers):
        out.update(layer_fn(ours, i, cfg))
    return {name: t.contiguous() for name, t in out.items()}


# --- configs ----------------------------------------------------------------------

ARCHITECTURES = {Flavour.gpt2: "GPT2LMHeadModel", Flavour.llama: "LlamaForCausalLM"}


class UnsupportedModel(CheckpointError):
    """A Hugging Face model that megaresil's model cannot represent."""


def _gpt2_config_to_hf(cfg: ModelConfig) -> dict:
    return {"model_type": "gpt2", "n_layer": cfg.num_layers, "n_embd": cfg.hidden_size,
            "n_head": cfg.num_heads, "n_inner": ffn_size(cfg), "n_positions": cfg.max_seq_len,
            "layer_norm_epsilon": cfg.norm_eps, "activation_function": "gelu_new",
            "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout,
            "attn_pdrop": cfg.attention_dropout}


def _llama_config_to_hf(cfg: ModelConfig) -> dict:
    return {"model_type": "llama", "num_hidden_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads or cfg.num_heads,
            "head_dim": cfg.hidden_size // cfg.num_heads, "intermediate_size": ffn_size(cfg),
            "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
            # Older transformers read rope_theta, newer ones rope_parameters.
            "rope_theta": cfg.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "attention_dropout": cfg.attention_dropout}


def config_to_hf(cfg: ModelConfig, dtype: str) -> dict:
    """The config.json of the equivalent transformers model."""
    specific = _gpt2_config_to_hf(cfg) if cfg.flavour == Flavour.gpt2 else _llama_config_to_hf(cfg)
    return {"architectures": [ARCHITECTURES[cfg.flavour]], **specific,
            "vocab_size": cfg.vocab_size, "tie_word_embeddings": ties_embeddings(cfg),
            "initializer_range": cfg.init_std,
            "dtype": dtype, "torch_dtype": dtype}  # newer transformers read dtype, older torch_dtype


def _require_hf(ok: bool, key: str, problem: str) -> None:
    if not ok:
        raise UnsupportedModel(f"config.json {key}: {problem}; megaresil's model has no such "
                               "variant. Fix: convert a model without it.")


def _gpt2_config_from_hf(hf: dict) -> dict:
    _require_hf(hf.get("activation_function", "gelu_new") in ("gelu_new", "gelu_pytorch_tanh"),
                "activation_function", f"{hf.get('activation_function')!r} is not tanh-GELU")
    for flag in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        _require_hf(not hf.get(flag, False), flag, "is set")
    _require_hf(hf.get("scale_attn_weights", True), "scale_attn_weights", "is off")
    return {"flavour": "gpt2", "num_layers": hf["n_layer"], "hidden_size": hf["n_embd"],
            "num_heads": hf["n_head"], "num_kv_heads": None, "ffn_hidden_size": hf.get("n_inner"),
            "max_seq_len": hf["n_positions"], "norm_eps": hf.get("layer_norm_epsilon", 1e-5),
            "tie_embeddings": hf.get("tie_word_embeddings", True)}


def _rope_theta(hf: dict) -> float:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    _require_hf(rope.get("rope_type", rope.get("type", "default")) == "default", "rope_parameters",
                f"RoPE scaling {rope.get('rope_type', rope.get('type'))!r}")
    return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _llama_config_from_hf(hf: dict) -> dict:
    heads = hf["num_attention_heads"]
    _require_hf(hf.get("hidden_act", "silu") == "silu", "hidden_act", f"{hf.get('hidden_act')!r}")
    for flag in ("attention_bias", "mlp_bias"):
        _require_hf(not hf.get(flag, False), flag, "is set")
    _require_hf(hf.get("head_dim") in (None, hf["hidden_size"] // heads), "head_dim",
                f"{hf.get('head_dim')} differs from hidden_size / num_attention_heads")
    return {"flavour": "llama", "num_layers": hf["num_hidden_layers"],
            "hidden_size": hf["hidden_size"], "num_heads": heads,
            "num_kv_heads": hf.get("num_key_value_heads") or heads,
            "ffn_hidden_size": hf["intermediate_size"],
            "max_seq_len": hf["max_position_embeddings"], "norm_eps": hf.get("rms_norm_eps", 1e-6),
            "rope_theta": _rope_theta(hf), "tie_embeddings": hf.get("tie_word_embeddings", False)}


def config_from_hf(hf: dict) -> dict:
    """A transformers config.json → megaresil's `model.*` keys (the
    architecture only: dropout and init are training choices)."""
    architecture = (hf.get("architectures") or [None])[0]
    flavours = {arch: flavour for flavour, arch in ARCHITECTURES.items()}
    if architecture not in flavours:
        raise UnsupportedModel(f"config.json names architecture {architecture!r}; megaresil "
                               f"converts {sorted(flavours)}. Fix: export the model as one of "
                               "them.")
    from_hf_config = (_gpt2_config_from_hf if flavours[architecture] == Flavour.gpt2
                      else _llama_config_from_hf)
    try:
        return {**from_hf_config(hf), "vocab_size": hf["vocab_size"]}
    except KeyError as err:
        raise UnsupportedModel(f"config.json has no {err.args[0]!r}, which {architecture} needs. "
                               "Fix: save the config with transformers' save_pretrained.") from None
