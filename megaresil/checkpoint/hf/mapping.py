"""Name, layout and config mapping between megaresil and Hugging Face
`transformers`, both ways, for every flavour: the family's names and config
keys come from its spec (`model/flavours/`, `FlavourSpec.hf`); this module
adds what every family shares (the output head, token ids, the checks).

Works on full (unsharded, unpadded-vocab) tensors; the resharding path takes
it from there.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Collection, Iterator, Optional

import torch

from megaresil.checkpoint.format import CheckpointError
from megaresil.config import ConfigError, ModelConfig, RopeScalingType
from megaresil.model.flavours import FLAVOURS, architectures, by_architecture, named, spec_of_model
from megaresil.model.flavours.hf_common import Mapped, UnsupportedVariant
from megaresil.model.gpt import ties_embeddings
from megaresil.model.layers import ffn_size

# Tensors a transformers file may hold that are not weights (buffers older
# versions saved, every family's); they carry nothing to import.
NOT_WEIGHTS = tuple(suffix for spec in FLAVOURS.values() for suffix in spec.hf.not_weights)
TIED_HEAD = "lm_head.weight"  # the output head, in every family (tied or not)


def hf_mapping(cfg: ModelConfig, held: Collection[str] = ()) -> dict[str, Mapped]:
    """Each of megaresil's full, layout-free tensors, as made from a
    transformers state dict's tensors: in the Hub's names, or in the
    family's stacked spelling where `held` (the file's keys) has it."""
    hf = spec_of_model(cfg).hf
    out = hf.top_from_hf(cfg)
    if not ties_embeddings(cfg):
        out["head.weight"] = Mapped((TIED_HEAD,))
    for i in range(cfg.num_layers):
        out.update(hf.layer_from_hf(i, cfg))
        stacked = hf.stacked_layer_from_hf(i, cfg)
        if stacked and all(source in held for m in stacked.values() for source in m.sources):
            out.update(stacked)
    return out


def unused_hf_keys(held: Collection[str], cfg: ModelConfig) -> list[str]:
    """The weights of a transformers model that the mapping would not use
    (so the model is not the one the config describes), beyond buffers; a
    tied head is the caller's to compare with the embedding."""
    used = {source for m in hf_mapping(cfg, held).values() for source in m.sources}
    return sorted(key for key in held if key not in used and not key.endswith(NOT_WEIGHTS)
                  and not (key == TIED_HEAD and ties_embeddings(cfg)))


def from_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A transformers state dict (either spelling) → megaresil's full,
    layout-free state dict."""
    return {key: m.combine(*(sd[source] for source in m.sources))
            for key, m in hf_mapping(cfg, sd).items()}


def to_hf_parts(cfg: ModelConfig) -> Iterator[tuple[list[str], Callable[[dict], dict]]]:
    """to_hf a piece at a time (embeddings, norm and head, then each layer):
    (our keys it reads, function from those tensors to transformers'), so an
    export holds one piece in memory, not the model."""
    keys = sorted(hf_mapping(cfg))
    yield [k for k in keys if not k.startswith("layers.")], _top_to_hf(cfg)
    for i in range(cfg.num_layers):
        yield [k for k in keys if k.startswith(f"layers.{i}.")], _layer_to_hf(i, cfg)


def _top_to_hf(cfg: ModelConfig) -> Callable[[dict], dict]:
    def convert(ours: dict) -> dict:
        out = spec_of_model(cfg).hf.top_to_hf(ours, cfg)
        if not ties_embeddings(cfg):
            out[TIED_HEAD] = ours["head.weight"]
        return out
    return convert


def _layer_to_hf(i: int, cfg: ModelConfig) -> Callable[[dict], dict]:
    layer_to_hf = spec_of_model(cfg).hf.layer_to_hf
    return lambda ours: layer_to_hf(ours, i, cfg)


def to_hf(ours: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """megaresil's full, layout-free state dict → a transformers state dict
    (contiguous tensors, as safetensors stores them). A tied head is not
    stored: transformers ties it on load."""
    out = {}
    for _, part in to_hf_parts(cfg):
        out.update(part(ours))
    return {name: t.contiguous() for name, t in out.items()}


# --- configs ----------------------------------------------------------------------


def rope_fields(m: ModelConfig) -> dict:
    """The RoPE settings the model's rope type uses: without scaling the
    scaling block's other fields (a recipe's factor 32, say) compute nothing."""
    scaling = dataclasses.asdict(m.rope_scaling)
    if m.rope_scaling.type == RopeScalingType.none:
        scaling = {"type": scaling["type"]}
    return {"rope_theta": m.rope_theta, "rope_scaling": scaling}


def architecture(m: ModelConfig) -> dict:
    """What a model computes, beyond its tensors' shapes and keys (which a
    load checks itself), with defaults resolved."""
    return {"flavour": m.flavour.value, "norm_eps": m.norm_eps, "num_heads": m.num_heads,
            "num_kv_heads": m.num_kv_heads or m.num_heads, **rope_fields(m),
            "tied": ties_embeddings(m), "ffn_hidden_size": ffn_size(m),
            "sliding_window": m.sliding_window, **_experts(m)}


def _experts(m: ModelConfig) -> dict:
    """What the experts compute: their number alone when there are none."""
    e = m.moe
    if not e.num_experts:
        return {"moe.num_experts": 0}
    return {"moe.num_experts": e.num_experts, "moe.top_k": e.top_k,
            "moe.expert_width": e.expert_ffn_hidden_size or ffn_size(m),
            "moe.score_function": e.score_function.value,
            "moe.normalize_top_k": e.normalize_top_k,
            "moe.routed_scaling_factor": e.routed_scaling_factor,
            "moe.shared_expert_hidden_size": e.shared_expert_hidden_size,
            "moe.first_dense_layers": e.first_dense_layers,
            "moe.every_n_layers": e.every_n_layers}


def hf_refusals(cfg: ModelConfig) -> list[str]:
    """What of the model its family's transformers model cannot hold."""
    return spec_of_model(cfg).hf.refusals(cfg)


