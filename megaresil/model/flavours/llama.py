"""Llama: RoPE (with Llama 3's scaling), RMSNorm, a SwiGLU MLP, no biases,
grouped-query attention, an untied head by default; transformers'
LlamaForCausalLM."""
from __future__ import annotations

import math
from typing import Optional

import torch.nn as nn

from megaresil.config import Flavour, ModelConfig, RopeScalingType, attention_head_dim
from megaresil.config.flavours import TRAITS
from megaresil.model.flavours.base import FlavourSpec, HFSpec
from megaresil.model.flavours.hf_common import (
    Mapped,
    UnsupportedVariant,
    fuse_qkv,
    require_hf,
    split_qkv,
    token_id,
)
from megaresil.model.mlp import SwiGLUMLP
from megaresil.parallel.tensor_parallel import TPGroup


def _norm(cfg: ModelConfig) -> nn.Module:
    return nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)


def _mlp(cfg: ModelConfig, tp: TPGroup, index: int) -> nn.Module:
    return SwiGLUMLP(cfg, tp, ffn=SPEC.ffn_size(cfg))


def _default_ffn(hidden: int) -> int:
    """2/3 of 4h, rounded up to a multiple of 64."""
    return 64 * math.ceil(int(8 * hidden / 3) / 64)


def _top_from_hf(cfg: ModelConfig) -> dict[str, Mapped]:
    return {"embed.tokens.weight": Mapped(("model.embed_tokens.weight",)),
            "norm.weight": Mapped(("model.norm.weight",))}


def qkv_from_hf(h: str, o: str, cfg: ModelConfig, part: str) -> dict[str, Mapped]:
    """The q/k/v projections' `part` ("weight" or "bias") as our fused one."""
    kv = cfg.num_kv_heads or cfg.num_heads
    qkv = tuple(f"{h}self_attn.{name}_proj.{part}" for name in "qkv")
    fused = Mapped(qkv, lambda q, k, v: fuse_qkv(q, k, v, cfg.num_heads, kv))
    return {o + f"attn.qkv.{part}": fused}


def attention_from_hf(h: str, o: str, cfg: ModelConfig) -> dict[str, Mapped]:
    """A layer's norms and attention, from transformers prefix `h` to ours `o`."""
    return {
        o + "norm1.weight": Mapped((h + "input_layernorm.weight",)),
        **qkv_from_hf(h, o, cfg, "weight"),
        o + "attn.proj.weight": Mapped((h + "self_attn.o_proj.weight",)),
        o + "norm2.weight": Mapped((h + "post_attention_layernorm.weight",)),
    }


def mlp_from_hf(h: str, o: str) -> dict[str, Mapped]:
    """A layer's dense SwiGLU MLP."""
    return {o + f"mlp.{name}.weight": Mapped((h + f"mlp.{name}_proj.weight",))
            for name in ("gate", "up", "down")}


def _layer_from_hf(i: int, cfg: ModelConfig) -> dict[str, Mapped]:
    h, o = f"model.layers.{i}.", f"layers.{i}."
    return {**attention_from_hf(h, o, cfg), **mlp_from_hf(h, o)}


def _top_to_hf(ours: dict, cfg: ModelConfig) -> dict:
    return {"model.embed_tokens.weight": ours["embed.tokens.weight"],
            "model.norm.weight": ours["norm.weight"]}


def qkv_to_hf(ours: dict, h: str, o: str, cfg: ModelConfig, part: str) -> dict:
    kv_heads = cfg.num_kv_heads or cfg.num_heads
    q, k, v = split_qkv(ours[o + f"attn.qkv.{part}"], cfg.num_heads, kv_heads)
    return {h + f"self_attn.{name}_proj.{part}": t for name, t in zip("qkv", (q, k, v))}


def attention_to_hf(ours: dict, h: str, o: str, cfg: ModelConfig) -> dict:
    return {
        h + "input_layernorm.weight": ours[o + "norm1.weight"],
        **qkv_to_hf(ours, h, o, cfg, "weight"),
        h + "self_attn.o_proj.weight": ours[o + "attn.proj.weight"],
        h + "post_attention_layernorm.weight": ours[o + "norm2.weight"],
    }


def mlp_to_hf(ours: dict, h: str, o: str) -> dict:
    return {h + f"mlp.{name}_proj.weight": ours[o + f"mlp.{name}.weight"]
            for name in ("gate", "up", "down")}


def _layer_to_hf(ours: dict, i: int, cfg: ModelConfig) -> dict:
    h, o = f"model.layers.{i}.", f"layers.{i}."
    return {**attention_to_hf(ours, h, o, cfg), **mlp_to_hf(ours, h, o)}


def rope_to_hf(cfg: ModelConfig) -> dict:
    scaling = cfg.rope_scaling
    if scaling.type == RopeScalingType.none:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_seq_len}


