"""GPT-2: learned positions, LayerNorm, a tanh-GELU MLP, biases, the output
head tied to the token embedding; transformers' GPT2LMHeadModel."""
from __future__ import annotations

import torch
import torch.nn as nn

from megaresil.config import Flavour, ModelConfig
from megaresil.config.flavours import TRAITS
from megaresil.model.flavours.base import FlavourSpec, HFSpec
from megaresil.model.flavours.hf_common import (
    Mapped,
    fuse_qkv,
    require_hf,
    split_qkv,
    token_id,
    transposed,
)
from megaresil.model.mlp import GeluMLP
from megaresil.parallel.tensor_parallel import TPGroup

# (ours, theirs) inside a layer: linears (Conv1D in transformers) and norms.
_LINEARS = (("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj"))
_NORMS = (("norm1", "ln_1"), ("norm2", "ln_2"))


def _norm(cfg: ModelConfig) -> nn.Module:
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)


def _mlp(cfg: ModelConfig, tp: TPGroup, index: int) -> nn.Module:
    return GeluMLP(cfg, tp, ffn=SPEC.ffn_size(cfg))


def _top_from_hf(cfg: ModelConfig) -> dict[str, Mapped]:
    return {"embed.tokens.weight": Mapped(("transformer.wte.weight",)),
            "embed.positions.weight": Mapped(("transformer.wpe.weight",)),
            "norm.weight": Mapped(("transformer.ln_f.weight",)),
            "norm.bias": Mapped(("transformer.ln_f.bias",))}


def _layer_from_hf(i: int, cfg: ModelConfig) -> dict[str, Mapped]:
    h, o, heads = f"transformer.h.{i}.", f"layers.{i}.", cfg.num_heads

    def fused(t: torch.Tensor) -> torch.Tensor:
        q, k, v = t.chunk(3, dim=0)
        return fuse_qkv(q, k, v, heads, heads)

    out = {o + "attn.qkv.weight": Mapped((h + "attn.c_attn.weight",), lambda w: fused(w.t())),
           o + "attn.qkv.bias": Mapped((h + "attn.c_attn.bias",), fused)}
    for ours, theirs in _LINEARS:
        out[o + ours + ".weight"] = transposed(h + theirs + ".weight")
        out[o + ours + ".bias"] = Mapped((h + theirs + ".bias",))
    for ours, theirs in _NORMS:
        out[o + ours + ".weight"] = Mapped((h + theirs + ".weight",))
        out[o + ours + ".bias"] = Mapped((h + theirs + ".bias",))
    return out


def _top_to_hf(ours: dict, cfg: ModelConfig) -> dict:
    return {"transformer.wte.weight": ours["embed.tokens.weight"],
            "transformer.wpe.weight": ours["embed.positions.weight"],
            "transformer.ln_f.weight": ours["norm.weight"],
            "transformer.ln_f.bias": ours["norm.bias"]}


def _layer_to_hf(ours: dict, i: int, cfg: ModelConfig) -> dict:
    h, o = f"transformer.h.{i}.", f"layers.{i}."
    heads = cfg.num_heads
    qkv_weight = torch.cat(split_qkv(ours[o + "attn.qkv.weight"], heads, heads))
    out = {h + "attn.c_attn.weight": qkv_weight.t(),  # Conv1D is (in, out)
           h + "attn.c_attn.bias": torch.cat(split_qkv(ours[o + "attn.qkv.bias"], heads, heads))}
    for ours_name, theirs in _LINEARS:
        out[h + theirs + ".weight"] = ours[o + ours_name + ".weight"].t()
        out[h + theirs + ".bias"] = ours[o + ours_name + ".bias"]
    for ours_name, theirs in _NORMS:
        out[h + theirs + ".weight"] = ours[o + ours_name + ".weight"]
        out[h + theirs + ".bias"] = ours[o + ours_name + ".bias"]
    return out


def _config_to_hf(cfg: ModelConfig) -> dict:
    return {"model_type": "gpt2", "n_layer": cfg.num_layers, "n_embd": cfg.hidden_size,
            "n_head": cfg.num_heads, "n_inner": SPEC.ffn_size(cfg),
            "n_positions": cfg.max_seq_len, "layer_norm_epsilon": cfg.norm_eps,
            "activation_function": "gelu_new", "resid_pdrop": cfg.dropout,
            "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.attention_dropout}


def _config_from_hf(hf: dict, notes: list[str]) -> dict:
    require_hf(hf.get("activation_function", "gelu_new") in ("gelu_new", "gelu_pytorch_tanh"),
               "activation_function", f"{hf.get('activation_function')!r} is not tanh-GELU")
    for flag in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        require_hf(not hf.get(flag, False), flag, "is set")
    require_hf(hf.get("scale_attn_weights", True), "scale_attn_weights", "is off")
    resid, embd = hf.get("resid_pdrop", 0.1), hf.get("embd_pdrop", 0.1)
    if embd != resid:
        notes.append(f"config.json has embd_pdrop={embd} and resid_pdrop={resid}; megaresil has "
                     f"one model.dropout for both and uses {resid}")
    return {"flavour": Flavour.gpt2.value, "num_layers": hf["n_layer"],
            "hidden_size": hf["n_embd"], "num_heads": hf["n_head"], "num_kv_heads": None,
            "ffn_hidden_size": hf.get("n_inner"), "max_seq_len": hf["n_positions"],
            "norm_eps": hf.get("layer_norm_epsilon", 1e-5),
            "tie_embeddings": hf.get("tie_word_embeddings", True), "dropout": resid,
            "attention_dropout": hf.get("attn_pdrop", 0.1),
            "bos_token_id": token_id(hf, "bos_token_id", notes),
            "eos_token_id": token_id(hf, "eos_token_id", notes)}


SPEC = FlavourSpec(
    flavour=Flavour.gpt2, traits=TRAITS[Flavour.gpt2],
    make_norm=_norm, make_mlp=_mlp, default_ffn=lambda hidden: 4 * hidden,
    linear_biases=True, qkv_bias=False, qk_norm=False,
    learned_positions=True, tied_by_default=True,
    mlp_matrices=2,
    te_norm="LayerNorm", te_mlp="gelu",
    te_names=(("norm1.weight", "attn.qkv.layer_norm_weight"),
              ("norm1.bias", "attn.qkv.layer_norm_bias"),
              ("norm2.weight", "mlp.fused.layer_norm_weight"),
              ("norm2.bias", "mlp.fused.layer_norm_bias"),
              ("mlp.fc.weight", "mlp.fused.fc1_weight"),
              ("mlp.fc.bias", "mlp.fused.fc1_bias"),
              ("mlp.proj.weight", "mlp.fused.fc2_weight"),
              ("mlp.proj.bias", "mlp.fused.fc2_bias")),
    hf=HFSpec(
        architecture="GPT2LMHeadModel", layers_key="n_layer", layer_prefix="transformer.h.",
        not_weights=(".attn.bias", ".attn.masked_bias"),
        declared_sizes=(("vocab_size", "vocab_size", "transformer.wte.weight", 0),
                        ("n_embd", "hidden_size", "transformer.wte.weight", 1),
                        ("n_positions", "max_seq_len", "transformer.wpe.weight", 0),
                        ("n_inner", "ffn_hidden_size", "transformer.h.0.mlp.c_fc.weight", 1)),
        top_from_hf=_top_from_hf, layer_from_hf=_layer_from_hf,
        top_to_hf=_top_to_hf, layer_to_hf=_layer_to_hf,
        config_to_hf=_config_to_hf, config_from_hf=_config_from_hf))
