"""A model family as data: `FlavourSpec` holds every choice a flavour makes
(norm, MLP, positions, biases, tying, FFN width, FLOPs, Transformer Engine
names) and `HFSpec` its Hugging Face names and config mapping. Generic code
(`model/layers.py`, `model/gpt.py`, `model/te.py`, `checkpoint/hf/mapping.py`,
`observe/flops.py`) reads the spec and never asks which flavour it has.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.nn as nn

from megaresil.config import Flavour, ModelConfig
from megaresil.config.flavours import FlavourTraits
from megaresil.model.flavours.hf_common import Mapped
from megaresil.parallel.tensor_parallel import TPGroup


def no_mapping(layer: int, cfg: ModelConfig) -> dict[str, Mapped]:
    return {}


def nothing_refused(cfg: ModelConfig) -> list[str]:
    return []


@dataclass(frozen=True)
class HFSpec:
    """The family's transformers model. Top-level maps leave out the output
    head (`lm_head.weight`, the same in every family, mapped where ties are
    known); layer maps take the global layer number."""
    architecture: str  # config.json "architectures"[0], e.g. "LlamaForCausalLM"
    layers_key: str  # config.json's layer count, e.g. "num_hidden_layers"
    layer_prefix: str  # a layer's tensors' prefix before its number, e.g. "model.layers."
    not_weights: tuple[str, ...]  # suffixes of buffers older files saved, skipped on import
    # Sizes config.json declares, each shown by a tensor's dimension:
    # (config.json key, megaresil model key, tensor, dim).
    declared_sizes: tuple[tuple[str, str, str, int], ...]
    top_from_hf: Callable[[ModelConfig], dict[str, Mapped]]
    layer_from_hf: Callable[[int, ModelConfig], dict[str, Mapped]]
    top_to_hf: Callable[[dict, ModelConfig], dict]
    layer_to_hf: Callable[[dict, int, ModelConfig], dict]
    config_to_hf: Callable[[ModelConfig], dict]  # family keys of config.json
    # config.json -> megaresil's model.* keys (less vocab_size and init_std);
    # appends to the notes, raises UnsupportedVariant or KeyError.
    config_from_hf: Callable[[dict, list[str]], dict]
    # Layer i's tensors a file may hold in another spelling (transformers'
    # in-memory stacked experts, where layer_from_hf reads the Hub's one tensor
    # per expert): they replace layer_from_hf's where the file holds them all.
    stacked_layer_from_hf: Callable[[int, ModelConfig], dict[str, Mapped]] = no_mapping
    # What of a model this family's transformers model cannot hold, a phrase
    # each (e.g. experts in a family without them); empty when it converts.
    refusals: Callable[[ModelConfig], list[str]] = nothing_refused


@dataclass(frozen=True)
class FlavourSpec:
    flavour: Flavour
    traits: FlavourTraits  # config.flavours.TRAITS[flavour]: what validation allows
    make_norm: Callable[[ModelConfig], nn.Module]  # the caller marks its parameters
    make_mlp: Callable[[ModelConfig, TPGroup, int], nn.Module]  # (cfg, tp, global layer)
    default_ffn: Callable[[int], int]  # hidden size -> FFN width when the recipe sets none
    linear_biases: bool  # attention projections
    qkv_bias: bool  # a bias on the q/k/v projection alone, the output's without (Qwen2)
    qk_norm: bool  # an RMSNorm over each head's queries and keys, before RoPE (Qwen3)
    learned_positions: bool  # a position embedding table beside the token embedding
    tied_by_default: bool  # the output head is the token embedding
    mlp_matrices: int  # weight matrices of hidden x FFN per MLP, for the FLOPs count
    te_norm: str  # Transformer Engine's normalization name
    te_mlp: str  # which of model/te.py's fused MLPs replaces the MLP and its norm
    te_names: tuple[tuple[str, str], ...]  # (local suffix, TE suffix) inside `layers.<i>.`
    hf: HFSpec

    def ffn_size(self, cfg: ModelConfig) -> int:
        return cfg.ffn_hidden_size or self.default_ffn(cfg.hidden_size)