def config_to_hf(cfg: ModelConfig) -> dict:
    """config.json's keys of a Llama-like model, less its MLP's."""
    rope = rope_to_hf(cfg)
    return {"model_type": "llama", "num_hidden_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads or cfg.num_heads,
            "head_dim": attention_head_dim(cfg), "intermediate_size": SPEC.ffn_size(cfg),
            "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
            # Older transformers read rope_theta and rope_scaling, newer ones rope_parameters.
            "rope_theta": cfg.rope_theta, "rope_parameters": rope,
            "rope_scaling": None if rope["rope_type"] == "default" else rope,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "attention_dropout": cfg.attention_dropout}


def rope_from_hf(hf: dict) -> dict:
    """rope_theta and rope_scaling from either spelling: rope_parameters
    (transformers 5) or rope_theta + rope_scaling (earlier, and the files
    published for Llama 3.x)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    require_hf(kind in ("default", "llama3"), "rope_parameters", f"RoPE scaling {kind!r} (only "
               "Llama 3's 'llama3' scaling is implemented)")
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if kind == "default":
        return {"rope_theta": theta, "rope_scaling": {"type": "none"}}
    try:
        scaling = {"type": "llama3", "factor": float(rope["factor"]),
                   "low_freq_factor": float(rope["low_freq_factor"]),
                   "high_freq_factor": float(rope["high_freq_factor"]),
                   "original_max_seq_len": int(rope["original_max_position_embeddings"])}
    except KeyError as err:
        raise UnsupportedVariant(f"config.json rope_parameters: llama3 scaling without "
                                 f"{err.args[0]!r}. Fix: save the config with transformers' "
                                 "save_pretrained.") from None
    return {"rope_theta": theta, "rope_scaling": scaling}


def _head_dim_from_hf(hf: dict) -> Optional[int]:
    """model.head_dim: null where config.json's is hidden_size / heads or absent
    (transformers' default), so such a model's recipe reads as before."""
    head_dim = hf.get("head_dim")
    return None if head_dim == hf["hidden_size"] // hf["num_attention_heads"] else head_dim


def config_from_hf(hf: dict, notes: list[str]) -> dict:
    """model.* keys of a Llama-like config.json (the flavour llama's)."""
    heads = hf["num_attention_heads"]
    require_hf(hf.get("hidden_act", "silu") == "silu", "hidden_act", f"{hf.get('hidden_act')!r}")
    for flag in ("attention_bias", "mlp_bias"):
        require_hf(not hf.get(flag, False), flag, "is set")
    return {"flavour": Flavour.llama.value, "num_layers": hf["num_hidden_layers"],
            "hidden_size": hf["hidden_size"], "num_heads": heads,
            "num_kv_heads": hf.get("num_key_value_heads") or heads,
            "head_dim": _head_dim_from_hf(hf),
            "ffn_hidden_size": hf["intermediate_size"],
            "max_seq_len": hf["max_position_embeddings"], "norm_eps": hf.get("rms_norm_eps", 1e-6),
            **rope_from_hf(hf), "tie_embeddings": hf.get("tie_word_embeddings", False),
            # transformers' Llama has attention dropout only.
            "dropout": 0.0, "attention_dropout": hf.get("attention_dropout", 0.0),
            "bos_token_id": token_id(hf, "bos_token_id", notes),
            "eos_token_id": token_id(hf, "eos_token_id", notes)}


def _refusals(cfg: ModelConfig) -> list[str]:
    return ["experts (model.moe.num_experts > 0): transformers' Llama has none; flavour=mixtral "
            "or qwen3_moe converts them"] if cfg.moe.num_experts else []


SPEC = FlavourSpec(
    flavour=Flavour.llama, traits=TRAITS[Flavour.llama],
    make_norm=_norm, make_mlp=_mlp, default_ffn=_default_ffn,
    linear_biases=False, qkv_bias=False, qk_norm=False,
    learned_positions=False, tied_by_default=False,
    mlp_matrices=3,
    te_norm="RMSNorm", te_mlp="swiglu",
    te_names=(("norm1.weight", "attn.qkv.layer_norm_weight"),
              ("norm2.weight", "mlp.gate_up.layer_norm_weight"),
              ("mlp.gate.weight", "mlp.gate_up.gate_weight"),
              ("mlp.up.weight", "mlp.gate_up.up_weight")),
    hf=HFSpec(
        architecture="LlamaForCausalLM", layers_key="num_hidden_layers",
        layer_prefix="model.layers.", not_weights=(".rotary_emb.inv_freq",),
        declared_sizes=(("vocab_size", "vocab_size", "model.embed_tokens.weight", 0),
                        ("hidden_size", "hidden_size", "model.embed_tokens.weight", 1),
                        ("intermediate_size", "ffn_hidden_size",
                         "model.layers.0.mlp.gate_proj.weight", 0)),
        top_from_hf=_top_from_hf, layer_from_hf=_layer_from_hf,
        top_to_hf=_top_to_hf, layer_to_hf=_layer_to_hf,
        config_to_hf=config_to_hf, config_from_hf=config_from_hf, refusals=_refusals))
