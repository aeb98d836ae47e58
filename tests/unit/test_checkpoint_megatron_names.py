"""The key table and tensor transforms between megaresil and Megatron-Core
(checkpoint/megatron/names.py), on full tensors; the table against the keys
Megatron-Core itself writes is in tests/multirank/test_checkpoint_megatron.py."""
from __future__ import annotations

import pytest
import torch

from megaresil.checkpoint.megatron import names
from megaresil.config import load_recipe
from megaresil.model.gpt import layout_free_shapes
from tests.harness.mcore import FLAVOURS, RECIPE, TINY


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_every_key_of_a_model_has_a_row(flavour):
    keys = set(layout_free_shapes(load_recipe(RECIPE, TINY + FLAVOURS[flavour]).model))
    top, layer = names.names_of(keys)
    named = {n.ours for n in top} | {f"layers.{i}.{n.ours}" for i in range(2) for n in layer}
    assert keys <= named  # a dense layer among expert layers has fewer


def test_swiglu_fc1_round_trip():
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    fc1 = names.swiglu_fc1(gate, up)
    assert torch.equal(fc1[:6], gate) and torch.equal(fc1[6:], up)  # [gate; up]
    again = names.swiglu_halves(fc1)
    assert torch.equal(again[0], gate) and torch.equal(again[1], up)
    experts = names.swiglu_fc1(gate.expand(3, 6, 4), up.expand(3, 6, 4), experts=True)
    assert experts.shape == (3, 12, 4) and torch.equal(experts[1, 6:], up)
    assert torch.equal(names.swiglu_halves(experts, experts=True)[0][2], gate)


def test_vocabulary_padding_round_trip():
    embedding = torch.randn(300, 8)
    wide = names.padded(embedding, 384)
    assert wide.shape == (384, 8) and not wide[300:].any()
    assert torch.equal(names.unpadded(wide, 300), embedding)
    with pytest.raises(ValueError, match="do not fit"):
        names.padded(embedding, 256)
    with pytest.raises(ValueError, match="hold no vocabulary"):
        names.unpadded(embedding, 301)


def test_keys_stacked_per_layer_and_extra_state():
    assert names.stacked("mlp.linear_fc2.weight") == "decoder.layers.mlp.linear_fc2.weight"
    assert names.per_layer_index(names.per_layer(11, "mlp.linear_fc2.weight")) == 11
    assert names.per_layer_index(names.stacked("mlp.linear_fc2.weight")) is None
    assert names.is_extra_state("decoder.layers.mlp.linear_fc1._extra_state/shard_0_2")