def refuse_unmapped(cfg: ModelConfig, action: str) -> None:
    """A recipe whose model its transformers family cannot hold cannot be
    started from Hugging Face weights (one line naming what)."""
    refusals = hf_refusals(cfg)
    if refusals:
        raise ConfigError("model.moe", f"{action} of a mixture of experts is not supported yet "
                          f"for flavour {cfg.flavour.value}: transformers' model does not hold "
                          f"{'; '.join(refusals)}.", "drop those settings, or start from a "
                          "megaresil checkpoint.")


def model_differences(saved: ModelConfig, ours: ModelConfig) -> list[str]:
    """One `key=saved (this recipe: ours)` per architecture setting that differs."""
    theirs, mine = architecture(saved), architecture(ours)
    return [f"{key}={theirs[key]} (this recipe: {mine.get(key)})"
            for key in theirs if theirs[key] != mine.get(key)]


class UnsupportedModel(CheckpointError):
    """A Hugging Face model that megaresil's model cannot represent."""


# A layer's number in a transformers key, in any family's layer prefix.
LAYER_INDEX = re.compile("^(?:" + "|".join(re.escape(spec.hf.layer_prefix)
                                           for spec in FLAVOURS.values()) + r")(\d+)\.")


def _held_layers(layers: list[int]) -> str:
    if not layers:
        return "no layers"
    span = f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}"
    return f"{span} ({len(layers)} in all)"


def declared_size_errors(model_keys: dict, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """What config.json declares (as config_from_hf's `model.*` keys) that
    the weights' headers contradict: the layer count against the layer
    indices present, each of the flavour's declared sizes against its
    tensor. A tensor that is missing is the key check's to name."""
    hf = named(model_keys["flavour"]).hf
    layers = sorted({int(found[1]) for key in shapes if (found := LAYER_INDEX.match(key))})
    errors, declared_layers = [], model_keys["num_layers"]
    # Compared without counting up to the declared number: it may be 10**15.
    if layers != list(range(len(layers))) or declared_layers != len(layers):
        errors.append(f"{hf.layers_key}={model_keys['num_layers']} but the weights hold "
                      f"{_held_layers(layers)}")
    for hf_key, key, tensor, dim in hf.declared_sizes:
        declared, shape = model_keys.get(key), shapes.get(tensor)
        if declared is not None and shape is not None and (len(shape) <= dim
                                                           or shape[dim] != declared):
            errors.append(f"{hf_key}={declared} but {tensor} has shape {list(shape)}")
    return errors


def config_to_hf(cfg: ModelConfig, dtype: str, bos: Optional[int] = None,
                 eos: Optional[int] = None) -> dict:
    """The config.json of the equivalent transformers model; `bos`/`eos`
    are the token ids to declare (None leaves transformers' defaults)."""
    hf = spec_of_model(cfg).hf
    tokens = {name: token for name, token in (("bos_token_id", bos), ("eos_token_id", eos))
              if token is not None}
    return {"architectures": [hf.architecture], **hf.config_to_hf(cfg), **tokens,
            "vocab_size": cfg.vocab_size, "tie_word_embeddings": ties_embeddings(cfg),
            "initializer_range": cfg.init_std,
            "dtype": dtype, "torch_dtype": dtype}  # newer transformers read dtype, older torch_dtype


def config_from_hf(hf: dict) -> tuple[dict, list[str]]:
    """A transformers config.json → megaresil's `model.*` keys (architecture,
    dropout, init scale, token ids), and one line per setting that could not
    be carried over exactly."""
    architecture = (hf.get("architectures") or [None])[0]
    spec = by_architecture(architecture)
    if spec is None:
        raise UnsupportedModel(f"config.json names architecture {architecture!r}; megaresil "
                               f"converts {architectures()}. Fix: export the model as one of "
                               "them.")
    notes: list[str] = []
    try:
        model = spec.hf.config_from_hf(hf, notes)
        model.update(vocab_size=hf["vocab_size"], init_std=hf.get("initializer_range", 0.02))
    except KeyError as err:
        raise UnsupportedModel(f"config.json has no {err.args[0]!r}, which {architecture} needs. "
                               "Fix: save the config with transformers' save_pretrained.") from None
    except UnsupportedVariant as err:
        raise UnsupportedModel(str(err)) from None
    return model, notes
