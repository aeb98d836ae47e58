"""Heads set apart from the model width (config.json's head_dim, as Qwen3's
and Gemma's): a tiny random Qwen3-MoE and Llama whose heads are 24 wide in
a 64-wide model give transformers' logits (fp32) in our model and after an
import at tp=2; an export writes back the very tensors and head_dim; a
head_dim of hidden_size / heads stays the recipe's default (null)."""
from __future__ import annotations

import json

import pytest
import torch

from megaresil.checkpoint.hf.mapping import from_hf
from megaresil.config import model_from_dict
from megaresil.model.gpt import GPT
from tests.harness.hf import llama32_style
from tests.harness.model import load_full_state
from tests.unit.test_checkpoint_hf_moe import (
    import_at_tp2_then_export,
    model_keys,
    qwen3_moe,
    relative_error,
)

transformers = pytest.importorskip("transformers")

HEAD_DIM = 24  # 4 heads of 24 in a 64-wide model: queries 96 wide, k/v (2 kv heads) 48
FAMILIES = {"qwen3_moe": qwen3_moe, "llama": llama32_style}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_equal_transformers_with_heads_apart_from_the_width(family):
    hf = FAMILIES[family](head_dim=HEAD_DIM)
    cfg = model_from_dict(model_keys(hf))
    assert cfg.head_dim == HEAD_DIM
    ours = GPT(cfg).eval()
    load_full_state(ours, cfg, from_hf(hf.state_dict(), cfg))
    weights = ours.state_dict()
    assert weights["layers.0.attn.qkv.weight"].shape == ((4 + 2 * 2) * HEAD_DIM, 64)
    assert weights["layers.0.attn.proj.weight"].shape == (64, 4 * HEAD_DIM)
    tokens = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        assert relative_error(ours.logits(tokens), hf(tokens).logits) <= 1e-5


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_import_at_tp2_then_export_writes_the_same_tensors_and_head_dim(family, tmp_path):
    import_at_tp2_then_export(FAMILIES[family](head_dim=HEAD_DIM), tmp_path)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["head_dim"] == HEAD_DIM


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_head_dim_of_width_over_heads_stays_the_default(family):
    assert model_keys(FAMILIES[family](head_dim=64 // 4))["head_dim"] is None
