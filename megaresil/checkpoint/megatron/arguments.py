"""Megatron-LM's `args` (the argparse.Namespace its save_checkpoint stores in
the common state) as megaresil's `model.*` keys and tokenizer, for the
flavours both compute alike (their forms: `config.flavours.MEGATRON`), with
experts where the flavour takes them (moe_* args). A setting megaresil's
model cannot compute is refused in one line; one it computes a little
differently is carried with a note."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Optional

from megaresil.checkpoint.format import CheckpointError
from megaresil.config import Flavour
from megaresil.config.flavours import MEGATRON, TRAITS, MegatronForm
from megaresil.data.tokenizer import GPT2_BPE

# Mcore's Llama 3 RoPE scaling (use_rope_scaling) takes the factor alone; these are fixed.
MCORE_ROPE_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_seq_len": 8192}


class UnsupportedMegatron(CheckpointError):
    """A Megatron model that megaresil's model cannot represent."""


def _get(args: argparse.Namespace, name: str, default: Any = None) -> Any:
    value = getattr(args, name, default)
    return default if value is None else value


def _form(form: MegatronForm) -> str:
    return (f"{form.normalization}, {'swiglu' if form.swiglu else 'GELU'}, "
            f"{form.position_embedding_type}" + (", qkv bias" if form.add_qkv_bias else "")
            + (", qk_layernorm" if form.qk_layernorm else ""))


def _flavour(args: argparse.Namespace) -> Flavour:
    """The flavour whose Megatron form the args say (of two with one form,
    the one that takes experts when the args have them)."""
    biases = bool(_get(args, "add_bias_linear", True))
    said = MegatronForm(swiglu=bool(_get(args, "swiglu", False)),
                        normalization=_get(args, "normalization", "LayerNorm"),
                        position_embedding_type=_get(args, "position_embedding_type",
                                                     "learned_absolute"),
                        add_bias_linear=False,
                        add_qkv_bias=bool(_get(args, "add_qkv_bias", False)) and not biases,
                        qk_layernorm=bool(_get(args, "qk_layernorm", False)))
    matching = [f for f, form in MEGATRON.items() if _form(form) == _form(said)]
    experts = bool(_get(args, "num_experts"))
    for candidate in matching:
        if TRAITS[candidate].experts >= experts and TRAITS[candidate].needs_experts <= experts:
            return candidate
    if matching:
        return matching[0]
    known = "; ".join(f"{f.value} ({_form(form)})" for f, form in MEGATRON.items())
    raise UnsupportedMegatron(
        f"args say {_form(said)}; megaresil reads these models from Megatron: {known}. Fix: "
        "convert it through Hugging Face, or give --recipe with a model megaresil has.")


def _refusals(args: argparse.Namespace, flavour: Flavour) -> list[str]:
    form = MEGATRON[flavour]
    biases = bool(_get(args, "add_bias_linear", True))
    checks = [
        (_get(args, "num_experts") and not TRAITS[flavour].experts,
         f"experts in a {flavour.value} model"),
        (_get(args, "moe_shared_expert_gate", False), "moe_shared_expert_gate"),
        (_get(args, "moe_router_num_groups"), "moe_router_num_groups (group-limited routing)"),
        (_get(args, "moe_router_load_balancing_type", "aux_loss") not in ("aux_loss", "none"),
         f"moe_router_load_balancing_type={_get(args, 'moe_router_load_balancing_type')}"),
        (_get(args, "rotary_percent", 1.0) != 1.0, f"rotary_percent={args.rotary_percent}"),
        (biases != form.add_bias_linear,
         f"add_bias_linear={biases} in a {flavour.value} model, whose Megatron form has "
         f"{form.add_bias_linear}"),
        (_get(args, "window_size") is not None, f"window_size={_get(args, 'window_size')} "
         "(a sliding window: not read from Megatron yet)"),
    ]
    return [what for failed, what in checks if failed]


