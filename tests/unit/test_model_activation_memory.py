"""Activation memory: every recompute variant gives the math of no
recomputation (dropout on), and the memory it keeps for backward, measured by
`ActivationMeter` (an allocator-style count of live tensor storages), goes
down by the factor claimed for it.

Memory is read on a middle pipeline chunk (no embedding, no head) after its
forward, with the chunk's input and output dropped by the caller, so what is
still alive is exactly what the chunk keeps for backward. One unit is a
(B, T, C) fp32 tensor: Korthikanti et al.'s 2sbh, a full-recomputation layer's
whole stored input, with 4-byte instead of 2-byte activations.
"""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.harness.cli import ROOT
from tests.harness.dist import spawn_ranks
from megaresil.config import (ActivationOffload, ConfigError, ModelConfig, Recompute,
                              RecomputePolicy, load_recipe)
from megaresil.model.activation_meter import ActivationMeter
from megaresil.model.activations import recompute_segments
from megaresil.model.gpt import GPT
from megaresil.model.init import initialize
from megaresil.parallel.tensor_parallel import TPGroup
from megaresil.ports import free_port

B, T, C, LAYERS, HEADS = 2, 32, 64, 4, 4
UNIT = B * T * C * 4  # bytes of one (B, T, C) fp32 tensor
BASE = ModelConfig(num_layers=LAYERS, hidden_size=C, num_heads=HEADS, vocab_size=300,
                   max_seq_len=T, dropout=0.1, attention_dropout=0.1)
FULL = dict(recompute=Recompute.full)
VARIANTS = {
    "selective": dict(recompute=Recompute.selective),
    "full": FULL,
    "uniform2": dict(FULL, recompute_layers=2),
    "block1": dict(FULL, recompute_policy=RecomputePolicy.block, recompute_layers=1),
    "offload": dict(FULL, activation_offload=ActivationOffload.cpu),
}


def run_chunk(cfg: ModelConfig, tp: TPGroup = TPGroup()):
    """Forward/backward of a middle chunk: the memory it held after forward,
    its loss and grads, and the chunk. Offloading runs two steps and reports
    the second: the host pool's buffers are allocated in the first."""
    steps = 2 if cfg.activation_offload == ActivationOffload.cpu else 1
    model = GPT(cfg, tp=tp, seed=3, first=False, last=False)
    initialize(model, cfg, seed=3)
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(B, T, C, generator=gen, requires_grad=True)
    weights = torch.randn(B, T, C, generator=gen)
    samples = torch.tensor([5, 6])
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        x0.grad = None
        meter = ActivationMeter(torch.device("cpu"))
        with meter:
            x = x0 * 1.0  # allocated under the meter, like any layer's input
            y = model.stage_forward(x, samples)
            del x
            loss = (y * weights).sum()  # saves only `weights`, made before the meter
            del y
            held = meter.reading()
            loss.backward()
    grads = {k: p.grad for k, p in model.named_parameters()} | {"input": x0.grad}
    return held, loss.detach(), grads, model


def assert_same_math(got, expected):
    (_, loss, grads, _), (_, base_loss, base_grads, _) = got, expected
    torch.testing.assert_close(loss, base_loss, rtol=0, atol=0)
    for key in base_grads:
        torch.testing.assert_close(grads[key], base_grads[key], rtol=1e-6, atol=1e-8, msg=key)


@pytest.fixture(scope="module")
def measured():
    return {name: run_chunk(replace(BASE, **kw)) for name, kw in
            {"none": {}, **VARIANTS}.items()}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_has_the_math_of_no_recomputation(measured, variant):
    assert_same_math(measured[variant], measured["none"])


def held_units(measured, variant) -> float:
    return measured[variant][0].device_bytes / UNIT


def test_full_recomputation_keeps_one_input_per_layer(measured):
    # The loss scalar (4 bytes) is all that is held besides the checkpoints.
    assert held_units(measured, "full") == pytest.approx(LAYERS, abs=1e-3)


