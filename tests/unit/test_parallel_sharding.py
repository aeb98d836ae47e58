"""`ShardSpec` (parallel/sharding.py): its arithmetic, that every parameter
gets one where it is made, and that nothing reads the per-parameter marks it
replaced."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from megaresil.config import Flavour, ModelConfig
from megaresil.model import init
from megaresil.model.gpt import GPT
from megaresil.parallel import sharding
from megaresil.parallel.sharding import EMBEDDING_TIE, AxisShard, ShardSpec, set_spec, spec_of
from megaresil.parallel.tensor_parallel import TPGroup

ROOT = Path(__file__).resolve().parents[2]
MARKS = {"tp_dim", "tp_size", "tp_rank", "pipeline_copy", "main_shard", "sequence_parallel",
         "tied_across_pipeline"}


def two_axis_spec(tp_rank: int, ep_rank: int) -> ShardSpec:
    return ShardSpec(shards=(AxisShard(1, "ep", 3, ep_rank), AxisShard(0, "tp", 2, tp_rank)))


def test_offset_and_global_shape_cover_every_shard():
    spec = two_axis_spec(tp_rank=1, ep_rank=2)
    local = torch.Size([4, 5])
    assert spec.global_shape(local) == torch.Size([8, 15])
    assert spec.offset(local) == (4, 10)
    assert spec.unit_dim == 1
    assert ShardSpec().unit_dim == 0 and ShardSpec().offset(local) == (0, 0)


def test_two_shards_of_one_dim_nest_outermost_first():
    spec = ShardSpec(shards=(AxisShard(0, "ep", 2, 1), AxisShard(0, "tp", 3, 2)))
    assert spec.global_shape(torch.Size([2, 7])) == torch.Size([12, 7])
    assert spec.offset(torch.Size([2, 7])) == (10, 0)  # block 1 * 3 + 2


def test_counted_once_along_the_model_axes_and_never_as_a_pipeline_copy():
    at = {"tp": 1, "dp": 1}.__getitem__
    sharded = ShardSpec(shards=(AxisShard(0, "tp", 2, 1),))
    assert sharded.counted_on(at, ("tp",))
    assert not ShardSpec().counted_on(at, ("tp",))
    assert ShardSpec().counted_on({"tp": 0}.__getitem__, ("tp",))
    assert not ShardSpec(pipeline_copy=True).counted_on({"tp": 0}.__getitem__, ("tp",))


def test_a_parameter_without_a_spec_is_named_and_a_spec_survives_replacement():
    bare = torch.nn.Parameter(torch.zeros(3, 2))
    with pytest.raises(ValueError, match="no ShardSpec"):
        spec_of(bare)
    set_spec(bare, ShardSpec())
    sharding.with_spec(bare, tie=EMBEDDING_TIE)
    new = torch.nn.Parameter(torch.ones(3, 2))
    sharding.carry_spec(bare, new)
    assert spec_of(new) == ShardSpec(tie=EMBEDDING_TIE)


def test_a_two_axis_shard_draws_its_block_of_the_whole_tensor(monkeypatch):
    """Init is layout-free with two cut dims too: six ranks' blocks put
    together are the tensor one rank draws whole."""
    monkeypatch.setattr(init, "UNITS_PER_DRAW", 3)
    cfg = ModelConfig(num_layers=1, hidden_size=8, num_heads=2, vocab_size=64, max_seq_len=8)
    whole = set_spec(torch.nn.Parameter(torch.empty(8, 15)),
                     ShardSpec(shards=(AxisShard(1, "ep", 1, 0), AxisShard(0, "tp", 1, 0))))
    init.draw_normal(whole, "w", cfg, seed=3)
    for tp_rank in range(2):
        for ep_rank in range(3):
            block = set_spec(torch.nn.Parameter(torch.empty(4, 5)),
                             two_axis_spec(tp_rank, ep_rank))
            init.draw_normal(block, "w", cfg, seed=3)
            rows, cols = 4 * tp_rank, 5 * ep_rank
            assert torch.equal(block, whole[rows:rows + 4, cols:cols + 5])


@pytest.mark.parametrize("flavour", list(Flavour))
@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True)])
def test_every_parameter_gets_a_spec_where_it_is_made(flavour, tp, sp):
    cfg = ModelConfig(flavour=flavour, num_layers=2, hidden_size=32, num_heads=4,
                      vocab_size=100, max_seq_len=16)
    with torch.device("meta"):
        model = GPT(cfg, tp=TPGroup(size=tp, rank=tp - 1, sequence_parallel=sp))
    for key, param in model.named_parameters():
        spec = spec_of(param)
        assert all(s.axis == "tp" and s.size == tp for s in spec.shards), key
        # Replicated params sum their grads over tp exactly under SP, and a
        # per-head q/k norm (qwen3_moe) whenever tp cuts the heads: each rank
        # norms its own heads, so each holds part of the weight's gradient.
        per_head = key.endswith(("q_norm.weight", "k_norm.weight")) and tp > 1
        assert bool(spec.grad_sum_axes) == ((sp or per_head) and not spec.shards), key


def test_a_tied_embedding_is_marked_on_both_stages_and_only_the_last_is_a_copy():
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, vocab_size=100, max_seq_len=16)
    with torch.device("meta"):
        first = GPT(cfg, layer_ids=range(0, 1), first=True, last=False)
        last = GPT(cfg, layer_ids=range(1, 2), first=False, last=True)
    for model, copy in ((first, False), (last, True)):
        spec = spec_of(model.embed.tokens.weight)
        assert spec.tie == EMBEDDING_TIE and spec.pipeline_copy == copy


def sources(*folders: str):
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path, path.read_text()


def mark_uses(tree: ast.AST) -> list[str]:
    """Marks stored as attributes, or reached by name through get/set/hasattr."""
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and node.attr in MARKS):
            found.append(f"line {node.lineno}: .{node.attr} = ...")
        if (isinstance(node, ast.Attribute) and node.attr in {"tp_dim", "main_shard",
                                                               "tied_across_pipeline"}):
            found.append(f"line {node.lineno}: .{node.attr}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in {"getattr", "setattr", "hasattr", "delattr"}
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in MARKS):
            found.append(f"line {node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return found


def test_no_parameter_marks_outside_the_spec():
    offenders = {str(path.relative_to(ROOT)): uses
                 for path, text in sources("megaresil", "tests/harness")
                 if (uses := mark_uses(ast.parse(text)))}
    assert not offenders, f"read or set a parameter's ShardSpec instead: {offenders}"


def test_only_the_sharding_module_names_the_spec_attribute():
    allowed = {ROOT / "megaresil/parallel/sharding.py", Path(__file__).resolve()}
    naming = [str(path.relative_to(ROOT)) for path, text in sources("megaresil", "tests")
              if "shard_spec" in text and path not in allowed]
    assert not naming, f"use parallel/sharding.spec_of/set_spec: {naming}"
