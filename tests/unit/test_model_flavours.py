"""Model flavours as specs (megaresil/model/flavours/): the parameter order
each flavour builds, the registry's consistency, every spec's completeness
(its HF and TE maps cover the model it builds), that a new family is one
module plus its registration, and that no module outside the flavours
branches on a flavour."""
from __future__ import annotations

import dataclasses
import io
import re
import tokenize

import pytest
import torch
import torch.nn as nn

from megaresil.checkpoint.hf import mapping as hf
from megaresil.config import Flavour, ModelConfig, MoEConfig
from megaresil.config.flavours import TRAITS
from megaresil.model import te
from megaresil.model.flavours import (
    FLAVOURS,
    architectures,
    by_architecture,
    gpt2,
    llama,
    named,
    registry_problems,
    spec_of_model,
)
from megaresil.model.flavours.base import HFSpec
from megaresil.model.flavours.hf_common import Mapped
from megaresil.model.gpt import GPT, padded_vocab_size
from megaresil.model.init import materialize
from megaresil.model.mlp import SwiGLUMLP
from megaresil.observe import flops
from tests.harness.cli import ROOT


def small(flavour: str, **extra) -> ModelConfig:
    kv = {"num_kv_heads": 2} if TRAITS[Flavour(flavour)].grouped_query else {}
    if TRAITS[Flavour(flavour)].needs_experts:
        extra.setdefault("moe", MoEConfig(num_experts=4, top_k=2))
    return ModelConfig(flavour=Flavour(flavour), num_layers=2, hidden_size=64, num_heads=4,
                       vocab_size=300, **kv, **extra)


def drawn(cfg: ModelConfig) -> GPT:
    with torch.device("meta"):
        model = GPT(cfg)
    return materialize(model, cfg, 0, torch.device("cpu"))


def keys_of(model: nn.Module) -> list[str]:
    return [key for key, _ in model.named_parameters()]


# named_parameters() order decides gradient buckets, optimizer order and the
# fp64 norm sum, so a flavour's order is fixed, key by key.
GOLDEN = {
    "gpt2": ["embed.tokens.weight", "embed.positions.weight"] + [
        f"layers.{i}.{name}" for i in range(2)
        for name in ("norm1.weight", "norm1.bias", "attn.qkv.weight", "attn.qkv.bias",
                     "attn.proj.weight", "attn.proj.bias", "norm2.weight", "norm2.bias",
                     "mlp.fc.weight", "mlp.fc.bias", "mlp.proj.weight", "mlp.proj.bias")
    ] + ["norm.weight", "norm.bias"],
    "llama": ["embed.tokens.weight"] + [
        f"layers.{i}.{name}" for i in range(2)
        for name in ("norm1.weight", "attn.qkv.weight", "attn.proj.weight", "norm2.weight",
                     "mlp.gate.weight", "mlp.up.weight", "mlp.down.weight")
    ] + ["norm.weight", "head.weight"],
    "mixtral": ["embed.tokens.weight"] + [
        f"layers.{i}.{name}" for i in range(2)
        for name in ("norm1.weight", "attn.qkv.weight", "attn.proj.weight", "norm2.weight",
                     "mlp.router.weight", "mlp.experts.gate", "mlp.experts.up",
                     "mlp.experts.down")
    ] + ["norm.weight", "head.weight"],
    "qwen3_moe": ["embed.tokens.weight"] + [
        f"layers.{i}.{name}" for i in range(2)
        for name in ("norm1.weight", "attn.qkv.weight", "attn.proj.weight",
                     "attn.q_norm.weight", "attn.k_norm.weight", "norm2.weight",
                     "mlp.router.weight", "mlp.experts.gate", "mlp.experts.up",
                     "mlp.experts.down")
    ] + ["norm.weight", "head.weight"],
    "qwen2": ["embed.tokens.weight"] + [
        f"layers.{i}.{name}" for i in range(2)
        for name in ("norm1.weight", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
                     "norm2.weight", "mlp.gate.weight", "mlp.up.weight", "mlp.down.weight")
    ] + ["norm.weight", "head.weight"],
    "qwen3": ["embed.tokens.weight"] + [
        f"layers.{i}.{name}" for i in range(2)
        for name in ("norm1.weight", "attn.qkv.weight", "attn.proj.weight",
                     "attn.q_norm.weight", "attn.k_norm.weight", "norm2.weight",
                     "mlp.gate.weight", "mlp.up.weight", "mlp.down.weight")
    ] + ["norm.weight", "head.weight"],
}
GOLDEN["mistral"] = GOLDEN["llama"]  # its window is a mask, not a parameter