def model_keys(args: argparse.Namespace, notes: list[str]) -> dict:
    """megaresil's model.* keys from Megatron-LM's args; `notes` gets a line
    per setting carried over inexactly."""
    flavour = _flavour(args)
    traits, form = TRAITS[flavour], MEGATRON[flavour]
    refused = _refusals(args, flavour)
    if refused:
        raise UnsupportedMegatron(f"args set {'; '.join(refused)}, which megaresil's "
                                  f"{flavour.value} model does not compute. Fix: convert a "
                                  "model without them.")
    try:
        hidden, heads = int(args.hidden_size), int(args.num_attention_heads)
        keys = {"flavour": flavour.value, "num_layers": int(args.num_layers), "hidden_size": hidden,
                "num_heads": heads, "ffn_hidden_size": _get(args, "ffn_hidden_size"),
                "max_seq_len": int(args.max_position_embeddings)}
        vocab = _get(args, "vocab_size") or int(args.padded_vocab_size)
    except (AttributeError, TypeError, ValueError) as err:
        raise UnsupportedMegatron(f"args lack a model size ({err}). Fix: give --recipe with "
                                  "the model.") from None
    head_dim = _get(args, "kv_channels", hidden // heads)
    groups = _get(args, "num_query_groups", heads) if _get(args, "group_query_attention") else heads
    if _get(args, "vocab_size") is None:
        notes.append(f"args hold no vocab_size: all {vocab} rows of the padded vocabulary are "
                     "kept (give --set model.vocab_size=N to cut Megatron's padding)")
    if not form.swiglu and not _get(args, "openai_gelu", False):
        notes.append("Megatron's GELU is exact (erf) without --openai-gelu; megaresil's gpt2 "
                     "uses the tanh approximation (logits differ by about 1e-3)")
    keys.update(
        num_kv_heads=groups if traits.grouped_query else None,
        head_dim=None if head_dim == hidden // heads else head_dim,
        norm_eps=float(_get(args, "norm_epsilon", _get(args, "layernorm_epsilon", 1e-5))),
        tie_embeddings=not _get(args, "untie_embeddings_and_output_weights", False),
        vocab_size=int(vocab),
        make_vocab_size_divisible_by=int(_get(args, "make_vocab_size_divisible_by", 128)),
        init_std=float(_get(args, "init_method_std", 0.02)),
        dropout=float(_get(args, "hidden_dropout", 0.0)),
        attention_dropout=float(_get(args, "attention_dropout", 0.0)))
    if traits.rope:
        keys["rope_theta"] = float(_get(args, "rotary_base", 10000))
    if traits.rope and _get(args, "use_rope_scaling", False):
        keys["rope_scaling"] = {"type": "llama3", **MCORE_ROPE_SCALING,
                                "factor": float(_get(args, "rope_scaling_factor", 8.0))}
    if _get(args, "num_experts"):
        keys["moe"] = _experts(args, keys["num_layers"])
        keys["flavour"] = _family_of_experts(keys, flavour).value
    return keys


def _family_of_experts(keys: dict, flavour: Flavour) -> Flavour:
    """Of the mixture-of-experts flavours with `flavour`'s Megatron form, the
    first whose Hugging Face family holds the model (a Mixtral-shaped
    mixture reads back as mixtral, so `--to-hf` writes it); else `flavour`,
    which computes the same."""
    from megaresil.config.loading import model_from_dict
    from megaresil.model.flavours import named

    for candidate, form in MEGATRON.items():
        if form == MEGATRON[flavour] and TRAITS[candidate].needs_experts:
            model = model_from_dict({**keys, "flavour": candidate.value})
            if not named(candidate.value).hf.refusals(model):
                return candidate
    return flavour


def _expert_layers(args: argparse.Namespace, layers: int) -> list[int]:
    """moe_layer_freq as a 0/1 per layer (an int n: every n-th layer)."""
    freq = _get(args, "moe_layer_freq", 1)
    if isinstance(freq, int):
        return [int(i % freq == 0) for i in range(layers)]
    if isinstance(freq, list) and len(freq) == layers:
        return [int(bool(x)) for x in freq]
    raise UnsupportedMegatron(f"args set moe_layer_freq={freq!r}, which is neither an int nor "
                              f"a list over the {layers} layers. Fix: give --recipe with the "
                              "model.")


def _experts(args: argparse.Namespace, layers: int) -> dict:
    """model.moe.* from Megatron-LM's moe_* args: its experts from
    first_dense_layers on, every every_n_layers-th, as megaresil places them."""
    pattern = _expert_layers(args, layers)
    first = pattern.index(1) if 1 in pattern else layers
    later = [i for i in range(first + 1, layers) if pattern[i]]
    every = later[0] - first if later else 1
    if pattern != [int(i >= first and (i - first) % every == 0) for i in range(layers)]:
        raise UnsupportedMegatron(f"args place experts in layers {pattern}; megaresil places "
                                  "them from a first layer on, every n-th. Fix: convert a model "
                                  "whose expert layers are so placed.")
    balancing = _get(args, "moe_router_load_balancing_type", "aux_loss") == "aux_loss"
    return {"num_experts": int(args.num_experts), "top_k": int(_get(args, "moe_router_topk", 2)),
            "expert_ffn_hidden_size": _get(args, "moe_ffn_hidden_size"),
            "shared_expert_hidden_size": int(_get(args, "moe_shared_expert_intermediate_size", 0)),
            "first_dense_layers": first, "every_n_layers": every,
            "score_function": _get(args, "moe_router_score_function", "softmax"),
            # Mcore's pre-softmax: over all experts, then top-k; otherwise over the k chosen.
            "normalize_top_k": not _get(args, "moe_router_pre_softmax", False),
            "routed_scaling_factor": float(_get(args, "moe_router_topk_scaling_factor", 1.0)),
            "aux_loss_coeff": float(_get(args, "moe_aux_loss_coeff", 0.0)) if balancing else 0.0,
            "z_loss_coeff": float(_get(args, "moe_z_loss_coeff", 0.0)),
            "capacity_factor": _get(args, "moe_expert_capacity_factor"),
            # Aux-loss-free balancing: Mcore's update is megaresil's, rate * sign(mean - load).
            "bias_update_rate": (float(_get(args, "moe_router_bias_update_rate", 1e-3))
                                 if _get(args, "moe_router_enable_expert_bias", False) else 0.0)}


def tokenizer_of(args: Optional[argparse.Namespace], notes: list[str]) -> Optional[str]:
    """megaresil's data.tokenizer for Megatron-LM's tokenizer_type and
    tokenizer_model, when it has one (a local Hugging Face directory, GPT-2's
    BPE); else None, with a note unless the run had none."""
    kind = _get(args, "tokenizer_type") if args is not None else None
    model = _get(args, "tokenizer_model") if args is not None else None
    if kind == "HuggingFaceTokenizer" and model and Path(str(model)).is_dir():
        return str(model)
    if kind == "GPT2BPETokenizer":
        return GPT2_BPE
    if kind not in (None, "NullTokenizer"):
        notes.append(f"tokenizer {kind} ({model}) is not carried over; give --tokenizer SPEC")
    return None
