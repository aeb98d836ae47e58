"""train.precision=bf16 under the distributed optimizer (ZeRO-1): each DP rank
keeps only its row shard of the fp32 main weights, as Megatron's distributed
optimizer does, and checkpoints still hold the whole fp32 main state, layout-free.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.harness.dist import MOE, Case, recipe_for, run_cases, train_case
from megaresil.config import ModelConfig
from megaresil.events import read_events, read_metrics
from megaresil.model.gpt import GPT
from megaresil.model.init import initialize
from megaresil.parallel.distributed_optimizer import DistributedOptimizer
from megaresil.parallel.layout import ParallelLayout
from megaresil.train.loop import Trainer
from megaresil.train.optim import AdamState
from megaresil.train.precision import MainParams, shard_main_params

CPU = ParallelLayout(device=torch.device("cpu"))
BF16 = ["train.precision=bf16"]
ZERO2 = ["parallel.dp=2", "optimizer.distributed=true"]


def tiny_params() -> list[torch.nn.Parameter]:
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, vocab_size=300, max_seq_len=16)
    model = GPT(cfg)
    initialize(model, cfg, seed=0)
    return list(model.parameters())


def main_bytes(main: MainParams | None, optimizer) -> int:
    """Bytes of fp32 main weights this rank holds: whole copies, or the
    optimizer's row shards that are a parameter's main rows."""
    if main is not None:
        return sum(p.numel() * p.element_size() for p in main.main)
    main_rows = AdamState(optimizer).main_rows()
    return sum(s.view.numel() * s.view.element_size() for s in optimizer.shards
               if main_rows(s.param) is s)


@pytest.mark.parametrize("dp", [2, 4])
def test_zero1_keeps_1_over_dp_of_the_fp32_main_weights(dp):
    """Measured from the tensors each rank holds: whole copies without
    sharding, about 1/dp of them (and together exactly all of them) with it."""
    whole = main_bytes(MainParams(tiny_params()), None)
    per_rank = []
    for rank in range(dp):
        params = tiny_params()
        optimizer = DistributedOptimizer([{"params": params}], torch.optim.AdamW, {"lr": 1e-3},
                                         group=None, dp=dp, dp_rank=rank, separate_main=True)
        shard_main_params(optimizer)
        assert {p.dtype for p in params} == {torch.bfloat16}
        per_rank.append(main_bytes(None, optimizer))
        # The fp32 rows are the init's fp32 values, not their bf16 rounding.
        shard = max(optimizer.shards, key=lambda s: s.view.numel())
        assert shard.view.dtype == torch.float32
        assert not torch.equal(shard.view, shard.view.bfloat16().float())
    print(f"dp={dp}: fp32 main bytes per rank {per_rank} vs whole copy {whole}")
    assert sum(per_rank) == whole
    # Row blocks round up, so a rank may hold a few rows more than 1/dp.
    assert max(per_rank) / whole < 1 / dp + 0.02


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


@pytest.mark.slow
def test_bf16_zero1_resumes_exactly_and_across_layouts_and_precisions(tmp_path):
    # An fp32 1x1x1 run stopped at step 5, to be resumed by bf16 ZeRO dp=2.
    fp32 = Case("from_fp32", ["train.exit_at_step=5"])
    train_case(fp32, tmp_path / fp32.name, CPU)
    run_cases(2, [Case("straight", BF16 + ZERO2),
                  Case("resumed", BF16 + ZERO2 + ["train.exit_at_step=5"], resume=True),
                  Case("from_fp32", BF16 + ZERO2)], tmp_path)

    straight = losses(tmp_path / "straight")
    assert len(straight) == 10 and losses(tmp_path / "resumed") == straight

    crossed = losses(tmp_path / "from_fp32")
    assert len(crossed) == 10  # 5 in fp32 at 1x1x1, then 5 in bf16 at dp=2
    loaded = [e for e in read_events(tmp_path / "from_fp32") if e["event"] == "checkpoint_loaded"]
    assert loaded and loaded[0]["step"] == 5
    reference = Trainer(recipe_for(Case("fp32_ref"), tmp_path / "fp32_ref"), CPU)
    reference.run()
    reference.close()
    assert abs(crossed[5] - losses(tmp_path / "fp32_ref")[5]) / crossed[5] < 2e-3

    # And back: the dp=2 bf16 checkpoint resumes in fp32 at 1x1x1 from the
    # fp32 main weights (bf16-rounded values would all survive a bf16 cast).
    back = Trainer(recipe_for(Case("resumed", ["train.precision=fp32"]), tmp_path / "resumed"),
                   CPU)
    assert back.state.step == 5 and back.main is None
    weights = [p for _, p in back.named_state_parameters() if p.ndim == 2]
    assert any(not torch.equal(w, w.bfloat16().float()) for w in weights)
    back.close()


@pytest.mark.slow
def test_bf16_zero1_trains_through_a_pipeline(tmp_path):
    """bf16 under ZeRO-1 casts the model to bf16 after the optimizer is built:
    a pipeline stage must take its activations' dtype after that cast, or the
    second stage receives fp32 hidden states into bf16 layers and every step
    fails. Against the same layout keeping whole fp32 main copies."""
    pipeline = ["parallel.pp=2", "parallel.dp=2"]
    run_cases(4, [Case("zero1", BF16 + pipeline + ["optimizer.distributed=true"]),
                  Case("whole", BF16 + pipeline)], tmp_path)
    zero1, whole = losses(tmp_path / "zero1"), losses(tmp_path / "whole")
    assert len(zero1) == len(whole) == 10
    assert max(abs(a - b) / b for a, b in zip(zero1, whole)) < 2e-3, (zero1, whole)


@pytest.mark.slow
def test_bf16_zero1_at_ep_equal_dp_keeps_whole_main_copies_of_the_experts(tmp_path):
    """At ep = dp the experts' gradient group has one rank (edp = 1): it does
    not shard, so the experts keep whole fp32 main copies beside the dense
    group's ZeRO-1 rows (once they stepped their bf16 weights). It tracks
    the same run without ZeRO-1 within bf16's rounding, resumes bit for bit,
    and its checkpoint holds fp32 experts."""
    expert = MOE + BF16 + ["parallel.dp=2", "parallel.ep=2"]
    run_cases(2, [Case("zero1", expert + ["optimizer.distributed=true"]),
                  Case("resumed", expert + ["optimizer.distributed=true", "train.exit_at_step=5"],
                       resume=True),
                  Case("whole", expert)], tmp_path)
    zero1, whole = losses(tmp_path / "zero1"), losses(tmp_path / "whole")
    assert len(zero1) == len(whole) == 10
    assert max(abs(a - b) / b for a, b in zip(zero1, whole)) < 2e-3, (zero1, whole)
    assert losses(tmp_path / "resumed") == zero1
    # The ep=2 save at step 5, resumed in fp32 at 1x1x1: the experts come
    # back as fp32 main weights (bf16-rounded values would survive a cast).
    back = Trainer(recipe_for(Case("resumed", MOE + ["train.precision=fp32"]),
                              tmp_path / "resumed"), CPU)
    try:
        assert back.state.step == 5
        gate = dict(back.named_state_parameters())["layers.1.mlp.experts.gate"]
        assert not torch.equal(gate, gate.bfloat16().float())
    finally:
        back.close()