@pytest.mark.parametrize("flavour", sorted(GOLDEN))
def test_each_flavour_builds_its_parameters_in_the_golden_order(flavour):
    with torch.device("meta"):
        assert keys_of(GPT(small(flavour))) == GOLDEN[flavour]


def test_the_registry_holds_every_flavour_consistently():
    assert set(FLAVOURS) == set(Flavour) == set(TRAITS)
    assert registry_problems(FLAVOURS) == []
    for flavour, spec in FLAVOURS.items():
        assert named(flavour.value) is spec is spec_of_model(small(flavour.value))
        assert by_architecture(spec.hf.architecture) is spec
    assert by_architecture("BertModel") is None
    assert architectures() == ["GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM",
                               "MixtralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                               "Qwen3MoeForCausalLM"]


def test_the_registry_names_what_is_inconsistent():
    swapped = {Flavour.gpt2: llama.SPEC, Flavour.llama: gpt2.SPEC}
    problems = registry_problems(swapped)
    assert "gpt2's spec is llama's" in problems and "llama's spec is gpt2's" in problems
    assert "gpt2's traits are not config/flavours.py's" in problems
    assert registry_problems({Flavour.gpt2: gpt2.SPEC}) == [
        "llama has no spec", "mixtral has no spec", "qwen3_moe has no spec",
        "qwen2 has no spec", "qwen3 has no spec", "mistral has no spec"]


@pytest.mark.parametrize("flavour", sorted(GOLDEN))
@pytest.mark.parametrize("tied", [False, True])
def test_each_spec_maps_every_parameter_to_hugging_face_and_back(flavour, tied):
    cfg = small(flavour, tie_embeddings=tied)
    ours = drawn(cfg).state_dict()
    mapping = hf.hf_mapping(cfg)
    assert set(mapping) == set(ours)
    theirs = hf.to_hf(ours, cfg)
    assert {source for m in mapping.values() for source in m.sources} == set(theirs)
    assert ("lm_head.weight" in theirs) == (not tied)
    back = hf.from_hf(theirs, cfg)
    assert all(torch.equal(back[key], ours[key]) for key in ours)
    config, notes = hf.config_from_hf(hf.config_to_hf(cfg, "float32"))
    assert config["flavour"] == flavour and not notes


@pytest.mark.parametrize("flavour", sorted(GOLDEN))
def test_each_specs_te_names_rename_only_keys_its_model_has(flavour):
    keys = {key.split(".", 2)[2] for key in GOLDEN[flavour] if key.startswith("layers.")}
    spec = named(flavour)
    assert {local for local, _ in spec.te_names} <= keys
    assert te._BLOCK_NAMES[flavour] == spec.te_names


# --- a third family: one module's worth of spec, registered, nothing generic touched --------


def _toy_mlp(cfg: ModelConfig, tp, index: int) -> nn.Module:
    return SwiGLUMLP(cfg, tp, ffn=spec_of_model(cfg).ffn_size(cfg))


def _renamed(ours: str, theirs: str, keys: list[str]) -> dict[str, Mapped]:
    return {ours + key: Mapped((theirs + key,)) for key in keys}


_TOY_LAYER = ["norm1.weight", "attn.qkv.weight", "attn.proj.weight", "norm2.weight",
              "mlp.gate.weight", "mlp.up.weight", "mlp.down.weight"]
_TOY_TOP = ["embed.tokens.weight", "embed.positions.weight", "norm.weight"]


def _picked(ours: dict, prefix: str, theirs: str, keys: list[str]) -> dict:
    return {theirs + key: ours[prefix + key] for key in keys}


def _toy_hf() -> HFSpec:
    return HFSpec(
        architecture="ToyForCausalLM", layers_key="n_blocks", layer_prefix="toy.blocks.",
        not_weights=(), declared_sizes=(),
        top_from_hf=lambda cfg: _renamed("", "toy.", _TOY_TOP),
        layer_from_hf=lambda i, cfg: _renamed(f"layers.{i}.", f"toy.blocks.{i}.", _TOY_LAYER),
        top_to_hf=lambda ours, cfg: _picked(ours, "", "toy.", _TOY_TOP),
        layer_to_hf=lambda ours, i, cfg: _picked(ours, f"layers.{i}.", f"toy.blocks.{i}.",
                                                 _TOY_LAYER),
        config_to_hf=lambda cfg: {"model_type": "toy", "n_blocks": cfg.num_layers},
        config_from_hf=lambda config, notes: {"flavour": "gpt2",
                                              "num_layers": config["n_blocks"]})


def toy_spec():
    """Learned positions with RMSNorm, a SwiGLU MLP 3h wide, no biases, a tied
    head, its own HF names: a family neither gpt2 nor llama is. Filed under
    gpt2 (the Flavour enum is closed), with gpt2's traits."""
    return dataclasses.replace(
        gpt2.SPEC, make_norm=llama.SPEC.make_norm, make_mlp=_toy_mlp,
        default_ffn=lambda hidden: 3 * hidden, linear_biases=False, mlp_matrices=3,
        te_norm="RMSNorm", te_mlp="swiglu", te_names=llama.SPEC.te_names, hf=_toy_hf())


def test_a_new_family_is_its_spec_and_a_registration(monkeypatch):
    monkeypatch.setitem(FLAVOURS, Flavour.gpt2, toy_spec())
    assert registry_problems(FLAVOURS) == []
    cfg = small("gpt2")
    model = drawn(cfg)
    block = model.layers["0"]
    assert isinstance(block.norm1, nn.RMSNorm) and isinstance(block.mlp, SwiGLUMLP)
    assert block.mlp.gate.weight.shape == (3 * 64, 64) and block.attn.qkv.bias is None
    assert block.attn.rope is None and model.embed.positions is not None and model.tied
    ours = model.state_dict()
    assert keys_of(model) == _TOY_TOP[:2] + [f"layers.{i}.{key}" for i in range(2)
                                             for key in _TOY_LAYER] + ["norm.weight"]
    theirs = hf.to_hf(ours, cfg)
    assert sorted(theirs) == sorted(m.sources[0] for m in hf.hf_mapping(cfg).values())
    assert all(key.startswith("toy.") for key in theirs)
    back = hf.from_hf(theirs, cfg)
    assert all(torch.equal(back[key], ours[key]) for key in ours)
    config = hf.config_to_hf(cfg, "float32")
    assert config["architectures"] == ["ToyForCausalLM"] and config["n_blocks"] == 2
    assert hf.config_from_hf(config)[0]["num_layers"] == 2
    c = 64
    attention = c * 3 * c + c * c
    assert flops.matmul_parameters(cfg) == (2 * (attention + 3 * c * 3 * c)
                                            + c * padded_vocab_size(cfg, 1))


def test_flops_count_the_attention_weights_a_head_dim_gives():
    """4 heads of 24 in a 64-wide model: the model's q/k/v/o weights are
    what the FLOPs count, and the score products span 4 * 24 features."""
    narrow, wide = small("llama"), small("llama", head_dim=24)

    def attention_weights(cfg: ModelConfig) -> int:
        attn = drawn(cfg).layers["0"].attn
        return attn.qkv.weight.numel() + attn.proj.weight.numel()

    grown = attention_weights(wide) - attention_weights(narrow)
    assert grown == 64 * (4 + 2 * 2) * 8 + 4 * 8 * 64
    assert flops.matmul_parameters(wide) - flops.matmul_parameters(narrow) == 2 * grown
    T = 32
    assert (flops.flops_per_token(wide, T) - flops.flops_per_token(narrow, T)
            == 6 * 2 * grown + 12 * 2 * T * 4 * 8)


# --- no flavour branch outside the flavours -----------------------------------------------

PACKAGE = ROOT / "megaresil"
# The flavours themselves: the model specs and the config's traits table.
FLAVOUR_HOMES = ("megaresil/model/flavours/", "megaresil/config/flavours.py")
# In code (comments and strings blanked): a flavour named, a flavour
# compared, or a flavour told by its modules' types.
BRANCH = re.compile(r"\bFlavour\.[a-z]\w*"
                    r"|\bflavour\b\S*\s*(==|!=|\bis\b|\bin\b)"
                    r"|isinstance\([^)]*\b(LayerNorm|RMSNorm|GeluMLP|SwiGLUMLP)\b")
# ... or a string that is a flavour's name.
FLAVOUR_NAMES = {flavour.value for flavour in Flavour}
# Lines that name a flavour without branching on it.
NOT_BRANCHES = {
    "megaresil/config/schema.py": re.compile(r'^\s+(\w+) = "\1"$'  # the enum
                                             r"|flavour: Flavour = doc\(Flavour\.gpt2,"),
    # The tokenizer called gpt2 (GPT-2's BPE), not the model flavour.
    "megaresil/data/tokenizer.py": re.compile(r'"gpt2"'),
    "megaresil/data/provenance.py": re.compile(r'"gpt2"'),
}


def branch_lines(source: str) -> set[int]:
    """The numbers of the lines that name or test a flavour (see BRANCH)."""
    lines = source.splitlines()
    named = set()
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type not in (tokenize.COMMENT, tokenize.STRING):
                continue
            if token.type == tokenize.STRING and token.string[1:-1] in FLAVOUR_NAMES:
                named.add(token.start[0])
            (row, col), (end_row, end_col) = token.start, token.end
            for number in range(row, end_row + 1):  # blanked over every line it spans
                line = lines[number - 1]
                start = col if number == row else 0
                end = end_col if number == end_row else len(line)
                lines[number - 1] = line[:start] + " " * (end - start) + line[end:]
    except tokenize.TokenError:  # a fragment (the tests below): what was read is checked
        pass
    return named | {number for number, line in enumerate(lines, 1) if BRANCH.search(line)}


def flavour_branches(path: str, source: str) -> list[str]:
    allowed = NOT_BRANCHES.get(path)
    lines = source.splitlines()
    return [f"{path}:{number}: {lines[number - 1].strip()}"
            for number in sorted(branch_lines(source))
            if not (allowed and allowed.search(lines[number - 1]))]


@pytest.mark.parametrize("line", [
    "    if cfg.flavour == Flavour.gpt2:",
    "    mlp = (3 if cfg.flavour == Flavour.llama else 2) * c * ffn_size(cfg)",
    '    "gpt2": (("norm1.weight", "attn.qkv.layer_norm_weight"),',
    '    return "LayerNorm" if isinstance(norm, nn.LayerNorm) else "RMSNorm"',
    "    fused = FusedGeluMLP if isinstance(block.mlp, GeluMLP) else FusedSwiGLUMLP",
    "    if model_keys['flavour'] in ('gpt2',):",
])
def test_the_branch_pattern_sees_the_branches_flavours_used_to_be(line):
    assert flavour_branches("megaresil/x.py", line)


def test_the_branch_pattern_passes_generic_code():
    generic = ('    return {"flavour": m.flavour.value, "norm_eps": m.norm_eps}\n'
               "    hf = named(model_keys['flavour']).hf  # 'gpt2' if flavour == Flavour.gpt2\n"
               "    '''The tokenizer 'gpt2', as if flavour == Flavour.gpt2.'''\n"
               "_BLOCK_NAMES = {flavour.value: spec.te_names for flavour, spec in F.items()}\n")
    assert flavour_branches("megaresil/x.py", generic) == []


def test_no_module_outside_the_flavours_branches_on_a_flavour():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = str(path.relative_to(ROOT))
        if not relative.startswith(FLAVOUR_HOMES):
            found += flavour_branches(relative, path.read_text())
    assert not found, ("a flavour's choice belongs in its spec (megaresil/model/flavours/):\n"
                       + "\n".join(found))


def test_the_scan_would_see_the_flavours_own_modules():
    """Only their exclusion lets them name flavours: the pattern is not blind."""
    for home in ("megaresil/model/flavours/gpt2.py", "megaresil/config/flavours.py"):
        assert flavour_branches(home, (ROOT / home).read_text())


def test_every_flavour_module_is_registered():
    modules = {p.stem for p in (PACKAGE / "model/flavours").glob("*.py")}
    assert modules - {"__init__", "base", "hf_common"} == {f.value for f in FLAVOURS}