def test_no_recomputation_matches_the_textbook_per_layer_memory(measured):
    """Korthikanti et al.: sbh(34 + 5as/h) bytes per layer with 2-byte
    activations and 1-byte dropout masks, i.e. sbh(16e + 2m) + as^2 b(2e + m)
    for e-byte activations and m-byte masks; ours are 4 and 4 (the mask is
    kept in the activation dtype). The rest (norm statistics) is small."""
    e = m = 4
    sbh, as2b = T * B * C, HEADS * T * T * B
    textbook = sbh * (16 * e + 2 * m) + as2b * (2 * e + m)
    ratio = measured["none"][0].device_bytes / (LAYERS * textbook)
    assert 1.0 <= ratio <= 1.02, ratio
    # Selective recomputation drops the as^2b term (Korthikanti: 34 sbh).
    ratio = measured["selective"][0].device_bytes / (LAYERS * sbh * (16 * e + 2 * m))
    assert 1.0 <= ratio <= 1.02, ratio


def test_uniform_groups_store_one_input_per_group(measured):
    assert held_units(measured, "uniform2") / held_units(measured, "full") == pytest.approx(
        0.5, abs=1e-3)


def test_block_policy_recomputes_only_its_layers(measured):
    """1 of 4 layers recomputed: one stored input plus three plain layers."""
    plain_layer = held_units(measured, "none") / LAYERS
    assert held_units(measured, "block1") == pytest.approx(1 + 3 * plain_layer, rel=1e-4)


def test_offload_leaves_no_checkpoint_on_the_device(measured):
    held, _, _, model = measured["offload"]
    pool = model.checkpoints.pool
    assert held.device_bytes < 16  # the loss scalar
    assert pool.peak_bytes / UNIT == pytest.approx(LAYERS)  # all of them went to the host pool
    assert pool.bytes_in_use == 0  # and every buffer came back after backward


def test_recompute_segments_follow_megatrons_methods():
    cfg = replace(BASE, num_layers=6, **FULL)
    ids = range(3, 6)
    assert recompute_segments(cfg, ids) == [([3], True), ([4], True), ([5], True)]
    assert recompute_segments(replace(cfg, recompute_layers=2), ids) == [([3, 4], True),
                                                                          ([5], True)]
    assert recompute_segments(replace(cfg, recompute_policy=RecomputePolicy.block,
                                      recompute_layers=2), ids) == [([3], True), ([4], True),
                                                                    ([5], False)]
    assert recompute_segments(BASE, ids) == [([3, 4, 5], False)]


RECIPE = str(ROOT / "recipes" / "gpt-tiny.yaml")


@pytest.mark.parametrize("overrides,match", [
    (["model.activation_partition=true", "parallel.tp=2"], "set model.recompute=full"),
    (["model.recompute=full", "model.activation_partition=true", "parallel.tp=1"],
     "set parallel.tp > 1"),
    (["model.recompute=full", "model.activation_partition=true", "parallel.tp=2",
      "parallel.sequence_parallel=true"], "turn parallel.sequence_parallel off"),
    (["model.activation_offload=cpu"], "set model.recompute=full"),
    (["model.recompute_layers=2"], "set model.recompute=full"),
    (["model.recompute=full", "model.recompute_layers=3", "parallel.pp=2"],
     "choose recompute_layers <= 2"),
])
def test_misconfigurations_name_the_fix(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_recipe(RECIPE, ["parallel.dp=1"] + overrides)


# --- partition across the TP group (2 gloo ranks) ---------------------------------------


def _partition_worker(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        tp = TPGroup(group=dist.group.WORLD, size=2, rank=rank)
        partitioned = dict(FULL, activation_partition=True)
        runs = {name: run_chunk(replace(BASE, **kw), tp) for name, kw in {
            "none": {}, "full": FULL, "partition": partitioned,
            "partition_offload": dict(partitioned, activation_offload=ActivationOffload.cpu)}.items()}
        for name, run in runs.items():
            assert_same_math(run, runs["none"])
        pool = runs["partition_offload"][3].checkpoints.pool
        out[rank] = {"full": runs["full"][0].device_bytes,
                     "partition": runs["partition"][0].device_bytes,
                     "partition_offload": runs["partition_offload"][0].device_bytes,
                     "pool_peak": pool.peak_bytes}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_partition_divides_checkpoint_memory_by_tp():
    with mp.Manager() as manager:
        out = manager.dict()
        spawn_ranks(_partition_worker, (free_port(), out), 2)
        out = dict(out)
    for rank in (0, 1):
        bytes_ = out[rank]
        assert bytes_["full"] / UNIT == pytest.approx(LAYERS, abs=1e-3)
        assert bytes_["partition"] / bytes_["full"] == pytest.approx(1 / 2, abs=1e-3)
        assert bytes_["partition_offload"] < 16
        assert bytes_["pool_peak"] / bytes_["full"] == pytest.approx(1 / 2, abs=1e-3)
