"""Mixtral: Llama with experts in every layer (softmax top-k routing, the
choices' weights normalised, no shared expert); transformers'
MixtralForCausalLM. Its Hub files name a layer's experts
`block_sparse_moe.experts.<j>.w1/w3/w2` (gate, up, down) and its router
`block_sparse_moe.gate`."""
from __future__ import annotations

import dataclasses

from megaresil.config import Flavour, ModelConfig, RouterScore
from megaresil.config.flavours import TRAITS
from megaresil.model.flavours import llama
from megaresil.model.flavours.hf_common import HubExperts, Mapped, require_hf

EXPERTS = HubExperts(block="block_sparse_moe.", gate="w1", up="w3", down="w2")


def _layer_from_hf(i: int, cfg: ModelConfig) -> dict[str, Mapped]:
    h, o = f"model.layers.{i}.", f"layers.{i}."
    return {**llama.attention_from_hf(h, o, cfg), **EXPERTS.from_hf(h, o, cfg)}


def _stacked_layer_from_hf(i: int, cfg: ModelConfig) -> dict[str, Mapped]:
    return EXPERTS.stacked_from_hf(f"model.layers.{i}.", f"layers.{i}.")


def _layer_to_hf(ours: dict, i: int, cfg: ModelConfig) -> dict:
    h, o = f"model.layers.{i}.", f"layers.{i}."
    return {**llama.attention_to_hf(ours, h, o, cfg), **EXPERTS.to_hf(ours, h, o)}


def expert_width(cfg: ModelConfig) -> int:
    return cfg.moe.expert_ffn_hidden_size or SPEC.ffn_size(cfg)


def _config_to_hf(cfg: ModelConfig) -> dict:
    out = {**llama.config_to_hf(cfg), "model_type": "mixtral",
           "intermediate_size": expert_width(cfg), "num_local_experts": cfg.moe.num_experts,
           "num_experts_per_tok": cfg.moe.top_k, "sliding_window": None,
           "router_jitter_noise": 0.0}
    del out["mlp_bias"]
    return out


def routing_from_hf(experts: int, top_k: int, normalized: bool) -> dict:
    """model.moe's architecture keys for softmax top-k routing over
    `experts` (a model's training settings, such as the loss weights, stay
    the recipe's)."""
    return {"num_experts": experts, "top_k": top_k, "score_function": RouterScore.softmax.value,
            "normalize_top_k": normalized, "routed_scaling_factor": 1.0,
            "shared_expert_hidden_size": 0, "first_dense_layers": 0, "every_n_layers": 1,
            "expert_ffn_hidden_size": None, "bias_update_rate": 0.0}


def _config_from_hf(hf: dict, notes: list[str]) -> dict:
    window = hf.get("sliding_window")
    require_hf(window is None or window >= hf["max_position_embeddings"], "sliding_window",
               f"{window} attends to fewer than max_position_embeddings tokens")
    if hf.get("router_jitter_noise"):
        notes.append(f"config.json router_jitter_noise={hf['router_jitter_noise']}: megaresil "
                     "routes without noise")
    return {**llama.config_from_hf(hf, notes), "flavour": Flavour.mixtral.value,
            "moe": routing_from_hf(hf["num_local_experts"], hf["num_experts_per_tok"], True)}


def routing_refusals(cfg: ModelConfig) -> list[str]:
    """What of model.moe no softmax top-k family of transformers holds."""
    e = cfg.moe
    return [phrase for wrong, phrase in (
        (e.score_function != RouterScore.softmax, "sigmoid router scores"),
        (e.routed_scaling_factor != 1.0, "routed_scaling_factor other than 1"),
        (bool(e.shared_expert_hidden_size), "a shared expert"),
        (bool(e.bias_update_rate), "an expert bias (bias_update_rate > 0)")) if wrong]


def _refusals(cfg: ModelConfig) -> list[str]:
    e = cfg.moe
    return routing_refusals(cfg) + [phrase for wrong, phrase in (
        (not e.normalize_top_k, "normalize_top_k=false"),
        (e.first_dense_layers > 0 or e.every_n_layers > 1, "layers without experts")) if wrong]


# Llama's choices but for the experts' names and routing.
SPEC = dataclasses.replace(
    llama.SPEC, flavour=Flavour.mixtral, traits=TRAITS[Flavour.mixtral],
    te_names=(),  # experts have no Transformer Engine layers (validation refuses the pair)
    hf=dataclasses.replace(
        llama.SPEC.hf, architecture="MixtralForCausalLM",
        declared_sizes=(("vocab_size", "vocab_size", "model.embed_tokens.weight", 0),
                        ("hidden_size", "hidden_size", "model.embed_tokens.weight", 1),
                        ("intermediate_size", "ffn_hidden_size",
                         "model.layers.0.block_sparse_moe.experts.0.w1.weight", 0)),
        layer_from_hf=_layer_from_hf, layer_to_hf=_layer_to_hf, config_to_hf=_config_to_hf,
        config_from_hf=_config_from_hf, stacked_layer_from_hf=_stacked_layer_from_hf,
        refusals=_refusals))
