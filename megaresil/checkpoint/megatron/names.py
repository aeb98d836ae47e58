"""The one table between megaresil's checkpoint keys and Megatron-Core's
sharded keys (what its dist_checkpointing writes for a GPTModel), and the
transforms between their full (unsharded) tensors, both ways. Import and
export both use it (docs/checkpoints.md, "Megatron checkpoints").

A layer's tensors are under `decoder.layers.`, layer-stacked (a leading
layer axis over all layers, whatever the pipeline split: what Mcore 0.16
writes) or per layer (`decoder.layers.{i}.`). Mcore's QKV, interleaved per
query group ([q heads of group g..., k_g, v_g] for each g), is megaresil's
fused layout already (fuse_qkv in model/flavours/hf_common.py): its rows
carry over as they are. SwiGLU's `linear_fc1` is [gate; up] at any tp (or
the halves as `linear_fc1.weight_w` / `_v`); megaresil keeps `mlp.gate` and
`mlp.up` apart. Mcore's embedding and output layer hold padded_vocab_size
rows, a megaresil checkpoint the real vocabulary's.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch

LAYERS = "decoder.layers."
EXTRA_STATE = "_extra_state"
VOCAB_KEYS = ("embed.tokens.weight", "head.weight")  # megaresil's rows of the vocabulary


@dataclass(frozen=True)
class Name:
    """A megaresil key (within a layer: after `layers.{i}.`) and Mcore's
    spellings of it (within a layer: after `decoder.layers.` and the layer
    index, if any), the one Mcore writes first. `half` is the SwiGLU half
    of `linear_fc1` it is (0 gate, 1 up), or None for the whole tensor;
    `experts`: the tensor has a leading (global) expert axis."""
    ours: str
    theirs: tuple[str, ...]
    half: Optional[int] = None
    experts: bool = False


# A norm has two spellings: Transformer Engine's fused `layer_norm_weight`
# (which the local spec writes too, for TE compatibility) and the local
# spec's `input_layernorm` / `pre_mlp_layernorm`; each row lists the one
# Mcore writes first.
TOP = (
    Name("embed.tokens.weight", ("embedding.word_embeddings.weight",)),
    Name("embed.positions.weight", ("embedding.position_embeddings.weight",)),
    Name("norm.weight", ("decoder.final_layernorm.weight",)),
    Name("norm.bias", ("decoder.final_layernorm.bias",)),
    Name("head.weight", ("output_layer.weight",)),
)
_FC1 = ("mlp.linear_fc1.weight",)
LAYER = (
    Name("norm1.weight", ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight")),
    Name("norm1.bias", ("self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias")),
    Name("attn.qkv.weight", ("self_attention.linear_qkv.weight",)),
    Name("attn.qkv.bias", ("self_attention.linear_qkv.bias",)),
    Name("attn.q_norm.weight", ("self_attention.q_layernorm.weight",)),
    Name("attn.k_norm.weight", ("self_attention.k_layernorm.weight",)),
    Name("attn.proj.weight", ("self_attention.linear_proj.weight",)),
    Name("attn.proj.bias", ("self_attention.linear_proj.bias",)),
    Name("norm2.weight", ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")),
    Name("norm2.bias", ("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias")),
    Name("mlp.fc.weight", _FC1),
    Name("mlp.fc.bias", ("mlp.linear_fc1.bias",)),
    Name("mlp.proj.weight", ("mlp.linear_fc2.weight",)),
    Name("mlp.proj.bias", ("mlp.linear_fc2.bias",)),
    Name("mlp.gate.weight", _FC1, half=0),
    Name("mlp.up.weight", _FC1, half=1),
    Name("mlp.down.weight", ("mlp.linear_fc2.weight",)),
    # A mixture of experts: the router, the routed experts (SequentialMLP's
    # and TEGroupedMLP's keys alike: one tensor per projection over the
    # global expert axis), the shared expert.
    Name("mlp.router.weight", ("mlp.router.weight",)),
    Name("mlp.router.expert_bias", ("mlp.router.expert_bias",)),  # a state buffer
    Name("mlp.experts.gate", ("mlp.experts.experts.linear_fc1.weight",), half=0, experts=True),
    Name("mlp.experts.up", ("mlp.experts.experts.linear_fc1.weight",), half=1, experts=True),
    Name("mlp.experts.down", ("mlp.experts.experts.linear_fc2.weight",), experts=True),
    Name("mlp.shared.gate.weight", ("mlp.shared_experts.linear_fc1.weight",), half=0),
    Name("mlp.shared.up.weight", ("mlp.shared_experts.linear_fc1.weight",), half=1),
    Name("mlp.shared.down.weight", ("mlp.shared_experts.linear_fc2.weight",)),
)
# The SwiGLU halves as separate tensors (Mcore's singleton_local_shards form).
HALF_SUFFIXES = ("_w", "_v")
_LAYER_INDEX = re.compile(r"^decoder\.layers\.(\d+)\.")


def names_of(ours_keys: set[str]) -> tuple[list[Name], list[Name]]:
    """The rows of the table (top level, within a layer) that a model with
    megaresil keys `ours_keys` (layout_free_shapes' keys) has."""
    layer = {key.split(".", 2)[2] for key in ours_keys if key.startswith("layers.")}
    return ([n for n in TOP if n.ours in ours_keys], [n for n in LAYER if n.ours in layer])


def stacked(suffix: str) -> str:
    """The layer-stacked key of a layer tensor (leading axis: the layer)."""
    return LAYERS + suffix


def per_layer(i: int, suffix: str) -> str:
    return f"{LAYERS}{i}.{suffix}"


def is_extra_state(key: str) -> bool:
    """TE's per-module metadata (FP8 scales; empty without TE): no weights."""
    return EXTRA_STATE in key


def per_layer_index(key: str) -> Optional[int]:
    """The layer of a per-layer key, None for a stacked or top-level one."""
    found = _LAYER_INDEX.match(key)
    return int(found[1]) if found else None


def swiglu_halves(fc1: torch.Tensor, experts: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Mcore's SwiGLU linear_fc1 [gate; up] (rows; each expert's, after a
    leading expert axis) as (gate, up)."""
    gate, up = fc1.chunk(2, dim=1 if experts else 0)
    return gate, up


def swiglu_fc1(gate: torch.Tensor, up: torch.Tensor, experts: bool = False) -> torch.Tensor:
    """(gate, up) as Mcore's SwiGLU linear_fc1 [gate; up]."""
    return torch.cat([gate, up], dim=1 if experts else 0)


def unpadded(tensor: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The real vocabulary's rows of an embedding or output layer."""
    if tensor.shape[0] < vocab_size:
        raise ValueError(f"{tensor.shape[0]} rows hold no vocabulary of {vocab_size}")
    return tensor[:vocab_size]


def padded(tensor: torch.Tensor, padded_vocab_size: int) -> torch.Tensor:
    """An embedding or output layer padded with zero rows to Megatron's
    padded_vocab_size (Megatron never reads the padding's logits)."""
    extra = padded_vocab_size - tensor.shape[0]
    if extra < 0:
        raise ValueError(f"{tensor.shape[0]} rows do not fit a padded vocabulary of "
                         f"{padded_vocab_size}")
    return torch.cat([tensor, tensor.new_zeros(extra, *tensor.shape[1:])])
