"""Mistral: Llama with sliding-window attention, config.json's
sliding_window (null: every earlier position, as from v0.2 on) as
model.sliding_window; transformers' MistralForCausalLM, whose tensors have
Llama's names."""
from __future__ import annotations

import dataclasses

from megaresil.config import Flavour, ModelConfig
from megaresil.config.flavours import TRAITS
from megaresil.model.flavours import llama
from megaresil.model.flavours.base import nothing_refused

# MistralConfig's sliding_window where config.json has none (Mistral 7B v0.1's).
DEFAULT_WINDOW = 4096


def _config_to_hf(cfg: ModelConfig) -> dict:
    out = {**llama.config_to_hf(cfg), "model_type": "mistral",
           "sliding_window": cfg.sliding_window}
    del out["attention_bias"], out["mlp_bias"]
    return out


def _config_from_hf(hf: dict, notes: list[str]) -> dict:
    return {**llama.config_from_hf(hf, notes), "flavour": Flavour.mistral.value,
            "sliding_window": hf.get("sliding_window", DEFAULT_WINDOW)}


# Llama's choices but for the window.
SPEC = dataclasses.replace(
    llama.SPEC, flavour=Flavour.mistral, traits=TRAITS[Flavour.mistral],
    hf=dataclasses.replace(
        llama.SPEC.hf, architecture="MistralForCausalLM", config_to_hf=_config_to_hf,
        config_from_hf=_config_from_hf, refusals=nothing_refused))
