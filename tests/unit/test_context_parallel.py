"""Context parallelism's arithmetic (parallel/context_parallel.CPGroup) and
the recipes it refuses (config/context.py): one line naming the key and the
fix, from `megaresil train` before any worker starts."""
from __future__ import annotations

import pytest
import torch

from megaresil.config import ConfigError, ContextComm, load_recipe
from megaresil.parallel.context_parallel import CPGroup
from tests.harness.cli import ROOT

TINY = ROOT / "recipes" / "gpt-tiny.yaml"


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_each_rank_holds_a_head_and_a_tail_and_together_every_chunk(cp):
    held = [CPGroup(size=cp, rank=r).chunk_ids() for r in range(cp)]
    assert held == [(r, 2 * cp - 1 - r) for r in range(cp)]
    assert sorted(c for pair in held for c in pair) == list(range(2 * cp))
    group = CPGroup(size=cp)
    for rank, (head, tail) in enumerate(held):
        assert group.owner(head) == (rank, 0) and group.owner(tail) == (rank, 1)
        assert group.chunk_ids(rank) == (head, tail)


def test_cp4_slices_positions_and_chunks_agree():
    T, cp = 32, 4  # chunks of 4 tokens
    x = torch.arange(2 * T).view(2, T)  # two sequences, each token its place (+T)
    for rank in range(cp):
        group = CPGroup(size=cp, rank=rank)
        mine = group.slice_sequence(x)
        head, tail = group.chunk_ids()
        want = list(range(4 * head, 4 * head + 4)) + list(range(4 * tail, 4 * tail + 4))
        assert mine[0].tolist() == want and mine[1].tolist() == [t + T for t in want]
        assert group.positions(T // cp, torch.device("cpu")).tolist() == want
        assert CPGroup(size=cp).positions(T // cp, torch.device("cpu"), rank=rank).tolist() == want
        # any dim: (B, H, T, D) as attention holds it
        y = torch.arange(T).view(1, 1, T, 1).expand(2, 3, T, 5)
        assert group.slice_sequence(y, dim=2)[1, 2, :, 4].tolist() == want
    # the balance zig-zag is for: every rank's causal (query, key) pairs alike
    pairs = [sum(p + 1 for p in CPGroup(size=cp, rank=r).positions(T // cp, torch.device("cpu")))
             for r in range(cp)]
    assert len(set(int(p) for p in pairs)) == 1


def test_cp1_is_the_whole_sequence():
    group = CPGroup()
    x = torch.randn(2, 10)
    assert not group.active and group.slice_sequence(x) is x
    assert group.positions(10, torch.device("cpu")).tolist() == list(range(10))
    mean = torch.tensor(2.5)
    assert group.token_share(torch.zeros(2, 10)) is None
    assert group.sum(mean) is mean


CP2 = ["parallel.cp=2", "parallel.tp=1", "parallel.pp=1", "parallel.dp=1", "data.seq_len=64",
       "model.max_seq_len=64"]
LLAMA_MOE = ["model.flavour=llama", "model.moe.num_experts=4", "model.moe.capacity_factor=1.25"]


@pytest.mark.parametrize("overrides,key,fix", [
    (CP2 + ["data.seq_len=62", "model.max_seq_len=62"], "data.seq_len",
     "choose data.seq_len a multiple of 4"),
    (CP2 + ["parallel.cp=4", "data.seq_len=68", "model.max_seq_len=68"], "data.seq_len",
     "choose data.seq_len a multiple of 8"),
    (CP2 + LLAMA_MOE, "model.moe.capacity_factor",
     "set model.moe.capacity_factor=null (dropless), or parallel.cp=1"),
    (CP2 + ["model.attention_dropout=0.1"], "model.attention_dropout",
     "set model.attention_dropout=0, or parallel.cp=1"),
    (CP2 + ["model.backend=te"], "parallel.cp", "set model.backend=local, or parallel.cp=1"),
])
def test_what_context_parallelism_does_not_take_is_refused(overrides, key, fix):
    with pytest.raises(ConfigError) as err:
        load_recipe(TINY, overrides)
    assert err.value.key == key and f"Fix: {fix}" in str(err.value) and "\n" not in str(err.value)


def test_a_context_parallel_recipe_loads():
    cfg = load_recipe(TINY, CP2 + ["parallel.cp_comm_type=p2p", "model.dropout=0.1"])
    assert cfg.parallel.cp == 2 and cfg.parallel.cp_comm_type == ContextComm.p2p
    cfg = load_recipe(TINY, CP2 + ["parallel.dp=2", "optimizer.distributed=true",
                                   "data.eod_mask_loss=true"])
    assert cfg.parallel.world_size == 4
    # Experts (dropless) and document masking compose with cp.
    cfg = load_recipe(TINY, CP2 + ["parallel.dp=2", "parallel.ep=2", "model.flavour=llama",
                                   "model.moe.num_experts=4", "data.source=shakespeare",
                                   "data.reset_attention_mask=true",
                                   "data.reset_position_ids=true"])
    assert cfg.parallel.ep == 2 and cfg.data.reset_attention_mask


def test_train_refuses_it_before_any_worker_starts(cli_main, tmp_path):
    run = tmp_path / "run"
    result = cli_main("train", str(TINY), *CP2, "model.attention_dropout=0.1",
                      f"run.dir={run}", check=False)
    assert result.returncode == 2, result.stderr
    (error,) = [line for line in result.stderr.splitlines() if "error" in line]
    assert "model.attention_dropout:" in error and "Fix: set model.attention_dropout=0" in error
    assert not (run / "events.jsonl").exists()  # no worker started
