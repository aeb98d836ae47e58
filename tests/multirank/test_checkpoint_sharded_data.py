"""Resume across the data-parallel modes, optimizer state included: plain
DP, ZeRO-1 (optimizer.distributed), HSDP (dp_shard=2 of dp=4) and full
sharding (dp_shard=dp=4, ZeRO-3 through FSDP2), each stopped and saved at
step 5. Every mode resumed in itself goes on bit-identically; every other
pair, and full sharding at tp=2 and at pp=2, within the resharding
tolerance (test_checkpoint.py's), each loading the other mode's checkpoint:
the checkpoint is the same layout-free format whichever mode wrote it."""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from megaresil.checkpoint.offline.convert import Target, convert
from megaresil.events import read_events
from tests.harness.dist import LLAMA, Case, run_cases
from tests.multirank.test_checkpoint_context import losses, saved_tensors
from tests.multirank.test_checkpoint_convert import assert_identical, manifest, shard_table

# The vocabulary (300) pads to 384 rows: the last shard at dp_shard=4 is
# mostly padding, which the checkpoint cuts.
COMMON = LLAMA + ["checkpoint.backend=torch_dist", "checkpoint.interval=5", "parallel.dp=4"]
MODES = {"plain": [],
         "zero1": ["optimizer.distributed=true"],
         "hsdp": ["parallel.dp_shard=2"],
         "zero3": ["parallel.dp_shard=4"]}
# Full sharding with tensor or pipeline parallelism, from the plain checkpoint.
ACROSS = {"tp2_zero3": ["parallel.tp=2", "parallel.dp=2", "parallel.dp_shard=2"],
          "pp2_zero3": ["parallel.pp=2", "parallel.dp=2", "parallel.dp_shard=2"]}
PAIRS = [(a, b) for a, b in itertools.product(MODES, MODES) if a != b]


def step_5(out: Path, mode: str) -> Path:
    return out / f"exact_{mode}" / "checkpoints" / "step_0000005"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded_data_resume")
    run_cases(4, [Case(f"straight_{m}", COMMON + o) for m, o in MODES.items()]
              + [Case(f"exact_{m}", COMMON + o + ["train.exit_at_step=5"], resume=True)
                 for m, o in MODES.items()], out)
    run_cases(4, [Case(f"{a}_to_{b}", COMMON + MODES[b] + [f"checkpoint.load={step_5(out, a)}"])
                  for a, b in PAIRS]
              + [Case(f"plain_to_{name}", COMMON + o + [f"checkpoint.load={step_5(out, 'plain')}"])
                 for name, o in ACROSS.items()], out)
    return out


@pytest.mark.parametrize("mode", MODES)
def test_resume_in_the_same_mode_is_bit_identical(runs, mode):
    straight, resumed = losses(runs / f"straight_{mode}"), losses(runs / f"exact_{mode}")
    assert sorted(resumed) == list(range(1, 11))
    for step in range(1, 11):
        assert resumed[step] == straight[step], f"step {step}"
    want = saved_tensors(runs / f"straight_{mode}" / "checkpoints" / "step_0000010")
    got = saved_tensors(runs / f"exact_{mode}" / "checkpoints" / "step_0000010")
    assert got.keys() == want.keys() and any(k.startswith("optim") for k in want), sorted(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("saved,target", PAIRS + [("plain", t) for t in ACROSS])
def test_resume_in_another_mode_matches_the_uninterrupted_run(runs, saved, target):
    straight, resumed = losses(runs / f"straight_{saved}"), losses(runs / f"{saved}_to_{target}")
    assert sorted(resumed) == list(range(6, 11))
    for step in range(6, 11):
        assert abs(resumed[step] - straight[step]) <= 1e-5 * straight[step], f"step {step}"
    loaded = next(e for e in read_events(runs / f"{saved}_to_{target}")
                  if e["event"] == "checkpoint_loaded")
    assert loaded["saved_layout"]["dp"] == 4
    assert loaded["saved_layout"].get("dp_shard", 1) == {"hsdp": 2, "zero3": 4}.get(saved, 1)


def test_the_modes_save_the_same_state(runs):
    """The four modes' step-10 checkpoints hold the same keys and shapes,
    and the same values within the tolerance the modes' reduction orders
    leave (the moments included)."""
    want = saved_tensors(runs / "straight_plain" / "checkpoints" / "step_0000010")
    for mode in ("zero1", "hsdp", "zero3"):
        got = saved_tensors(runs / f"straight_{mode}" / "checkpoints" / "step_0000010")
        assert got.keys() == want.keys(), mode
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-6,
                                       msg=f"{mode}: {key}")


@pytest.mark.parametrize("mode", ["hsdp", "zero3"])
def test_the_converters_plan_is_the_trainers_own_save(runs, tmp_path, mode):
    """Planned offline, the rects a sharded run's ranks write and their
    writers are exactly those its four ranks saved, checksums included."""
    saved = runs / f"straight_{mode}" / "checkpoints" / "step_0000010"
    out = convert(saved, tmp_path / "zarr", Target(backend="zarr"))
    assert shard_table(out) == shard_table(saved)
    assert manifest(out)["layout"] == manifest(saved)["layout"]


def test_convert_moves_between_the_modes_bit_identically(runs, tmp_path):
    """convert --dp-shard rewrites a replicated checkpoint as a sharded one
    (its layout record says so) and back, every tensor unchanged."""
    plain = runs / "straight_plain" / "checkpoints" / "step_0000010"
    sharded = convert(plain, tmp_path / "zero3", Target(dp_shard=4))
    assert manifest(sharded)["layout"]["dp_shard"] == 4
    assert manifest(sharded)["layout"]["distributed_optimizer"]
    assert_identical(plain, sharded)
    back = convert(sharded, tmp_path / "plain", Target(dp_shard=1))
    assert_identical(plain, back)
    assert shard_table(back) == shard_table(plain)
