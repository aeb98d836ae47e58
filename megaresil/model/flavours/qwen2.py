"""Qwen2 and Qwen2.5: Llama with a bias on the q, k and v projections (none
on the output projection), the head tied or not as config.json's
tie_word_embeddings says; transformers' Qwen2ForCausalLM. Its sliding
window (use_sliding_window) maps to model.sliding_window where it covers
every layer, as Qwen3's does."""
from __future__ import annotations

import dataclasses
from typing import Optional

from megaresil.config import Flavour, ModelConfig
from megaresil.config.flavours import TRAITS
from megaresil.model.flavours import llama
from megaresil.model.flavours.base import nothing_refused
from megaresil.model.flavours.hf_common import Mapped, require_hf

SLIDING, FULL = "sliding_attention", "full_attention"  # config.json's layer_types


def _layer_from_hf(i: int, cfg: ModelConfig) -> dict[str, Mapped]:
    h, o = f"model.layers.{i}.", f"layers.{i}."
    return {**llama.attention_from_hf(h, o, cfg), **llama.qkv_from_hf(h, o, cfg, "bias"),
            **llama.mlp_from_hf(h, o)}


def _layer_to_hf(ours: dict, i: int, cfg: ModelConfig) -> dict:
    h, o = f"model.layers.{i}.", f"layers.{i}."
    return {**llama.attention_to_hf(ours, h, o, cfg), **llama.qkv_to_hf(ours, h, o, cfg, "bias"),
            **llama.mlp_to_hf(ours, h, o)}


def window_to_hf(cfg: ModelConfig) -> dict:
    """A Qwen config.json's sliding-window keys: model.sliding_window in every
    layer (max_window_layers 0: transformers slides from that layer on)."""
    window = cfg.sliding_window
    return {"use_sliding_window": window is not None, "sliding_window": window,
            "max_window_layers": 0 if window is not None else cfg.num_layers,
            "layer_types": [FULL if window is None else SLIDING] * cfg.num_layers}


def window_from_hf(hf: dict) -> Optional[int]:
    """model.sliding_window of a Qwen config.json: its sliding_window where
    use_sliding_window gives every layer one (transformers: the layers from
    max_window_layers on, or those layer_types names), null where it gives
    none; a window in some layers only is refused."""
    layers = hf["num_hidden_layers"]
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    first = hf.get("max_window_layers", 28)  # Qwen2Config's default
    types = hf.get("layer_types") or [SLIDING if window is not None and i >= first else FULL
                                      for i in range(layers)]
    sliding = [i for i, kind in enumerate(types) if kind == SLIDING]
    if window is None:
        require_hf(not sliding, "layer_types", f"sliding layers {sliding} without "
                   "use_sliding_window")
        return None
    require_hf(len(sliding) in (0, layers), "layer_types", f"a sliding window in layers "
               f"{sliding} only (megaresil's is in every layer or none)")
    return window if sliding else None


def _config_to_hf(cfg: ModelConfig) -> dict:
    out = {**llama.config_to_hf(cfg), "model_type": "qwen2", **window_to_hf(cfg)}
    del out["attention_bias"], out["mlp_bias"]  # Qwen2's q/k/v biases are not optional
    return out


def _config_from_hf(hf: dict, notes: list[str]) -> dict:
    return {**llama.config_from_hf(hf, notes), "flavour": Flavour.qwen2.value,
            "sliding_window": window_from_hf(hf)}


# Llama's choices but for the q/k/v biases and the window.
SPEC = dataclasses.replace(
    llama.SPEC, flavour=Flavour.qwen2, traits=TRAITS[Flavour.qwen2], qkv_bias=True,
    hf=dataclasses.replace(
        llama.SPEC.hf, architecture="Qwen2ForCausalLM", layer_from_hf=_layer_from_hf,
        layer_to_hf=_layer_to_hf, config_to_hf=_config_to_hf, config_from_hf=_config_from_hf,
        refusals=nothing_refused))
