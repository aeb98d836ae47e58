"""The model families, one module each (`gpt2.py`, `llama.py`, `mixtral.py`,
`qwen3_moe.py`, `qwen2.py`, `qwen3.py`, `mistral.py`), registered
here by their `Flavour`. A new family is its module, a row in FLAVOURS, and
its `Flavour` member with its traits (`megaresil/config/flavours.py`);
nothing generic changes. The registry refuses, at import, a spec filed
under another flavour or with traits other than the config's row."""
from __future__ import annotations

from typing import Optional

from megaresil.config import Flavour, ModelConfig
from megaresil.config.flavours import TRAITS
from megaresil.model.flavours import gpt2, llama, mistral, mixtral, qwen2, qwen3, qwen3_moe
from megaresil.model.flavours.base import FlavourSpec

FLAVOURS: dict[Flavour, FlavourSpec] = {Flavour.gpt2: gpt2.SPEC, Flavour.llama: llama.SPEC,
                                        Flavour.mixtral: mixtral.SPEC,
                                        Flavour.qwen3_moe: qwen3_moe.SPEC,
                                        Flavour.qwen2: qwen2.SPEC, Flavour.qwen3: qwen3.SPEC,
                                        Flavour.mistral: mistral.SPEC}


def registry_problems(flavours: dict[Flavour, FlavourSpec]) -> list[str]:
    """What is inconsistent in a registry: a flavour without a spec or traits,
    a spec under another flavour's name, traits that are not the config's."""
    problems = [f"{f.value} has no spec" for f in Flavour if f not in flavours]
    problems += [f"{f.value} has no traits in config/flavours.py" for f in Flavour
                 if f not in TRAITS]
    for flavour, spec in flavours.items():
        if spec.flavour != flavour:
            problems.append(f"{flavour.value}'s spec is {spec.flavour.value}'s")
        if spec.traits is not TRAITS.get(flavour):
            problems.append(f"{flavour.value}'s traits are not config/flavours.py's")
    architectures = [spec.hf.architecture for spec in flavours.values()]
    if len(set(architectures)) != len(architectures):
        problems.append(f"two flavours convert one architecture: {architectures}")
    return problems


def _check_registry() -> None:
    problems = registry_problems(FLAVOURS)
    if problems:
        raise RuntimeError("model flavour registry: " + "; ".join(problems))


_check_registry()


def spec_of_model(cfg: ModelConfig) -> FlavourSpec:
    return FLAVOURS[Flavour(cfg.flavour)]


def named(name: str) -> FlavourSpec:
    """The spec of the flavour called `name` (a Flavour value)."""
    return FLAVOURS[Flavour(name)]


def by_architecture(architecture: Optional[str]) -> Optional[FlavourSpec]:
    """The spec converting transformers' `architecture`, None if none does."""
    return next((spec for spec in FLAVOURS.values()
                 if spec.hf.architecture == architecture), None)


def architectures() -> list[str]:
    return sorted(spec.hf.architecture for spec in FLAVOURS.values())
