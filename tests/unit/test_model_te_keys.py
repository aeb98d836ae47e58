"""model.backend=te's CPU-checkable logic: the name map between TE's fused
modules and the local backend's checkpoint keys, and which layouts the config
lets te run. (TE itself runs under `pytest -m gpu`: tests/gpu/test_model_te.py.)"""
from __future__ import annotations

import pytest
import torch

from tests.harness.dist import RECIPE, TINY
from megaresil.config import ModelConfig, load_recipe
from megaresil.model import te
from megaresil.model.gpt import GPT

# Parameters the fused modules absorb: their names must change.
FUSED = {"gpt2": ("norm1.", "norm2.", "mlp.fc.", "mlp.proj."),
         "llama": ("norm1.", "norm2.", "mlp.gate.", "mlp.up.")}


def local_keys(flavour: str) -> list[str]:
    extra = {"flavour": "llama", "num_kv_heads": 2} if flavour == "llama" else {}
    cfg = ModelConfig(num_layers=3, hidden_size=64, num_heads=4, vocab_size=300, **extra)
    with torch.device("meta"):
        return [k for k, _ in GPT(cfg).named_parameters()]


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_key_map_covers_every_local_key_once_and_round_trips(flavour):
    keys = local_keys(flavour)
    names = [te.te_key(k, flavour) for k in keys]
    assert len(set(names)) == len(keys)  # one TE name per local key, none shared
    assert [te.local_key(n, flavour) for n in names] == keys
    for key, name in zip(keys, names):
        block_part = key.split(".", 2)[2] if key.startswith("layers.") else ""
        absorbed = block_part.startswith(FUSED[flavour])
        assert (name != key) == absorbed, (key, name)
    # Every rule is used by a real key: no stale entry in the map.
    used = {n.split(".", 2)[2] for n, k in zip(names, keys) if n != k}
    assert used == {fused for _, fused in te._BLOCK_NAMES[flavour]}


def test_key_map_leaves_non_block_keys_and_other_flavours_names_alone():
    assert te.te_key("norm.weight", "gpt2") == "norm.weight"  # the final norm is unfused
    assert te.local_key("embed.tokens.weight", "llama") == "embed.tokens.weight"
    assert te.te_key("layers.0.mlp.down.weight", "llama") == "layers.0.mlp.down.weight"


def test_config_lets_te_run_tensor_and_sequence_parallel():
    for sp in ("false", "true"):
        cfg = load_recipe(RECIPE, TINY + ["model.backend=te", "parallel.tp=2",
                                          f"parallel.sequence_parallel={sp}"])
        assert cfg.parallel.sequence_parallel == (sp == "true")
