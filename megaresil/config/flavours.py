"""What a recipe may ask of each model flavour: the capabilities validation
checks (grouped-query attention, RoPE), one row per `Flavour`.

The flavour modules (`megaresil/model/flavours/`) take their traits from this
table and the model registry refuses a spec whose traits are not its row, so
what validation allows and what the model builds cannot drift apart. A new
family adds its `Flavour` member and its row here, beside its model module.
"""
from __future__ import annotations

from dataclasses import dataclass

from megaresil.config.schema import Flavour


@dataclass(frozen=True)
class FlavourTraits:
    grouped_query: bool  # num_kv_heads may be below num_heads
    rope: bool  # rotary positions, which RoPE scaling acts on


TRAITS: dict[Flavour, FlavourTraits] = {
    Flavour.gpt2: FlavourTraits(grouped_query=False, rope=False),
    Flavour.llama: FlavourTraits(grouped_query=True, rope=True),
}


def flavours_with(trait: str) -> list[str]:
    """The names of the flavours that have `trait` (a FlavourTraits field)."""
    return [flavour.value for flavour, traits in TRAITS.items() if getattr(traits, trait)]
