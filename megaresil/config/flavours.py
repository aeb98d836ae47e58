"""What a recipe may ask of each model flavour: the capabilities validation
checks (grouped-query attention, RoPE, experts, sliding windows), one row per `Flavour`.

The flavour modules (`megaresil/model/flavours/`) take their traits from this
table and the model registry refuses a spec whose traits are not its row, so
what validation allows and what the model builds cannot drift apart. A new
family adds its `Flavour` member and its row here, beside its model module.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from megaresil.config.schema import Flavour


@dataclass(frozen=True)
class FlavourTraits:
    grouped_query: bool  # num_kv_heads may be below num_heads
    rope: bool  # rotary positions, which RoPE scaling acts on
    experts: bool  # model.moe may replace its MLP by experts (SwiGLU experts)
    needs_experts: bool  # a mixture-of-experts family: model.moe.num_experts must be set
    sliding_window: bool  # model.sliding_window may be set (its transformers model has one)


TRAITS: dict[Flavour, FlavourTraits] = {
    Flavour.gpt2: FlavourTraits(grouped_query=False, rope=False, experts=False,
                                needs_experts=False, sliding_window=False),
    Flavour.llama: FlavourTraits(grouped_query=True, rope=True, experts=True, needs_experts=False,
                                 sliding_window=False),
    Flavour.mixtral: FlavourTraits(grouped_query=True, rope=True, experts=True,
                                   needs_experts=True, sliding_window=False),
    Flavour.qwen3_moe: FlavourTraits(grouped_query=True, rope=True, experts=True,
                                     needs_experts=True, sliding_window=False),
    Flavour.qwen2: FlavourTraits(grouped_query=True, rope=True, experts=False,
                                 needs_experts=False, sliding_window=True),
    Flavour.qwen3: FlavourTraits(grouped_query=True, rope=True, experts=False,
                                 needs_experts=False, sliding_window=True),
    Flavour.mistral: FlavourTraits(grouped_query=True, rope=True, experts=False,
                                   needs_experts=False, sliding_window=True),
}


@dataclass(frozen=True)
class MegatronForm:
    """How Megatron-LM's args say a flavour's model, for the flavours
    Megatron-Core's GPTModel computes as megaresil does: the only ones
    `checkpoint/megatron/` reads and writes."""
    swiglu: bool  # a SwiGLU MLP; else GELU (Megatron's exact GELU unless openai_gelu)
    normalization: str  # Megatron's name: RMSNorm or LayerNorm
    position_embedding_type: str  # rope or learned_absolute
    add_bias_linear: bool  # biases on every linear layer
    add_qkv_bias: bool = False  # biases on q, k and v alone (in a model without the others)
    qk_layernorm: bool = False  # a norm over each head's queries and keys


_LLAMA = MegatronForm(swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
                      add_bias_linear=False)
# Two flavours may share a form (qwen3 and qwen3_moe): the one whose traits
# allow experts is read when the args have them, the other otherwise.
MEGATRON: dict[Flavour, MegatronForm] = {
    Flavour.gpt2: MegatronForm(swiglu=False, normalization="LayerNorm",
                               position_embedding_type="learned_absolute", add_bias_linear=True),
    Flavour.llama: _LLAMA,
    Flavour.qwen2: replace(_LLAMA, add_qkv_bias=True),
    Flavour.qwen3: replace(_LLAMA, qk_layernorm=True),
    Flavour.qwen3_moe: replace(_LLAMA, qk_layernorm=True),
    # Llama's form: written as Llama, read back as llama (with experts or not).
    Flavour.mistral: _LLAMA,
    Flavour.mixtral: _LLAMA,
}


def flavours_with(trait: str) -> list[str]:
    """The names of the flavours that have `trait` (a FlavourTraits field)."""
    return [flavour.value for flavour, traits in TRAITS.items() if getattr(traits, trait)]
