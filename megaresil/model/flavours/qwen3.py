"""Dense Qwen3: Llama with qwen3_moe's RMSNorm over each head's queries and
keys (before RoPE), heads config.json's head_dim wide, no biases;
transformers' Qwen3ForCausalLM. Its layers are qwen3_moe's dense ones, its
sliding window Qwen2's."""
from __future__ import annotations

import dataclasses

from megaresil.config import Flavour, ModelConfig
from megaresil.config.flavours import TRAITS
from megaresil.model.flavours import llama, qwen2, qwen3_moe
from megaresil.model.flavours.base import nothing_refused


def _config_to_hf(cfg: ModelConfig) -> dict:
    out = {**llama.config_to_hf(cfg), "model_type": "qwen3", **qwen2.window_to_hf(cfg)}
    del out["mlp_bias"]
    return out


def _config_from_hf(hf: dict, notes: list[str]) -> dict:
    return {**llama.config_from_hf(hf, notes), "flavour": Flavour.qwen3.value,
            "sliding_window": qwen2.window_from_hf(hf)}


# Llama's choices but for the q/k norms and the window.
SPEC = dataclasses.replace(
    llama.SPEC, flavour=Flavour.qwen3, traits=TRAITS[Flavour.qwen3], qk_norm=True,
    hf=dataclasses.replace(
        llama.SPEC.hf, architecture="Qwen3ForCausalLM", layer_from_hf=qwen3_moe.layer_from_hf,
        layer_to_hf=qwen3_moe.layer_to_hf, config_to_hf=_config_to_hf,
        config_from_hf=_config_from_hf, refusals=nothing_refused))
