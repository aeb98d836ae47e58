"""Qwen3-MoE: Llama with an RMSNorm over each head's queries and keys
(before RoPE) and experts (softmax top-k routing; the choices' weights
normalised when norm_topk_prob) in every layer but those config.json keeps
dense; transformers' Qwen3MoeForCausalLM. Its Hub files name a layer's
experts `mlp.experts.<j>.gate_proj/up_proj/down_proj` and its router
`mlp.gate`; a dense layer's MLP has Llama's names."""
from __future__ import annotations

import dataclasses

from megaresil.config import Flavour, ModelConfig, MoEConfig
from megaresil.config.flavours import TRAITS
from megaresil.model.flavours import llama, mixtral
from megaresil.model.flavours.hf_common import HubExperts, Mapped, require_hf
from megaresil.model.moe import has_experts

EXPERTS = HubExperts(block="mlp.", gate="gate_proj", up="up_proj", down="down_proj")
HEAD_NORMS = (("attn.q_norm.weight", "self_attn.q_norm.weight"),
              ("attn.k_norm.weight", "self_attn.k_norm.weight"))


def layer_from_hf(i: int, cfg: ModelConfig) -> dict[str, Mapped]:
    h, o = f"model.layers.{i}.", f"layers.{i}."
    mlp = EXPERTS.from_hf(h, o, cfg) if has_experts(cfg.moe, i) else llama.mlp_from_hf(h, o)
    norms = {o + ours: Mapped((h + theirs,)) for ours, theirs in HEAD_NORMS}
    return {**llama.attention_from_hf(h, o, cfg), **norms, **mlp}


def _stacked_layer_from_hf(i: int, cfg: ModelConfig) -> dict[str, Mapped]:
    if not has_experts(cfg.moe, i):
        return {}
    return EXPERTS.stacked_from_hf(f"model.layers.{i}.", f"layers.{i}.")


def layer_to_hf(ours: dict, i: int, cfg: ModelConfig) -> dict:
    h, o = f"model.layers.{i}.", f"layers.{i}."
    mlp = EXPERTS.to_hf(ours, h, o) if has_experts(cfg.moe, i) else llama.mlp_to_hf(ours, h, o)
    norms = {h + theirs: ours[o + ours_key] for ours_key, theirs in HEAD_NORMS}
    return {**llama.attention_to_hf(ours, h, o, cfg), **norms, **mlp}


def _config_to_hf(cfg: ModelConfig) -> dict:
    # Every layer is sparse at step 1 unless listed dense: any layer pattern fits.
    dense = [i for i in range(cfg.num_layers) if not has_experts(cfg.moe, i)]
    out = {**llama.config_to_hf(cfg), "model_type": "qwen3_moe",
           "num_experts": cfg.moe.num_experts, "num_experts_per_tok": cfg.moe.top_k,
           "moe_intermediate_size": mixtral.expert_width(cfg),
           "norm_topk_prob": cfg.moe.normalize_top_k, "decoder_sparse_step": 1,
           "mlp_only_layers": dense, "use_sliding_window": False, "sliding_window": None}
    del out["mlp_bias"]
    return out


def _sparse_layers(hf: dict) -> list[int]:
    """The layers transformers' Qwen3-MoE gives experts."""
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    return [i for i in range(hf["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0]


def _layer_pattern(hf: dict, experts: int) -> dict:
    """first_dense_layers and every_n_layers giving experts to the layers
    config.json does; refused where no such pair does."""
    sparse = _sparse_layers(hf)
    require_hf(bool(sparse), "mlp_only_layers", "leaves no layer with experts")
    first, every = sparse[0], sparse[1] - sparse[0] if len(sparse) > 1 else 1
    ours = MoEConfig(num_experts=experts, first_dense_layers=first, every_n_layers=every)
    require_hf([i for i in range(hf["num_hidden_layers"]) if has_experts(ours, i)] == sparse,
               "mlp_only_layers", f"experts in layers {sparse}, not every n-th from one on")
    return {"first_dense_layers": first, "every_n_layers": every}


def _config_from_hf(hf: dict, notes: list[str]) -> dict:
    require_hf(not hf.get("use_sliding_window", False), "use_sliding_window", "is set")
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if experts is None:
        raise KeyError("num_experts")
    moe = {**mixtral.routing_from_hf(experts, hf["num_experts_per_tok"],
                                     bool(hf.get("norm_topk_prob", False))),
           "expert_ffn_hidden_size": hf["moe_intermediate_size"], **_layer_pattern(hf, experts)}
    return {**llama.config_from_hf(hf, notes), "flavour": Flavour.qwen3_moe.value, "moe": moe}


# Llama's choices but for the q/k norms, the experts' names and routing.
SPEC = dataclasses.replace(
    llama.SPEC, flavour=Flavour.qwen3_moe, traits=TRAITS[Flavour.qwen3_moe], qk_norm=True,
    te_names=(),  # experts have no Transformer Engine layers (validation refuses the pair)
    hf=dataclasses.replace(
        llama.SPEC.hf, architecture="Qwen3MoeForCausalLM",
        declared_sizes=(("vocab_size", "vocab_size", "model.embed_tokens.weight", 0),
                        ("hidden_size", "hidden_size", "model.embed_tokens.weight", 1)),
        layer_from_hf=layer_from_hf, layer_to_hf=layer_to_hf, config_to_hf=_config_to_hf,
        config_from_hf=_config_from_hf, stacked_layer_from_hf=_stacked_layer_from_hf,
        refusals=mixtral.routing_refusals))
